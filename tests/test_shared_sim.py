"""Shared state on real nodes in the simulator (trio's virtual clock): convergence under
concurrent writers, a partition, killed and restarted nodes; policy on gossip; hostile
gossip (seed R9, Properties 27-28; R10; R9.5).

The 100-node lossy-network case is covered at the gossip-core level by test_crdt_sim.py.
"""

from __future__ import annotations

import dataclasses
import random
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.crdt.gossip import DeltaBatch, DeltaPush, GossipConfig, GossipError
from p2pnode.crdt.ops import CounterAdd, RegisterSet, SetAdd
from p2pnode.crdt.replica import Replica
from p2pnode.envelope import Envelope, MessageType
from p2pnode.errors import ErrorCode, LocalError
from p2pnode.identity import Identity
from p2pnode.node.channels import RetryPolicy
from p2pnode.node.config import NodeConfig
from p2pnode.node.discovery import MemoryDiscovery
from p2pnode.node.docops import (
    decode_gossip_payload_untrusted,
    gossip_payload,
    op_from_json,
    value_to_json,
)
from p2pnode.node.frames import encode_envelope
from p2pnode.node.node import Node
from p2pnode.node.observability import EventKind
from p2pnode.node.shared import STORE_FILE_NAME, SharedConfig, SharedState
from p2pnode.simnet import SimNetwork
from p2pnode.wire import pack

DOC = "plan"
FAST = NodeConfig(
    retry=RetryPolicy(first_delay=0.05, max_redials=3, dial_timeout=2.0), request_timeout=5.0
)
SHARED = SharedConfig(
    gossip=GossipConfig(interval=1.0), refresh_interval=1.0, discovery_interval=5.0, suspend=3.0
)


async def ignore(envelope: Envelope) -> Any:
    return None


@dataclasses.dataclass
class Member:
    """One node of the swarm, restartable on the same identity, host and data directory."""

    index: int
    host: str
    config: NodeConfig
    agent: str
    sandbox: str | None = None
    node: Node | None = None
    scope: trio.CancelScope | None = None
    stopped: trio.Event = dataclasses.field(default_factory=trio.Event)
    #: Envelopes the agent's handler got (gossip must never land here).
    inbox: list[Envelope] = dataclasses.field(default_factory=list)

    async def handle(self, envelope: Envelope) -> Any:
        self.inbox.append(envelope)

    @property
    def shared(self) -> SharedState:
        assert self.node is not None
        return self.node.shared


class Swarm:
    def __init__(self, sim: SimNetwork, nursery: trio.Nursery, tmp: Path | None) -> None:
        self.sim = sim
        self.nursery = nursery
        self.tmp = tmp
        self.directory = MemoryDiscovery()
        self.members: list[Member] = []

    async def add(self, *, durable: bool = False, sandbox: str | None = None) -> Member:
        i = len(self.members)
        host = self.sim.add_host()
        data_dir = self.tmp / f"node{i}" if durable and self.tmp is not None else None
        config = dataclasses.replace(FAST, listen=(host.host, 7000), data_dir=data_dir)
        member = Member(i, host.host, config, f"agent{i}", sandbox)
        self.members.append(member)
        await self.start(member, subscribe=True)
        return member

    async def start(self, member: Member, *, subscribe: bool) -> None:
        member.stopped = trio.Event()
        member.node = await self.nursery.start(self._run, member)
        if subscribe:
            await member.shared.subscribe(member.agent, DOC)

    async def _run(self, member: Member, *, task_status: trio.TaskStatus[Node]) -> None:
        try:
            with trio.CancelScope() as member.scope:
                host = self.sim._hosts[member.host]
                identity = Identity(bytes([member.index + 1]) * 32)
                async with Node(identity, host, member.config, discovery=self.directory) as node:
                    await node.add_agent(member.agent, member.handle, sandbox_id=member.sandbox)
                    await node.open_shared(SHARED, rng=random.Random(member.index))
                    task_status.started(node)
                    await trio.sleep_forever()
        finally:
            member.stopped.set()

    async def stop(self, member: Member) -> None:
        assert member.scope is not None
        member.scope.cancel()
        await member.stopped.wait()


@asynccontextmanager
async def swarm(tmp: Path | None = None, seed: int = 7) -> AsyncIterator[Swarm]:
    async with trio.open_nursery() as nursery:
        yield Swarm(SimNetwork(random.Random(seed)), nursery, tmp)
        nursery.cancel_scope.cancel()


def snapshot(members: list[Member]) -> list[tuple[Any, Any]]:
    return [(m.shared.read(DOC), m.shared.clock(DOC)) for m in members]


async def wait_converged(members: list[Member], within: float) -> bool:
    with trio.move_on_after(within):
        while True:
            states = snapshot(members)
            if all(s == states[0] for s in states):
                return True
            await trio.sleep(0.5)
    return False


# -- convergence ----------------------------------------------------------------------------------


async def test_swarm_converges_through_partition_kills_and_restarts(
    autojump_clock: Any, tmp_path: Path
) -> None:
    async with swarm(tmp_path) as sw:
        n = 24
        restarted = {3, 17}
        for i in range(n):
            await sw.add(durable=i in restarted)
        await trio.sleep(3)  # cards announced, peers found
        members = sw.members
        ops: dict[str, int] = {}  # acknowledged operations per writer
        expected_members: set[str] = set()

        async def write(m: Member, rounds: int, tag: str) -> None:
            for r in range(rounds):
                await m.shared.update(m.agent, DOC, CounterAdd(("count",), 1))
                await m.shared.update(m.agent, DOC, SetAdd(("members",), f"{m.agent}-{tag}{r}"))
                ops[m.agent] = ops.get(m.agent, 0) + 2
                expected_members.add(f"{m.agent}-{tag}{r}")
                await trio.sleep(0.05)

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
        await trio.sleep(5)
        assert left[0].shared.read(DOC) != right[0].shared.read(DOC)
        # Kill some nodes (they keep writing, cut off) and restart the durable ones.
        killed = [members[5], members[20]]
        for m in killed:
            sw.sim.kill(m.host)
        async with trio.open_nursery() as writers:
            for m in killed:
                writers.start_soon(write, m, 2, "c")
        for i in restarted:
            await write(members[i], 2, "d")  # acknowledged: durable
            await sw.stop(members[i])
        await trio.sleep(5)
        sw.sim.heal()
        for m in killed:
            sw.sim.revive(m.host)
        for i in restarted:
            await sw.start(members[i], subscribe=False)  # subscription restored from disk
            me = members[i].shared
            assert me.subscriptions() == {DOC: [members[i].agent]}
            # Every acknowledged update came back from disk, before any gossip.
            assert me.clock(DOC).get(me.replica_id) == ops[members[i].agent]
        start = trio.current_time()
        assert await wait_converged(members, within=120.0)
        print(f"converged {trio.current_time() - start:.1f} s (virtual) after healing")
        value = members[0].shared.read(DOC)
        assert value["count"] == sum(ops.values()) // 2
        assert value["members"] == frozenset(expected_members)
        clock = members[0].shared.clock(DOC)
        assert {m.agent: clock.get(m.shared.replica_id) for m in members} == ops
        assert all(m.inbox == [] for m in members)


async def test_no_frame_carries_an_update_before_it_is_durable(
    autojump_clock: Any, tmp_path: Path
) -> None:
    async with swarm(tmp_path) as sw:
        writer, peer = await sw.add(durable=True), await sw.add()
        await trio.sleep(3)
        await writer.shared.update(writer.agent, DOC, CounterAdd(("n",), 1))
        assert await wait_converged([writer, peer], within=10.0)
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
            await trio.sleep(10)  # anti-entropy rounds run meanwhile
            # ... and no frame showed it to a peer.
            assert peer.shared.read(DOC) == {"n": 1}
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        # Once a retried commit succeeds, it is durable and spreads.
        assert await wait_converged([writer, peer], within=30.0)
        assert peer.shared.read(DOC) == {"n": 11}


# -- policy ---------------------------------------------------------------------------------------


async def test_gossip_obeys_sandboxes(autojump_clock: Any) -> None:
    async with swarm() as sw:
        boxed = await sw.add(sandbox="sb1")
        sibling = await sw.add(sandbox="sb1")
        outside = await sw.add()
        await trio.sleep(3)
        for m in (boxed, sibling, outside):
            await m.shared.update(m.agent, DOC, SetAdd(("who",), m.agent))
        await trio.sleep(20)
        assert boxed.shared.read(DOC) == {"who": frozenset({boxed.agent, sibling.agent})}
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
        await outside.node.links.link(boxed.node.peer_id).send(encode_envelope(envelope))
        await trio.sleep(1)
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
    async with swarm() as sw:
        victim, honest, evil = await sw.add(), await sw.add(), await sw.add()
        await trio.sleep(3)
        assert victim.node is not None and evil.node is not None
        link = evil.node.links.link(victim.node.peer_id)
        forged = Replica(evil.shared.replica_id)
        good = forged.update(DOC, CounterAdd(("evil",), 1))
        bad_delta = DeltaPush(DOC, good.origin, 2, b"\x81\xa1x\x01", 0)
        payloads: list[Any] = [
            {"crdt": DOC, "frame": b"\xc1junk"},  # undecodable frame
            {"crdt": DOC},  # wrong payload shape
            {"crdt": 7, "frame": b""},
            gossip_payload(DOC, pack({"v": 9, "t": 2, "doc": DOC, "vc": {}, "r": False})),
            gossip_payload(DOC, bad_delta.encode()),  # good frame, bad delta
            gossip_payload(DOC, DeltaBatch((b"\x00", good.encode())).encode()),  # one bad, one good
            gossip_payload(DOC, bytes.fromhex("82a17601a17490")),  # {"v": 1, "t": []}
        ]
        for payload in payloads:
            env = evil.node.envelope(evil.agent, victim.agent, MessageType.STREAM_DATA, payload)
            await link.send(encode_envelope(env))
        await trio.sleep(1)
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
        assert await wait_converged([victim, honest], within=10.0)
        assert victim.shared.read(DOC)["status"] == "green"
        assert victim.inbox == [] and honest.inbox == []  # gossip never reaches handlers


# -- API ------------------------------------------------------------------------------------------


async def test_watch_update_membership_and_async_with(autojump_clock: Any) -> None:
    async with swarm() as sw:
        a, b = await sw.add(), await sw.add()
        await trio.sleep(3)
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
        assert sw.directory.cards[a.agent].has_capability("crdt:" + DOC)
        assert a.node.status()["documents"] == {DOC: [a.agent]}
        assert await a.node.add_capability(a.agent, card.capabilities[0]) == card  # no-op
        with pytest.raises(LocalError):  # one service per node
            async with SharedState(a.node):
                pass
        # A service opened with `async with` on a node of its own.
        host = sw.sim.add_host()
        config = dataclasses.replace(FAST, listen=(host.host, 7000))
        async with Node(Identity(b"\x77" * 32), host, config) as bare:
            await bare.add_agent("solo", ignore)
            async with SharedState(bare) as solo:
                await solo.subscribe("solo", "notes")
                await solo.update("solo", "notes", CounterAdd(("n",), 1))
                assert solo.read("notes") == {"n": 1}
            with pytest.raises(LocalError):
                await solo.subscribe("solo", "notes")


@given(
    st.recursive(
        st.none() | st.binary() | st.text() | st.integers(),
        lambda c: st.dictionaries(st.text(), c) | st.lists(c),
    )
)
def test_gossip_payload_decoder_raises_only_gossip_errors(obj: Any) -> None:
    try:
        doc, frame = decode_gossip_payload_untrusted(obj)
    except GossipError as exc:
        assert exc.code is ErrorCode.MALFORMED_MESSAGE
    else:
        assert gossip_payload(doc, frame) == obj


def test_shared_config_is_validated() -> None:
    with pytest.raises(LocalError) as info:
        SharedConfig(refresh_interval=0)
    assert info.value.code is ErrorCode.CONFIG_ERROR
    with pytest.raises(LocalError):
        SharedConfig(send_queue=0)


def test_json_operations() -> None:
    now = 1_700_000_000_000
    assert op_from_json({"op": "counter.add", "path": "n", "amount": -2}, now_ms=now) == CounterAdd(
        ("n",), -2
    )
    assert op_from_json({"op": "register.set", "path": ["a", "b"], "value": 1.5}, now_ms=now) == (
        RegisterSet(("a", "b"), 1.5, now)
    )
    assert op_from_json({"op": "set.add", "path": ["s"], "element": 3}, now_ms=now) == SetAdd(
        ("s",), 3
    )
    for bad in ({"op": "nope"}, {"op": "set.add", "path": [], "element": 1},
                {"op": "set.add", "path": ["s"], "element": True},
                {"op": "counter.add", "path": ["n"], "amount": "1"}, [1]):  # fmt: skip
        with pytest.raises(LocalError) as info:
            op_from_json(bad, now_ms=now)
        assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert value_to_json({"s": frozenset({"b", "a"}), "x": b"\x00"}) == {
        "s": ["a", "b"],
        "x": "AA==",
    }
