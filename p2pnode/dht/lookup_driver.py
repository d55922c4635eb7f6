"""The trio side of lookups (docs/protocol/dht.md §6): the calls' callbacks drive them.

Theory of operation: a :class:`~p2pnode.dht.lookup.Lookup` is sans-IO; a
:class:`LookupDriver` feeds it. Each request's callback (registered with
:meth:`~p2pnode.dht.calls.Calls.call_nowait`, wrapped by
:meth:`~p2pnode.dht.gate.Gate.informing` so the routing table learns how the
contact did) takes the reply where it lands, in the node's receive loop:
parses it, hands it to the lookup and queues the requests that frees, which
the node's flush sends with its own datagrams. No task wakes per
reply. Soft timeouts (§6) are the node's timer's: while a lookup runs it is
in the node's ``lookups``, the node wakes at the earliest of their
:meth:`LookupDriver.next_deadline` (a round of requests pulls that in) and
calls :meth:`LookupDriver.timer_due`. The task that runs
:meth:`LookupDriver.run` sleeps until the lookup is done: it wakes once.

A reply that comes after the lookup ended (its requests run on to their
reply or hard timeout for the routing table's sake) is ignored here. A
reply whose processing raises anything unexpected is contained to that
reply (the node's failure boundary logs it) and counts as a failed request,
so the lookup never waits for an answer it already had.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

import trio

from p2pnode.core.boundary import FailureBoundary
from p2pnode.dht import rpcwire
from p2pnode.dht.calls import NO_REPLY, Calls
from p2pnode.dht.config import DhtConfig, DhtStatistics
from p2pnode.dht.gate import Gate
from p2pnode.dht.lookup import Lookup, RecordCollector, RttEstimator
from p2pnode.dht.records import RecordError, RecordStore, SignedRecord
from p2pnode.dht.routing import Contact, RoutingTable
from p2pnode.dht.rpc import Address


class LookupHost(Protocol):
    """What a lookup reads of its node, at each use."""

    @property
    def node_id(self) -> bytes: ...
    @property
    def config(self) -> DhtConfig: ...
    @property
    def table(self) -> RoutingTable: ...
    @property
    def rtt(self) -> RttEstimator: ...
    @property
    def gate(self) -> Gate: ...
    @property
    def calls(self) -> Calls: ...
    @property
    def stats(self) -> DhtStatistics: ...
    @property
    def records(self) -> RecordStore: ...
    @property
    def boundary(self) -> FailureBoundary: ...
    @property
    def wall_clock_ms(self) -> Callable[[], int]: ...
    @property
    def lookups(self) -> dict[LookupDriver, None]:
        """The lookups running: the node's timer runs their soft timeouts."""

    def drop(self, source: Address, reason: str, kind: str) -> None: ...


def _text(address: Address) -> str:
    return f"{address[0]}:{address[1]}"


class LookupDriver:
    """One iterative lookup of ``host`` for ``target`` (see the module docstring).

    ``want_value``: ask ``find_value`` and collect records; ``quorum``: finish once
    that many replies held records; ``soft_timeouts``: see :class:`Lookup`.
    """

    __slots__ = (
        "_done",
        "_ended",
        "_host",
        "_pumping",
        "args",
        "collector",
        "lookup",
        "method",
        "quorum",
    )

    def __init__(
        self,
        host: LookupHost,
        target: bytes,
        *,
        want_value: bool = False,
        quorum: int | None = None,
        soft_timeouts: bool = True,
    ) -> None:
        config = host.config
        self._host = host
        self.lookup = Lookup(
            target,
            host.gate.seeds(target),
            rtt=host.rtt,
            own_id=host.node_id,
            k=config.k,
            alpha=config.alpha,
            soft_timeouts=soft_timeouts,
        )
        self.method = "find_value" if want_value else "find_node"
        self.args = [host.node_id, target]
        self.quorum = quorum
        self.collector = RecordCollector(target, host.records.known)
        self._done = trio.Event()
        # True once run() returned: late results only tell the routing table.
        self._ended = False
        # True while _pump sends: a call refused at once (max_pending) fails inside it.
        self._pumping = False

    async def run(self) -> tuple[Lookup, list[SignedRecord]]:
        """Run the lookup to its end: the lookup and the records read.

        Bounded: the lookup asks at most ``max_queries`` nodes, and each call ends
        in a reply or its hard timeout.
        """
        host = self._host
        host.table.touch_range(self.lookup.target, trio.current_time())
        host.lookups[self] = None
        try:
            self._pump(trio.current_time())
            host.calls.flush()
            await self._done.wait()
        finally:
            self._ended = True
            del host.lookups[self]
        return self.lookup, self.collector.records()

    def next_deadline(self) -> float:
        """When the next request of this lookup turns slow (inf: none pending)."""
        if self._done.is_set():
            return math.inf
        deadline = self.lookup.next_deadline()
        return math.inf if deadline is None else deadline

    def timer_due(self, now: float) -> None:
        """The node's timer: if a soft timeout is due, slots free up; the node flushes."""
        if self.next_deadline() <= now:
            self._pump(now)

    def _pump(self, now: float) -> None:
        """Mark slow requests, send what that and the replies freed; end when done."""
        lookup = self.lookup
        lookup.handle_timer(now)
        host = self._host
        self._pumping = True
        try:
            # A call refused at once fails inside call_nowait and frees its slot for
            # the next round (bounded: the lookup's requests are).
            while requests := lookup.next_requests(now):
                for c in requests:
                    deliver = host.gate.informing(c, partial(self._on_result, c))
                    host.calls.call_nowait(c.address, self.method, self.args, deliver, now)
        finally:
            self._pumping = False
        if lookup.done:
            self._done.set()
            return
        wake = host.calls.wake
        if wake is not None:
            # Only ever sooner: as answers come the next soft timeout moves later, and
            # each move would cost the timer heap an entry to push and one gone stale
            # (a hundred thousand nodes' timers are in one heap in the simulator). A
            # wake-up that comes too soon finds nothing due and sleeps again to the
            # right deadline.
            deadline = lookup.next_deadline()
            if deadline is not None and deadline < wake.deadline:
                wake.deadline = deadline

    def _on_result(self, c: Contact, value: Any) -> None:
        if self._ended or self._done.is_set():
            return
        now = trio.current_time()
        try:
            self._take(c, value, now)
        except Exception as exc:  # one node's reply must not end or stall the lookup
            self.lookup.handle_failure(c.node_id)
            self._host.boundary.contain(_text(c.address), f"{self.method} reply", exc)
        if not self._pumping:
            self._pump(now)

    def _take(self, c: Contact, value: Any, now: float) -> None:
        lookup, host = self.lookup, self._host
        if value is NO_REPLY:
            lookup.handle_failure(c.node_id)
            return
        # Every contact named is checked; those the lookup has heard of already are left
        # out, the others made into contacts only if the lookup asks them (Lookup.add_named).
        heard = lookup.heard
        try:
            if self.method == "find_value":
                raw, named = rpcwire.named_find_value_untrusted(value, heard)
            else:
                raw, named = None, rpcwire.named_contacts_untrusted(value, heard)
        except rpcwire.RpcError as exc:
            host.drop(c.address, f"{self.method} reply: {exc.message}", "replies")
            lookup.handle_failure(c.node_id)
            return
        lookup.handle_response(c.node_id, (), now, named=named)
        if raw is None:
            return
        collector = self.collector
        try:
            host.stats.records_rejected += collector.add_untrusted(raw, host.wall_clock_ms())
        except RecordError as exc:  # not a record list (say, a stock node's plain value)
            host.drop(c.address, f"find_value value: {exc.message}", "replies")
        except Exception as exc:  # one node's value must not end the lookup
            host.boundary.contain(_text(c.address), f"{self.method} value", exc)
            return
        if self.quorum is not None and collector.hits >= self.quorum:
            lookup.finish()


__all__ = ["LookupDriver", "LookupHost"]
