"""Replicas: local updates, remote deltas, missing-delta computation, log compaction, R9.5."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.crdt.clock import MAX_CLOCK_ENTRIES, CRDTError, VectorClock
from p2pnode.crdt.dots import DotContext
from p2pnode.crdt.ops import CounterAdd, RegisterSet, SetAdd
from p2pnode.crdt.replica import MAX_CLOUD, Delta, FullState, Replica
from p2pnode.crdt.types import DocState
from p2pnode.errors import ErrorCode, LocalError
from p2pnode.wire import pack, unpack_untrusted

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
    reps = {"A": Replica("A"), "B": Replica("B")}
    for who, op in script:
        delta = reps[who].update("doc", op)
        assert len(delta.clock) > 0
        assert delta.clock[who] == delta.seq
        decoded = Delta.decode_untrusted(delta.encode())
        assert decoded.clock == delta.clock
        assert decoded.state == delta.state
        other = reps["B" if who == "A" else "A"]
        assert other.receive_delta_untrusted(delta.encode(), source=who) is not None
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


def test_compacted_log_falls_back_to_full_state() -> None:
    a = Replica("A", max_log=4)
    for i in range(10):
        a.update("doc", SetAdd(("s",), f"e{i}"))
    assert len(a.document("doc").log) <= 4
    got = a.missing_for("doc", VectorClock())
    assert isinstance(got, FullState)
    b = Replica("B", max_log=4)
    assert b.receive_full_state_untrusted(got.encode(), source="A") is not None
    assert b.value("doc") == a.value("doc")
    assert b.clock("doc") == a.clock("doc")
    assert b.document("doc").state == a.document("doc").state
    # B now lacks the logged deltas, so a peer behind it gets a full state too.
    assert isinstance(b.missing_for("doc", VectorClock()), FullState)
    # A peer already up to date gets nothing; one just behind the log gets deltas.
    assert a.missing_for("doc", a.clock("doc")) == []
    recent = a.missing_for("doc", VectorClock({"A": 9}))
    assert isinstance(recent, list)
    assert [d.seq for d in recent] == [10]
    # A stale full state teaches nothing.
    assert not b.apply_full_state(a.full_state("doc"))


def test_malformed_delta_is_logged_recorded_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    """R9.5: log the error with the source agent id, skip it, keep synchronising."""
    a, b = Replica("A"), Replica("B")
    good = a.update("doc", CounterAdd(("n",), 4)).encode()
    bad_inputs = [
        b"\xc1",
        good[:-3],
        pack({"doc": "doc", "o": "A", "s": 1, "vc": {}, "st": [[], [{}, []]]}),  # empty clock
        pack({"doc": "doc", "o": "A", "s": 2, "vc": {"A": 1}, "st": [[], [{}, []]]}),
        pack([1, 2, 3]),
    ]
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
    r = Replica("B")
    assert r.receive_delta_untrusted(data, source="x") is None
    assert r.receive_full_state_untrusted(data, source="x") is None


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


def test_full_state_codec_rejects_empty_clock() -> None:
    a = Replica("A")
    a.update("doc", SetAdd(("s",), "x"))
    wire = a.full_state("doc").to_wire()
    wire["ap"] = [{}, []]
    with pytest.raises(CRDTError):
        FullState.from_wire_untrusted(wire)


def test_local_misuse() -> None:
    with pytest.raises(LocalError):
        Replica("")
    with pytest.raises(LocalError):
        Replica("A", max_log=0)
    with pytest.raises(LocalError):
        Replica("A").update("", CounterAdd(("n",), 1))
    with pytest.raises(LocalError):
        Replica("A").document("missing")


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


def test_full_state_naming_many_origins_prunes_the_log_in_one_pass() -> None:
    # The log used to be swept once per origin of the state (quadratic in the worst case).
    a = Replica("A", max_log=1024)
    for _ in range(1000):
        a.update("doc", CounterAdd(("n",), 1))
    peer_ops = [(f"o{i}", 2) for i in range(4000)]
    full = FullState("doc", "B", DotContext({"A": 400}, peer_ops), DocState())
    assert a.receive_full_state_untrusted(full.encode(), source="B") is not None
    doc = a.document("doc")
    assert doc.floor["o7"] == 2 and "A" not in doc.floor
    assert len(doc.log) == 1000  # A's own deltas stay: the state taught nothing of A
    # A state lifting A's floor prunes exactly what is at or below it.
    lifted = FullState("doc", "B", DotContext({"A": 400}, [("A", 1002)]), DocState())
    assert a.apply_full_state(lifted)
    assert doc.floor["A"] == 1002 and not doc.log


def _names(count: int, prefix: str = "o") -> DotContext:
    return DotContext({f"{prefix}{i}": 1 for i in range(count)})


def test_updates_naming_more_replicas_than_a_clock_carries_are_refused() -> None:
    # Replica ids are not authenticated: one full state naming 4,097 replicas used to be
    # joined, after which every clock, delta and full state of the document exceeded the
    # 4,096 entries peers decode, for good.
    a = Replica("A")
    a.update("doc", CounterAdd(("n",), 1))
    wide = FullState("doc", "B", _names(MAX_CLOCK_ENTRIES), DocState())
    assert a.receive_full_state_untrusted(wide.encode(), source="B") is None
    assert a.errors[-1].code is ErrorCode.CRDT_DESERIALIZATION_FAILED
    assert a.clock("doc") == VectorClock({"A": 1})
    # Up to the limit is fine; A, named already, can still write; everything decodes.
    fits = FullState("doc", "B", _names(MAX_CLOCK_ENTRIES - 1), DocState())
    assert a.receive_full_state_untrusted(fits.encode(), source="B") is not None
    delta = a.update("doc", CounterAdd(("n",), 1))
    assert Delta.decode_untrusted(delta.encode()) == delta
    assert FullState.decode_untrusted(a.full_state("doc").encode()) == a.full_state("doc")
    # Now full: a delta from one more replica is refused. A newcomer still reads the
    # document (it fits), but may not write into it.
    extra = Replica("Z").update("doc", CounterAdd(("n",), 1))
    assert a.receive_delta_untrusted(extra.encode(), source="Z") is None
    b = Replica("B")
    assert b.receive_full_state_untrusted(a.full_state("doc").encode(), source="A") is not None
    assert b.value("doc") == a.value("doc")
    with pytest.raises(LocalError) as info:
        b.update("doc", CounterAdd(("n",), 1))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT


def test_a_cloud_too_large_to_encode_is_refused() -> None:
    a = Replica("A")
    a.update("doc", CounterAdd(("n",), 1))
    gaps = DotContext(cloud=[("B", 2 * i + 3) for i in range(MAX_CLOUD)])
    full = FullState("doc", "B", gaps, DocState())
    assert a.receive_full_state_untrusted(full.encode(), source="B") is not None
    again = FullState("doc", "B", DotContext(cloud=[*gaps.cloud, ("C", 1)]), DocState())
    assert a.receive_full_state_untrusted(again.encode(), source="B") is not None  # a union
    more = FullState("doc", "B", DotContext(cloud=[("C", 5)]), DocState())
    assert a.receive_full_state_untrusted(more.encode(), source="B") is None
    assert FullState.decode_untrusted(a.full_state("doc").encode()) == a.full_state("doc")
