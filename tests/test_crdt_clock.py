"""Vector clocks: the causal partial order, least upper bound, and the untrusted codec."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.wire import pack
from p2pnode.crdt.clock import CRDTError, Ordering, VectorClock

ids = st.sampled_from(["a", "b", "c", "d"])
clocks = st.dictionaries(ids, st.integers(min_value=0, max_value=5), max_size=4).map(VectorClock)


def leq(a: VectorClock, b: VectorClock) -> bool:
    return a.compare(b) in (Ordering.BEFORE, Ordering.EQUAL)


@given(clocks)
def test_reflexive(a: VectorClock) -> None:
    assert a.compare(a) is Ordering.EQUAL
    assert leq(a, a)


@given(clocks, clocks)
def test_antisymmetric_and_converse(a: VectorClock, b: VectorClock) -> None:
    if leq(a, b) and leq(b, a):
        assert a == b
    converse = {
        Ordering.BEFORE: Ordering.AFTER,
        Ordering.AFTER: Ordering.BEFORE,
        Ordering.EQUAL: Ordering.EQUAL,
        Ordering.CONCURRENT: Ordering.CONCURRENT,
    }
    assert b.compare(a) is converse[a.compare(b)]


@given(clocks, clocks, clocks)
def test_transitive(a: VectorClock, b: VectorClock, c: VectorClock) -> None:
    if leq(a, b) and leq(b, c):
        assert leq(a, c)


@given(clocks, clocks, clocks)
def test_merge_is_least_upper_bound(a: VectorClock, b: VectorClock, c: VectorClock) -> None:
    m = a.merge(b)
    assert leq(a, m)
    assert leq(b, m)
    if leq(a, c) and leq(b, c):
        assert leq(m, c)
    assert m == b.merge(a)
    assert a.merge(a) == a


@given(clocks, ids)
def test_increment_moves_strictly_after(a: VectorClock, rid: str) -> None:
    b = a.increment(rid)
    assert a.compare(b) is Ordering.BEFORE
    assert b[rid] == a.get(rid) + 1


def test_concurrent_example() -> None:
    a = VectorClock({"x": 1})
    b = VectorClock({"y": 1})
    assert a.compare(b) is Ordering.CONCURRENT
    assert a.merge(b) == VectorClock({"x": 1, "y": 1})


def test_zero_entries_are_canonical() -> None:
    assert VectorClock({"a": 0, "b": 2}) == VectorClock({"b": 2})
    assert VectorClock({"a": 0}).encode() == VectorClock().encode()
    assert hash(VectorClock({"b": 2, "a": 1})) == hash(VectorClock({"a": 1, "b": 2}))


@settings(max_examples=200)
@given(clocks)
def test_codec_round_trip(a: VectorClock) -> None:
    data = a.encode()
    assert VectorClock.decode_untrusted(data) == a
    for cut in range(len(data)):
        try:
            assert VectorClock.decode_untrusted(data[:cut]) is not None
        except CRDTError as exc:
            assert exc.code is ErrorCode.CRDT_DESERIALIZATION_FAILED


@settings(max_examples=300)
@given(st.binary(max_size=64))
def test_random_bytes_raise_only_crdt_error(data: bytes) -> None:
    try:
        VectorClock.decode_untrusted(data)
    except CRDTError as exc:
        assert exc.code is ErrorCode.CRDT_DESERIALIZATION_FAILED


@pytest.mark.parametrize(
    "obj",
    [
        [1, 2],
        {"a": -1},
        {"a": 0},
        {"a": 2**63},
        {"a": 1.5},
        {"a": True},
        {"": 1},
        {"x" * 129: 1},
        {b"a": 1},
        {"a": {"b": 1}},
    ],
)
def test_tampered_clocks_rejected(obj: object) -> None:
    with pytest.raises(CRDTError):
        VectorClock.decode_untrusted(pack(obj))


def test_entry_limit() -> None:
    big = {f"r{i}": 1 for i in range(20)}
    with pytest.raises(CRDTError):
        VectorClock.decode_untrusted(pack(big), max_entries=10)
    assert len(VectorClock.decode_untrusted(pack(big), max_entries=20)) == 20


def test_local_misuse_is_local_error() -> None:
    with pytest.raises(LocalError):
        VectorClock({"a": -1})
    with pytest.raises(LocalError):
        VectorClock({"": 1})
