"""The reachability service of whole nodes behind the simulator's NATs
(reachability.md §5, dht.md §5.3): a node checks its own addresses, the external UDP
address its ``stun`` replies agree on among them, and the verdict sets its DHT's mode:
a full-cone node is reached there and stays a server, a port-restricted or symmetric
one is not and turns client; a client whose TCP address is confirmed serves again, and
one with no reachable TCP address stays a client (it ignores the UDP dial-back too)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from p2pnode.core.envelope import Envelope
from p2pnode.dht import DhtMode
from p2pnode.dht.node import DhtNode
from p2pnode.node.discovery import DhtDiscovery
from p2pnode.runtime import Node, NodeConfig
from p2pnode.services.reachability import Reachability, Transport
from p2pnode.simnet.nat import NatKind, NatNetwork
from tests.sim import Swarm, met, wait_until
from tests.sim.nat import LastBehindNat


async def echo(envelope: Envelope) -> Any:
    return None


def dht_of(node: Node) -> DhtNode:
    discovery = node.discovery
    assert isinstance(discovery, DhtDiscovery)
    return discovery.dht


@asynccontextmanager
async def natted_swarm(kind: NatKind) -> AsyncIterator[tuple[NatNetwork, Node, list[Node]]]:
    """Three public nodes and one behind a NAT of ``kind`` that has met them all."""
    sim = LastBehindNat(random.Random(4))
    async with trio.open_nursery() as nursery:
        sw = Swarm(sim, nursery, config=NodeConfig(), dht=True)
        for i in range(4):
            if i == 3:
                sim.next_kind = kind
            await sw.add()
            await sw.nodes[-1].add_agent(f"a{i}", echo, tier=3)
        for node in sw.nodes:
            await node.join()
        natted = sw.nodes[-1]
        for node in sw.nodes[:-1]:
            await natted.connect(node.listen_address)
        await wait_until(lambda: all(met(natted, n) for n in sw.nodes[:-1]))
        yield sim, natted, sw.nodes[:-1]
        await sw.aclose()


@pytest.mark.parametrize(
    ("kind", "reachability", "mode"),
    [
        (NatKind.FULL_CONE, Reachability.REACHABLE, DhtMode.SERVER),
        (NatKind.PORT_RESTRICTED, Reachability.UNREACHABLE, DhtMode.CLIENT),
        (NatKind.SYMMETRIC, Reachability.UNREACHABLE, DhtMode.CLIENT),
    ],
)
async def test_the_check_behind_each_nat_sets_the_dht_mode(
    autojump_clock: Any, kind: NatKind, reachability: Reachability, mode: DhtMode
) -> None:
    async with natted_swarm(kind) as (sim, node, _):
        nat = sim.nat_of(node.listen_address[0])
        assert nat is not None
        verdict = await node.check_reachability()
        assert verdict.reachability is reachability
        assert verdict.external_ip == nat.public_ip
        assert dht_of(node).mode is mode
        if reachability is Reachability.REACHABLE:
            # Reached at its external UDP address, never at its inside ones.
            assert [(c.transport, c.host) for c in verdict.confirmed] == [
                (Transport.UDP, nat.public_ip)
            ]


async def test_a_client_whose_check_finds_it_reachable_serves_again(autojump_clock: Any) -> None:
    async with natted_swarm(NatKind.FULL_CONE) as (_, _natted, public):
        node = public[0]
        dht = dht_of(node)
        dht.set_mode(DhtMode.CLIENT)
        verdict = await node.check_reachability()
        # Its UDP candidate is denied by its own silence, its TCP address is confirmed.
        assert verdict.reachability is Reachability.REACHABLE
        assert {c.transport for c in verdict.confirmed} == {Transport.TCP}
        assert dht.mode is DhtMode.SERVER
        assert dht.statistics().requests_ignored > 0


async def test_a_full_cone_client_is_not_reached_over_udp_while_it_is_a_client(
    autojump_clock: Any,
) -> None:
    # The limit of the rule (reachability.md §5): a client ignores the dial-back ping
    # too, so a NAT'd client with no reachable TCP address stays a client.
    async with natted_swarm(NatKind.FULL_CONE) as (_, node, _):
        dht = dht_of(node)
        dht.set_mode(DhtMode.CLIENT)
        verdict = await node.check_reachability()
        assert verdict.reachability is Reachability.UNREACHABLE
        assert dht.mode is DhtMode.CLIENT
        assert dht.statistics().requests_ignored > 0
