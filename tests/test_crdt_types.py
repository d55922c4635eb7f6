"""Delta-state CRDTs: join laws on deltas and states, semantics, and the untrusted codec."""

from __future__ import annotations

import builtins
from collections.abc import Iterable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.wire import canonical_pack, pack, unpack_untrusted
from p2pnode.crdt import dots
from p2pnode.crdt.clock import CRDTError
from p2pnode.crdt.dots import Dot, DotContext
from p2pnode.crdt.ops import CounterAdd, MapRemove, Op, RegisterSet, SetAdd, SetRemove
from p2pnode.crdt.types import DocState, Kind, LWWRegister, ORMap

REPLICAS = ["r0", "r1", "r2"]
paths = st.sampled_from(
    [("t1",), ("t2",), ("t1", "status"), ("t1", "who"), ("t1", "n"), ("t2", "who"), ("t3", "x")]
)
ops: st.SearchStrategy[Op] = st.one_of(
    st.builds(CounterAdd, paths, st.integers(-3, 3).filter(bool)),
    st.builds(CounterAdd, paths, st.integers(1, 3), st.just(True)),
    st.builds(RegisterSet, paths, st.sampled_from(["open", "done", 1, None]), st.integers(1, 4)),
    st.builds(SetAdd, paths, st.sampled_from(["a", "b", 7])),
    st.builds(SetRemove, paths, st.sampled_from(["a", "b", 7])),
    st.builds(MapRemove, paths),
)
# A step is an op at a replica, or replica i joining replica j's state.
steps = st.lists(
    st.one_of(
        st.tuples(st.just("op"), st.integers(0, 2), ops),
        st.tuples(st.just("sync"), st.integers(0, 2), st.integers(0, 2)),
    ),
    min_size=1,
    max_size=25,
)


def run_history(history: list[tuple[Any, ...]]) -> tuple[list[DocState], list[DocState]]:
    """Play a history; return every delta produced and the replicas' final states."""
    states = [DocState() for _ in REPLICAS]
    deltas: list[DocState] = []
    for step in history:
        if step[0] == "op":
            _, i, op = step
            try:
                delta = states[i].mutate(REPLICAS[i], op)
            except LocalError:
                continue  # a local kind conflict: the caller's mistake, nothing produced
            states[i].join(delta)
            deltas.append(delta)
        else:
            _, i, j = step
            states[i].join(states[j])
    return deltas, states


def joined(*parts: DocState) -> DocState:
    out = DocState()
    for p in parts:
        out.join(p)
    return out


def enc(s: DocState) -> bytes:
    return canonical_pack(s.to_wire())


@settings(max_examples=150, deadline=None)
@given(steps, st.data())
def test_join_laws_on_deltas_and_states(
    history: list[tuple[Any, ...]], data: st.DataObject
) -> None:
    deltas, states = run_history(history)
    pool = deltas + states + [DocState()]
    a, b, c = (data.draw(st.sampled_from(pool)) for _ in range(3))
    before = enc(a), enc(b), enc(c)
    assert joined(a, a) == joined(a)  # idempotent
    assert joined(a, b) == joined(b, a)  # commutative
    ab_c = joined(a, b)
    ab_c.join(c)
    bc = joined(b, c)
    a_bc = joined(a)
    a_bc.join(bc)
    assert ab_c == a_bc  # associative
    assert (enc(a), enc(b), enc(c)) == before  # joins never mutate their argument


@settings(max_examples=150, deadline=None)
@given(steps, st.randoms(use_true_random=False))
def test_any_delivery_order_with_duplicates_converges(
    history: list[tuple[Any, ...]], rnd: Any
) -> None:
    deltas, _ = run_history(history)
    reference = joined(*deltas)
    shuffled = deltas + rnd.sample(deltas, k=len(deltas) // 2)
    rnd.shuffle(shuffled)
    assert joined(*shuffled) == reference
    assert enc(joined(*shuffled)) == enc(reference)


@settings(max_examples=100, deadline=None)
@given(steps)
def test_states_after_full_sync_are_equal(history: list[tuple[Any, ...]]) -> None:
    deltas, states = run_history(history)
    everything = joined(*deltas)
    for s in states:
        s.join(everything)
        assert s == everything
        assert s.value() == everything.value()


@settings(max_examples=100, deadline=None)
@given(steps)
def test_codec_round_trip(history: list[tuple[Any, ...]]) -> None:
    deltas, states = run_history(history)
    for s in [*deltas, *states]:
        wire = unpack_untrusted(pack(s.to_wire()))
        assert DocState.from_wire_untrusted(wire) == s


def test_task_state_example() -> None:
    a, b = DocState(), DocState()

    def do(s: DocState, rid: str, op: Op) -> DocState:
        d = s.mutate(rid, op)
        s.join(d)
        return d

    d1 = do(a, "A", RegisterSet(("t1", "status"), "open", 100))
    d2 = do(a, "A", SetAdd(("t1", "assignees"), "alice"))
    b.join(d1)
    b.join(d2)
    # Concurrently: A removes alice, B re-adds alice and bumps progress; add wins.
    d3 = do(a, "A", SetRemove(("t1", "assignees"), "alice"))
    d4 = do(b, "B", SetAdd(("t1", "assignees"), "alice"))
    d5 = do(b, "B", CounterAdd(("t1", "progress"), 30))
    d6 = do(a, "A", CounterAdd(("t1", "progress"), -5))
    for d in (d4, d5):
        a.join(d)
    for d in (d3, d6):
        b.join(d)
    assert a == b
    assert a.value() == {
        "t1": {"assignees": frozenset({"alice"}), "progress": 25, "status": "open"}
    }


def test_observed_remove_and_remove_wins_only_over_observed() -> None:
    a = DocState()
    add = a.mutate("A", SetAdd(("s",), "x"))
    a.join(add)
    rm = a.mutate("A", SetRemove(("s",), "x"))
    a.join(rm)
    assert a.value() == {"s": frozenset()}
    b = DocState()
    b.join(rm)  # remove before the add it observed arrives
    b.join(add)
    assert b == a


def test_lww_tie_breaks_on_replica_then_value() -> None:
    a = DocState()
    b = DocState()
    da = a.mutate("A", RegisterSet(("r",), "from-a", 5))
    db = b.mutate("B", RegisterSet(("r",), "from-b", 5))
    assert joined(da, db).value() == {"r": "from-b"} == joined(db, da).value()
    # A writer that saw the current value supersedes it even with an older clock.
    c = joined(da, db)
    dc = c.mutate("A", RegisterSet(("r",), "newer", 1))
    c.join(dc)
    assert c.value() == {"r": "newer"}
    reg = dc.root.entries["r"].value
    assert isinstance(reg, LWWRegister)
    assert reg.timestamp == 6


def test_map_remove_hides_key_but_concurrent_write_wins() -> None:
    a = DocState()
    a.join(a.mutate("A", CounterAdd(("k", "n"), 2)))
    b = a.copy()
    rm = a.mutate("A", MapRemove(("k",)))
    a.join(rm)
    assert a.value() == {}
    w = b.mutate("B", CounterAdd(("k", "n"), 1))
    b.join(w)
    a.join(w)
    b.join(rm)
    assert a == b
    assert a.value() == {"k": {"n": 3}}  # no reset: the counter keeps its history


def test_concurrent_kind_conflict_resolves_to_higher_kind() -> None:
    a, b = DocState(), DocState()
    da = a.mutate("A", CounterAdd(("k",), 1))
    db = b.mutate("B", SetAdd(("k",), "x"))
    assert joined(da, db) == joined(db, da)
    assert joined(da, db).value() == {"k": frozenset({"x"})}
    assert Kind.ORSET > Kind.PNCOUNTER


@pytest.mark.parametrize(
    "op",
    [
        CounterAdd((), 1),
        CounterAdd(("a", ""), 1),
        CounterAdd(("a",), 0),
        CounterAdd(("a",), -1, True),
        RegisterSet(("a",), object(), 1),
        RegisterSet(("a",), "v", 0),
        SetAdd(("a",), True),
        SetAdd(("a",), 1.5),  # type: ignore[arg-type]
        SetAdd(("a",), "x" * 257),
        SetAdd(("a",), 2**64),
        RegisterSet(("a",), "x" * 65537, 1),
        RegisterSet(("a",), 2**64, 1),
        CounterAdd(("k" * 257,), 1),
        CounterAdd(tuple("abcdefghi"), 1),
    ],
)
def test_bad_local_ops_are_local_errors(op: Op) -> None:
    with pytest.raises(LocalError):
        DocState().mutate("A", op)


def test_path_through_a_non_map_is_local_error() -> None:
    s = DocState()
    s.join(s.mutate("A", CounterAdd(("a",), 1)))
    with pytest.raises(LocalError):
        s.mutate("A", CounterAdd(("a", "b"), 1))
    with pytest.raises(LocalError):
        s.mutate("A", SetAdd(("a",), "x"))


def _valid_wire() -> Any:
    s = DocState()
    for op in (SetAdd(("t", "s"), "x"), CounterAdd(("t", "c"), 2), RegisterSet(("r",), "v", 3)):
        s.join(s.mutate("A", op))
    return s.to_wire()


@pytest.mark.parametrize(
    "tamper",
    [
        lambda w: [w[0]],
        lambda w: [w[0], [{}, []]],  # dots outside the causal context
        lambda w: [[["t", [], [9, []]]], w[1]],  # unknown kind
        lambda w: [[["t", [], [5, "x"]]], w[1]],
        lambda w: [[["t", [["A", 0]], [1, {}]]], w[1]],  # dot counter 0
        lambda w: [[["t", [], [1, {"A": -1}]]], w[1]],
        lambda w: [[["t", [], [3, [0, "A", "v"]]]], w[1]],  # unwritten register with a value
        lambda w: [[["t", [], [4, [["x", []]]]]], w[1]],  # set element without dots
        lambda w: [[["t", [], [5, []]], ["t", [], [5, []]]], w[1]],  # repeated key
        lambda w: [[[1, [], [5, []]]], w[1]],
        lambda w: [[["t", [], [4, [[True, [["A", 1]]]]]]], w[1]],
    ],
)
def test_tampered_states_rejected(tamper: Any) -> None:
    wire = _valid_wire()
    assert DocState.from_wire_untrusted(unpack_untrusted(pack(wire))) is not None
    with pytest.raises(CRDTError) as info:
        DocState.from_wire_untrusted(unpack_untrusted(pack(tamper(wire))))
    assert info.value.code is ErrorCode.CRDT_DESERIALIZATION_FAILED


def test_nesting_limit() -> None:
    inner: Any = [5, []]
    for _ in range(12):
        inner = [5, [["k", [], inner]]]
    with pytest.raises(CRDTError):
        DocState.from_wire_untrusted([inner[1], [{}, []]])


@settings(max_examples=300)
@given(
    st.recursive(st.integers() | st.text(max_size=3) | st.none(), lambda c: st.lists(c, max_size=4))
)
def test_random_structures_raise_only_crdt_error(obj: Any) -> None:
    try:
        DocState.from_wire_untrusted(obj)
    except CRDTError:
        pass


def test_ormap_value_hides_removed_keys() -> None:
    m = ORMap()
    assert m.value() == {}


def test_foreign_dot_of_ours_in_context_does_not_swallow_our_next_write() -> None:
    """A peer's state may carry a dot with our id beyond our prefix; we must skip it."""
    mine = DocState()
    mine.join(mine.mutate("A", SetAdd(("s",), "x")))
    hostile = DocState.from_wire_untrusted([[], [{}, [["A", 5]]]])
    mine.join(hostile)
    for element in ("y", "z", "w", "v"):
        mine.join(mine.mutate("A", SetAdd(("s",), element)))
    assert mine.value() == {"s": frozenset({"x", "y", "z", "w", "v"})}


dot_sets = st.sets(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 12)), max_size=20)


@settings(max_examples=300)
@given(dot_sets, dot_sets, dot_sets)
def test_context_join_is_set_union_and_stays_compact(a: set[Dot], b: set[Dot], c: set[Dot]) -> None:
    # join() compacts only the replicas it touched: the result must still be the union in
    # the unique compact form (what a fresh context of the union is).
    ctx = DotContext(cloud=a)
    for other in (b, c):
        ctx.join(DotContext(cloud=other))
    union = DotContext(cloud=a | b | c)
    assert ctx == union
    assert set(ctx) == a | b | c
    assert all(n > ctx.vv.get(r, 0) + 1 for r, n in ctx.cloud)


#: Elements already in the set: building it costs a pass over the set per add (a delta's
#: join tests each element against the delta's few dots), so not more than needed to
#: tell a pass per delta (over 2 million dots tested) from a few dots per delta.
ELEMENTS = 2000


def test_a_batch_of_deltas_into_a_large_set_is_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each delta of a batch used to sort the whole context cloud and causally re-join
    # every element of the set: a 1,024-delta frame cost seconds. The work is counted,
    # not timed: dots tested against a context, and dots sorted.
    base = DocState()
    for i in range(ELEMENTS):
        base.join(base.mutate("w", SetAdd(("s",), i)))
    writer = DocState()
    deltas = []
    for i in range(1024):
        delta = writer.mutate("x", SetAdd(("s",), f"e{i}"))
        writer.join(delta)
        deltas.append(delta)
    work = {"tested": 0, "sorted": 0}
    test_dot = DotContext.__contains__

    def counted_test(context: DotContext, dot: Dot) -> bool:
        work["tested"] += 1
        return test_dot(context, dot)

    def counted_sort(items: Iterable[Any], **options: Any) -> list[Any]:
        ordered = builtins.sorted(items, **options)
        work["sorted"] += len(ordered)
        return ordered

    monkeypatch.setattr(DotContext, "__contains__", counted_test)
    monkeypatch.setattr(dots, "sorted", counted_sort, raising=False)
    for delta in deltas[1:]:  # the first never arrives: the batch's dots stay in the cloud
        base.join(delta)
    # A few dots per delta; a pass over the 2,000 elements or the cloud per delta would
    # be millions and hundreds of thousands.
    assert work["tested"] <= 10 * len(deltas) and work["sorted"] <= 10 * len(deltas)
    value = base.value()["s"]
    assert len(value) == ELEMENTS + 1023 and "e0" not in value and "e1023" in value
