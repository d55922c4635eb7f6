"""DhtNode over the simulated network (virtual time)."""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

from p2pnode.core.errors import LocalError
from p2pnode.core.wire import pack
from p2pnode.dht.node import DhtNode
from p2pnode.dht.records import capability_key
from tests.sim import dht_swarm, make_card, virtual_ms


async def test_small_swarm_provide_and_find(autojump_clock: trio.testing.MockClock) -> None:
    async with dht_swarm(12) as (_, nodes):
        assert all(len(n.table) >= 5 for n in nodes)
        owner = nodes[3]
        assert owner.identity is not None
        card = make_card(owner.identity, ["translate", "summarise"])
        accepted = await owner.provide(card)
        assert accepted >= 2
        for asker in (nodes[0], nodes[7], nodes[11]):
            found = await asker.find_providers("translate")
            assert [c.peer_id for c in found] == [card.peer_id]
            assert await asker.find_card(card.peer_id, card.id) == card
        assert await nodes[5].find_providers("nothing") == []
        recs = await nodes[9].get_records(capability_key("summarise"))
        assert [r.publisher for r in recs] == [card.peer_id]


async def test_find_node_returns_k_closest(autojump_clock: trio.testing.MockClock) -> None:
    async with dht_swarm(60, seed=4) as (_, nodes):
        rng = random.Random(8)
        for _ in range(5):
            target = rng.randbytes(20)
            asker = nodes[rng.randrange(60)]
            got = await asker.find_node(target)
            truth = sorted(
                (n for n in nodes if n is not asker),
                key=lambda n: int.from_bytes(n.node_id, "big") ^ int.from_bytes(target, "big"),
            )
            assert [c.node_id for c in got] == [n.node_id for n in truth[:20]]


async def test_snapshot_restore_rejoins_without_bootstrap(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with dht_swarm(30, seed=6) as (sim, nodes):
        owner = nodes[4]
        assert owner.identity is not None
        card = make_card(owner.identity, ["ocr"])
        await owner.provide(card)
        snap = nodes[9].snapshot()
        host = sim.add_host()
        fresh = DhtNode(
            host,
            node_id=b"\x42" * 20,
            address=(host.host, 4000),
            wall_clock_ms=virtual_ms,
            rng=random.Random(1),
        )
        async with fresh:
            assert fresh.restore(snap) == len(nodes[9].table)
            assert [c.peer_id for c in await fresh.find_providers("ocr")] == [card.peer_id]
            with pytest.raises(LocalError):
                fresh.restore(b"\x93\x01")
            with pytest.raises(LocalError):
                fresh.restore(pack([[b"short", "h", 1]]))


async def test_provide_refuses_foreign_card(autojump_clock: trio.testing.MockClock) -> None:
    async with dht_swarm(3, seed=7) as (_, nodes):
        other = nodes[1].identity
        assert other is not None
        with pytest.raises(LocalError):
            await nodes[0].provide(make_card(other, ["x"]))
