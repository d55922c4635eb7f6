"""200-node swarms on the simulated network: discovery, churn, partitions (virtual time)."""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

from p2pnode.core.card import AgentCard
from p2pnode.core.identity import PeerId
from p2pnode.dht.node import DhtNode
from p2pnode.dht.peer import DhtPeer
from p2pnode.transport.net import Address
from tests.sim import FAST_DHT, dht_swarm, make_card

N = 200
CAPS = [f"cap-{i}" for i in range(8)]


async def _publish(nodes: list[DhtNode], rng: random.Random) -> dict[str, set[PeerId]]:
    """Every 10th node provides two capabilities."""
    providers: dict[str, set[PeerId]] = {c: set() for c in CAPS}
    cards: list[tuple[DhtNode, AgentCard]] = []
    for node in nodes[::10]:
        assert node.identity is not None
        caps = rng.sample(CAPS, 2)
        cards.append((node, make_card(node.identity, caps)))
        for c in caps:
            providers[c].add(node.identity.peer_id)
    async with trio.open_nursery() as nursery:
        for node, card in cards:
            nursery.start_soon(node.provide, card)
    return providers


async def _lookups(
    nodes: list[DhtNode],
    expected: dict[str, set[PeerId]],
    rng: random.Random,
    count: int,
) -> float:
    """Run ``count`` find_providers from random nodes, 10 at a time; success ratio."""
    ok = 0
    limiter = trio.CapacityLimiter(10)

    async def one(asker: DhtNode, cap: str) -> None:
        nonlocal ok
        async with limiter:
            found = {c.peer_id for c in await asker.find_providers(cap)}
        if expected[cap] <= found:
            ok += 1

    async with trio.open_nursery() as nursery:
        for _ in range(count):
            nursery.start_soon(one, rng.choice(nodes), rng.choice(sorted(expected)))
    return ok / count


async def test_every_provider_found_without_churn(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rng = random.Random(21)
    async with dht_swarm(N, seed=21) as (_, nodes):
        expected = await _publish(nodes, rng)
        # 100 lookups from random askers, each of the 8 capabilities about 12 times (a
        # lookup costs some 40 ms of CPU here: the swarm's size is the point, not them).
        assert await _lookups(nodes, expected, rng, 100) == 1.0


async def test_every_provider_found_with_datagrams_handed_over_by_the_driver(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under SimNetwork.drive the nodes take each datagram in a callback from the
    # driver's task (no receive loop wakes per datagram): the same DHT.
    handed: list[int] = [0]
    take = DhtPeer.datagram_received

    def counting(peer: DhtPeer, data: bytes, source: Address) -> None:
        handed[0] += 1
        take(peer, data, source)

    monkeypatch.setattr(DhtPeer, "datagram_received", counting)
    rng = random.Random(24)
    async with dht_swarm(N // 2, seed=24) as (sim, nodes), trio.open_nursery() as nursery:
        await nursery.start(sim.drive)
        sent = sim.datagrams_sent
        expected = await _publish(nodes, rng)
        assert await _lookups(nodes, expected, rng, 100) == 1.0
        assert handed[0] >= (sim.datagrams_sent - sent) * 0.95
        nursery.cancel_scope.cancel()


async def test_lookups_survive_killing_a_fifth(autojump_clock: trio.testing.MockClock) -> None:
    rng = random.Random(22)
    async with dht_swarm(N, seed=22) as (sim, nodes):
        expected = await _publish(nodes, rng)
        victims = rng.sample(nodes[1:], N // 5)
        for v in victims:
            sim.kill(v.address[0])
        dead = {v.identity.peer_id for v in victims if v.identity is not None}
        # Providers that died are no longer required, only those alive.
        alive_expected = {c: p - dead for c, p in expected.items()}
        alive = [n for n in nodes if n not in victims]
        # The behaviour under test: a refresh and a maintenance pass after the deaths.
        await trio.sleep(FAST_DHT.refresh_interval + FAST_DHT.maintenance_interval)
        # At most one lookup in 200 may miss a live provider.
        assert await _lookups(alive, alive_expected, rng, 200) >= 0.995


async def test_partition_heals(autojump_clock: trio.testing.MockClock) -> None:
    rng = random.Random(23)
    async with dht_swarm(N // 2, seed=23) as (sim, nodes):
        expected = await _publish(nodes, rng)
        side_a, side_b = nodes[: len(nodes) // 2], nodes[len(nodes) // 2 :]
        sim.partition({n.address[0] for n in side_a})
        # Published during the cut: stored on side A only.
        owner = side_a[3]
        assert owner.identity is not None
        await owner.provide(make_card(owner.identity, ["late-cap"], revision=2))
        late = {"late-cap": {owner.identity.peer_id}}
        assert await _lookups(side_b, late, rng, 20) == 0.0
        assert await _lookups(side_a, late, rng, 20) == 1.0
        sim.heal()
        # One republish interval later the owner has stored it across the healed network.
        await trio.sleep(FAST_DHT.republish_interval + FAST_DHT.maintenance_interval)
        assert await _lookups(side_b, late, rng, 50) == 1.0
        assert await _lookups(nodes, expected, rng, 100) == 1.0
