"""Shared state on real nodes in the simulator (trio's virtual clock): convergence under
concurrent writers, a partition, killed and restarted nodes; policy on gossip; hostile
gossip (seed R9, Properties 27-28; R10; R9.5).

The 100-node lossy-network case is covered at the gossip-core level by test_crdt_sim.py.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.identity import Identity
from p2pnode.core.wire import pack
from p2pnode.crdt.gossip import DeltaBatch, DeltaPush
from p2pnode.crdt.ops import CounterAdd, RegisterSet, SetAdd
from p2pnode.crdt.replica import Replica
from p2pnode.node.frames import encode_envelope
from p2pnode.node.observability import EventKind
from p2pnode.runtime import Node
from p2pnode.services.shared.docops import gossip_payload
from p2pnode.services.shared.service import STORE_FILE_NAME, SharedConfig, SharedState
from tests.sim import (
    FAST_NODE,
    FAST_SHARED,
    Member,
    Swarm,
    converged,
    knows,
    open_swarm,
    wait_until,
)

DOC = "plan"


async def ignore(envelope: Envelope) -> Any:
    return None


@asynccontextmanager
async def shared_swarm(data_root: Path | None = None) -> AsyncIterator[Swarm]:
    """The builder's members finding each other through one in-memory directory and
    opening the shared-state service."""
    async with open_swarm(seed=7, discovery=True, shared=FAST_SHARED, data_root=data_root) as sw:
        yield sw


async def join(sw: Swarm, *, durable: bool = False, sandbox: str | None = None) -> Member:
    """A new member hosting agent<index>, subscribed to the document."""
    member = await sw.add(agent=f"agent{len(sw.members)}", sandbox=sandbox, durable=durable)
    await member.shared.subscribe(member.agent, DOC)
    return member


def gossiping(*members: Member) -> bool:
    """Each of ``members`` gossips the document with every other one of them."""
    return all(
        set(m.shared.peers(DOC)) >= {o.agent for o in members if o is not m} for m in members
    )


# -- convergence ----------------------------------------------------------------------------------


async def test_updates_reach_every_node_along_the_tree_without_anti_entropy(
    autojump_clock: Any,
) -> None:
    # Anti-entropy off: every update must arrive by the tree's pushes, and the timer task
    # must wake for the announcements a delivery queues (their deadline comes after it).
    config = dataclasses.replace(
        FAST_SHARED, gossip=dataclasses.replace(FAST_SHARED.gossip, anti_entropy=False)
    )
    async with open_swarm(seed=3, discovery=True, shared=config) as sw:
        members = [await join(sw) for _ in range(8)]
        await wait_until(lambda: gossiping(*members))
        for k in range(12):
            writer = members[k % len(members)]
            delta = await writer.shared.update(writer.agent, DOC, CounterAdd(("n",), 1))
            await wait_until(
                lambda d=delta: all(  # type: ignore[misc]
                    m.shared.replica.has_applied(DOC, d.origin, d.seq) for m in members
                ),
                5.0,
            )
        stats = [m.shared.statistics(DOC) for m in members]
        assert all(s.new_by_batch == 0 and s.digests_sent == 0 for s in stats)
        assert sum(s.prunes_sent for s in stats) > 0  # redundant links were pruned
        assert sum(s.ihaves_sent for s in stats) > 0  # and announce lazily
        assert all(m.shared.read(DOC) == {"n": 12} for m in members)


async def test_swarm_converges_through_partition_kills_and_restarts(
    autojump_clock: Any, tmp_path: Path
) -> None:
    # 16 nodes: two halves of 8, each with a node killed and a durable one restarted
    # (the 100-node lossy case is test_crdt_sim.py's, at the gossip core).
    async with shared_swarm(tmp_path) as sw:
        n = 16
        restarted = {3, 11}
        for i in range(n):
            await join(sw, durable=i in restarted)
        members = sw.members
        # The swarm has formed: every card announced, every member gossiping with some peer.
        assert sw.directory is not None
        directory = sw.directory
        await wait_until(
            lambda: all(
                directory.cards[m.agent].has_capability("crdt:" + DOC) and m.shared.peers(DOC)
                for m in members
            )
        )
        ops: dict[str, int] = {}  # acknowledged operations per writer
        expected_members: set[str] = set()

        async def write(m: Member, rounds: int, tag: str) -> None:
            for r in range(rounds):
                await m.shared.update(m.agent, DOC, CounterAdd(("count",), 1))
                await m.shared.update(m.agent, DOC, SetAdd(("members",), f"{m.agent}-{tag}{r}"))
                ops[m.agent] = ops.get(m.agent, 0) + 2
                expected_members.add(f"{m.agent}-{tag}{r}")
                await trio.sleep(0.05)  # writers interleave with each other and with gossip

        # Concurrent writers everywhere.
        async with trio.open_nursery() as writers:
            for m in members:
                writers.start_soon(write, m, 3, "a")
        # Partition the swarm in two halves that keep writing.
        left, right = members[: n // 2], members[n // 2 :]
        sw.sim.partition([m.host for m in left], [m.host for m in right])
        async with trio.open_nursery() as writers:
            for m in members[::3]:
                writers.start_soon(write, m, 2, "b")
        await trio.sleep(5)  # the behaviour under test: the partition lasts 5 s
        assert left[0].shared.read(DOC) != right[0].shared.read(DOC)
        # Kill some nodes (they keep writing, cut off) and restart the durable ones.
        killed = [members[5], members[14]]
        for m in killed:
            sw.sim.kill(m.host)
        async with trio.open_nursery() as writers:
            for m in killed:
                writers.start_soon(write, m, 2, "c")
        for i in restarted:
            await write(members[i], 2, "d")  # acknowledged: durable
            await sw.stop(members[i])
        await trio.sleep(5)  # the behaviour under test: 5 s more with nodes down, still split
        sw.sim.heal()
        for m in killed:
            sw.sim.revive(m.host)
        for i in restarted:
            await sw.start(members[i])  # not subscribed again: the subscription comes from disk
            me = members[i].shared
            assert me.subscriptions() == {DOC: [members[i].agent]}
            # Every acknowledged update came back from disk, before any gossip.
            assert me.clock(DOC).get(me.replica_id) == ops[members[i].agent]
        start = trio.current_time()
        await wait_until(lambda: converged(members, DOC), 120.0, interval=0.5)
        print(f"converged {trio.current_time() - start:.1f} s (virtual) after healing")
        value = members[0].shared.read(DOC)
        assert value["count"] == sum(ops.values()) // 2
        assert value["members"] == frozenset(expected_members)
        clock = members[0].shared.clock(DOC)
        assert {m.agent: clock.get(m.shared.replica_id) for m in members} == ops
        assert all(m.inbox.received == [] for m in members)


async def test_no_frame_carries_an_update_before_it_is_durable(
    autojump_clock: Any, tmp_path: Path
) -> None:
    # The durable store commits in a worker thread, and SQLite waits out the lock in real
    # time: with a threshold of 0 the clock would jump from deadline to deadline while a
    # commit runs, and on a loaded machine virtual time ran past the 30 s wait below.
    autojump_clock.autojump_threshold = 0.02
    async with shared_swarm(tmp_path) as sw:
        writer, peer = await join(sw, durable=True), await join(sw)
        await wait_until(lambda: gossiping(writer, peer))
        await writer.shared.update(writer.agent, DOC, CounterAdd(("n",), 1))
        await wait_until(lambda: converged([writer, peer], DOC), 10.0, interval=0.5)
        assert writer.config.data_dir is not None
        # Another connection holds the database's write lock: commits fail (after
        # SQLite's busy timeout), so the next update is not acknowledged...
        blocker = sqlite3.connect(writer.config.data_dir / STORE_FILE_NAME, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(LocalError) as info:
                await writer.shared.update(writer.agent, DOC, CounterAdd(("n",), 10))
            assert info.value.code is ErrorCode.INTERNAL
            assert writer.shared.read(DOC) == {"n": 11}  # applied in memory only
            await trio.sleep(10)  # the behaviour under test: anti-entropy rounds run meanwhile
            # ... and no frame showed it to a peer.
            assert peer.shared.read(DOC) == {"n": 1}
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        # Once a retried commit succeeds, it is durable and spreads.
        await wait_until(lambda: converged([writer, peer], DOC), 30.0, interval=0.5)
        assert peer.shared.read(DOC) == {"n": 11}


# -- policy ---------------------------------------------------------------------------------------


async def test_gossip_obeys_sandboxes(autojump_clock: Any) -> None:
    async with shared_swarm() as sw:
        boxed = await join(sw, sandbox="sb1")
        sibling = await join(sw, sandbox="sb1")
        outside = await join(sw)
        await wait_until(lambda: gossiping(boxed, sibling))
        for m in (boxed, sibling, outside):
            await m.shared.update(m.agent, DOC, SetAdd(("who",), m.agent))
        inside = {"who": frozenset({boxed.agent, sibling.agent})}
        await wait_until(lambda: boxed.shared.read(DOC) == sibling.shared.read(DOC) == inside)
        # What is asserted next is an absence: ten gossip rounds and two discovery lookups
        # pass in which a leak across the sandbox would show.
        await trio.sleep(10 * FAST_SHARED.gossip.interval)
        assert boxed.shared.read(DOC) == inside
        assert sibling.shared.read(DOC) == boxed.shared.read(DOC)
        assert outside.shared.read(DOC) == {"who": frozenset({outside.agent})}
        assert boxed.shared.peers(DOC) == (sibling.agent,)
        assert outside.shared.peers(DOC) == ()
        # A peer that skips its egress checks is stopped by the receiver's ingress policy.
        assert outside.node is not None and boxed.node is not None
        rogue = Replica("rogue")
        delta = rogue.update(DOC, SetAdd(("who",), "intruder"))
        payload = gossip_payload(DOC, DeltaPush.of(delta).encode())
        envelope = outside.node.envelope(
            outside.agent, boxed.agent, MessageType.STREAM_DATA, payload
        )
        node = boxed.node
        before = len(node.events.recent(kind=EventKind.SECURITY))
        await outside.node.links.link(boxed.node.peer_id).send(encode_envelope(envelope))
        await wait_until(lambda: len(node.events.recent(kind=EventKind.SECURITY)) > before)
        assert "intruder" not in boxed.shared.read(DOC)["who"]
        security = boxed.node.events.recent(kind=EventKind.SECURITY)
        assert security[-1].code is ErrorCode.SANDBOX_VIOLATION
        assert security[-1].peer == str(outside.node.peer_id)
        # Two local agents share the node's replica only if they may talk both ways.
        await boxed.node.add_agent("free", ignore, tier=3)
        with pytest.raises(LocalError) as info:
            await boxed.shared.subscribe("free", DOC)
        assert info.value.code is ErrorCode.SANDBOX_VIOLATION


# -- hostile gossip -------------------------------------------------------------------------------


async def test_garbage_gossip_does_not_stop_sync(autojump_clock: Any) -> None:
    async with shared_swarm() as sw:
        victim, honest, evil = await join(sw), await join(sw), await join(sw)
        assert victim.node is not None and evil.node is not None
        # The victim authenticates the evil agent (knows its card) before it gets the frames.
        victim_node, evil_node = victim.node, evil.node
        await wait_until(lambda: gossiping(victim, honest, evil) and knows(victim_node, evil_node))
        link = evil.node.links.link(victim.node.peer_id)
        own = Replica(evil.shared.replica_id, signer=evil.node.identity)
        good = own.update(DOC, CounterAdd(("evil",), 1))
        bad_delta = DeltaPush(DOC, good.origin, 2, 2, b"\x81\xa1x\x01", 0)
        payloads: list[Any] = [
            {"crdt": DOC, "frame": b"\xc1junk"},  # undecodable frame
            {"crdt": DOC},  # wrong payload shape
            {"crdt": 7, "frame": b""},
            gossip_payload(DOC, pack({"v": 9, "t": 2, "doc": DOC, "vc": {}, "r": False})),
            gossip_payload(DOC, bad_delta.encode()),  # good frame, bad delta
            gossip_payload(DOC, DeltaBatch((b"\x00", good.sealed)).encode()),  # one bad, one good
            gossip_payload(DOC, bytes.fromhex("82a17603a17490")),  # {"v": 3, "t": []}
        ]
        for payload in payloads:
            env = evil.node.envelope(evil.agent, victim.agent, MessageType.STREAM_DATA, payload)
            await link.send(encode_envelope(env))

        def reported() -> int:
            return len(victim_node.events.recent(kind=EventKind.SECURITY)) + len(
                victim_node.events.recent(kind=EventKind.ERROR)
            )

        # Each of the seven payloads is reported once, as a security event or an error.
        await wait_until(lambda: reported() >= len(payloads))
        security = victim.node.events.recent(kind=EventKind.SECURITY)
        assert len(security) == 5
        assert {e.code for e in security} <= {
            ErrorCode.MALFORMED_MESSAGE,
            ErrorCode.PROTOCOL_VERSION_MISMATCH,
        }
        assert all(e.peer == str(evil.node.peer_id) for e in security)
        errors = victim.node.events.recent(kind=EventKind.ERROR)
        assert [e.code for e in errors] == [ErrorCode.CRDT_DESERIALIZATION_FAILED] * 2
        assert evil.agent in (errors[-1].detail or "")
        assert victim.shared.read(DOC) == {"evil": 1}  # the good delta of the batch
        # Sync goes on.
        await honest.shared.update(honest.agent, DOC, RegisterSet(("status",), "green", 5))
        await wait_until(lambda: converged([victim, honest], DOC), 10.0, interval=0.5)
        assert victim.shared.read(DOC)["status"] == "green"
        # Gossip never reaches the agents' handlers.
        assert victim.inbox.received == [] and honest.inbox.received == []


# -- API ------------------------------------------------------------------------------------------


async def test_watch_update_membership_and_async_with(autojump_clock: Any) -> None:
    async with shared_swarm() as sw:
        a, b = await join(sw), await join(sw)
        await wait_until(lambda: gossiping(a, b))
        seen: list[dict[str, Any]] = []
        with b.shared.watch(DOC) as watch:
            await a.shared.update(a.agent, DOC, CounterAdd(("n",), 2))
            await a.shared.update(a.agent, DOC, CounterAdd(("n",), 3))
            with trio.move_on_after(5):
                async for value in watch:
                    seen.append(value)
                    if value.get("n") == 5:
                        break
        assert seen[-1] == {"n": 5}
        with pytest.raises(LocalError) as info:
            await a.shared.update(a.agent, "other", CounterAdd(("n",), 1))
        assert info.value.code is ErrorCode.INVALID_ARGUMENT
        with pytest.raises(LocalError):
            await a.shared.subscribe(a.agent, "bad name!")
        assert a.node is not None and b.node is not None
        # Interest is advertised: the card's new revision reached the peer and discovery.
        card = a.node.local_agent(a.agent)
        # A node's first card has revision = its issue time (ms); subscribing bumps it once.
        assert card.has_capability("crdt:" + DOC) and card.revision == card.issued_at + 1
        assert b.node.registry.get(a.agent).revision == card.revision
        assert sw.directory is not None
        assert sw.directory.cards[a.agent].has_capability("crdt:" + DOC)
        assert a.node.status()["documents"] == {DOC: [a.agent]}
        assert await a.node.add_capability(a.agent, card.capabilities[0]) == card  # no-op
        with pytest.raises(LocalError):  # one service per node
            async with SharedState(a.node):
                pass
        # A service opened with `async with` on a node of its own.
        host = sw.sim.add_host()
        config = dataclasses.replace(FAST_NODE, listen=(host.host, 7000))
        async with Node(Identity(b"\x77" * 32), host, config) as bare:
            await bare.add_agent("solo", ignore)
            async with SharedState(bare) as solo:
                await solo.subscribe("solo", "notes")
                await solo.update("solo", "notes", CounterAdd(("n",), 1))
                assert solo.read("notes") == {"n": 1}
            with pytest.raises(LocalError):
                await solo.subscribe("solo", "notes")


def test_shared_config_is_validated() -> None:
    with pytest.raises(LocalError) as info:
        SharedConfig(refresh_interval=0)
    assert info.value.code is ErrorCode.CONFIG_ERROR
    with pytest.raises(LocalError):
        SharedConfig(send_queue=0)
