"""The switch from a relayed channel to a hole-punched one, with real TCP on 127.0.0.1
(docs/protocol/holepunch.md §5).

The dialer's network refuses connections to the other node's listening address (as a
NAT would), so their channel opens through a relay. Then the two nodes punch: on the
loopback both simultaneous connects reach the other's listening port, and the link
moves to the direct channel. Requests keep flowing the whole time: every one is
answered, and each reaches the agent exactly once."""

from __future__ import annotations

import dataclasses

import pytest
import trio

from p2pnode.core.identity import Identity
from p2pnode.node.discovery import MemoryDiscovery
from p2pnode.runtime import Node
from p2pnode.transport.net import Address, TrioNetwork
from p2pnode.transport.relay import format_relay_address
from p2pnode.transport.relayserve import RelayServer
from tests.sim.configs import FAST_NODE
from tests.sim.nodes import Inbox
from tests.sim.waiting import wait_until

pytestmark = pytest.mark.slow

RELAY = Identity(b"\x70" * 32)
STEP = 10.0  # seconds any one wait may take


class RefusingTo(TrioNetwork):
    """The real network, except that connections to ``refused`` are refused at once."""

    def __init__(self) -> None:
        self.refused: Address | None = None

    async def connect_stream(self, address: Address) -> trio.abc.Stream:
        if address == self.refused:
            raise ConnectionRefusedError(f"{address} refused (a NAT in front of it)")
        return await super().connect_stream(address)


async def _requests(
    dialer: Node, count: int, answered: list[int], paths: set[bool | None] | None = None
) -> None:
    """``count`` requests, four at a time, each answer recorded by its number (and in
    ``paths`` whether the link was relayed when it came)."""
    limiter = trio.CapacityLimiter(4)

    async def one(n: int) -> None:
        async with limiter:
            reply = await dialer.request("caller", "behind", {"n": n})
            assert reply.payload == {"echo": {"n": n}}
            answered.append(n)
            if paths is not None:  # the dialer's one link: to the node behind the NAT
                paths.update(link.relayed for link in dialer.links)

    async with trio.open_nursery() as nursery:
        for n in range(count):
            nursery.start_soon(one, n)
            await trio.sleep(0.005)  # a steady flow across the switch


async def test_relayed_channel_becomes_direct_without_losing_requests() -> None:
    relay_network, dialer_network = TrioNetwork(), RefusingTo()
    server = RelayServer(relay_network, RELAY.peer_id)
    directory = MemoryDiscovery()
    inbox, answered = Inbox(), list[int]()
    count = 300
    with trio.fail_after(3 * STEP):
        async with trio.open_nursery() as nursery:
            host, port = await nursery.start(server.serve, ("127.0.0.1", 0))
            relayed = format_relay_address((host, port), RELAY.peer_id)
            behind_config = dataclasses.replace(FAST_NODE, relays=(relayed,))
            async with (
                Node(Identity.generate(), TrioNetwork(), behind_config,
                     discovery=directory) as behind,
                Node(Identity.generate(), dialer_network, FAST_NODE,
                     discovery=directory) as dialer,
            ):  # fmt: skip
                dialer_network.refused = behind.listen_address
                await behind.add_agent("behind", inbox)
                await dialer.add_agent("caller", Inbox())
                await wait_until(lambda: server.core.reservation(behind.peer_id) is not None, STEP)
                paths: set[bool | None] = set()
                await _requests(dialer, count, answered, paths)
                assert paths == {True, False}  # answers came before and after the switch
                link = dialer.links.get(behind.peer_id)
                assert link is not None
                await wait_until(lambda: link.relayed is False, STEP)
                back = behind.links.get(dialer.peer_id)
                assert back is not None and back.relayed is False
                assert server.statistics().circuits_opened == 1  # relayed first
                punched = [n.holepunch.statistics()["direct"] for n in (behind, dialer)]
                assert sorted(punched) == [0, 1] or sorted(punched) == [1, 1], punched
                # More requests after the switch go over the direct channel.
                await _requests(dialer, 20, answered)
            nursery.cancel_scope.cancel()
    assert sorted(answered) == sorted([*range(count), *range(20)])
    numbers = [e.payload["n"] for e in inbox.received]
    assert sorted(numbers) == sorted([*range(count), *range(20)])  # each exactly once
