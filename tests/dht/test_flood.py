"""The hardening issue's flood, repeated in the simulator (virtual time).

100,000 datagrams from 500 source ports of one host, a quarter each random
bytes, ``find_node``, ``store`` and ``ping`` with a fresh random id, against
the bootstrap node of a 16-node swarm while new honest nodes join through
it. Before admission (docs/protocol/dht.md §5.1) 802 of 805 contacts were
junk. Now a silent flood leaves the table as it was; a flooder that answers
on every port (25,000 datagrams, 50 from each port) gets at most
``max_ids_per_host`` (2) ids in; honest nodes
still join, lookups still find the true k closest, the log has a few
summary lines instead of one line per datagram, and a snapshot carries no
junk into a restart.
"""

from __future__ import annotations

import logging
import random
from contextlib import AsyncExitStack

import pytest
import trio
import trio.testing

from p2pnode.dht.node import DhtNode
from p2pnode.dht.routing import Contact, distance
from p2pnode.dht.snapshot import parse_snapshot, snapshot_contacts
from p2pnode.simnet import SimNetwork
from tests.dht.flood import Flood, ask_find_node, junk_in
from tests.sim import FAST_DHT, dht_node, dht_swarm, make_card, wait_until

FLOOD = 100_000
#: The answering flood: the host limit is about how many ports answer, not how many
#: datagrams come (each of the 500 ports still sends 50), and the attacker's 500
#: reading tasks double the simulator's work per datagram.
ANSWERING_FLOOD = 25_000
PORTS = 500
HONEST = 16
JOINERS = 4
MAX_JUNK = 5


async def _node(sim: SimNetwork, rng: random.Random, stack: AsyncExitStack) -> DhtNode:
    return await stack.enter_async_context(dht_node(sim, rng))


async def _flood_the_bootstrap_node(
    *, responsive: bool, seed: int, caplog: pytest.LogCaptureFixture, count: int = FLOOD
) -> None:
    caplog.set_level(logging.INFO, logger="p2pnode.dht")
    rng = random.Random(seed + 1000)  # not the swarm's seed: the joiners' ids are new
    async with dht_swarm(HONEST, seed=seed) as (sim, nodes), AsyncExitStack() as stack:
        victim = nodes[0]
        before = {c.node_id for c in victim.table.contacts()}
        attacker = sim.add_host()
        ports = [await attacker.bind_datagram((attacker.host, 20_000 + i)) for i in range(PORTS)]
        flood = Flood(ports, victim.address, random.Random(seed + 1))
        # Started here, outside the attack's nursery; they join during the flood.
        joiners = [await _node(sim, rng, stack) for _ in range(JOINERS)]
        joined: list[DhtNode] = []
        caplog.clear()
        async with trio.open_nursery() as nursery:
            if responsive:
                for ep in ports:
                    nursery.start_soon(flood.answer, ep)
            flooded = trio.Event()

            async def attack() -> None:
                await flood.send(count)
                flooded.set()

            nursery.start_soon(attack)
            # Honest nodes join through the victim while it is flooded (50 datagrams
            # every 10 ms: 100,000 take 20 s, and the last joiner comes at 12 s).
            for node in joiners:
                await trio.sleep(3 * count / FLOOD)
                assert await node.bootstrap([victim.address]) == 1
                joined.append(node)
            await flooded.wait()
            await wait_until(lambda: victim.gate.admission.checking == 0, timeout=30)
            honest = {n.node_id for n in nodes + joined}
            ids = [c.node_id for c in victim.table.contacts()]
            junk_table = junk_in(ids, flood)
            # What the victim tells others: find_node replies for 50 random keys.
            asker = await sim.add_host().bind_datagram(("", 7000))
            served: set[bytes] = set()
            for _ in range(50):
                served |= set(
                    await ask_find_node(asker, victim.address, rng.randbytes(20), b"\x5a" * 20)
                )
            junk_served = junk_in(served, flood)
            # Lookups still find the true k closest of the honest nodes.
            target = rng.randbytes(20)
            found = [c.node_id for c in await joined[-1].find_node(target)]
            truth = sorted(honest - {joined[-1].node_id}, key=lambda i: distance(i, target))
            owner = nodes[5]
            assert owner.identity is not None
            card = make_card(owner.identity, ["ocr"])
            await owner.provide(card)
            providers = [c.peer_id for c in await joined[0].find_providers("ocr")]
            nursery.cancel_scope.cancel()
        stats = victim.stats
        info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
        print(
            f"\nflood ({'responsive' if responsive else 'silent'}): sent {flood.sent}, "
            f"answered by the attacker {flood.answered}; victim: contacts {len(ids)} "
            f"(junk {junk_table}), junk in 50 find_node replies {junk_served}, "
            f"checks sent {stats.checks_sent} failed {stats.checks_failed} "
            f"retried {stats.checks_retried} "
            f"skipped {stats.checks_skipped}, refused {stats.admissions_refused}, "
            f"dropped {stats.datagrams_dropped}, records rejected {stats.records_rejected}, "
            f"INFO lines {len(info)}"
        )
        assert junk_table <= MAX_JUNK
        assert junk_served <= MAX_JUNK
        # Every honest node that talked to the victim is in its table.
        assert {n.node_id for n in joined} <= set(ids)
        assert before <= set(ids)
        if not responsive:
            assert junk_table == 0
            assert set(ids) == before | {n.node_id for n in joined}
        else:
            assert junk_table <= FAST_DHT.max_ids_per_host
        assert truth[:15] == [i for i in found if i in honest][:15]
        assert providers == [card.peer_id]
        # A few pings to check senders, not one per datagram; a few log lines too.
        assert stats.checks_sent < 100
        assert stats.datagrams_dropped >= count // 4 - 1_000
        assert len(info) <= 5
        assert all(m.startswith("dht.summary") for m in info)


async def test_silent_flood_leaves_the_table_as_it_was(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    await _flood_the_bootstrap_node(responsive=False, seed=31, caplog=caplog)


async def test_answering_flood_gets_at_most_the_host_limit_in(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    await _flood_the_bootstrap_node(
        responsive=True, seed=32, caplog=caplog, count=ANSWERING_FLOOD
    )


async def test_a_snapshot_full_of_junk_admits_only_who_answers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The node kept its 802 junk contacts across restarts. A snapshot is
    # now a list of candidates: only those that answer enter the table.
    async with dht_swarm(12, seed=33) as (sim, nodes), AsyncExitStack() as stack:
        owner = nodes[4]
        assert owner.identity is not None
        card = make_card(owner.identity, ["ocr"])
        await owner.provide(card)
        rng = random.Random(34)
        attacker = sim.add_host()
        junk = [Contact(rng.randbytes(20), attacker.host, 20_000 + i) for i in range(800)]
        honest = nodes[9].table.contacts()
        fresh = await _node(sim, random.Random(35), stack)
        assert fresh.restore(snapshot_contacts(junk + honest)) == 800 + len(honest)
        # Lookups may ask candidates: the first one works at once.
        assert [c.peer_id for c in await fresh.find_providers("ocr")] == [card.peer_id]
        await wait_until(lambda: not fresh.gate.candidates, timeout=200)
        ids = {c.node_id for c in fresh.table.contacts()}
        assert not ids & {c.node_id for c in junk}
        assert {c.node_id for c in honest} <= ids
        # And the next snapshot carries none of it forward.
        again = parse_snapshot(fresh.snapshot())
        assert not {c.node_id for c in again} & {c.node_id for c in junk}
