"""The reachability service's use of the node's DHT (docs/protocol/reachability.md §2.3).

* The UDP dial-back: a Kademlia ``ping`` (dht.md §3, resent while unanswered) sent
  from a **new** UDP socket, never the DHT's own, so a NAT mapping the requester opened
  towards the checker's DHT does not let it through; reached when the reply, from the
  address pinged, with the request's message id, carries the requester's node id.
* ``stun`` to a checker's DHT, from the node's own DHT socket: where that checker sees
  it (the mapping the NAT made towards that checker).
* A lookup of a random key: peers the network, not this node, picked.
* The DHT's mode, set from the verdict (client when the node is unreachable).
"""

from __future__ import annotations

import math
import random
from typing import Protocol

import trio

from p2pnode.core.identity import PeerId
from p2pnode.dht.calls import NO_REPLY
from p2pnode.dht.config import DhtMode
from p2pnode.dht.contacts import Contact
from p2pnode.dht.rpcwire import (
    MSG_ID_BYTES,
    Response,
    RpcError,
    decode_datagram_untrusted,
    encode_request,
    parse_ping_reply_untrusted,
    parse_stun_reply_untrusted,
)
from p2pnode.services.reachability.wire import Address
from p2pnode.transport.net import Network

#: Datagrams a fresh socket reads while waiting for the ping's reply (others are noise).
MAX_STRAY = 16
#: Pings sent (the same request each time), PING_RESEND_S apart, until one is answered.
PING_SENDS = 3
PING_RESEND_S = 0.5


class _Calls(Protocol):
    async def call(self, address: Address, method: str, args: list[object]) -> object: ...


class _Dht(Protocol):
    """The part of :class:`~p2pnode.dht.peer.DhtPeer` used here."""

    @property
    def calls(self) -> _Calls: ...

    async def find_node(self, target: bytes) -> list[Contact]: ...

    def set_mode(self, mode: DhtMode) -> None: ...


class DhtReach:
    """:class:`~p2pnode.services.reachability.service.DhtSide` over a running DHT."""

    def __init__(
        self, dht: _Dht, network: Network, caller_id: bytes, rng: random.Random
    ) -> None:
        """``caller_id``: the node id a dial-back ping states (the dial-back identity's)."""
        self._dht = dht
        self._network = network
        self._caller_id = caller_id
        self._rng = rng

    async def ping_from_fresh_socket(self, address: Address, node_id: bytes) -> bool:
        any_host = "::" if ":" in address[0] else "0.0.0.0"
        try:
            endpoint = await self._network.bind_datagram((any_host, 0))
        except OSError:  # no socket of that family here: the address cannot be checked
            return False
        try:
            msg_id = self._rng.randbytes(MSG_ID_BYTES)
            request = encode_request(msg_id, "ping", [self._caller_id])
            strays = 0
            # A single datagram lost on the way would read as "unreachable": the same
            # request goes again every PING_RESEND_S, the caller's dial timeout bounding all.
            for sent in range(1, PING_SENDS + 1):
                await endpoint.sendto(request, address)
                with trio.move_on_after(PING_RESEND_S if sent < PING_SENDS else math.inf):
                    while strays < MAX_STRAY:
                        data, source = await endpoint.recvfrom()
                        strays += 1
                        if source != address:
                            continue
                        try:
                            decoded = decode_datagram_untrusted(data)
                        except RpcError:
                            return False
                        if isinstance(decoded, Response) and decoded.msg_id == msg_id:
                            try:
                                return parse_ping_reply_untrusted(decoded.value) == node_id
                            except RpcError:
                                return False
                    return False
            return False
        except (OSError, trio.ClosedResourceError):
            return False
        finally:
            endpoint.close()

    async def stun(self, address: Address) -> Address | None:
        value = await self._dht.calls.call(address, "stun", [])
        if value is NO_REPLY:
            return None
        try:
            return parse_stun_reply_untrusted(value)
        except RpcError:
            return None

    async def looked_up(self) -> list[tuple[PeerId, Address]]:
        contacts = await self._dht.find_node(self._rng.randbytes(20))
        return [(PeerId(c.node_id), c.address) for c in contacts]


    def set_mode(self, mode: DhtMode) -> None:
        self._dht.set_mode(mode)


__all__ = ["MAX_STRAY", "DhtReach"]
