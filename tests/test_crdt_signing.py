"""Origin signatures on CRDT deltas (docs/protocol/gossip.md §3.1): the sealed form pinned
by a known answer and checked with another Ed25519 implementation, the replica id bound
to the key, authorship of a delta's content, and the gossip core dropping what its origin
did not sign before applying or forwarding it."""

from __future__ import annotations

import random

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode
from p2pnode.core.identity import Identity
from p2pnode.core.wire import pack, unpack_untrusted
from p2pnode.crdt.clock import CRDTError, VectorClock
from p2pnode.crdt.delta import Delta, Opened
from p2pnode.crdt.dots import DotContext
from p2pnode.crdt.gossip import DeltaPush, GossipConfig, GossipNode
from p2pnode.crdt.ops import CounterAdd, MapRemove, Op, RegisterSet, SetAdd, SetRemove
from p2pnode.crdt.replica import Replica
from p2pnode.crdt.signing import (
    DELTA_SIGNATURE_CONTEXT,
    ForgedDeltaError,
    Sealed,
    check_authorship,
    replica_id_of,
    seal,
)
from p2pnode.crdt.types import (
    DocState,
    GCounter,
    LWWRegister,
    MapEntry,
    ORMap,
    ORSet,
    PNCounter,
)
from tests.crdtkeys import identity, replica, rid

A, B, C = rid("A"), rid("B"), rid("C")

# The identity of seed 00 01 .. 1f adds "red" to the set at tags of document "notes", its
# first operation. Ed25519 signatures are deterministic (RFC 8032 §5.1.6), so the sealed
# bytes are too: docs/protocol/gossip.md §3.1 quotes this vector.
KNOWN_SEED = bytes(range(32))
KNOWN_REPLICA = "tnepm3je4ajeckia6mnwud4oifeudbck"
KNOWN_BODY = bytes.fromhex(
    "86a3646f63a56e6f746573a16fd920746e65706d336a6534616a65636b6961366d6e777564346f69666575"
    "6462636ba16601a17301a2766381d920746e65706d336a6534616a65636b6961366d6e777564346f696665"
    "756462636b01a27374929193a4746167739192d920746e65706d336a6534616a65636b6961366d6e777564"
    "346f696665756462636b0192049192a37265649192d920746e65706d336a6534616a65636b6961366d6e77"
    "7564346f696665756462636b029281d920746e65706d336a6534616a65636b6961366d6e777564346f6966"
    "65756462636b0290"
)
KNOWN_SIGNATURE = bytes.fromhex(
    "33f6d83dce597c8431fa00efe942a400950a3ca7cbf9e9dba9e18a94d8b724fb"
    "8dac410c40daa0ee29e5a2696b23848da82971aaac569d358f075ddf031f4f0d"
)


def test_known_answer_and_another_ed25519_implementation() -> None:
    me = Identity(KNOWN_SEED)
    assert replica_id_of(me.public_key) == str(me.peer_id) == KNOWN_REPLICA
    delta = Replica(KNOWN_REPLICA, signer=me).update("notes", SetAdd(("tags",), "red"))
    assert delta.encode() == KNOWN_BODY
    sealed = unpack_untrusted(delta.sealed)
    assert sealed == {"b": KNOWN_BODY, "k": me.public_key, "g": KNOWN_SIGNATURE}
    assert list(sealed) == ["b", "k", "g"]
    body = unpack_untrusted(KNOWN_BODY)
    assert list(body) == ["doc", "o", "f", "s", "vc", "st"]
    assert body["o"] == KNOWN_REPLICA and (body["f"], body["s"]) == (1, 1)
    # The signature is plain Ed25519 over the context string and the body bytes.
    assert DELTA_SIGNATURE_CONTEXT == b"p2pnode-crdt-delta-v1\x00"
    key = Ed25519PublicKey.from_public_bytes(me.public_key)
    key.verify(KNOWN_SIGNATURE, DELTA_SIGNATURE_CONTEXT + KNOWN_BODY)  # raises if not
    assert Opened.open_untrusted(delta.sealed).verify() == delta


def test_what_a_receiver_refuses() -> None:
    delta = replica("A").update("doc", SetAdd(("s",), 1))
    opened = Opened.open_untrusted(delta.sealed)
    assert opened.id == ("doc", A, 1, 1)
    assert opened.verify() == delta

    def refused(data: bytes) -> ErrorCode:
        with pytest.raises(ForgedDeltaError) as info:
            Opened.open_untrusted(data).verify()
        return info.value.code

    parts = unpack_untrusted(delta.sealed)
    # Signed by another key than the origin's: the replica id is not the key's.
    resigned = Delta("doc", A, 1, delta.clock, delta.state).sign(identity("B"))
    assert refused(resigned.sealed) is ErrorCode.PEER_ID_MISMATCH
    assert refused(pack({**parts, "k": identity("B").public_key})) is ErrorCode.PEER_ID_MISMATCH
    # A bad, truncated or missing signature; a body changed after signing.
    assert refused(pack({**parts, "g": bytes(64)})) is ErrorCode.INVALID_SIGNATURE
    assert refused(pack({**parts, "g": parts["g"][:63]})) is ErrorCode.INVALID_SIGNATURE
    assert refused(seal(delta.encode(), None)) is ErrorCode.INVALID_SIGNATURE
    other = replica("A").update("doc", SetAdd(("s",), 2)).encode()
    assert refused(pack({**parts, "b": other})) is ErrorCode.INVALID_SIGNATURE
    # The same key's signature over the body without the context (another protocol's).
    plain = identity("A").sign(delta.encode())
    assert refused(pack({**parts, "g": plain})) is ErrorCode.INVALID_SIGNATURE


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_sealed_parser_raises_only_crdt_errors(data: bytes) -> None:
    try:
        Opened.open_untrusted(data).verify()
    except CRDTError:
        pass


@pytest.mark.parametrize(
    "value",
    [
        GCounter({B: 3}),
        PNCounter(n=GCounter({B: 1})),
        LWWRegister(5, B, "x"),
        ORSet({"e": {(B, 7)}}),
        ORMap({"inner": MapEntry({(A, 8)}, ORSet({"e": {(B, 9)}}))}),
    ],
)
def test_a_delta_writing_as_another_replica_is_forged(value: object) -> None:
    ctx = DotContext(cloud=[(A, 1), (A, 8), (B, 7), (B, 9)])
    state = DocState(ORMap({"k": MapEntry({(A, 1)}, value)}), ctx)  # type: ignore[arg-type]
    with pytest.raises(ForgedDeltaError) as info:
        check_authorship(state, A)
    assert info.value.code is ErrorCode.INVALID_SIGNATURE and B in info.value.message
    presence = DocState(ORMap({"k": MapEntry({(B, 1)}, GCounter({A: 1}))}), ctx)
    with pytest.raises(ForgedDeltaError):
        check_authorship(presence, A)


def test_every_operation_a_replica_makes_is_its_own() -> None:
    # Removes and overwrites list other replicas' dots in the context: that is allowed.
    a, b = replica("A"), replica("B")
    first: list[Op] = [SetAdd(("s",), 1), CounterAdd(("n",), 2), RegisterSet(("r",), "x", 3)]
    for op in first:
        a.apply_delta(b.update("doc", op))
    ops: list[Op] = [
        SetAdd(("s",), 1), SetRemove(("s",), 1), CounterAdd(("n",), -4),
        RegisterSet(("r",), "y", 1), MapRemove(("r",)), SetAdd(("m", "deep"), "z"),
    ]  # fmt: skip
    for op in ops:
        delta = a.update("doc", op)
        check_authorship(delta.state, A)
        assert Opened.open_untrusted(delta.sealed).verify() == delta
    a = replica("A", checkpoint_every=2)
    for op in ops:
        a.update("doc", op)
    checkpoint = a.checkpoint("doc", A)
    assert checkpoint is not None and checkpoint.seq == 6
    check_authorship(checkpoint.state, A)


def core(name: str, peers: list[str], **config: object) -> GossipNode:
    return GossipNode(
        replica(name),
        peers=[rid(p) for p in peers],
        docs=["doc"],
        rng=random.Random(1),
        now=0.0,
        config=GossipConfig(**config),  # type: ignore[arg-type]
    )


def test_the_core_drops_a_forged_push_without_applying_or_forwarding_it() -> None:
    middle = core("B", ["A", "C", "D", "E"], fanout=3, tree=False)
    forged = Replica(A).update("doc", SetAdd(("s",), "forged")).sign(identity("C"))
    res = middle.receive_untrusted(C, DeltaPush.of(forged).encode())
    assert (res.new, res.forwarded_to) == (0, ())
    assert [e.code for e in res.rejected] == [ErrorCode.PEER_ID_MISMATCH]
    assert middle.take_outgoing() == [] and middle.replica.value("doc") == {}
    assert not middle.replica.has_applied("doc", A, 1)
    stats = middle.statistics()
    assert (stats.errors, stats.forged) == (1, 1)
    # A's real operation 1 is not hidden by the forgery, and is forwarded once.
    real = replica("A").update("doc", SetAdd(("s",), "real"))
    res = middle.receive_untrusted(A, DeltaPush.of(real).encode())
    assert res.new == 1 and len(res.forwarded_to) == 3 and res.rejected == ()
    assert middle.replica.value("doc") == {"s": frozenset({"real"})}


def test_duplicates_are_dropped_before_their_signature_is_checked() -> None:
    # Verifying costs an Ed25519 check: a copy of an applied delta never pays it.
    node = core("B", ["A"])
    real = replica("A").update("doc", SetAdd(("s",), 1))
    assert node.receive_untrusted(A, DeltaPush.of(real).encode()).new == 1
    garbage = pack({**unpack_untrusted(real.sealed), "g": bytes(64)})
    res = node.receive_untrusted(A, DeltaPush("doc", A, 1, 1, garbage).encode())
    assert (res.new, res.duplicate, res.rejected) == (0, 1, ())
    assert Sealed.decode_untrusted(garbage).signature == bytes(64)


def test_a_forged_checkpoint_hides_nothing() -> None:
    # Accepted, a checkpoint 1..1000 "of A" would mark A's operations applied for good.
    node = core("B", ["A"])
    fake = Delta("doc", A, 1000, VectorClock({A: 1000}), DocState(), first=1)
    res = node.receive_untrusted(C, DeltaPush.of(fake.sign(identity("C"))).encode())
    assert [e.code for e in res.rejected] == [ErrorCode.PEER_ID_MISMATCH]
    assert node.replica.clock("doc") == VectorClock()
    assert node.replica.checkpoint("doc", A) is None
