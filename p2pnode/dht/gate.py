"""The trio side of routing-table admission: check unproven senders, admit proven ones.

Theory of operation (docs/protocol/dht.md §5.1): :class:`Gate` sits between
a :class:`~p2pnode.dht.peer.DhtPeer` and its routing table. Everything that
would add a contact goes through it:

* :meth:`Gate.heard` for each request (the handlers call it with the
  claimed id and the datagram's source). A contact the table holds at that
  address was heard from; anyone else is answered but not admitted, and the
  sans-IO :class:`~p2pnode.dht.admission.Admission` decides whether to ping
  the source address. The id a ping reply names is admitted.
* :meth:`Gate.proven` for each reply to one of our calls (the call's
  callback, wrapped by :meth:`Gate.informing`): the reply came from the
  address the request went to and echoed its random message id, which is
  the proof. The table's own limits (one id per address, a few per host)
  still apply, and a full bucket's liveness ping goes out from here.
* Contacts restored from a snapshot are *candidates*: lookups may ask them
  (:meth:`Gate.seeds`), nobody is told of them, and
  :meth:`Gate.check_candidates` pings them a few at a time; those that
  answer are admitted like anyone else.

No task per check: pings are queued with :meth:`~p2pnode.dht.calls.Calls.call_nowait`
and flushed by whoever made them due; their callbacks finish the check.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Protocol

import trio

from p2pnode.dht import rpcwire
from p2pnode.dht.admission import Admission, Verdict
from p2pnode.dht.calls import NO_REPLY, Calls, OnResult
from p2pnode.dht.config import DhtConfig, DhtStatistics
from p2pnode.dht.contacts import make_contact
from p2pnode.dht.routing import Contact, RoutingTable, distance
from p2pnode.dht.rpc import Address

log = logging.getLogger("p2pnode.dht")

#: Restored contacts kept waiting for proof, and how many are pinged at a time.
MAX_CANDIDATES = 1024
CANDIDATE_CHECKS = 32


class GateHost(Protocol):
    """What the gate reads of its node, at each use (so a replaced table counts)."""

    @property
    def node_id(self) -> bytes: ...
    @property
    def table(self) -> RoutingTable: ...
    @property
    def stats(self) -> DhtStatistics: ...
    @property
    def calls(self) -> Calls: ...


def ping_reply(value: Any) -> bytes | None:
    """The id a ping reply names, or None (no reply, or not a 20-byte id)."""
    if value is NO_REPLY:
        return None
    try:
        return rpcwire.parse_ping_reply_untrusted(value)
    except rpcwire.RpcError:
        return None


class Gate:
    """Admission to one node's routing table (see the module docstring)."""

    __slots__ = ("_host", "_k", "admission", "candidates")

    def __init__(self, host: GateHost, config: DhtConfig) -> None:
        self._host = host
        self._k = config.k
        self.admission = Admission(
            max_checks=config.max_checks,
            max_checks_per_host=config.max_checks_per_host,
            slot_time=config.check_slot_time,
            retry_after=config.check_retry_after,
            memory=config.check_memory,
            attempts=config.check_attempts,
            limit_loopback=config.limit_loopback,
            check_fill=config.check_fill,
        )
        #: Restored contacts not proven yet, by id.
        self.candidates: dict[bytes, Contact] = {}

    # ------------------------------------------------------------------ requests

    def heard(self, node_id: bytes, source: Address, now: float) -> None:
        """A request from ``source`` at ``now`` claims ``node_id``: refresh or maybe
        check it."""
        host = self._host
        table = host.table
        admission = self.admission
        if not table.seen_at(node_id, source, now):
            # Unknown here (most requests are from contacts held there: seen again,
            # the admission has nothing to decide).
            asked = host.calls.core.awaiting(source)
            verdict = admission.on_request(node_id, source, table, now, asked=asked)
            if verdict is Verdict.CHECK:
                self._check(source, now)
            elif verdict is not Verdict.KNOWN:
                host.stats.checks_skipped += 1
        if admission.waiting:
            self.check_waiting(now)

    def check_waiting(self, now: float) -> None:
        """Check senders that wait for a slot, as long as slots are free."""
        while (waiting := self.admission.next_waiting(self._host.table, now)) is not None:
            self._check(waiting[1], now)

    def _check(self, source: Address, now: float) -> None:
        host = self._host
        host.stats.checks_sent += 1

        def checked(value: Any) -> None:
            now = trio.current_time()
            answered = ping_reply(value)
            admitted = False
            if answered is None:
                host.stats.checks_failed += 1
            else:
                self.proven(answered, source, stated=True)
                held = host.table.get(answered)
                admitted = held is not None and held.address == source
            # A ping lost under a flood is tried again (up to check_attempts), once a
            # slot is free: check_waiting below sends it.
            done = self.admission.check_done
            if done(source, now, answered=answered is not None, admitted=admitted):
                host.stats.checks_retried += 1
            self.check_waiting(now)

        # Queued; the flush after the datagram or timer at hand sends it (no task).
        host.calls.call_nowait(source, "ping", [host.node_id], checked, now)

    # ------------------------------------------------------------------ replies

    def informing(self, contact: Contact, on_result: OnResult) -> OnResult:
        """``on_result`` after telling the table whether ``contact`` answered."""

        def done(value: Any) -> None:
            if self.candidates:
                self.candidates.pop(contact.node_id, None)
            if value is NO_REPLY:
                self._host.table.record_failure(contact.node_id)
            else:
                self.admit(contact)
            on_result(value)

        return done

    def proven(self, node_id: bytes, address: Address, *, stated: bool = False) -> None:
        """A reply from ``address`` proved it receives there: offer ``node_id`` to the table.

        ``stated``: the reply named the id itself (a ping), so another id held at
        ``address`` is gone from there and leaves the table.
        """
        self.admit(make_contact(node_id, *address), stated=stated)

    def admit(self, contact: Contact, *, stated: bool = False) -> None:
        """:meth:`proven` for a contact at hand (the one a call went to)."""
        host = self._host
        table = host.table
        now = trio.current_time()
        if table.seen(contact, now):  # most replies: a contact held there
            return
        node_id = contact.node_id
        held = table.holder(contact.address)
        if held != node_id:  # else nothing the table limits can refuse: it holds it there
            if stated and held is not None:
                table.remove(held)
            refusal = table.refusal(contact)
            if refusal is not None:
                host.stats.admissions_refused += 1
                log.debug("dht.not_admitted peer=%s:%s reason=%s", *contact.address, refusal.value)
                return
        new = table.get(node_id) is None
        to_ping = table.observe(contact, now)
        if new and node_id in table:
            host.stats.contacts_admitted += 1
        if to_ping is None:
            return

        def alive(value: Any) -> None:
            answered = ping_reply(value)
            table.ping_result(to_ping.node_id, answered == to_ping.node_id, trio.current_time())
            if answered is not None and answered != to_ping.node_id:
                self.proven(answered, to_ping.address, stated=True)

        # Queued; the flush after the datagram or call at hand sends it (no task).
        host.calls.call_nowait(to_ping.address, "ping", [host.node_id], alive, now)

    # ------------------------------------------------------------------ candidates

    def seeds(self, target: bytes) -> list[Contact]:
        """Where a lookup for ``target`` starts: the table's closest and the closest
        candidates (asking them is how they prove themselves)."""
        seeds = self._host.table.closest(target, self._k)
        if self.candidates:
            near = sorted(self.candidates.values(), key=lambda c: distance(c.node_id, target))
            seeds += near[: self._k]
        return seeds

    def add_candidates(self, contacts: Iterable[Contact]) -> None:
        """Keep ``contacts`` (up to :data:`MAX_CANDIDATES`) to be proven."""
        host = self._host
        for c in contacts:
            if len(self.candidates) >= MAX_CANDIDATES:
                break
            if c.node_id != host.node_id and c.node_id not in host.table:
                self.candidates[c.node_id] = c

    async def check_candidates(self) -> None:
        """Ping every candidate, :data:`CANDIDATE_CHECKS` at a time; admit who answers."""
        limiter = trio.CapacityLimiter(CANDIDATE_CHECKS)
        host = self._host

        async def check(c: Contact) -> None:
            async with limiter:
                if c.node_id not in self.candidates:
                    return  # a lookup asked it meanwhile
                value = await host.calls.call(c.address, "ping", [host.node_id])
                self.candidates.pop(c.node_id, None)
                answered = ping_reply(value)
                if answered is not None:
                    self.proven(answered, c.address, stated=True)
                    host.calls.flush()  # a liveness ping it may have queued

        async with trio.open_nursery() as nursery:
            for c in list(self.candidates.values()):
                nursery.start_soon(check, c)


__all__ = ["CANDIDATE_CHECKS", "MAX_CANDIDATES", "Gate", "GateHost", "ping_reply"]
