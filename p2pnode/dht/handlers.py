"""The callee side of the Kademlia RPC (sans-IO): one handler per request name.

Theory of operation (docs/protocol/dht.md §3 and §4.4): the driver hands
each :class:`~p2pnode.dht.rpc.RequestReceived` to
:meth:`RequestHandlers.answer_untrusted`, which dispatches on the RPC name
through the table ``_HANDLERS``. A handler checks its arguments with the
:mod:`p2pnode.dht.rpcwire` parsers (anything malformed raises RpcError and
the driver drops the datagram: no error reply exists), reports the claimed
caller id and the datagram's source to the node's admission (every RPC but
``stun``: §3 "the address is always the UDP source, never a field"; §5.1:
a request alone does not put its sender in the table), and returns the reply
value for :meth:`~p2pnode.dht.rpc.RpcCore.reply`.

``store`` applies the per-host token bucket, verifies each record of the
value alone (a bad record does not hide good ones), merges the valid ones
into the record store and answers True only if at least one of them is now
held: a replay or a value of stale revisions is False (§4.4).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from p2pnode.dht import rpcwire
from p2pnode.dht.config import DhtStatistics
from p2pnode.dht.records import RecordError, RecordStore, decode_value_untrusted, encode_value
from p2pnode.dht.routing import RoutingTable
from p2pnode.dht.rpc import Address

log = logging.getLogger("p2pnode.dht")

#: ``(claimed caller id, source address, now)`` of a request, for admission (§5.1).
Heard = Callable[[bytes, Address, float], None]


class HandlerHost(Protocol):
    """What the handlers read of their node, at each request (so a replaced table counts)."""

    @property
    def node_id(self) -> bytes: ...
    @property
    def table(self) -> RoutingTable: ...
    @property
    def records(self) -> RecordStore: ...
    @property
    def stats(self) -> DhtStatistics: ...
    @property
    def wall_clock_ms(self) -> Callable[[], int]: ...


class RequestHandlers:
    """Answers requests from the node's routing table and record store."""

    __slots__ = ("_heard", "_host")

    def __init__(self, host: HandlerHost, heard: Heard) -> None:
        self._host = host
        self._heard = heard

    def answer_untrusted(self, method: str, source: Address, args: list[Any], now: float) -> Any:
        """The reply to ``method(*args)`` from ``source`` at ``now``.

        Raises RpcError for malformed arguments (``method`` is one of rpcwire.METHODS).
        """
        return _HANDLERS[method](self, source, args, now)

    def _ping(self, source: Address, args: list[Any], now: float) -> Any:
        self._heard(rpcwire.parse_ping_args_untrusted(args), source, now)
        return self._host.node_id

    def _store(self, source: Address, args: list[Any], now: float) -> Any:
        node_id, key, value = rpcwire.parse_store_args_untrusted(args)
        self._heard(node_id, source, now)
        host = self._host
        if not host.records.allow_store(source[0], now):
            host.stats.stores_rate_limited += 1
            log.debug("dht.store_rate_limited peer=%s:%s", *source)
            return False
        now_ms = host.wall_clock_ms()
        try:
            recs, rejected = decode_value_untrusted(
                value, key, now_ms=now_ms, known=host.records.known
            )
        except RecordError as exc:
            host.stats.records_rejected += 1
            log.debug("dht.store_rejected peer=%s:%s reason=%s", source[0], source[1], exc.message)
            return False
        if rejected:
            host.stats.records_rejected += rejected
            log.debug("dht.records_rejected peer=%s:%s count=%d", source[0], source[1], rejected)
        records = host.records
        records.put(key, recs, now_ms)
        # Each of recs is unexpired at now_ms; held is what the store has under its bytes.
        return any(records.known(r.encoded) is not None for r in recs)

    def _find_node(self, source: Address, args: list[Any], now: float) -> Any:
        node_id, key = rpcwire.parse_find_args_untrusted(args)
        self._heard(node_id, source, now)
        return self._closest_wire(key, source)

    def _find_value(self, source: Address, args: list[Any], now: float) -> Any:
        node_id, key = rpcwire.parse_find_args_untrusted(args)
        self._heard(node_id, source, now)
        recs = self._host.records.get(key, self._host.wall_clock_ms())
        if recs:
            return {"value": encode_value(recs)}
        return self._closest_wire(key, source)

    def _stun(self, source: Address, args: list[Any], now: float) -> Any:
        rpcwire.parse_stun_args_untrusted(args)
        return [source[0], source[1]]

    def _closest_wire(self, key: bytes, source: Address) -> rpcwire.Encoded:
        # As stock: never return the asker itself nor a contact whose id is the key.
        # The table holds one id per address: the asker is the contact held at its
        # source address, if any, and both are left out by id (no contact read).
        table = self._host.table
        asker = table.holder(source)
        if asker is not None:
            held = table.get(asker)
            if held is None or held.address != source:  # a replacement there, not a contact
                asker = None
        return rpcwire.contacts_reply(table.closest(key, table.k, excluding=(key, asker)))


# Shared by all nodes: no per-node dict of bound methods.
_HANDLERS: dict[str, Callable[[RequestHandlers, Address, list[Any], float], Any]] = {
    "ping": RequestHandlers._ping,
    "store": RequestHandlers._store,
    "find_node": RequestHandlers._find_node,
    "find_value": RequestHandlers._find_value,
    "stun": RequestHandlers._stun,
}

__all__ = ["HandlerHost", "Heard", "RequestHandlers"]
