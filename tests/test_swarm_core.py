"""Swarms without a node: the plan and journal in the document, the fold, the
coordinator's decisions, the takeover order (p2pnode.services.swarms.document, swarmcore;
Properties 25-26, R8.2-R8.6)."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.agent.task import Task
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.identity import PeerId
from p2pnode.core.jsonutil import dumps
from p2pnode.services.swarms.coordinator import (
    Coordinator,
    Participation,
    SwarmConfig,
    Verdict,
    claim_after,
    invitees,
    successors,
)
from p2pnode.services.swarms.document import (
    ASSIGNED,
    COMPLETED,
    DONE,
    ESCALATED,
    INPUT_REQUIRED,
    Authored,
    DocReader,
    Plan,
    Record,
    SubTask,
    aggregate,
    fold,
    lease_stamp,
    log_key,
    member_address,
    peer_of,
)

CAPS = ["a", "b", "c"]
capsets = st.frozensets(st.sampled_from(CAPS), max_size=3)


def make_plan(costs: list[float], needs: list[frozenset[str]], agg: str = "sum") -> Plan:
    subtasks = tuple(
        SubTask(f"t{i}", Task(f"part {i}", tuple(sorted(n)), c, i))
        for i, (c, n) in enumerate(zip(costs, needs, strict=True))
    )
    return Plan("s1", "test", subtasks, agg, lease=3.0, opener="boss")


# -- Property 25: invitations go only to capable agents -------------------------------------------


@given(
    st.dictionaries(st.sampled_from(["x", "y", "z", "w", "v"]), capsets),
    st.lists(capsets, min_size=1, max_size=4),
)
def test_p25_only_agents_offering_a_subtasks_capabilities_are_invited(
    offers: dict[str, frozenset[str]], needs: list[frozenset[str]]
) -> None:
    cards = list(offers.items())
    chosen = invitees(cards, needs, exclude=["v"])
    offered = dict(cards)
    for agent in chosen:
        assert agent != "v"
        assert any(n <= offered[agent] for n in needs)
    for agent, caps in cards:
        if agent != "v" and any(n <= caps for n in needs):
            assert agent in chosen


# -- the document ---------------------------------------------------------------------------------


@given(
    st.lists(st.tuples(st.floats(0, 100), capsets, st.text(max_size=300)), min_size=1, max_size=60),
    st.sampled_from(["list", "sum", "count", "map", "concat"]),
)
def test_a_plan_survives_the_document_in_chunks(
    parts: list[tuple[float, frozenset[str], str]], agg: str
) -> None:
    subtasks = tuple(
        SubTask(f"t{i}", Task(text, tuple(sorted(n)), c, {"text": text}))
        for i, (c, n, text) in enumerate(parts)
    )
    plan = Plan("s1", "d", subtasks, agg, 2.5, "boss")
    chunks = dict(plan.chunks())
    assert all(len(text) <= 64 * 1024 for text in chunks.values())
    assert Plan.from_doc_untrusted(chunks) == plan
    incomplete = {k: v for k, v in chunks.items() if k != f"c{len(chunks) - 2}"}
    assert Plan.from_doc_untrusted(incomplete) is None  # a chunk still on its way


def test_a_large_plan_is_split_into_chunks() -> None:
    plan = make_plan([1.0] * 3000, [frozenset({"a"})] * 3000)
    chunks = plan.chunks()
    assert len(chunks) > 2
    assert Plan.from_doc_untrusted(dict(chunks)) == plan


def test_plans_are_checked() -> None:
    with pytest.raises(LocalError, match="distinct"):
        Plan("s", "", (SubTask("a", Task("x")), SubTask("a", Task("y"))))
    with pytest.raises(LocalError, match="aggregate"):
        make_plan([1.0], [frozenset()], agg="median")
    with pytest.raises(LocalError, match="subtasks"):
        Plan("s", "", ())
    with pytest.raises(LocalError, match="unknown fields"):
        Plan.from_json({"subtasks": [], "x": 1}, swarm="s")
    with pytest.raises(LocalError, match="complexity"):
        Plan.from_json({"subtasks": [{"id": "a", "description": "", "complexity": -1}]}, swarm="s")
    plan = Plan.from_json(
        {"description": "d", "aggregate": "map", "subtasks": [{"id": "a", "description": "x"}]},
        swarm="s",
        opener="boss",
    )
    assert plan.subtasks[0].task == Task("x") and plan.aggregate == "map"


junk = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=4),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(list("jadfxlesoq")), inner, max_size=4)
    ),
    max_leaves=15,
)


@given(junk)
def test_records_from_a_replica_raise_only_task_errors(data: Any) -> None:
    try:
        Record.from_json_untrusted(data, 3)
    except RemoteError as exc:
        assert exc.code is ErrorCode.MALFORMED_MESSAGE


@given(
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 3), st.sampled_from("pq")), max_size=12)
)
def test_the_fold_accepts_the_first_result_of_each_subtask(
    results: list[tuple[int, int, str]],
) -> None:
    # Results journaled by two overlapping coordinators: each sub-task keeps the first
    # in (epoch, writer, sequence) order, the others are counted as duplicates.
    records = []
    for seq, (index, epoch, writer) in enumerate(results):
        record = Record(done=[(index, 1, writer, f"{writer}{seq}")])
        records.append((f"{log_key(epoch, writer)}/{seq:010d}", record))
    random.Random(1).shuffle(records)
    view = fold(4, records)
    ordered = sorted(records, key=lambda kr: kr[0])
    for index in range(4):
        firsts = [r.done[0][3] for _, r in ordered if r.done[0][0] == index]
        assert view.subtasks[index].result == (firsts[0] if firsts else None)
    assert view.duplicates == len(results) - len({i for i, _, _ in results})


OWNER = str(PeerId.from_public_key(bytes([1]) * 32))
P_W = str(PeerId.from_public_key(bytes([2]) * 32))
BOSS, W = member_address("boss", OWNER), member_address("w", P_W)


def signed(value: dict[str, Any]) -> dict[str, Any]:
    """A plain document value as :func:`authored` gives it: the plan and ``cancel`` by
    the opener's peer, each journal record by its term's coordinator's peer."""
    out: dict[str, Any] = {k: Authored(v, OWNER) for k, v in value.items() if k != "log"}
    out["plan"] = {k: Authored(v, OWNER) for k, v in value["plan"].items()}
    out["log"] = {t: {q: Authored(v, peer_of(t.split(":", 1)[1]) or "") for q, v in e.items()}
                  for t, e in value.get("log", {}).items()}  # fmt: skip
    if "coord" in value:
        out["coord"] = Authored(value["coord"], P_W)
    return out


def test_the_reader_folds_incrementally_and_refolds_out_of_order() -> None:
    plan = make_plan([1.0, 1.0], [frozenset(), frozenset()])
    value: dict[str, Any] = {"plan": dict(plan.chunks()), "log": {}}
    reader = DocReader()
    assert reader.read_untrusted({"plan": {}}) == []
    late = log_key(2, W)
    value["log"][late] = {f"{1:010d}": dumps({"d": [[0, 2, W, "late"]]})}
    # Term 2 before term 1 arrived: not admitted yet (no term 1, w not yet a member).
    assert reader.read_untrusted(signed(value)) == []
    assert reader.view is not None and reader.view.subtasks[0].result is None
    early = log_key(1, "boss@" + OWNER)
    first = {"j": [[W, [], 1]], "a": [[0, W, 1], [0, W, 2]], "d": [[0, 1, W, "early"]]}
    value["log"][early] = {f"{1:010d}": dumps(first), "2": "{"}
    value["coord"] = dumps({"agent": W, "epoch": 2, "beat": 3})
    value["cancel"] = True
    new = reader.read_untrusted(signed(value))
    assert [k for k, _ in new] == [f"{early}/{1:010d}"]  # the bad register is skipped
    assert reader.view.subtasks[0].result == "early"  # refolded: the earlier term wins
    assert reader.view.duplicates == 1 and reader.bad == 1  # term 2, admitted now
    assert reader.view.breaches == {}
    assert reader.coord is not None and reader.coord.agent == W and reader.canceled
    assert reader.read_untrusted(signed(value)) == []


def test_a_later_epoch_outranks_any_renewal_of_an_earlier_one() -> None:
    assert lease_stamp(2, 1) > lease_stamp(1, 9_999_999_999_999)
    assert lease_stamp(1, 5) < lease_stamp(1, 6)


def test_aggregations() -> None:
    assert aggregate("sum", ["a", "b"], [1, 2.5]) == 3.5
    assert aggregate("concat", ["a", "b"], ["x", "y"]) == "xy"
    assert aggregate("concat", ["a", "b"], [[1], [2]]) == [1, 2]
    assert aggregate("map", ["a", "b"], [1, 2]) == {"a": 1, "b": 2}
    assert aggregate("count", ["a"], [None]) == 1
    with pytest.raises(LocalError):
        aggregate("sum", ["a"], ["x"])


# -- Property 26: assignment, state, completion ---------------------------------------------------

NOW_MS = 1_800_000_000_000


def run_swarm(
    plan: Plan,
    members: dict[str, tuple[frozenset[str], int]],
    *,
    seed: int,
    kill: set[str] = frozenset(),  # type: ignore[assignment]
    repeat: int = 0,
) -> tuple[Coordinator, list[tuple[str, Record]], dict[str, list[int]]]:
    """Drive a coordinator as a driver would: participants join, each tick's assignments
    run (in a shuffled order; killed participants never answer, and stop beating),
    the journal is kept. ``repeat``: results reported again that many times."""
    rng = random.Random(seed)
    core = Coordinator(plan, "boss", 1, now=0.0, config=SwarmConfig(join_deadline=1.0))
    journal: list[tuple[str, Record]] = []
    first: dict[str, list[int]] = {}
    now = 0.0
    for agent, (caps, capacity) in members.items():
        core.join(agent, caps, capacity, now=now, now_ms=NOW_MS)
    queued: list[tuple[str, int, int]] = []
    for step in range(2000):
        orders = core.tick(now)
        for agent, items in orders.assign.items():
            first.setdefault(agent, [i for i, _ in items]) if step == 0 else None
            queued.extend((agent, i, a) for i, a in items)
        taken = core.take_record()
        if taken is not None:
            journal.append((f"{log_key(1, 'boss')}/{taken[0]}", taken[1]))
        settled = all(sub.status in (DONE, ESCALATED) for sub in core.subs)
        if core.status == COMPLETED or (settled and core.status == INPUT_REQUIRED):
            break
        rng.shuffle(queued)
        keep = []
        for agent, index, attempt in queued:
            if agent in kill:
                continue
            if rng.random() < 0.5:
                for _ in range(1 + repeat):
                    core.result(agent, index, attempt, plan.subtasks[index].task.input)
            else:
                keep.append((agent, index, attempt))
        queued = keep
        now += 1.0
        for agent in members:
            if agent not in kill:
                core.beat(agent, now=now, now_ms=NOW_MS)
    return core, journal, first


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.floats(0.1, 5.0), min_size=1, max_size=30),
    st.integers(1, 6),
    st.integers(1, 3),
    st.integers(0, 2**16),
    st.integers(0, 2),
)
def test_p26_every_participant_gets_work_and_the_swarm_completes_once(
    costs: list[float], n: int, capacity: int, seed: int, repeat: int
) -> None:
    plan = make_plan(costs, [frozenset({"a"})] * len(costs))
    members = {f"m{i}": (frozenset({"a", "b"}), capacity) for i in range(n)}
    core, journal, first = run_swarm(plan, members, seed=seed, repeat=repeat)
    if len(costs) >= n:
        assert set(first) == set(members)  # each participant got at least one sub-task
    assert core.status == COMPLETED
    view = fold(len(costs), journal)
    assert view.status == COMPLETED and view.complete
    expected = list(range(len(costs)))
    assert view.results() == expected  # every result, each accepted once
    assert view.outcome == core.outcome == sum(expected)
    assert view.duplicates == 0  # the coordinator journals a result once
    assert core.duplicates == repeat * len(costs)  # the repeats were dropped


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.1, 5.0), capsets), min_size=1, max_size=25),
    st.dictionaries(st.sampled_from(["p", "q", "r", "s"]), capsets, min_size=1),
    st.sets(st.sampled_from(["p", "q", "r", "s"])),
    st.integers(0, 2**16),
)
def test_p26_dead_participants_are_replaced_or_the_swarm_escalates(
    parts: list[tuple[float, frozenset[str]]],
    caps: dict[str, frozenset[str]],
    kill: set[str],
    seed: int,
) -> None:
    plan = make_plan([c for c, _ in parts], [n for _, n in parts])
    members = {a: (c, 1) for a, c in caps.items()}
    core, journal, _ = run_swarm(plan, members, seed=seed, kill=kill)
    alive = [c for a, c in caps.items() if a not in kill]
    doable = [any(n <= c for c in alive) for _, n in parts]
    view = fold(len(parts), journal)
    for index, sub in enumerate(view.subtasks):
        if sub.status == DONE:
            assert sub.result == index and sub.assignee not in kill
        else:
            # Only what no live participant can do is left, escalated (R8.5).
            assert not doable[index] and sub.status == ESCALATED
    if all(doable):
        assert core.status == COMPLETED
    else:
        assert core.status == INPUT_REQUIRED and view.status == INPUT_REQUIRED
    killed_work = any(a in kill for a in caps)
    assert core.reassignments >= 0 and (killed_work or core.reassignments == 0)


def test_assignment_follows_capability_and_load_longest_first() -> None:
    plan = make_plan([1.0, 4.0, 2.0, 3.0], [frozenset({"a"})] * 3 + [frozenset({"b"})])
    core = Coordinator(plan, "boss", 1, now=0.0, config=SwarmConfig(prefetch=0))
    core.join("x", {"a"}, 1, now=0.0, now_ms=NOW_MS)
    core.join("y", {"a", "b"}, 1, now=0.0, now_ms=NOW_MS, external=5)
    orders = core.tick(0.0)
    # The longest "a" task goes to x (y is loaded elsewhere); y alone can do the "b" one.
    assert orders.assign == {"x": [(1, 1)], "y": [(3, 1)]}
    assert core.result("x", 1, 1, "r1") is Verdict.ACCEPTED
    assert core.result("x", 1, 1, "again") is Verdict.DUPLICATE
    assert core.result("z", 0, 1, "stranger") is Verdict.REFUSED  # not the assignee
    assert core.tick(1.0).assign == {"x": [(2, 1)]}


def test_a_failing_subtask_is_retried_then_escalated() -> None:
    plan = make_plan([1.0], [frozenset({"a"})])
    core = Coordinator(plan, "boss", 1, now=0.0, config=SwarmConfig(max_attempts=2))
    core.join("x", {"a"}, 1, now=0.0, now_ms=NOW_MS)
    assert core.tick(0.0).assign == {"x": [(0, 1)]}
    core.failure("x", 0, 1, "HANDLER_FAILED")
    assert core.tick(0.5).assign == {"x": [(0, 2)]}
    core.failure("x", 0, 2, "HANDLER_FAILED")
    orders = core.tick(1.0)
    assert orders.assign == {} and core.status == INPUT_REQUIRED
    core.join("y", {"a"}, 1, now=1.0, now_ms=NOW_MS)  # a capable newcomer: tried again
    assert core.tick(1.5).assign == {"y": [(0, 3)]}


def test_leases_expire_and_a_rejoin_is_welcome() -> None:
    plan = make_plan([1.0, 1.0], [frozenset()] * 2)
    core = Coordinator(plan, "boss", 1, now=0.0)
    core.join("x", set(), 1, now=0.0, now_ms=NOW_MS)
    assert core.tick(0.0).assign == {"x": [(0, 1), (1, 1)]}  # equal costs: plan order
    assert core.tick(3.5).assign == {}  # x's lease (3 s) ran out: its work is pending
    assert core.reassignments == 2 and not core.beat("x", now=3.6, now_ms=NOW_MS)
    core.join("x", set(), 1, now=3.6, now_ms=NOW_MS)
    assert core.tick(3.7).assign == {"x": [(0, 2), (1, 2)]}
    taken = core.take_record()
    assert taken is not None and taken[1].dead == ["x"]
    view = fold(2, [("k", taken[1])])
    assert view.members["x"].alive and view.subtasks[0].attempt == 2  # dead, then back


def test_a_new_coordinator_resumes_from_the_fold() -> None:
    plan = make_plan([1.0] * 4, [frozenset()] * 4)
    core = Coordinator(plan, "boss", 1, now=0.0)
    for agent in ("x", "y"):
        core.join(agent, set(), 1, now=0.0, now_ms=NOW_MS)
    core.tick(0.0)
    core.result("x", 0, 1, "r0")
    core.tick(0.5)
    journal = []
    while (taken := core.take_record()) is not None:
        journal.append((f"{log_key(1, 'boss')}/{taken[0]}", taken[1]))
    view = fold(4, journal)
    assert successors(view, "boss") == ["x", "y"]
    assert claim_after(0, 3.0) == 3.0 and claim_after(2, 3.0) == 9.0
    heir = Coordinator(plan, "x", 2, now=10.0, view=view)
    assert heir.done == 1 and heir.results()[0] == "r0"
    # The work assigned before is still held (x and y may still be at it).
    assert heir.tick(10.0).assign == {}
    assert [s.status for s in heir.subs] == [DONE, ASSIGNED, ASSIGNED, ASSIGNED]
    heir.absorb(Record(done=[(3, 1, "y", "r3")], dead=["y"]))
    assert heir.subs[3].status == DONE and "y" not in heir.members()


def test_a_participant_runs_each_subtask_once_and_keeps_results_until_accepted() -> None:
    part = Participation("x", capacity=1)
    part.assigned([(0, 1), (1, 1), (0, 2)])  # a reassignment of what it has queued
    assert part.next() == (0, 1) and part.next() is None  # capacity 1
    part.assigned([(0, 3)])  # running: not again
    part.succeeded(0, 1, "r")
    assert part.next() == (1, 1)
    part.assigned([(0, 4)])  # finished, its result kept: not again
    assert part.load == 1
    plan = make_plan([1.0, 1.0], [frozenset()] * 2)
    view = fold(2, [("k", Record(done=[(0, 1, "x", "r")]))])
    part.accepted(view)
    assert part.results == {} and view.subtasks[0].status == DONE
    assert part.finished == 1 and plan.ids == ("t0", "t1")


def test_a_large_record_is_split_into_registers_and_folds_the_same() -> None:
    plan = make_plan([1.0] * 40, [frozenset()] * 40, agg="list")
    big = "x" * 5000
    record = Record(
        joined=[(W, (), 1)],
        assigned=[(i, W, 1) for i in range(40)],
        done=[(i, 1, W, big) for i in range(40)],
        leases={W: NOW_MS},
        status=COMPLETED,
        outcome=[big] * 40,
    )
    parts = record.split()
    assert len(parts) > 3
    assert all(len(dumps(p.to_json())) <= 48 * 1024 for p in parts)
    assert not parts[-1].has_outcome and parts[-1].status == COMPLETED  # too large: left out
    keys = [f"{log_key(1, BOSS)}/{1:010d}" + ("" if n == 0 else f".{n:04d}")
            for n in range(len(parts))]  # fmt: skip
    value = {
        "plan": dict(plan.chunks()),
        "log": {
            log_key(1, BOSS): {
                k.split("/")[1]: dumps(p.to_json()) for k, p in zip(keys, parts, strict=True)
            }
        },
    }
    reader = DocReader()
    reader.read_untrusted(signed(value))
    assert reader.view is not None and reader.view.complete
    assert reader.view.results() == [big] * 40
    assert reader.view.outcome == [big] * 40  # computed by the reader
    assert record.split(10**9) == [record]
    with pytest.raises(LocalError):
        Record(done=[(0, 1, "w", "y" * 60_000)]).split()
