"""A node behind a port-restricted or symmetric NAT is found through the DHT after its
reachability verdict, in the simulator on trio's virtual clock: its card then lists no
direct address (reachability.md §6), so its provider records carry none either, and a
reader must not take such a record for a withdrawal (dht.md §4.5) but read the card key,
which holds the live card with its relayed endpoint."""

from __future__ import annotations

import random
from typing import Any

import pytest
import trio

from p2pnode.core.identity import Identity
from p2pnode.dht.records import ProviderInfo, agent_capability, capability_key
from p2pnode.node.discovery import DhtDiscovery
from p2pnode.runtime import Node, NodeConfig
from p2pnode.services.reachability import Reachability
from p2pnode.simnet.nat import NatKind
from p2pnode.transport.relay import format_relay_address
from p2pnode.transport.relayserve import RelayServer
from tests.sim import wait_until
from tests.sim.nat import LastBehindNat
from tests.test_confirmed_addresses_sim import own_card, swarm_of, verdict_is

RELAY = Identity(b"\x71" * 32)


def dht_of(node: Node) -> Any:
    discovery = node.discovery
    assert isinstance(discovery, DhtDiscovery)
    return discovery.dht


def holds_addressless_provider(node: Node, agent: str, revision: int) -> bool:
    """Whether ``node``'s DHT store holds ``agent``'s provider record at ``revision``
    listing no address (what a card with relayed endpoints only publishes)."""
    dht = dht_of(node)
    key = capability_key(agent_capability(agent))
    return any(
        r.revision == revision and not ProviderInfo.from_bytes_untrusted(r.payload).addresses
        for r in dht.records.get(key, dht.wall_clock_ms())
    )


@pytest.mark.parametrize("kind", [NatKind.PORT_RESTRICTED, NatKind.SYMMETRIC])
async def test_a_natted_nodes_relayed_only_card_is_found_through_the_dht(
    autojump_clock: Any, kind: NatKind
) -> None:
    sim = LastBehindNat(random.Random(7))
    relay_host = sim.add_host()
    relayed = format_relay_address((relay_host.host, 4100), RELAY.peer_id)
    server = RelayServer(relay_host, RELAY.peer_id)
    async with trio.open_nursery() as outer:
        await outer.start(server.serve, (relay_host.host, 4100))
        async with swarm_of(4, NodeConfig(relays=(relayed,)), natted=kind, sim=sim) as (_, sw):
            node, reader = sw.nodes[-1], sw.nodes[1]
            before = own_card(node, "a3")
            await wait_until(lambda: verdict_is(node, Reachability.UNREACHABLE), timeout=120)
            await wait_until(lambda: own_card(node, "a3").revision > before.revision)
            after = own_card(node, "a3")
            assert after.addresses == ()
            # The new revision reached the servers: no direct address in its provider record.
            await wait_until(
                lambda: any(
                    holds_addressless_provider(n, "a3", after.revision) for n in sw.nodes[:-1]
                ),
                timeout=120,
            )
            found = await dht_of(reader).find_agent("a3")
            assert [(c.peer_id, c.revision) for c in found] == [(node.peer_id, after.revision)]
            assert [e.address for e in found[0].endpoints] == [relayed]
        outer.cancel_scope.cancel()


async def test_a_withdrawn_agent_is_still_not_found(autojump_clock: Any) -> None:
    """The withdrawal's provider records list no address either; the card key says the
    agent left, so the reader still finds nothing."""
    async with swarm_of(4, NodeConfig()) as (_, sw):
        node, reader = sw.nodes[-1], sw.nodes[1]
        revision = own_card(node, "a3").revision
        assert [c.id for c in await dht_of(reader).find_agent("a3")] == ["a3"]
        await node.remove_agent("a3")
        await wait_until(
            lambda: any(
                holds_addressless_provider(n, "a3", revision + 1) for n in sw.nodes[:-1]
            ),
            timeout=60,
        )
        assert await dht_of(reader).find_agent("a3") == []
