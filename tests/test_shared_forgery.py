"""A malicious subscribed peer on real nodes in the simulator: deltas claiming another
origin, tampered deltas, a checkpoint in another replica's name, a delta writing as
another replica and a version-1 (unsigned) frame are never applied nor forwarded, each
is reported as a security event naming the peer that sent it, and the honest replicas
still converge (docs/protocol/gossip.md §3.1 and §7)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from p2pnode.core.envelope import MessageType
from p2pnode.core.errors import ErrorCode
from p2pnode.core.wire import pack, unpack_untrusted
from p2pnode.crdt.clock import VectorClock
from p2pnode.crdt.delta import Delta
from p2pnode.crdt.dots import DotContext
from p2pnode.crdt.gossip import DeltaBatch, DeltaPush
from p2pnode.crdt.ops import CounterAdd, SetAdd
from p2pnode.crdt.replica import Replica
from p2pnode.crdt.types import DocState, GCounter, MapEntry, ORMap
from p2pnode.node.frames import encode_envelope
from p2pnode.node.observability import EventKind
from p2pnode.services.shared.docops import gossip_payload
from tests.sim import FAST_SHARED, Member, Swarm, converged, knows, open_swarm, wait_until

DOC = "ledger"


@asynccontextmanager
async def four() -> AsyncIterator[tuple[Swarm, Member, Member, Member, Member]]:
    """victim, honest, bystander and evil, all subscribed to DOC and gossiping."""
    async with open_swarm(seed=11, discovery=True, shared=FAST_SHARED) as sw:
        members = await sw.add_subscribed(4, DOC)
        victim, honest, bystander, evil = members
        assert victim.node is not None and evil.node is not None
        victim_node, evil_node = victim.node, evil.node
        await wait_until(
            lambda: (
                all(
                    set(m.shared.peers(DOC)) >= {o.agent for o in members if o is not m}
                    for m in members
                )
                and knows(victim_node, evil_node)
            )
        )
        yield sw, victim, honest, bystander, evil


def tamper(sealed: bytes, state: DocState) -> bytes:
    """The sealed delta with another state in its body, key and signature kept."""
    outer = unpack_untrusted(sealed)
    body = unpack_untrusted(outer["b"])
    body["st"] = state.to_wire()
    return pack({**outer, "b": pack(body)})


async def test_forged_gossip_is_never_applied_nor_forwarded(autojump_clock: Any) -> None:
    async with four() as (_, victim, honest, bystander, evil):
        assert victim.node is not None and evil.node is not None and honest.node is not None
        h, e = honest.shared.replica_id, evil.shared.replica_id
        evil_key = evil.node.identity
        # 1. Honest's operation 1, written and signed by evil: a key that is not honest's.
        claimed = Replica(h).update(DOC, SetAdd(("who",), "forged-claimed")).sign(evil_key)
        # 2. Honest's key, a signature that is not honest's.
        fake = Replica(h).update(DOC, SetAdd(("who",), "forged-badsig"))
        outer = {"b": fake.encode(), "k": honest.node.identity.public_key, "g": b"\0" * 64}
        bad_signature = pack(outer)
        # 3. A delta honest really signed (seq 50, made apart from its replica), tampered.
        base = Replica(h).update(DOC, SetAdd(("who",), "really-honest"))
        signed = Delta(DOC, h, 50, VectorClock({h: 50}), base.state).sign(honest.node.identity)
        other = Replica(h).update(DOC, SetAdd(("who",), "forged-tampered")).state
        tampered = tamper(signed.sealed, other)
        # 4. Evil's own delta, signed by evil, raising honest's counter slot.
        slot = DocState(
            ORMap({"score": MapEntry({(e, 900)}, GCounter({h: 10**6}))}),
            DotContext(cloud=[(e, 900)]),
        )
        as_other = Delta(DOC, e, 100, VectorClock({e: 100}), slot).sign(evil_key)
        # 5. A checkpoint of honest's operations 1..1000 signed by evil (anti-entropy path):
        # accepted, it would mark all of them applied and hide honest's real ones.
        cp_state = Replica(h).update(DOC, SetAdd(("who",), "forged-checkpoint")).state
        checkpoint = Delta(DOC, h, 1000, VectorClock({h: 1000}), cp_state, first=1)
        forged_checkpoint = checkpoint.sign(evil_key).sealed
        # 6. A version-1 frame: an unsigned delta.
        v1 = pack({"v": 1, "t": 1, "doc": DOC, "o": h, "s": 1, "d": fake.encode(), "h": 0})
        frames = [
            DeltaPush.of(claimed).encode(),
            DeltaPush(DOC, h, 1, 1, bad_signature).encode(),
            DeltaPush(DOC, h, 50, 50, tampered).encode(),
            DeltaPush.of(as_other).encode(),
            DeltaBatch((forged_checkpoint,)).encode(),
            v1,
        ]
        victim_node = victim.node
        link = evil.node.links.link(victim.node.peer_id)
        for frame in frames:
            payload = gossip_payload(DOC, frame)
            env = evil.node.envelope(evil.agent, victim.agent, MessageType.STREAM_DATA, payload)
            await link.send(encode_envelope(env))
        await wait_until(
            lambda: len(victim_node.events.recent(kind=EventKind.SECURITY)) >= len(frames)
        )
        security = victim.node.events.recent(kind=EventKind.SECURITY)
        assert [e.code for e in security] == [
            ErrorCode.PEER_ID_MISMATCH,
            ErrorCode.INVALID_SIGNATURE,
            ErrorCode.INVALID_SIGNATURE,
            ErrorCode.INVALID_SIGNATURE,
            ErrorCode.PEER_ID_MISMATCH,
            ErrorCode.PROTOCOL_VERSION_MISMATCH,
        ]
        # Each names the forwarding peer (the event's peer, and its agent in the text).
        assert all(ev.peer == str(evil.node.peer_id) for ev in security)
        assert all(evil.agent in (ev.detail or "") for ev in security)
        assert victim.shared.forged_deltas == 5
        assert victim.shared.statistics(DOC).forged == 5
        # Nothing was applied, so nothing was forwarded.
        assert victim.shared.read(DOC) == {}
        assert victim.shared.clock(DOC) == VectorClock()
        assert victim.shared.statistics(DOC).forwarded == 0
        # Honest updates still converge, with honest's real operation ids 1, 2, 3.
        for i in range(3):
            await honest.shared.update(honest.agent, DOC, SetAdd(("who",), f"honest-{i}"))
        await honest.shared.update(honest.agent, DOC, CounterAdd(("score",), 1))
        members = [victim, honest, bystander, evil]
        await wait_until(lambda: converged(members, DOC), 20.0, interval=0.5)
        value = victim.shared.read(DOC)
        assert value == {"who": frozenset(f"honest-{i}" for i in range(3)), "score": 1}
        assert victim.shared.clock(DOC) == VectorClock({h: 4})
        applied = victim.shared.replica.document(DOC).applied
        assert (h, 50) not in applied and (e, 100) not in applied
        # The bystander never saw a forged delta: no security event, nothing forged held.
        assert bystander.node is not None
        assert bystander.node.events.recent(kind=EventKind.SECURITY) == []
        assert bystander.shared.forged_deltas == 0
        assert not bystander.shared.replica.errors and not honest.shared.replica.errors
        # Later anti-entropy rounds (what the behaviour under test is: no late leak).
        await trio.sleep(5 * FAST_SHARED.gossip.interval)
        assert all(m.shared.read(DOC) == value for m in members)
