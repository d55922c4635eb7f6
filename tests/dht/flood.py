"""The datagram flood of the hardening issue, for the simulator and for loopback.

One attacker host sends from many source ports a mix of random bytes and
well-formed ``find_node``, ``store`` and ``ping`` requests, each claiming a
fresh random id. A *responsive* attacker also reads every port and answers
each request made to it (a ping with a fresh id per port, a ``find_node``
with nothing), which is the most a flooder that really receives on its
ports can do.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import trio

from p2pnode.core.wire import pack
from p2pnode.dht import rpcwire
from p2pnode.transport.net import Address, DatagramEndpoint


@dataclass
class Flood:
    """Sends the flood from ``ports`` to ``target`` and remembers every id it claimed."""

    ports: list[DatagramEndpoint]
    target: Address
    rng: random.Random
    #: Every id the attacker used (claimed in a request or named in a ping reply).
    ids: set[bytes] = field(default_factory=set)
    sent: int = 0
    answered: int = 0

    def _fresh_id(self) -> bytes:
        node_id = self.rng.randbytes(20)
        self.ids.add(node_id)
        return node_id

    def datagram(self) -> bytes:
        """One datagram of the mix: a quarter each random, find_node, store, ping."""
        rng = self.rng
        kind = rng.randrange(4)
        msg_id = rng.randbytes(20)
        if kind == 0:
            return rng.randbytes(rng.randrange(1, 200))
        if kind == 1:
            return rpcwire.encode_request(
                msg_id, "find_node", [self._fresh_id(), rng.randbytes(20)]
            )
        if kind == 2:
            value = rng.randbytes(rng.randrange(1, 300))
            return rpcwire.encode_request(
                msg_id, "store", [self._fresh_id(), rng.randbytes(20), value]
            )
        return rpcwire.encode_request(msg_id, "ping", [self._fresh_id()])

    async def send(self, count: int, *, burst: int = 50, gap: float = 0.01) -> None:
        """Send ``count`` datagrams, ``burst`` at a time ``gap`` seconds apart, each from
        a port drawn at random."""
        for i in range(count):
            await self.rng.choice(self.ports).sendto(self.datagram(), self.target)
            self.sent += 1
            if i % burst == burst - 1:
                await trio.sleep(gap)

    async def answer(self, ep: DatagramEndpoint) -> None:
        """Answer every request made to ``ep`` (run one per port, until cancelled)."""
        my_id = self._fresh_id()
        while True:
            data, source = await ep.recvfrom()
            try:
                msg = rpcwire.decode_datagram_untrusted(data)
            except rpcwire.RpcError:
                continue
            if not isinstance(msg, rpcwire.Request):
                continue
            value: object = my_id if msg.method == "ping" else []
            await ep.sendto(rpcwire.encode_response(msg.msg_id, value), source)
            self.answered += 1


def junk_in(ids: object, flood: Flood) -> int:
    """How many of ``ids`` (an iterable of 20-byte ids) the flood made up."""
    assert isinstance(ids, list | set | tuple)
    return sum(1 for i in ids if i in flood.ids)


async def ask_find_node(
    ep: DatagramEndpoint, target: Address, key: bytes, asker: bytes
) -> list[bytes]:
    """The ids of one ``find_node`` reply from ``target`` (empty if none came)."""
    msg_id = random.Random(key).randbytes(20)
    await ep.sendto(b"\x00" + msg_id + pack(["find_node", [asker, key]]), target)
    with trio.move_on_after(5):
        while True:
            data, _ = await ep.recvfrom()
            msg = rpcwire.decode_datagram_untrusted(data)
            if isinstance(msg, rpcwire.Response) and msg.msg_id == msg_id:
                return [c.node_id for c in rpcwire.parse_contacts_untrusted(msg.value)]
            if isinstance(msg, rpcwire.Request):  # the node checking us: answer as asker
                await ep.sendto(rpcwire.encode_response(msg.msg_id, asker), target)
    return []
