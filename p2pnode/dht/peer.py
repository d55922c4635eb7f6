"""The trio DHT peer: UDP RPC, lookups, records and maintenance over ``net``.

Theory of operation: a :class:`DhtPeer` binds one datagram endpoint from a
:class:`p2pnode.net.Network` (real sockets or the simulator) and runs one
long-lived task in its own nursery, the receive loop, which also wakes at the
maintenance deadline and starts a short-lived maintenance task (so a
thousand simulated nodes cost a thousand tasks, not two thousand).

* **RPC** (docs/protocol/dht.md §2-3): requests are decoded by
  :mod:`p2pnode.dht.rpcwire`, dispatched through a handler table, answered
  inline (no task per request). A reply is matched by message id *and* by the
  address the request went to; anything else is dropped and logged on the
  ``p2pnode.dht`` logger. Each outgoing call waits at most
  ``rpc_hard_timeout``; no reply counts as a failure for the routing table.
* **Lookups** are driven from the sans-IO :class:`~p2pnode.dht.lookup.Lookup`:
  one task per request in flight, results come back over a memory channel,
  the loop wakes at ``next_deadline()`` to mark slow nodes.
* **Records**: ``store`` accepts only values that decode to valid signed
  records (:mod:`p2pnode.dht.records`), merged into a bounded store; a
  ``find_value`` hit returns the merged value. Publishing is a value lookup
  (read) followed by stores of the merged value at the k closest (write), so
  stock nodes, which overwrite, carry everyone's records too.
* **Maintenance** (every ``maintenance_interval``): drop expired records,
  look up a random id in every stale bucket (Kademlia §2.3), republish our
  own records when ``republish_interval`` has passed (before they expire).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import trio

from p2pnode.boundary import FailureBoundary, describe
from p2pnode.dht import rpcwire
from p2pnode.dht.lookup import Lookup, RttEstimator
from p2pnode.dht.records import (
    RecordError,
    RecordKind,
    RecordStore,
    SignedRecord,
    decode_value_untrusted,
    encode_value,
)
from p2pnode.dht.routing import Contact, RoutingTable, random_id_in_range
from p2pnode.errors import ErrorCode, LocalError, RemoteError
from p2pnode.identity import Identity
from p2pnode.net import Address, DatagramEndpoint, Network
from p2pnode.wire import WireError, WireLimits, pack, unpack_untrusted

log = logging.getLogger("p2pnode.dht")

_SNAPSHOT_LIMITS = WireLimits(max_size=1 << 20, max_array_len=8192, max_depth=3)


@dataclass(frozen=True, slots=True)
class DhtConfig:
    """Tunables; defaults follow Kademlia §2.3-§4 and the stock package."""

    k: int = 20
    alpha: int = 3
    rto_initial: float = 1.0
    rto_floor: float = 0.05
    rto_ceiling: float = 2.0
    rpc_hard_timeout: float = 5.0
    refresh_interval: float = 3600.0
    republish_interval: float = 1800.0
    maintenance_interval: float = 60.0
    record_ttl_ms: int = 2 * 3600 * 1000
    value_quorum: int = 3
    replacement_size: int = 8
    card_quorum: int = 1
    max_pending: int = 1024


@dataclass(slots=True)
class DhtStatistics:
    """Counters for benchmarks and tests."""

    rpcs_sent: int = 0
    rpcs_answered: int = 0
    rpcs_timed_out: int = 0
    requests_handled: int = 0
    datagrams_dropped: int = 0
    records_rejected: int = 0
    stores_rate_limited: int = 0
    #: Datagrams and looked-up values whose processing raised (contained, dropped).
    inputs_failed: int = 0


class _Pending:
    __slots__ = ("address", "event", "value")

    def __init__(self, address: Address) -> None:
        self.address = address
        self.event = trio.Event()
        self.value: Any = _NO_REPLY


_NO_REPLY = object()


def _text(address: Address) -> str:
    return f"{address[0]}:{address[1]}"


def _wall_ms() -> int:
    return time.time_ns() // 1_000_000


class DhtPeer:
    """A Kademlia node without the Agent Card API (see :class:`p2pnode.dht.node.DhtNode`)."""

    def __init__(
        self,
        network: Network,
        *,
        identity: Identity | None = None,
        node_id: bytes | None = None,
        address: Address = ("127.0.0.1", 0),
        config: DhtConfig = DhtConfig(),
        rng: random.Random | None = None,
        wall_clock_ms: Callable[[], int] = _wall_ms,
        store: RecordStore | None = None,
    ) -> None:
        """``identity`` signs what this node publishes; ``node_id`` defaults to its peer id.

        Raises LocalError(INVALID_ARGUMENT) when neither is given or the id is not 20 bytes.
        """
        if node_id is None:
            if identity is None:
                raise LocalError(ErrorCode.INVALID_ARGUMENT, "need an identity or a node id")
            node_id = identity.peer_id.raw
        if len(node_id) != 20:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "node ids are 20 bytes")
        self.node_id = node_id
        self.identity = identity
        self.config = config
        self._network = network
        self._bind_address = address
        self._rng = rng if rng is not None else random.Random()
        self._wall_ms = wall_clock_ms
        self.table = RoutingTable(node_id, k=config.k, replacement_size=config.replacement_size)
        self.records = store if store is not None else RecordStore()
        self.rtt = RttEstimator(
            initial=config.rto_initial, floor=config.rto_floor, ceiling=config.rto_ceiling
        )
        self.stats = DhtStatistics()
        #: Contains whatever one datagram or one looked-up value raises (p2pnode.boundary).
        self.boundary = FailureBoundary(log, self._input_failed)
        self._pending: dict[bytes, _Pending] = {}
        self._endpoint: DatagramEndpoint | None = None
        self._nursery: trio.Nursery | None = None
        self._nursery_cm: AbstractAsyncContextManager[trio.Nursery] | None = None
        self._published: dict[tuple[bytes, RecordKind], Callable[[], SignedRecord]] = {}
        self._last_republish = 0.0
        self._next_maintenance = 0.0
        self._maintaining = False

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> Self:
        self._endpoint = await self._network.bind_datagram(self._bind_address)
        # The table was built before the clock was known: it is fresh as of now.
        for lo, _ in self.table.stale_buckets(trio.current_time(), 0.0):
            self.table.touch_range(lo.to_bytes(20, "big"), trio.current_time())
        self._nursery_cm = trio.open_nursery()
        self._nursery = await self._nursery_cm.__aenter__()
        self._last_republish = trio.current_time()
        # Spread maintenance so a thousand nodes started together do not refresh in step.
        self._next_maintenance = trio.current_time() + self.config.maintenance_interval * (
            0.5 + self._rng.random()
        )
        self._nursery.start_soon(self._receive_loop)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._nursery is not None and self._endpoint is not None
        assert self._nursery_cm is not None
        self._nursery.cancel_scope.cancel()
        try:
            # The body's own exception is not the nursery's business: hand it on
            # unwrapped instead of inside an ExceptionGroup.
            await self._nursery_cm.__aexit__(None, None, None)
        finally:
            self._endpoint.close()
        return None

    @property
    def address(self) -> Address:
        """The UDP address peers reach this node at."""
        if self._endpoint is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "node not started")
        return self._endpoint.local_address

    def statistics(self) -> DhtStatistics:
        """A copy of the node's counters."""
        return dataclasses.replace(self.stats)

    @property
    def contact(self) -> Contact:
        """This node as a contact."""
        return Contact(self.node_id, *self.address)

    # ------------------------------------------------------------------ RPC plumbing

    async def _receive_loop(self) -> None:
        assert self._endpoint is not None
        while True:
            # One task per node: the receive loop also wakes for maintenance,
            # which runs in its own short-lived task so receiving never stops.
            # One cancel scope per maintenance period, not one per datagram.
            with trio.move_on_at(self._next_maintenance):
                while True:
                    data, source = await self._endpoint.recvfrom()
                    try:
                        await self._handle_datagram(data, source)
                    except Exception as exc:
                        self.boundary.contain(_text(source), "datagram", exc)
            self._next_maintenance = trio.current_time() + self.config.maintenance_interval
            if not self._maintaining and self._nursery is not None:
                self._nursery.start_soon(self._maintenance_task)

    async def _handle_datagram(self, data: bytes, source: Address) -> None:
        try:
            msg = rpcwire.decode_datagram_untrusted(data)
        except rpcwire.RpcError as exc:
            self._drop(source, exc.message)
            return
        if isinstance(msg, rpcwire.Response):
            pending = self._pending.get(msg.msg_id)
            if pending is None or pending.address != source:
                self._drop(source, "unsolicited or misdirected response")
            elif pending.value is _NO_REPLY:
                pending.value = msg.value
                pending.event.set()
            return
        await self._handle_request(msg, source)

    def _input_failed(self, source: str, what: str, exc: Exception) -> None:
        self.stats.inputs_failed += 1
        log.info("dht.input_failed peer=%s input=%s error=%s", source, what, describe(exc))

    def _drop(self, source: Address, reason: str) -> None:
        self.stats.datagrams_dropped += 1
        log.info("dht.drop peer=%s:%s reason=%s", source[0], source[1], reason)

    async def _handle_request(self, req: rpcwire.Request, source: Address) -> None:
        try:
            reply = _HANDLERS[req.method](self, source, req.args)
            out = rpcwire.encode_response(req.msg_id, reply)
        except RemoteError as exc:
            self._drop(source, f"{req.method}: {exc.message}")
            return
        except LocalError as exc:  # our reply would not fit: say nothing, as stock does
            log.warning("dht.reply_failed method=%s reason=%s", req.method, exc.message)
            return
        self.stats.requests_handled += 1
        assert self._endpoint is not None
        await self._endpoint.sendto(out, source)

    def _welcome(self, node_id: bytes, source: Address) -> None:
        """The sender proved it is reachable at ``source``: tell the routing table."""
        to_ping = self.table.observe(Contact(node_id, source[0], source[1]), trio.current_time())
        if to_ping is not None and self._nursery is not None:
            self._nursery.start_soon(self._liveness_ping, to_ping)

    async def _liveness_ping(self, contact: Contact) -> None:
        reply = await self._call(contact.address, "ping", [self.node_id])
        alive = reply is not _NO_REPLY
        self.table.ping_result(contact.node_id, alive, trio.current_time())

    async def _call(self, address: Address, method: str, args: list[Any]) -> Any:
        """Send one request; the raw reply value, or ``_NO_REPLY`` after the hard timeout."""
        assert self._endpoint is not None
        if len(self._pending) >= self.config.max_pending:
            return _NO_REPLY
        msg_id = self._rng.randbytes(20)
        pending = _Pending(address)
        self._pending[msg_id] = pending
        self.stats.rpcs_sent += 1
        try:
            await self._endpoint.sendto(rpcwire.encode_request(msg_id, method, args), address)
            with trio.move_on_after(self.config.rpc_hard_timeout):
                await pending.event.wait()
        finally:
            del self._pending[msg_id]
        if pending.value is _NO_REPLY:
            self.stats.rpcs_timed_out += 1
        else:
            self.stats.rpcs_answered += 1
        return pending.value

    async def _call_contact(self, contact: Contact, method: str, args: list[Any]) -> Any:
        """:meth:`_call` that keeps the routing table informed."""
        value = await self._call(contact.address, method, args)
        if value is _NO_REPLY:
            self.table.record_failure(contact.node_id)
        else:
            self._welcome(contact.node_id, contact.address)
        return value

    # ------------------------------------------------------------------ RPC handlers

    def _rpc_ping(self, source: Address, args: list[Any]) -> Any:
        self._welcome(rpcwire.parse_ping_args_untrusted(args), source)
        return self.node_id

    def _rpc_store(self, source: Address, args: list[Any]) -> Any:
        node_id, key, value = rpcwire.parse_store_args_untrusted(args)
        self._welcome(node_id, source)
        if not self.records.allow_store(source[0], trio.current_time()):
            self.stats.stores_rate_limited += 1
            log.info("dht.store_rate_limited peer=%s:%s", *source)
            return False
        now_ms = self._wall_ms()
        try:
            recs, rejected = decode_value_untrusted(
                value, key, now_ms=now_ms, known=self.records.known
            )
        except RecordError as exc:
            self.stats.records_rejected += 1
            log.info("dht.store_rejected peer=%s:%s reason=%s", source[0], source[1], exc.message)
            return False
        if rejected:
            self.stats.records_rejected += rejected
            log.info("dht.records_rejected peer=%s:%s count=%d", source[0], source[1], rejected)
        self.records.put(key, recs, now_ms)
        # True when at least one record of the value is what we now hold
        # (taken, or already held); a replay or a value of stale revisions is False.
        held = {r.encoded for r in self.records.get(key, now_ms)}
        return any(r.encoded in held for r in recs)

    def _rpc_find_node(self, source: Address, args: list[Any]) -> Any:
        node_id, key = rpcwire.parse_find_args_untrusted(args)
        self._welcome(node_id, source)
        return self._closest_wire(key, source)

    def _rpc_find_value(self, source: Address, args: list[Any]) -> Any:
        node_id, key = rpcwire.parse_find_args_untrusted(args)
        self._welcome(node_id, source)
        recs = self.records.get(key, self._wall_ms())
        if recs:
            return {"value": encode_value(recs)}
        return self._closest_wire(key, source)

    def _rpc_stun(self, source: Address, args: list[Any]) -> Any:
        rpcwire.parse_stun_args_untrusted(args)
        return [source[0], source[1]]

    def _closest_wire(self, key: bytes, source: Address) -> list[Any]:
        # As stock: never return the asker itself nor a contact whose id is the key.
        found = self.table.closest(key, exclude=lambda c: c.address == source or c.node_id == key)
        return [rpcwire.contact_to_wire(c) for c in found]

    # ------------------------------------------------------------------ lookups

    async def _lookup(
        self,
        target: bytes,
        *,
        want_value: bool = False,
        quorum: int | None = None,
    ) -> tuple[Lookup, list[SignedRecord]]:
        """Run one iterative lookup; with ``want_value`` collect records too."""
        now = trio.current_time()
        lookup = Lookup(
            target,
            self.table.closest(target),
            rtt=self.rtt,
            own_id=self.node_id,
            k=self.config.k,
            alpha=self.config.alpha,
        )
        self.table.touch_range(target, now)
        method = "find_value" if want_value else "find_node"
        args = [self.node_id, target]
        found: dict[tuple[bytes, str], SignedRecord] = {}
        hits = 0
        send, recv = trio.open_memory_channel[tuple[Contact, Any]](math.inf)

        async def ask(c: Contact) -> None:
            value = await self._call_contact(c, method, args)
            send.send_nowait((c, value))

        async with trio.open_nursery() as nursery:
            while True:
                now = trio.current_time()
                lookup.handle_timer(now)
                for c in lookup.next_requests(now):
                    nursery.start_soon(ask, c)
                if lookup.done:
                    break
                deadline = lookup.next_deadline()
                with trio.move_on_at(math.inf if deadline is None else deadline):
                    c, value = await recv.receive()
                    if value is _NO_REPLY:
                        lookup.handle_failure(c.node_id)
                        continue
                    try:
                        if want_value:
                            raw, contacts = rpcwire.parse_find_value_reply_untrusted(value)
                        else:
                            raw, contacts = None, rpcwire.parse_contacts_untrusted(value)
                    except rpcwire.RpcError as exc:
                        self._drop(c.address, f"{method} reply: {exc.message}")
                        lookup.handle_failure(c.node_id)
                        continue
                    lookup.handle_response(c.node_id, contacts, trio.current_time())
                    if raw is not None:
                        try:
                            hits += self._collect(target, raw, c, found)
                        except Exception as exc:  # one node's value must not end the lookup
                            self.boundary.contain(_text(c.address), f"{method} value", exc)
                            continue
                        if quorum is not None and hits >= quorum:
                            lookup.finish()
            nursery.cancel_scope.cancel()
        return lookup, list(found.values())

    def _collect(
        self, key: bytes, raw: Any, c: Contact, found: dict[tuple[bytes, str], SignedRecord]
    ) -> int:
        # Replies from different nodes mostly repeat the same records: verify once.
        seen = {r.encoded: r for r in found.values()}

        def known(encoded: bytes) -> SignedRecord | None:
            return seen.get(encoded) or self.records.known(encoded)

        try:
            recs, rejected = decode_value_untrusted(raw, key, now_ms=self._wall_ms(), known=known)
        except RecordError as exc:
            self._drop(c.address, f"find_value value: {exc.message}")
            return 0
        self.stats.records_rejected += rejected
        for r in recs:
            slot = (r.public_key, r.kind.value)
            held = found.get(slot)
            if held is None or r.newer_than(held):
                found[slot] = r
        return 1 if recs else 0

    # ------------------------------------------------------------------ public API

    async def ping(self, address: Address) -> bytes | None:
        """Ping ``address``; the node id it reports (and adds to the table), or None."""
        value = await self._call(address, "ping", [self.node_id])
        if value is _NO_REPLY:
            return None
        try:
            node_id = rpcwire.parse_ping_reply_untrusted(value)
        except rpcwire.RpcError as exc:
            self._drop(address, exc.message)
            return None
        self._welcome(node_id, address)
        return node_id

    async def bootstrap(self, addresses: Iterable[Address]) -> int:
        """Join through ``addresses``: ping them all, then look up our own id.

        Returns how many bootstrap nodes answered.
        """
        answered = 0

        async def one(a: Address) -> None:
            nonlocal answered
            if await self.ping(a) is not None:
                answered += 1

        async with trio.open_nursery() as nursery:
            for a in addresses:
                nursery.start_soon(one, a)
        if answered or len(self.table):
            await self.find_node(self.node_id)
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
        merged = {(r.public_key, r.kind.value): r for r in recs}
        for r in self.records.get(key, self._wall_ms()):
            slot = (r.public_key, r.kind.value)
            if slot not in merged or r.newer_than(merged[slot]):
                merged[slot] = r
        return list(merged.values())

    async def put_records(self, key: bytes, records: list[SignedRecord]) -> int:
        """Publish ``records`` under ``key``: read, merge, store at the k closest.

        Returns how many nodes accepted the store.
        """
        now_ms = self._wall_ms()
        lookup, existing = await self._lookup(key, want_value=True, quorum=None)
        self.records.put(key, records, now_ms)
        merged = {(r.public_key, r.kind.value): r for r in existing}
        for r in self.records.get(key, now_ms):
            slot = (r.public_key, r.kind.value)
            if slot not in merged or r.newer_than(merged[slot]):
                merged[slot] = r
        # Our own records first, so they survive any size cut.
        mine = {(r.public_key, r.kind.value) for r in records}
        value = encode_value([merged[s] for s in mine if s in merged])
        rest = [r for s, r in merged.items() if s not in mine]
        if rest:
            value = encode_value([merged[s] for s in mine if s in merged] + rest)
        accepted = 0

        async def store(c: Contact) -> None:
            nonlocal accepted
            reply = await self._call_contact(c, "store", [self.node_id, key, value])
            if reply is True:
                accepted += 1

        async with trio.open_nursery() as nursery:
            for c in lookup.closest_answered():
                nursery.start_soon(store, c)
        return accepted

    async def _publish(
        self, makers: Iterable[tuple[bytes, RecordKind, Callable[[], SignedRecord]]]
    ) -> int:
        total = 0

        async def one(key: bytes, make: Callable[[], SignedRecord]) -> None:
            nonlocal total
            total += await self.put_records(key, [make()])

        async with trio.open_nursery() as nursery:
            for key, _, make in makers:
                nursery.start_soon(one, key, make)
        return total

    # ------------------------------------------------------------------ maintenance

    async def _maintenance_task(self) -> None:
        self._maintaining = True
        try:
            await self.maintain()
        finally:
            self._maintaining = False

    async def maintain(self) -> None:
        """One maintenance pass: expire, refresh stale buckets, republish when due."""
        now = trio.current_time()
        self.records.expire(self._wall_ms())
        if len(self.table):
            stale = self.table.stale_buckets(now, self.config.refresh_interval)
            async with trio.open_nursery() as nursery:
                for lo, hi in stale:
                    nursery.start_soon(self.find_node, random_id_in_range(lo, hi, self._rng))
        if self._published and now - self._last_republish >= self.config.republish_interval:
            self._last_republish = now
            await self._publish([(k[0], k[1], m) for k, m in self._published.items()])

    # ------------------------------------------------------------------ snapshot

    def snapshot(self) -> bytes:
        """The routing table as bytes (``[[id, host, port], ...]``) for a fast rejoin."""
        return pack([rpcwire.contact_to_wire(c) for c in self.table.contacts()])

    def restore(self, data: bytes) -> int:
        """Add the contacts of a :meth:`snapshot`; returns how many. Raises LocalError."""
        try:
            items = unpack_untrusted(data, _SNAPSHOT_LIMITS)
            if not isinstance(items, list):
                raise LocalError(ErrorCode.CONFIG_ERROR, "snapshot is not a list")
            added = 0
            now = trio.current_time()
            for i in range(0, len(items), rpcwire.MAX_CONTACTS):
                for c in rpcwire.parse_contacts_untrusted(items[i : i + rpcwire.MAX_CONTACTS]):
                    self.table.observe(c, now)
                    added += 1
        except (WireError, rpcwire.RpcError) as exc:
            raise LocalError(ErrorCode.CONFIG_ERROR, f"corrupt snapshot: {exc.message}") from None
        return added


_HANDLERS: dict[str, Callable[[DhtPeer, Address, list[Any]], Any]] = {
    "ping": DhtPeer._rpc_ping,
    "store": DhtPeer._rpc_store,
    "find_node": DhtPeer._rpc_find_node,
    "find_value": DhtPeer._rpc_find_value,
    "stun": DhtPeer._rpc_stun,
}

__all__ = ["DhtConfig", "DhtPeer", "DhtStatistics"]
