"""The sans-IO gossip core: frames, push/forward, anti-entropy, bounded outboxes, R9.5."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.wire import pack
from p2pnode.crdt.clock import MAX_CLOCK_ENTRIES, VectorClock
from p2pnode.crdt.delta import Delta
from p2pnode.crdt.dots import DotContext
from p2pnode.crdt.gossip import (
    DeltaBatch,
    DeltaPush,
    Digest,
    GossipConfig,
    GossipError,
    GossipMessage,
    GossipNode,
    Graft,
    Received,
    decode_untrusted,
)
from p2pnode.crdt.ops import CounterAdd, SetAdd
from p2pnode.crdt.replica import Replica
from p2pnode.crdt.types import DocState, ORMap
from tests.crdtkeys import identity, replica, rid

A, B = rid("A"), rid("B")


def node(name: str, peers: list[str], seed: int = 0, **cfg: object) -> GossipNode:
    """The gossip core of replica ``name`` (signing), with peers named by name too."""
    return GossipNode(
        replica(name, max_log=cfg.pop("max_log", 1024)),
        peers=[rid(p) for p in peers],
        docs=["doc"],
        rng=random.Random(seed),
        now=0.0,
        config=GossipConfig(**cfg),  # type: ignore[arg-type]
    )


def deliver(nodes: dict[str, GossipNode], rounds: int = 50) -> int:
    """Deliver every queued frame (encoded and decoded) until quiet; returns frames moved."""
    moved = 0
    for _ in range(rounds):
        batch = [(src, dst, m) for src, n in nodes.items() for dst, m in n.take_outgoing()]
        if not batch:
            return moved
        for src, dst, m in batch:
            nodes[dst].receive_untrusted(src, m.encode())
            moved += 1
    raise AssertionError("did not quiesce")


def a_delta() -> Delta:
    return replica("A").update("doc", SetAdd(("s",), "x"))


@st.composite
def pushes(draw: st.DrawFn) -> DeltaPush:
    seq = draw(st.integers(1, 2**63 - 1))
    first = draw(st.sampled_from([1, seq]))
    origin = draw(st.sampled_from([A, B]))
    payload, hops = draw(st.binary(max_size=40)), draw(st.integers(0, 255))
    return DeltaPush("doc", origin, first, seq, payload, hops)


messages = st.one_of(
    pushes(),
    st.builds(
        Digest,
        st.text(min_size=1, max_size=10),
        st.dictionaries(st.sampled_from(["a", "b"]), st.integers(1, 9)).map(VectorClock),
        st.booleans(),
    ),
    st.builds(DeltaBatch, st.lists(st.binary(max_size=20), max_size=5).map(tuple)),
)


@settings(max_examples=200)
@given(messages)
def test_frame_round_trip_and_truncation(msg: GossipMessage) -> None:
    data = msg.encode()
    assert decode_untrusted(data) == msg
    for cut in range(len(data)):
        with pytest.raises(GossipError):
            decode_untrusted(data[:cut])


@settings(max_examples=300)
@given(st.binary(max_size=100))
def test_random_bytes_raise_only_gossip_error(data: bytes) -> None:
    try:
        decode_untrusted(data)
    except GossipError as exc:
        assert isinstance(exc, RemoteError)


@pytest.mark.parametrize(
    "obj",
    [
        {"v": 1, "t": 2, "doc": "d", "vc": {}, "r": False},  # version 1: unsigned deltas
        {"v": 1, "t": 1, "doc": "d", "o": "A", "s": 1, "d": b"", "h": 0},
        {"v": 2, "t": 2, "doc": "d", "vc": {}, "r": False},  # version 2: no tree frames
        {"v": 4, "t": 2, "doc": "d", "vc": {}, "r": False},
        {"v": 3, "t": 9},
        {"v": 3, "t": 2, "doc": "d", "vc": {}, "r": False, "x": 1},
        {"v": 3, "t": 2, "doc": "", "vc": {}, "r": False},
        {"v": 3, "t": 2, "doc": "d", "vc": {"a": 0}, "r": False},
        {"v": 3, "t": 2, "doc": "d", "vc": {}, "r": 1},
        {"v": 3, "t": 1, "doc": "d", "o": "A", "f": 0, "s": 0, "d": b"", "h": 0},
        {"v": 3, "t": 1, "doc": "d", "o": "A", "f": 2, "s": 3, "d": b"", "h": 0},  # f not 1 or s
        {"v": 3, "t": 1, "doc": "d", "o": "A", "s": 1, "d": b"", "h": 0},  # no f
        {"v": 3, "t": 1, "doc": "d", "o": "A", "f": 1, "s": 1, "d": "str", "h": 0},
        {"v": 3, "t": 1, "doc": "d", "o": "A", "f": 1, "s": 1, "d": b"", "h": 256},
        {"v": 3, "t": 3, "ds": [b"", 1]},
        {"v": 3, "t": 3, "ds": [b""] * 1025},
        {"v": 3, "t": 4, "s": b""},  # StatePush (an unsigned full state) is retired
        {"v": 3, "t": 5, "doc": "d", "ids": []},  # IHave announces at least one delta
        {"v": 3, "t": 5, "doc": "d", "ids": [["A", 1, 1]] * 257},
        {"v": 3, "t": 5, "doc": "d", "ids": [["A", 1]]},
        {"v": 3, "t": 5, "doc": "d", "ids": [["A", 2, 3]]},  # f not 1 or s
        {"v": 3, "t": 5, "doc": "d", "ids": [["A", 0, 0]]},
        {"v": 3, "t": 5, "doc": "d", "ids": [["", 1, 1]]},
        {"v": 3, "t": 5, "doc": "d", "ids": [{"o": "A"}]},
        {"v": 3, "t": 5, "doc": "", "ids": [["A", 1, 1]]},
        {"v": 3, "t": 5, "doc": "d", "ids": [["A", 1, 1]], "x": 1},
        {"v": 3, "t": 6, "doc": "d"},  # Graft without ids
        {"v": 3, "t": 6, "doc": "d", "ids": "A"},
        {"v": 3, "t": 6, "doc": "d", "ids": [["A", 1, 1.0]]},
        {"v": 3, "t": 6, "doc": 7, "ids": []},
        {"v": 3, "t": 7, "doc": "d", "ids": []},
        {"v": 3, "t": 7, "doc": b"d"},
        {"v": 3, "t": 7},
        [1, 2],
    ],
)
def test_tampered_frames_rejected(obj: object) -> None:
    with pytest.raises(GossipError) as info:
        decode_untrusted(pack(obj))
    assert info.value.code in (ErrorCode.MALFORMED_MESSAGE, ErrorCode.PROTOCOL_VERSION_MISMATCH)


def test_push_goes_to_fanout_random_peers_and_new_deltas_are_forwarded_once() -> None:
    names = [f"p{i}" for i in range(10)]
    nodes = {
        rid(name): node(name, names, seed=i, fanout=3, tree=False) for i, name in enumerate(names)
    }
    p0 = rid("p0")
    _, targets = nodes[p0].local_update("doc", CounterAdd(("n",), 1))
    assert len(targets) == 3
    assert p0 not in targets
    out = nodes[p0].take_outgoing()
    assert sorted(p for p, _ in out) == sorted(targets)
    first = targets[0]
    msg = out[0][1]
    assert isinstance(msg, DeltaPush)
    assert msg.hops == 0
    res = nodes[first].receive_untrusted(p0, msg.encode())
    assert res.new == 1
    assert len(res.forwarded_to) == 3
    assert p0 not in res.forwarded_to
    assert first not in res.forwarded_to
    fwd = nodes[first].take_outgoing()
    assert {p for p, _ in fwd} == set(res.forwarded_to)
    assert all(isinstance(m, DeltaPush) and m.hops == 1 for _, m in fwd)
    # The same delta again: a duplicate, not forwarded.
    again = nodes[first].receive_untrusted(rid("p5"), msg.encode())
    assert (again.new, again.duplicate, again.forwarded_to) == (0, 1, ())
    assert nodes[first].take_outgoing() == []
    assert nodes[first].replica.value("doc") == {"n": 1}


def test_forward_disabled_is_push_only() -> None:
    n = node("B", ["A", "C", "D"], forward=False)
    res = n.receive_untrusted(A, DeltaPush.of(a_delta()).encode())
    assert res.new == 1
    assert res.forwarded_to == ()
    assert n.take_outgoing() == []


def test_anti_entropy_push_pull_repairs_both_sides() -> None:
    a, b = node("A", ["B"], seed=1), node("B", ["A"], seed=2)
    for i in range(5):
        a.replica.update("doc", SetAdd(("s",), f"a{i}"))
        b.replica.update("doc", SetAdd(("s",), f"b{i}"))
    assert a.next_deadline() <= 1.5
    assert a.handle_timer(a.next_deadline() - 1e-9) == []
    sent = a.handle_timer(a.next_deadline())
    assert sent == [("doc", B)]
    assert 0.5 <= a.next_deadline() - 0.5 <= 3.0
    deliver({A: a, B: b})
    assert a.replica.value("doc") == b.replica.value("doc")
    assert len(a.replica.value("doc")["s"]) == 10
    assert a.statistics().deltas_served == 5
    assert b.statistics().deltas_served == 5


def test_digest_reply_is_never_answered_with_a_digest() -> None:
    a = node("A", ["B"])
    b = replica("B")
    b.update("doc", SetAdd(("s",), "x"))
    a.receive_untrusted(B, Digest("doc", b.clock("doc"), reply=True).encode())
    assert a.take_outgoing() == []
    a.receive_untrusted(B, Digest("doc", b.clock("doc"), reply=False).encode())
    out = a.take_outgoing()
    assert out == [(B, Digest("doc", VectorClock(), reply=True))]


def test_compacted_log_is_served_as_the_origins_checkpoint() -> None:
    a, b = node("A", ["B"], max_log=4), node("B", ["A"])
    for i in range(12):
        a.replica.update("doc", SetAdd(("s",), i))
    b.handle_timer(10.0)
    deliver({A: a, B: b})
    assert a.statistics().checkpoints_served == 1
    assert b.replica.value("doc") == a.replica.value("doc")
    assert b.replica.clock("doc") == a.replica.clock("doc")
    assert b.replica.checkpoint("doc", A) == a.replica.checkpoint("doc", A)


def test_a_checkpoint_is_pushed_with_the_delta_that_made_it() -> None:
    a, b = node("A", ["B"], max_log=8), node("B", ["A"])  # a checkpoint every 2 operations
    a.local_update("doc", SetAdd(("s",), 1))
    assert [m.seq for _, m in a.take_outgoing() if isinstance(m, DeltaPush)] == [1]
    a.local_update("doc", SetAdd(("s",), 2))
    out = a.take_outgoing()
    assert [(m.first, m.seq) for _, m in out if isinstance(m, DeltaPush)] == [(2, 2), (1, 2)]
    for _, msg in out:
        b.receive_untrusted(A, msg.encode())
    assert b.replica.checkpoint("doc", A) == a.replica.checkpoint("doc", A)
    assert b.replica.value("doc") == a.replica.value("doc")


def test_replies_are_bounded_and_progress() -> None:
    a, b = node("A", ["B"], max_reply_deltas=3), node("B", ["A"])
    for i in range(10):
        a.replica.update("doc", SetAdd(("s",), i))
    for t in range(1, 6):
        b.handle_timer(10.0 * t)
        deliver({A: a, B: b})
    assert b.replica.clock("doc") == VectorClock({A: 10})


def test_outbox_is_bounded_drop_oldest() -> None:
    n = node("A", ["B"], max_outbox=3, fanout=1, tree=False)
    deltas = [n.local_update("doc", SetAdd(("s",), i))[0] for i in range(5)]
    out = n.pop_outgoing(B)
    assert [m.seq for m in out if isinstance(m, DeltaPush)] == [d.seq for d in deltas[2:]]
    assert n.statistics().dropped == 2
    assert n.pop_outgoing(B) == []


def test_malformed_delta_inside_a_good_frame_is_skipped(caplog: pytest.LogCaptureFixture) -> None:
    """R9.5 at the gossip layer: one bad delta in a batch does not stop the others."""
    n = node("B", ["A"])
    src = replica("A")
    good = [src.update("doc", SetAdd(("s",), i)).sealed for i in range(3)]
    batch = DeltaBatch((good[0], b"\xc1garbage", good[1][:-2], good[1], good[2]))
    with caplog.at_level("WARNING", logger="p2pnode.crdt"):
        res = n.receive_untrusted("agent-A", batch.encode())
    assert res.new == 3
    assert n.statistics().errors == 2
    assert [e.code for e in n.replica.errors] == [ErrorCode.CRDT_DESERIALIZATION_FAILED] * 2
    assert sum("agent-A" in r.getMessage() for r in caplog.records) == 2
    # A push whose clear-text id disagrees with its payload is an error, not applied.
    other = src.update("doc", SetAdd(("s",), 99))
    mislabelled = DeltaPush("doc", A, 77, 77, other.sealed)
    assert n.receive_untrusted("agent-A", mislabelled.encode()).new == 0
    assert n.statistics().errors == 3
    # An unsigned delta is refused as a forgery (and named in the result).
    impostor = Replica(A)
    unsigned = [impostor.update("doc", SetAdd(("s",), 100 + i)) for i in range(5)][-1]
    res = n.receive_untrusted("agent-A", DeltaPush.of(unsigned).encode())
    assert res.new == 0 and [e.code for e in res.rejected] == [ErrorCode.INVALID_SIGNATURE]
    assert (n.statistics().errors, n.statistics().forged) == (4, 1)


def test_unsubscribed_documents_are_ignored() -> None:
    n = node("B", ["A"])
    d = replica("A").update("other", SetAdd(("s",), 1))
    assert n.receive_untrusted(A, DeltaPush.of(d).encode()).new == 0
    assert n.receive_untrusted(A, DeltaBatch((d.sealed,)).encode()).new == 0
    n.receive_untrusted(A, Digest("other", VectorClock()).encode())
    assert n.take_outgoing() == []
    assert "other" not in n.replica.documents()
    with pytest.raises(LocalError):
        n.publish(d)


def test_membership_and_config_validation() -> None:
    n = node("A", ["A", "B", "B", "C"])
    assert n.peers == (B, rid("C"))
    n.remove_peer(B)
    assert len(n.peers) == 1
    n.unsubscribe("doc")
    assert n.handle_timer(100.0) == []
    with pytest.raises(LocalError):
        GossipConfig(fanout=0)
    with pytest.raises(LocalError):
        GossipConfig(max_reply_deltas=0)
    idle = node("A", ["B"], anti_entropy=False)
    assert idle.next_deadline() == 0.0  # its links are made (and asked for) at once
    idle.handle_timer(0.0)
    assert idle.take_outgoing() == [(B, Graft("doc"))]
    assert idle.next_deadline() == float("inf")
    with pytest.raises(LocalError):  # peers refuse unsigned deltas: it may not publish
        GossipNode(Replica("A"), docs=["doc"], rng=random.Random(0), now=0.0).local_update(
            "doc", SetAdd(("s",), 1)
        )


@settings(max_examples=200)
@given(st.binary(max_size=100))
def test_node_receive_untrusted_raises_only_gossip_error(data: bytes) -> None:
    n = node("B", ["A"])
    try:
        n.receive_untrusted(A, data)
    except GossipError:
        pass


@settings(max_examples=200)
@given(messages)
def test_well_formed_frames_with_garbage_payloads_never_raise(msg: GossipMessage) -> None:
    n = node("B", ["A"])
    n.receive_untrusted(A, msg.encode())
    assert n.replica.value("doc") == {}


def test_local_update_requires_subscription() -> None:
    n = node("A", ["B"])
    with pytest.raises(LocalError):
        n.local_update("other", SetAdd(("s",), 1))
    assert "other" not in n.replica.documents()


@pytest.mark.parametrize(
    ("obj", "code"),
    [
        # {"v": 3, "t": []}: the type used to reach a dict lookup unhashed (TypeError).
        ({"v": 3, "t": []}, ErrorCode.MALFORMED_MESSAGE),
        ({"v": 3, "t": {"a": 1}}, ErrorCode.MALFORMED_MESSAGE),
        ({"v": 3, "t": True, "ds": []}, ErrorCode.MALFORMED_MESSAGE),
        ({"v": 3, "t": 3.0, "ds": []}, ErrorCode.MALFORMED_MESSAGE),
        ({"v": [], "t": 3, "ds": []}, ErrorCode.PROTOCOL_VERSION_MISMATCH),
        ({"v": True, "t": 3, "ds": []}, ErrorCode.PROTOCOL_VERSION_MISMATCH),
        ({"v": 1.0, "t": 3, "ds": []}, ErrorCode.PROTOCOL_VERSION_MISMATCH),
    ],
)
def test_frame_version_and_type_must_be_integers(obj: object, code: ErrorCode) -> None:
    with pytest.raises(GossipError) as info:
        decode_untrusted(pack(obj))
    assert info.value.code is code


def test_unhashable_frame_type_regression_bytes() -> None:
    with pytest.raises(GossipError) as info:
        decode_untrusted(bytes.fromhex("82a17603a17490"))  # {"v": 3, "t": []}
    assert info.value.code is ErrorCode.MALFORMED_MESSAGE
    assert decode_untrusted(pack({"v": 3, "t": 3, "ds": []})) == DeltaBatch(())


def test_updates_a_document_cannot_encode_are_refused_and_the_batch_goes_on() -> None:
    # A delta naming more replicas than a clock carries used to be joined, and then every
    # digest and delta of the document was undecodable for the peers. (A delta's context
    # may name any replica: a remove lists the dots it observed.)
    n = node("B", ["A"])

    def signed(name: str, ctx: DotContext) -> bytes:
        origin = rid(name)
        state = DocState(ORMap(), ctx)
        return Delta("doc", origin, 1, VectorClock({origin: 1}), state).sign(identity(name)).sealed

    insider = rid("o1")
    many = DotContext({insider: 1, **{f"o{i}": 1 for i in range(2, MAX_CLOCK_ENTRIES + 2)}})
    assert len(many.vv) == MAX_CLOCK_ENTRIES + 1
    assert n.receive_untrusted("agent-A", DeltaBatch((signed("A", many),)).encode()) == Received(
        0, 0, (), tuple(n.replica.errors)
    )
    assert n.statistics().errors == 1
    fits = DotContext({insider: 1, **{f"o{i}": 1 for i in range(2, MAX_CLOCK_ENTRIES + 1)}})
    assert n.receive_untrusted("agent-A", DeltaBatch((signed("A", fits),)).encode()).new == 1
    outsider = replica("Z").update("doc", SetAdd(("s",), 1)).sealed
    writer = replica("o1")
    writer.update("doc", SetAdd(("s",), 1))  # dots (o1, 1) and (o1, 2): in the context
    known = writer.update("doc", SetAdd(("s",), 2)).sealed  # (o1, 3), (o1, 4)
    res = n.receive_untrusted("agent-A", DeltaBatch((outsider, known)).encode())
    assert res.new == 1 and n.statistics().errors == 2
    assert n.replica.value("doc") == {"s": frozenset({2})}
    digest = Digest("doc", n.replica.clock("doc"))
    assert decode_untrusted(digest.encode()) == digest


def test_lag_counts_what_peers_digests_show_and_this_replica_lacks() -> None:
    a, b = node("A", ["B"]), node("B", ["A"])
    for i in range(5):
        b.replica.update("doc", SetAdd(("s",), i))
    assert a.lag("doc") == 0  # no digest yet: nothing known to be missing
    a.receive_untrusted(B, Digest("doc", b.replica.clock("doc")).encode())
    assert a.lag("doc") == 5
    deliver({A: a, B: b})  # a's reply digest brings b's deltas
    assert a.lag("doc") == 0 and a.replica.clock("doc") == b.replica.clock("doc")
