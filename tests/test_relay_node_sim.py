"""Nodes and relays in the simulator: a node nobody can dial keeps a reservation
(``NodeConfig.relays``), lists the relay in its cards' endpoints, and a peer that
finds its card reaches it through the relay, the channel authenticated end to end."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
import trio

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.identity import Identity
from p2pnode.node.discovery import MemoryDiscovery
from p2pnode.runtime import Node, NodeConfig
from p2pnode.simnet import LinkConditions, SimHost, SimNetwork
from p2pnode.transport.net import Address, StreamListener
from p2pnode.transport.relay import format_relay_address
from p2pnode.transport.relayserve import RelayServer
from tests.sim.configs import FAST_NODE
from tests.sim.nodes import Inbox
from tests.sim.waiting import wait_until

RELAY = Identity(b"\x60" * 32)
NATTED = Identity(b"\x61" * 32)
DIALER = Identity(b"\x62" * 32)


class InboundDropped(StreamListener):
    """A listener behind a NAT: every inbound connection is cut before a byte."""

    def __init__(self, inner: StreamListener) -> None:
        self._inner = inner

    @property
    def local_address(self) -> Address:
        return self._inner.local_address

    async def accept(self) -> trio.abc.Stream:
        while True:
            await trio.aclose_forcefully(await self._inner.accept())

    async def aclose(self) -> None:
        await self._inner.aclose()


class NattedHost(SimHost):
    """A simulated host whose listeners take no inbound connection; outbound works."""

    async def listen_stream(self, address: Address) -> StreamListener:
        return InboundDropped(await super().listen_stream(address))


class BlackholeTo(SimHost):
    """A simulated host whose connection attempts to ``unreachable`` get no answer at
    all (a NAT that drops them), as a dialer sees a node behind such a NAT."""

    unreachable = ""

    async def connect_stream(self, address: Address) -> trio.abc.Stream:
        if address[0] == self.unreachable:
            await trio.sleep_forever()
        return await super().connect_stream(address)


def test_relays_config_is_validated() -> None:
    with pytest.raises(LocalError) as caught:
        NodeConfig(relays=("10.0.0.1:4100",))
    assert caught.value.code is ErrorCode.CONFIG_ERROR
    NodeConfig(relays=(format_relay_address(("10.0.0.1", 4100), RELAY.peer_id),))


@pytest.mark.parametrize("nat", ["resets", "drops"])
async def test_node_behind_nat_reached_through_relay(nat: str, autojump_clock: Any) -> None:
    """The dialer tries the node's direct address first: a NAT that resets the
    connection fails it at once, one that drops it costs at most half the dial
    timeout; then the relay carries the channel, within the same dial."""
    sim = SimNetwork(random.Random(11), default=LinkConditions(latency=0.01, jitter=0.0))
    relay_host, natted_host = sim.add_host(), sim.add_host()
    dialer_host = BlackholeTo(sim, sim.add_host().host)
    if nat == "drops":
        dialer_host.unreachable = natted_host.host
    server = RelayServer(relay_host, RELAY.peer_id)  # the nodes sign with the real clock
    relayed = format_relay_address((relay_host.host, 4100), RELAY.peer_id)
    directory = MemoryDiscovery()
    natted_config = dataclasses.replace(
        FAST_NODE, listen=(natted_host.host, 7000), relays=(relayed,)
    )
    dialer_config = dataclasses.replace(FAST_NODE, listen=(dialer_host.host, 7000))
    inbox = Inbox()
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, (relay_host.host, 4100))
        async with (
            Node(NATTED, NattedHost(sim, natted_host.host), natted_config,
                 discovery=directory) as natted,
            Node(DIALER, dialer_host, dialer_config, discovery=directory) as dialer,
        ):  # fmt: skip
            card = await natted.add_agent("behind-nat", inbox)
            assert [e.address for e in card.endpoints] == [
                f"{natted_host.host}:7000",
                relayed,
            ]
            await wait_until(lambda: server.core.reservation(NATTED.peer_id) is not None)
            await dialer.add_agent("caller", Inbox())
            start = trio.current_time()
            reply = await dialer.request("caller", "behind-nat", {"n": 1})
            assert trio.current_time() - start < FAST_NODE.retry.dial_timeout
            assert reply.payload == {"echo": {"n": 1}}
            assert inbox.received[-1].sender == "caller"
            stats = server.statistics()
            assert stats.circuits_opened == 1 and stats.circuits == 1
            # The reply came back over the same relayed channel, and more requests do too.
            for n in range(2, 5):
                reply = await dialer.request("caller", "behind-nat", {"n": n})
                assert reply.payload == {"echo": {"n": n}}
            assert server.statistics().circuits_opened == 1
        nursery.cancel_scope.cancel()
