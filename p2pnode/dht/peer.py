"""The trio DHT peer: a thin driver of the sans-IO RPC core over one datagram endpoint.

Theory of operation: a :class:`DhtPeer` binds one datagram endpoint from a
:class:`p2pnode.transport.net.Network` (real sockets or the simulator) and is the
network's :class:`~p2pnode.transport.net.DatagramReceiver` on it:
:meth:`~p2pnode.transport.net.Network.serve_datagrams` runs it in the task that
calls :meth:`DhtPeer.serve` (or in one that ``async with`` starts), handing it each
datagram (:meth:`DhtPeer.datagram_received`) and running its timer
(:meth:`DhtPeer.timer_due`) when :meth:`DhtPeer.next_wake` comes.
Everything protocol-shaped happens in sans-IO objects it drives:

* :class:`~p2pnode.dht.rpc.RpcCore` (docs/protocol/dht.md §2-3) holds the
  pending calls, matches replies by message id *and* address, and turns
  each datagram into events. The node feeds it every datagram, behind
  :attr:`DhtPeer.boundary`, and dispatches the events through a table:
  requests go to the sans-IO :class:`~p2pnode.dht.handlers.RequestHandlers`
  and are answered inline (no task per request); a reply or a timeout goes
  to the callback its call registered. Datagrams the core queues are sent
  by whoever made them due.
* **Timers** are a query, not a cancel scope per call nor per lookup: the
  network sleeps to one timer until the earliest of the core's
  ``next_deadline()``, the maintenance schedule, rejoining and the running
  lookups' soft timeouts, then the node runs them all (:meth:`DhtPeer.timer_due`).
  A call or a lookup that needs an earlier wake-up pulls the timer's deadline in.
* **Lookups** (§6) are driven from the sans-IO :class:`~p2pnode.dht.lookup.Lookup`
  by a :class:`~p2pnode.dht.lookup_driver.LookupDriver`, without a task per
  request nor a wake-up per reply: each request's callback hands its reply
  to the lookup and queues the requests it frees, the node's timer marks
  slow nodes at the lookup's ``next_deadline()``, and the lookup's task
  wakes once, at its end.
  When a lookup ends, its outstanding calls run on to their reply or hard
  timeout for the routing table's sake only (a dead contact must fail to be
  evicted).
* **Rejoining** (§5.2): when the table is empty, :class:`~p2pnode.dht.rejoin.Rejoin`
  schedules attempts to join again from the bootstrap and snapshot
  addresses, with backoff.
* **Admission** (§5.1): a reply to one of our calls proves its sender
  receives at its address, and only proven contacts enter the table; a
  request from a sender not in the table is answered, and its address is
  pinged if the sans-IO :class:`~p2pnode.dht.admission.Admission` says so.
  Contacts restored from a snapshot are proven the same way before they
  count. :class:`~p2pnode.dht.gate.Gate` does all of it.
* **Drops** are counted in :attr:`DhtPeer.stats` (``status`` shows them) and
  logged one line per datagram at DEBUG only; at INFO a
  :class:`~p2pnode.dht.config.LogSummary` line at most once a minute.
* **Records** (§4) are publishing's business:
  :class:`~p2pnode.dht.publish.Publisher` does read-merge-write,
  :mod:`p2pnode.dht.maintenance` expires, refreshes stale buckets and
  republishes, :mod:`p2pnode.dht.snapshot` saves and restores the table.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any, Self

import trio

from p2pnode.core.boundary import FailureBoundary, describe
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.identity import Identity
from p2pnode.dht import rpcwire
from p2pnode.dht.calls import NO_REPLY, Calls, count_answers
from p2pnode.dht.config import DhtConfig, DhtMode, DhtStatistics, LogSummary
from p2pnode.dht.gate import Gate
from p2pnode.dht.handlers import RequestHandlers
from p2pnode.dht.lookup import Lookup, RttEstimator, merge_records
from p2pnode.dht.lookup_driver import LookupDriver
from p2pnode.dht.maintenance import (
    MaintenanceSchedule,
    maintenance_pass,
    mark_fresh,
    quiet_pass,
)
from p2pnode.dht.publish import Publisher
from p2pnode.dht.records import RecordStore, SignedRecord
from p2pnode.dht.rejoin import Rejoin
from p2pnode.dht.routing import Contact, RoutingTable
from p2pnode.dht.rpc import (
    CallTimedOut,
    DatagramDropped,
    DropReason,
    ReplyReceived,
    RequestReceived,
    RpcCore,
    RpcEvent,
)
from p2pnode.dht.snapshot import parse_snapshot, snapshot_contacts
from p2pnode.transport.net import Address, DatagramEndpoint, Network, Wake

log = logging.getLogger("p2pnode.dht")

_DEFAULT_CONFIG = DhtConfig()
#: The OS's randomness, for every node built without an ``rng``: a ``random.Random``
#: (SystemRandom included) carries a 2.5 KB Mersenne Twister state of its own, a
#: cost per node when a process runs many (the simulator, benchmarks).
_OS_RANDOM = random.SystemRandom()
#: Rounds of pings of the bootstrap addresses when none answers (dht.md §5.2).
BOOTSTRAP_ROUNDS = 2


def _text(address: Address) -> str:
    return f"{address[0]}:{address[1]}"


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


def _node_id_of(identity: Identity | None, node_id: bytes | None) -> bytes:
    """``node_id``, else the identity's peer id; LocalError without either or if not 20 bytes."""
    if node_id is None:
        if identity is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "need an identity or a node id")
        node_id = identity.peer_id.raw
    if len(node_id) != 20:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "node ids are 20 bytes")
    return node_id


def _table(node_id: bytes, config: DhtConfig) -> RoutingTable:
    """An empty routing table around ``node_id`` with ``config``'s bounds."""
    return RoutingTable(
        node_id,
        k=config.k,
        replacement_size=config.replacement_size,
        max_per_host=config.max_ids_per_host,
        limit_loopback=config.limit_loopback,
    )


class DhtPeer:
    """A Kademlia node without the Agent Card API (see :class:`p2pnode.dht.node.DhtNode`).

    Use as ``async with DhtPeer(net, ...) as peer:``; the node answers
    requests until the block ends.
    """

    def __init__(
        self,
        network: Network,
        *,
        identity: Identity | None = None,
        node_id: bytes | None = None,
        address: Address = ("127.0.0.1", 0),
        config: DhtConfig = _DEFAULT_CONFIG,
        rng: random.Random | None = None,
        wall_clock_ms: Callable[[], int] = _wall_ms,
        store: RecordStore | None = None,
    ) -> None:
        """``identity`` signs what this node publishes; ``node_id`` defaults to its peer id.

        ``rng`` drives jitter, refresh ids and (if given) message ids; without it all of
        them are drawn from the OS (message ids must be unpredictable to peers).
        Raises LocalError(INVALID_ARGUMENT) (see _node_id_of).
        """
        self.node_id = node_id = _node_id_of(identity, node_id)
        self.identity = identity
        self.config = config
        #: The wall clock (unix ms) that record expiry is measured on.
        self.wall_clock_ms = wall_clock_ms
        self._network = network
        self._bind_address = address
        self._rng: random.Random = rng if rng is not None else _OS_RANDOM
        self.table = _table(node_id, config)
        self._summary = LogSummary(config.log_summary_interval)
        self.records = store if store is not None else RecordStore()
        self.rtt = RttEstimator(
            initial=config.rto_initial, floor=config.rto_floor, ceiling=config.rto_ceiling
        )
        self.stats = DhtStatistics()
        #: Contains whatever one datagram or one looked-up value raises (p2pnode.core.boundary).
        self.boundary = FailureBoundary(log, self._input_failed)
        self.rpc = RpcCore(
            rng=self._rng,
            timeout=config.rpc_hard_timeout,
            max_pending=config.max_pending,
        )
        self._timed_work(config)
        self.calls = Calls(self.rpc, self.stats)
        self.calls.idle_wake = self._timers_wake
        self.gate = Gate(self, config)  # admission to the routing table (§5.1)
        self.handlers = RequestHandlers(self, self.gate.heard)
        self._endpoint: DatagramEndpoint | None = None
        self._nursery: trio.Nursery | None = None
        self._running: AbstractAsyncContextManager[Self] | None = None
        self._mode = DhtMode.SERVER

    def _timed_work(self, config: DhtConfig) -> None:
        """What the node's timer runs besides the calls' timeouts: republishing,
        maintenance passes, rejoining, and the running lookups' soft timeouts."""
        self.publisher = Publisher(
            self.records,
            self._lookup_value,
            self._store,
            wall_clock_ms=self.wall_clock_ms,
            republish_interval=config.republish_interval,
        )
        self.schedule = MaintenanceSchedule(config.maintenance_interval, self._rng)
        #: Joining again from the bootstrap and snapshot addresses when the table is empty.
        self.rejoin = Rejoin(
            self._rng, first_delay=config.rejoin_delay, max_delay=config.rejoin_max_delay
        )
        #: The lookups running (a dict for a fixed order): their soft timeouts.
        self.lookups: dict[LookupDriver, None] = {}

    # ------------------------------------------------------------------ lifecycle

    @property
    def is_running(self) -> bool:
        """True between entering ``async with`` and leaving it."""
        return self._running is not None

    async def __aenter__(self) -> Self:
        running = self._run()
        peer = await running.__aenter__()
        self._running = running
        return peer

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        running, self._running = self._running, None
        if running is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "node not started")
        return await running.__aexit__(*exc_info)

    @asynccontextmanager
    async def _run(self) -> AsyncIterator[Self]:
        self._check_idle()
        failure: BaseException | None = None
        async with trio.open_nursery() as nursery:
            await nursery.start(self.serve)
            try:
                yield self
            except BaseException as exc:  # handed on below, outside the nursery
                failure = exc
            self.close()
        # The body's own exception goes on as it is, not in the nursery's ExceptionGroup.
        if failure is not None:
            raise failure

    async def serve(self, *, task_status: trio.TaskStatus[Self] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the node in this task until :meth:`close` or cancellation
        (``await nursery.start(peer.serve)``): no task per node for a caller of many.

        Raises LocalError(INVALID_ARGUMENT) if the node runs already.
        """
        endpoint = await self._bind()
        try:
            async with trio.open_nursery() as nursery:
                self._endpoint, self._nursery = endpoint, nursery
                self.calls.endpoint = endpoint
                task_status.started(self)
                await self._network.serve_datagrams(endpoint, self)
        finally:
            self._nursery = self.calls.endpoint = None
            endpoint.close()

    def close(self) -> None:
        """Stop the node (serve returns); nothing if it is not running."""
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def _check_idle(self) -> None:
        if self._running is not None or self._nursery is not None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "node already started")

    async def _bind(self) -> DatagramEndpoint:
        self._check_idle()
        endpoint = await self._network.bind_datagram(self._bind_address)
        now = trio.current_time()
        mark_fresh(self.table, now)
        self.publisher.start(now)
        self.schedule.start(now)
        return endpoint

    @property
    def address(self) -> Address:
        """The UDP address peers reach this node at. Raises LocalError before start."""
        if self._endpoint is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "node not started")
        return self._endpoint.local_address

    @property
    def mode(self) -> DhtMode:
        """SERVER (the start) or CLIENT: whether requests are answered (dht.md §5.3)."""
        return self._mode

    def set_mode(self, mode: DhtMode) -> None:
        """Answer requests (SERVER) or none (CLIENT: for a node others cannot reach,
        which then never enters a routing table). Its own requests, lookups, stores
        and records work alike in both modes."""
        if mode is not self._mode:
            log.info("dht.mode %s -> %s", self._mode.value, mode.value)
            self._mode = mode

    def statistics(self) -> DhtStatistics:
        """A copy of the node's counters."""
        return dataclasses.replace(self.stats)

    @property
    def contact(self) -> Contact:
        """This node as a contact."""
        return Contact(self.node_id, *self.address)

    # ------------------------------------------------------------------ I/O

    # The network's DatagramReceiver: datagram_received, timer_due, next_wake, sleeping_in.

    def sleeping_in(self, wake: Wake | None) -> None:
        """The timer the network sleeps to (None while the node works): calls and
        lookups pull its deadline in."""
        self.calls.wake = wake

    def datagram_received(self, data: bytes, source: Address) -> None:
        """One datagram from ``source``, handed over by the network; never raises."""
        now = trio.current_time()
        try:
            self._take_datagram(data, source, now)
        except Exception as exc:
            self.boundary.contain(_text(source), "datagram", exc)
        self._summarise(now)

    def next_wake(self) -> float:
        """When :meth:`timer_due` should run next."""
        deadline = self.rpc.next_deadline()
        wake = self._timers_wake()
        return wake if deadline is None or deadline > wake else deadline

    def _timers_wake(self) -> float:
        """When the node must wake for anything but a pending call."""
        wake = min(
            self.schedule.next_deadline(),
            self._summary.next_deadline(),
            self.rejoin.next_deadline(),
        )
        for lookup in self.lookups:
            wake = min(wake, lookup.next_deadline())
        return wake

    def _summarise(self, now: float) -> None:
        line = self._summary.due(now, self.stats)
        if line is not None:
            log.info("%s", line)

    async def _handle_datagram(self, data: bytes, source: Address) -> None:
        """:meth:`_take_datagram`, then a checkpoint (for callers that feed datagrams)."""
        self._take_datagram(data, source, trio.current_time())
        await trio.lowlevel.checkpoint()

    def _take_datagram(self, data: bytes, source: Address, now: float) -> None:
        """Process one datagram from ``source`` at ``now`` and send what it calls for.

        Bad peer input is dropped and logged, not raised; anything else that
        processing raises propagates (:meth:`datagram_received` contains it behind
        :attr:`boundary`).
        """
        for event in self.rpc.receive_datagram_untrusted(data, source, now):
            _EVENT_HANDLERS[type(event)](self, event, now)
        self.calls.flush()

    def timer_due(self, now: float) -> None:
        """Run what is due at ``now``: the calls' hard timeouts, the lookups' soft
        ones, maintenance, rejoining, the log summary; then send what they queued."""
        for event in self.rpc.handle_timer(now):
            self.calls.on_timeout(event)
        for lookup in list(self.lookups):
            lookup.timer_due(now)
        if self.schedule.handle_timer(now):
            if self._quiet_pass(now):
                self.schedule.finished()
            else:
                assert self._nursery is not None
                self._nursery.start_soon(self._maintenance_task)
        # Contacts leave the table only as calls time out, which is handled here.
        if self.rejoin.observe(len(self.table), now):
            assert self._nursery is not None
            self._nursery.start_soon(self._republish_task)
        if self.rejoin.handle_timer(now):
            assert self._nursery is not None
            self._nursery.start_soon(self._rejoin_task)
        self._summarise(now)
        self.calls.flush()

    def _input_failed(self, source: str, what: str, exc: Exception) -> None:
        # The boundary logs the traceback (once per source and type a minute).
        self.stats.inputs_failed += 1
        log.debug("dht.input_failed peer=%s input=%s error=%s", source, what, describe(exc))

    def drop(self, source: Address, reason: str, kind: str) -> None:
        """Count a dropped datagram under ``dropped_<kind>``; the log has a summary."""
        stats = self.stats
        stats.datagrams_dropped += 1
        setattr(stats, f"dropped_{kind}", getattr(stats, f"dropped_{kind}") + 1)
        log.debug("dht.drop peer=%s:%s reason=%s", source[0], source[1], reason)

    # ------------------------------------------------------------------ core events

    def _on_request(self, event: RequestReceived, now: float) -> None:
        """Answer ``event``, which arrived at ``now`` (in client mode: ignore it)."""
        if self._mode is DhtMode.CLIENT:
            # Silence, not a refusal: nobody can prove this node's address, so it
            # is admitted nowhere (§5.1) and never handed out as a contact.
            self.stats.requests_ignored += 1
            return
        try:
            reply = self.handlers.answer_untrusted(event.method, event.source, event.args, now)
            self.rpc.reply(event, reply)
        except RemoteError as exc:
            self.drop(event.source, f"{event.method}: {exc.message}", "requests")
            return
        except LocalError as exc:  # our reply would not fit: say nothing, as stock does
            log.warning("dht.reply_failed method=%s reason=%s", event.method, exc.message)
            return
        self.stats.requests_handled += 1

    def _on_drop(self, event: DatagramDropped, now: float) -> None:
        kind = "malformed" if event.reason is DropReason.MALFORMED else "replies"
        self.drop(event.source, event.detail, kind)

    # ------------------------------------------------------------------ calls

    async def _call(
        self, address: Address, method: str, args: list[Any], *, contact: Contact | None = None
    ) -> Any:
        """One request; the raw reply value, or NO_REPLY after the hard timeout.

        With ``contact`` (at ``address``) the routing table learns how it did.
        """
        if contact is None:
            return await self.calls.call(address, method, args)
        return await self.calls.call(address, method, args, partial(self.gate.informing, contact))

    # ------------------------------------------------------------------ lookups

    async def _lookup(
        self,
        target: bytes,
        *,
        want_value: bool = False,
        quorum: int | None = None,
        soft_timeouts: bool = True,
    ) -> tuple[Lookup, list[SignedRecord]]:
        """Run one iterative lookup (§6); with ``want_value`` collect records too."""
        driver = LookupDriver(
            self, target, want_value=want_value, quorum=quorum, soft_timeouts=soft_timeouts
        )
        return await driver.run()

    async def _lookup_value(self, key: bytes) -> tuple[list[Contact], list[SignedRecord]]:
        """A value lookup to the k closest: the nodes that answered and the records read.

        Publishing stores at those nodes: no soft timeouts, slow ones are waited for.
        """
        lookup, recs = await self._lookup(key, want_value=True, soft_timeouts=False)
        return lookup.closest_answered(), recs

    async def _store(self, contacts: list[Contact], key: bytes, value: bytes) -> int:
        """``store(key, value)`` at every contact at once: how many accepted."""
        informing = self.gate.informing
        targets = [(c.address, partial(informing, c)) for c in contacts]
        replies = await self.calls.call_each(targets, "store", [self.node_id, key, value])
        return sum(1 for reply in replies if reply is True)

    # ------------------------------------------------------------------ public API

    async def ping(self, address: Address) -> bytes | None:
        """Ping ``address``; the node id it reports (and adds to the table), or None."""
        value = await self._call(address, "ping", [self.node_id])
        if value is NO_REPLY:
            return None
        try:
            node_id = rpcwire.parse_ping_reply_untrusted(value)
        except rpcwire.RpcError as exc:
            self.drop(address, exc.message, "replies")
            return None
        self.gate.proven(node_id, address, stated=True)
        self.calls.flush()
        return node_id

    async def bootstrap(self, addresses: Iterable[Address]) -> int:
        """Join through ``addresses``: ping them all, then look up our own id.

        When none answers (and the table is still empty), they are pinged once
        more: one lost datagram (a flooded bootstrap node's full socket buffer)
        must not leave the node alone. Returns how many bootstrap nodes answered.
        """
        addresses = list(addresses)
        self.rejoin.remember_bootstrap(addresses)
        answered = 0
        for _ in range(BOOTSTRAP_ROUNDS):
            answered = await count_answers(self.ping, addresses)
            if answered or len(self.table):
                await self.find_node(self.node_id)
                break
        return answered

    async def find_node(self, target: bytes) -> list[Contact]:
        """The k nodes nearest ``target`` that answered, nearest first."""
        lookup, _ = await self._lookup(target)
        return lookup.closest_answered()

    async def get_records(self, key: bytes, *, quorum: int | None = None) -> list[SignedRecord]:
        """Verified, merged records under ``key`` (local ones included).

        Stops once ``quorum`` nodes (default ``config.value_quorum``) returned
        records; ``quorum=0`` reads until the k closest nodes answered.
        """
        q = self.config.value_quorum if quorum is None else quorum
        _, recs = await self._lookup(key, want_value=True, quorum=q or None)
        return merge_records(recs, self.records.get(key, self.wall_clock_ms()))

    async def put_records(self, key: bytes, records: list[SignedRecord]) -> int:
        """Publish ``records`` under ``key``: read, merge, store at the k closest.

        Returns how many nodes accepted the store.
        """
        return await self.publisher.put_records(key, records)

    async def maintain(self) -> None:
        """One maintenance pass: expire, refresh stale buckets, republish when due."""
        await maintenance_pass(
            table=self.table,
            records=self.records,
            publisher=self.publisher,
            find_node=self.find_node,
            rng=self._rng,
            now=trio.current_time(),
            now_ms=self.wall_clock_ms(),
            refresh_interval=self.config.refresh_interval,
        )

    def _quiet_pass(self, now: float) -> bool:
        """The pass at ``now`` without I/O; True if there is nothing more to it."""
        return quiet_pass(
            table=self.table,
            records=self.records,
            publisher=self.publisher,
            now=now,
            now_ms=self.wall_clock_ms(),
            refresh_interval=self.config.refresh_interval,
        )

    async def _maintenance_task(self) -> None:
        try:
            await self.maintain()
        finally:
            self.schedule.finished()

    async def _rejoin_task(self) -> None:
        """One attempt to join again (dht.md §5.2): ping the seeds, then look up our id
        through those that answered."""
        seeds = self.rejoin.seeds
        self.stats.rejoins += 1
        log.info("dht.rejoin table empty: trying %d bootstrap and snapshot addresses", len(seeds))
        try:
            if await count_answers(self.ping, seeds) or len(self.table):
                await self.find_node(self.node_id)
        finally:
            if self.rejoin.finished(len(self.table), trio.current_time()):
                assert self._nursery is not None
                self._nursery.start_soon(self._republish_task)
            # The network sleeps to a deadline set before this attempt: pull it in.
            wake = self.calls.wake
            if wake is not None and self.rejoin.next_deadline() < wake.deadline:
                wake.deadline = self.rejoin.next_deadline()

    async def _republish_task(self) -> None:
        """The table holds contacts again after it was empty: put what was published
        meanwhile (stored here only) where readers look (dht.md §5.2)."""
        await self.publisher.republish_now(trio.current_time())

    def snapshot(self) -> bytes:
        """The routing table (and restored contacts not yet proven) as bytes
        (``[[id, host, port], ...]``) for a fast rejoin."""
        return snapshot_contacts([*self.table.contacts(), *self.gate.candidates.values()])

    def restore(self, data: bytes) -> int:
        """Take the contacts of a :meth:`snapshot` as candidates; returns how many.

        They enter the table only as they answer (§5.1): each is pinged (a few at
        a time, in the background) and lookups may ask them meanwhile. Raises
        LocalError(CONFIG_ERROR) for a corrupt snapshot, INVALID_ARGUMENT before
        the node started.
        """
        if self._nursery is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "node not started")
        contacts = parse_snapshot(data)
        self.rejoin.remember_snapshot(c.address for c in contacts)
        self.gate.add_candidates(contacts)
        self._nursery.start_soon(self.gate.check_candidates)
        return len(contacts)


# Shared by all nodes: no per-node dict of bound methods.
#: Each handler gets the event and the time its datagram arrived.
_EVENT_HANDLERS: dict[type[RpcEvent], Callable[[DhtPeer, Any, float], None]] = {
    RequestReceived: DhtPeer._on_request,
    ReplyReceived: lambda peer, event, now: peer.calls.on_reply(event),
    CallTimedOut: lambda peer, event, now: peer.calls.on_timeout(event),
    DatagramDropped: DhtPeer._on_drop,
}

__all__ = ["NO_REPLY", "DhtConfig", "DhtPeer", "DhtStatistics"]
