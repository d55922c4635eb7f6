"""Replicas: local updates, remote deltas, missing-delta computation, log compaction with
checkpoints, R9.5."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.wire import WireLimits, canonical_pack, pack, unpack_untrusted
from p2pnode.crdt.clock import MAX_CLOCK_ENTRIES, CRDTError, VectorClock
from p2pnode.crdt.delta import Delta
from p2pnode.crdt.dots import DotContext
from p2pnode.crdt.ops import CounterAdd, RegisterSet, SetAdd
from p2pnode.crdt.replica import MAX_CLOUD, Replica
from p2pnode.crdt.signing import seal
from p2pnode.crdt.types import DocState, ORMap
from tests.crdtkeys import identity, replica, rid

A, B = rid("A"), rid("B")

ops = st.one_of(
    st.builds(CounterAdd, st.just(("n",)), st.integers(1, 5)),
    st.builds(SetAdd, st.just(("s",)), st.sampled_from(["a", "b"])),
    st.builds(RegisterSet, st.just(("r",)), st.text(max_size=4), st.integers(1, 9)),
)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["A", "B"]), ops), min_size=1, max_size=15))
def test_every_delta_carries_a_nonempty_clock_counting_itself(
    script: list[tuple[str, CounterAdd | SetAdd | RegisterSet]],
) -> None:
    """Property 27: each update message contains a non-empty vector clock, and a
    replica receiving it applies it."""
    reps = {"A": replica("A"), "B": replica("B")}
    for who, op in script:
        delta = reps[who].update("doc", op)
        assert len(delta.clock) > 0
        assert delta.clock[rid(who)] == delta.seq
        decoded = Delta.decode_untrusted(delta.encode())
        assert decoded.clock == delta.clock
        assert decoded.state == delta.state
        other = reps["B" if who == "A" else "A"]
        assert other.receive_delta_untrusted(delta.sealed, source=who) is not None
        assert other.value("doc") == reps[who].value("doc")
    assert reps["A"].clock("doc") == reps["B"].clock("doc")


def test_sequence_numbers_and_duplicates() -> None:
    a, b = Replica("A"), Replica("B")
    d1 = a.update("doc", CounterAdd(("n",), 1))
    d2 = a.update("doc", CounterAdd(("n",), 2))
    assert (d1.seq, d2.seq) == (1, 2)
    assert d2.clock == VectorClock({"A": 2})
    assert b.apply_delta(d2)  # out of order is fine for delta-state CRDTs
    assert b.clock("doc") == VectorClock()  # but the advertised prefix waits for seq 1
    assert not b.apply_delta(d2)
    assert b.apply_delta(d1)
    assert b.clock("doc") == VectorClock({"A": 2})
    assert b.value("doc") == {"n": 3}
    d3 = b.update("doc", CounterAdd(("n",), 1))
    assert d3.clock == VectorClock({"A": 2, "B": 1})


def test_missing_for_returns_deltas_above_the_peer_clock() -> None:
    a = Replica("A")
    deltas = [a.update("doc", CounterAdd(("n",), 1)) for _ in range(5)]
    got = a.missing_for("doc", VectorClock({"A": 2}))
    assert got == deltas[2:]
    assert a.missing_for("doc", VectorClock({"A": 5})) == []
    assert a.missing_for("nope", VectorClock()) == []
    assert a.missing_for("doc", VectorClock(), limit=2) == deltas[:2]


def test_compacted_log_is_served_as_the_origins_checkpoint() -> None:
    a = replica("A", max_log=4)  # a checkpoint every operation (max_log // 4)
    for i in range(10):
        a.update("doc", SetAdd(("s",), f"e{i}"))
    doc = a.document("doc")
    assert len(doc.log) <= 4 and doc.floor[A] >= 6
    checkpoint = a.checkpoint("doc", A)
    assert checkpoint is not None and (checkpoint.first, checkpoint.seq) == (1, 10)
    got = a.missing_for("doc", VectorClock())
    assert got == [checkpoint]  # it covers everything: no delta is sent after it
    b = replica("B", max_log=4)
    assert b.receive_delta_untrusted(checkpoint.sealed, source="A") is not None
    assert b.value("doc") == a.value("doc")
    assert b.clock("doc") == a.clock("doc")
    assert b.document("doc").state == a.document("doc").state
    # B holds no delta of A, only the checkpoint, and serves that.
    assert b.missing_for("doc", VectorClock()) == [checkpoint]
    # A peer already up to date gets nothing; one just behind the log gets deltas.
    assert a.missing_for("doc", a.clock("doc")) == []
    recent = a.missing_for("doc", VectorClock({A: 9}))
    assert [(d.first, d.seq) for d in recent] == [(10, 10)]
    # A stale checkpoint teaches nothing, and is not kept over the newer one.
    older = Delta("doc", A, 5, VectorClock({A: 5}), DocState(), first=1)
    assert not b.apply_delta(older)
    assert b.checkpoint("doc", A) == checkpoint
    assert b.receive_delta_untrusted(checkpoint.sealed, source="A") is None  # duplicate


def test_a_checkpoint_equals_the_deltas_it_covers() -> None:
    a = replica("A", checkpoint_every=3)
    deltas = [a.update("doc", op) for op in (SetAdd(("s",), 1), CounterAdd(("n",), 2),
              SetAdd(("s",), 2), RegisterSet(("r",), "x", 4))]  # fmt: skip
    checkpoint = a.checkpoint("doc", A)
    assert checkpoint is not None and checkpoint.seq == 3
    from_deltas, from_checkpoint = Replica("C"), Replica("D")
    for d in deltas[:3]:
        from_deltas.apply_delta(d)
    from_checkpoint.apply_delta(checkpoint)
    assert from_checkpoint.document("doc").state == from_deltas.document("doc").state
    assert from_checkpoint.clock("doc") == from_deltas.clock("doc") == VectorClock({A: 3})
    # A delta the checkpoint covers is a duplicate; the next one applies.
    assert not from_checkpoint.apply_delta(deltas[1])
    assert from_checkpoint.apply_delta(deltas[3])


def test_deltas_no_checkpoint_covers_stay_in_the_log() -> None:
    # B never makes a checkpoint: its deltas cannot be served any other way, so they stay
    # even past max_log (bounded by checkpoint_every per origin in a real swarm).
    a = Replica("A", max_log=4)
    b = Replica("B", checkpoint_every=1000)
    for i in range(8):
        a.apply_delta(b.update("doc", SetAdd(("s",), i)))
    doc = a.document("doc")
    assert len(doc.log) == 8 and not doc.floor
    cp = Delta("doc", "B", 6, b.clock("doc").merge({"B": 6}), DocState(), first=1)
    a.apply_delta(cp)  # teaches nothing, but lets A evict what it covers
    assert a.checkpoint("doc", "B") == cp
    assert len(doc.log) <= 4 and doc.floor["B"] <= 6


def test_malformed_delta_is_logged_recorded_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    """R9.5: log the error with the source agent id, skip it, keep synchronising."""
    a, b = replica("A"), replica("B")
    good = a.update("doc", CounterAdd(("n",), 4)).sealed
    signed_by_a = identity("A")
    bad_inputs = [
        b"\xc1",
        good[:-3],
        # Bodies A signed that are malformed: an empty clock, a clock not counting s.
        seal(pack({"doc": "doc", "o": A, "f": 1, "s": 1, "vc": {}, "st": [[], [{}, []]]}),
             signed_by_a),
        seal(pack({"doc": "doc", "o": A, "f": 2, "s": 2, "vc": {A: 1}, "st": [[], [{}, []]]}),
             signed_by_a),
        seal(pack([1, 2, 3]), signed_by_a),
        pack([1, 2, 3]),
    ]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="p2pnode.crdt"):
        for bad in bad_inputs:
            assert b.receive_delta_untrusted(bad, source="agent-evil") is None
    assert len(b.errors) == len(bad_inputs)
    assert all(e.code is ErrorCode.CRDT_DESERIALIZATION_FAILED for e in b.errors)
    assert all(e.details["source"] == "agent-evil" for e in b.errors)
    records = [r for r in caplog.records if r.name == "p2pnode.crdt"]
    assert len(records) == len(bad_inputs)
    assert all("agent-evil" in r.getMessage() for r in records)
    assert b.receive_delta_untrusted(good, source="A") is not None
    assert b.value("doc") == {"n": 4}


@settings(max_examples=200)
@given(st.binary(max_size=120))
def test_random_bytes_never_raise(data: bytes) -> None:
    r = replica("B")
    assert r.receive_delta_untrusted(data, source="x") is None


def test_truncations_of_a_valid_delta_are_errors() -> None:
    a = Replica("A")
    a.update("doc", SetAdd(("s",), "x"))
    data = a.update("doc", SetAdd(("s",), "y")).encode()
    for cut in range(len(data)):
        with pytest.raises(CRDTError):
            Delta.decode_untrusted(data[:cut])
    obj = unpack_untrusted(data)
    obj["extra"] = 1
    with pytest.raises(CRDTError):
        Delta.from_wire_untrusted(obj)


def test_local_misuse() -> None:
    with pytest.raises(LocalError):
        Replica("")
    with pytest.raises(LocalError):
        Replica("A", max_log=0)
    with pytest.raises(LocalError):
        Replica("A").update("", CounterAdd(("n",), 1))
    with pytest.raises(LocalError):
        Replica("A").document("missing")
    with pytest.raises(LocalError):
        Replica("A", checkpoint_every=0)
    with pytest.raises(LocalError) as info:  # a replica id is the signer's peer id
        Replica("A", signer=identity("A"))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert replica("A").signed and not Replica("A").signed


def test_changes_journal() -> None:
    plain = Replica("P")
    plain.update("doc", CounterAdd(("n",), 1))
    assert not plain.take_changes()  # no storage, no journal, no growth
    a = Replica("A", max_log=4, journal=True)
    d = a.update("doc", CounterAdd(("n",), 1))
    ch = a.take_changes()
    assert ch.appended == [d]
    assert not a.take_changes()
    for _ in range(5):
        a.update("doc", CounterAdd(("n",), 1))
    ch = a.take_changes()
    assert ch.evicted
    assert ch.snapshot == {"doc"}
    assert [c.seq for c in ch.checkpoints] == [2, 3, 4, 5, 6]


def _names(count: int, prefix: str = "o") -> DotContext:
    return DotContext({f"{prefix}{i}": 1 for i in range(count)})


def _from(origin: str, ctx: DotContext, seq: int = 1) -> Delta:
    """A delta of ``origin`` whose context is ``ctx`` (what a remove of those dots sends)."""
    return Delta("doc", origin, seq, VectorClock({origin: seq}), DocState(ORMap(), ctx))


def test_updates_naming_more_replicas_than_a_clock_carries_are_refused() -> None:
    # A delta's context may name any replica (a remove lists the dots it observed): one
    # naming 4,097 replicas used to be joined, after which every clock and delta of the
    # document exceeded the 4,096 entries peers decode, for good.
    a = Replica("A")
    a.update("doc", CounterAdd(("n",), 1))
    with pytest.raises(CRDTError):
        a.apply_delta(_from("B", _names(MAX_CLOCK_ENTRIES)))
    assert a.clock("doc") == VectorClock({"A": 1})
    # Up to the limit is fine; A, named already, can still write; everything decodes.
    fits = _from("B", _names(MAX_CLOCK_ENTRIES - 1))
    assert a.apply_delta(fits)
    delta = a.update("doc", CounterAdd(("n",), 1))
    assert Delta.decode_untrusted(delta.encode()) == delta
    # Now full: a delta from one more replica is refused. A newcomer still reads the
    # document (it fits), but may not write into it.
    extra = Replica("Z").update("doc", CounterAdd(("n",), 1))
    with pytest.raises(CRDTError):
        a.apply_delta(extra)
    b = Replica("B")
    for d in a.missing_for("doc", VectorClock()):
        b.apply_delta(d)
    assert b.value("doc") == a.value("doc")
    with pytest.raises(LocalError) as info:
        b.update("doc", CounterAdd(("n",), 1))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT


def test_a_cloud_too_large_to_encode_is_refused() -> None:
    a = Replica("A")
    a.update("doc", CounterAdd(("n",), 1))
    gaps = DotContext(cloud=[("B", 2 * i + 3) for i in range(MAX_CLOUD)])
    assert a.apply_delta(_from("B", gaps))
    assert a.apply_delta(_from("B", DotContext(cloud=[*gaps.cloud, ("C", 1)]), 2))  # a union
    with pytest.raises(CRDTError):
        a.apply_delta(_from("B", DotContext(cloud=[("C", 5)]), 3))
    state = a.document("doc").state
    limits = WireLimits(max_size=4 * 1024 * 1024, max_depth=32)
    assert DocState.from_wire_untrusted(unpack_untrusted(canonical_pack(state.to_wire()), limits))
