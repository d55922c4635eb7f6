"""The swarm document's rules (docs/protocol/tasks.md §4.6), folded from authored
registers: forged entries of a hostile peer are ignored wherever they sort and noted as
breaches, and any interleaving of honest and forged entries folds to the honest outcome."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.agent.task import Task
from p2pnode.core.identity import PeerId
from p2pnode.core.jsonutil import dumps
from p2pnode.services.swarms.coordinator import Coordinator, Verdict
from p2pnode.services.swarms.document import (
    COMPLETED,
    Authored,
    CoordLease,
    DocReader,
    Plan,
    SubTask,
    log_key,
    member_address,
)


def peer(n: int) -> str:
    return str(PeerId.from_public_key(bytes([n]) * 32))


OWNER, P1, P2, EVIL = peer(1), peer(2), peer(3), peer(9)
OPENER = member_address("boss", OWNER)
W1, W2 = member_address("w1", P1), member_address("w2", P2)
X = member_address("x", EVIL)
SQUAT = member_address("w1", EVIL)  # the worker's agent id on the hostile peer
N = 6
HONEST = sum(i * i for i in range(N))

PLAN = Plan(
    "s1",
    "squares",
    tuple(SubTask(f"t{i}", Task(f"square {i}", ("sq",), 1.0, i)) for i in range(N)),
    "sum",
    2.0,
    "boss",
)


def term(epoch: int, member: str) -> str:
    return log_key(epoch, member)


def rec(**fields: Any) -> str:
    return dumps(fields)


def honest() -> list[tuple[str, str, str, str]]:
    """The honest journal: (term, seq, JSON text, writer). The opener (epoch 1) admits
    both workers and x (an invited member that turns hostile), assigns, accepts half;
    w2 takes over at epoch 2 and accepts the rest."""
    joins = [[W1, ["sq"], 1], [W2, ["sq"], 1], [X, ["sq"], 1]]
    first = [[i, W1 if i % 2 == 0 else W2, 1] for i in range(N)]
    t1, t2 = term(1, OPENER), term(2, W2)
    return [
        (t1, "0000000001", rec(j=joins, a=first), OWNER),
        (t1, "0000000002", rec(d=[[i, 1, first[i][1], i * i] for i in range(3)]), OWNER),
        (t2, "0000000001", rec(d=[[i, 1, first[i][1], i * i] for i in range(3, N)]), P2),
        (t2, "0000000002", rec(s=COMPLETED, o=HONEST), P2),
    ]


def forged() -> list[tuple[str, str, str, str]]:
    """One entry per attack (keys distinct from the honest ones: an overwrite of an honest
    register is a denial, not a forgery, and is out of this property)."""
    lies = rec(d=[[i, 1, X, -10_000] for i in range(N)], s=COMPLETED, o=-10_045)
    replay = honest()[1][2]
    return [
        ("0000000000:" + X, "0000000001", lies, EVIL),  # epoch 0 sorts first
        (term(1, X), "0000000001", lies, EVIL),  # epoch 1 is the opener's
        (term(1, OPENER), "0000000000", lies, EVIL),  # the opener's term, another writer
        (term(50, X), "0000000001", lies, EVIL),  # a far epoch
        (term(2, SQUAT), "0000000001", lies, EVIL),  # the squatted worker id
        (term(1, OPENER), "0000000001.9999", replay, EVIL),  # a replayed record
        # A member (x, admitted) reporting sub-tasks it was never assigned, at a term it
        # may claim (the next epoch): its results are not the assignees'.
        (term(3, X), "0000000001", rec(d=[[i, 1, X, -1] for i in range(N)]), EVIL),
        ("garbage", "1", lies, EVIL),
    ]


def document(entries: list[tuple[str, str, str, str]], coord: Authored | None) -> dict[str, Any]:
    log: dict[str, dict[str, Authored]] = {}
    for t, seq, text, writer in entries:
        log.setdefault(t, {})[seq] = Authored(text, writer)
    plan = {k: Authored(v, OWNER) for k, v in PLAN.chunks()}
    doc: dict[str, Any] = {"plan": plan, "log": log}
    if coord is not None:
        doc["coord"] = coord
    return doc


def read(entries: list[tuple[str, str, str, str]], coord: Authored | None = None) -> DocReader:
    reader = DocReader()
    reader.read_untrusted(document(entries, coord))
    return reader


def test_the_honest_journal_folds_to_the_honest_outcome() -> None:
    reader = read(honest())
    view = reader.view
    assert view is not None and view.status == COMPLETED and view.complete
    assert view.outcome == HONEST and view.breaches == {}
    assert sorted(view.terms) == [1, 2]


def test_each_forged_entry_is_ignored_and_noted() -> None:
    reader = read(honest() + forged())
    view = reader.view
    assert view is not None
    assert view.outcome == HONEST
    assert view.results() == [i * i for i in range(N)]
    assert all(s.assignee in (W1, W2) for s in view.subtasks)
    assert {b.key for b in view.breaches.values()} == {f"log/{t}/{s}" for t, s, _, _ in forged()}
    assert {b.writer for b in view.breaches.values()} == {EVIL}


def test_an_early_sorting_forged_completion_does_not_complete() -> None:
    lies = rec(d=[[i, 1, X, -1] for i in range(N)], s=COMPLETED, o=-30_045)
    reader = read([("0000000000:" + X, "0000000001", lies, EVIL), *honest()[:1]])
    view = reader.view
    assert view is not None and view.status != COMPLETED and view.done == 0
    assert view.outcome is None


def test_a_journaled_outcome_is_never_taken() -> None:
    entries = honest()
    entries[3] = (entries[3][0], entries[3][1], rec(s=COMPLETED, o=-1), P2)
    view = read(entries).view
    assert view is not None and view.outcome == HONEST


def test_forged_coordinator_claims_are_not_taken() -> None:
    good = Authored(CoordLease(W2, 2, 7).to_json(), P2)
    assert read(honest(), good).coord == CoordLease(W2, 2, 7)
    for lease, writer in [
        (CoordLease(X, 50, 0), EVIL),  # far epoch
        (CoordLease(W2, 3, 0), EVIL),  # a member's name, another peer's write
        (CoordLease(SQUAT, 3, 0), EVIL),  # the squatted id: not a member
    ]:
        reader = read(honest(), Authored(lease.to_json(), writer))
        assert reader.coord is None
        assert [b.rule for b in reader.breaches.values()], lease
    # A live member may claim the next epoch: the takeover rule.
    assert read(honest(), Authored(CoordLease(X, 3, 0).to_json(), EVIL)).coord is not None


def test_cancel_and_plan_only_from_the_opener() -> None:
    doc = document(honest()[:1], None)
    doc["cancel"] = Authored(True, EVIL)
    reader = DocReader()
    reader.read_untrusted(doc)
    assert not reader.canceled and "cancel" in reader.breaches
    doc["plan"] = {**doc["plan"], "meta": Authored(doc["plan"]["meta"].value, EVIL)}
    second = DocReader()
    second.read_untrusted(doc)
    assert second.plan is None and "plan" in second.breaches


def test_the_coordinator_takes_results_only_from_the_assignee() -> None:
    core = Coordinator(PLAN, OPENER, 1, now=0.0)
    core.join(W1, ["sq"], 1, now=0.0, now_ms=0)
    orders = core.tick(1.0)
    index, attempt = orders.assign[W1][0]
    assert core.result(SQUAT, index, attempt, -1) is Verdict.REFUSED
    assert core.result(X, index, attempt, -1) is Verdict.REFUSED
    assert core.result(W1, index, attempt + 1, -1) is Verdict.REFUSED  # not that attempt
    assert core.result(W1, index, attempt, index * index) is Verdict.ACCEPTED
    assert core.result(W1, index, attempt, 0) is Verdict.DUPLICATE
    assert core.refused == 3


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.booleans(), min_size=len(forged()), max_size=len(forged())),
    st.randoms(use_true_random=False),
    st.integers(1, 5),
)
def test_p_any_interleaving_of_honest_and_forged_entries_folds_to_the_honest_outcome(
    keep: list[bool], rng: Any, batches: int
) -> None:
    """Entries arrive in any order, in any batches (each read sees what arrived so far):
    the final fold is the honest one, and exactly the forged entries are breaches."""
    lies = [f for f, k in zip(forged(), keep, strict=True) if k]
    arrivals = honest() + lies
    rng.shuffle(arrivals)
    reader = DocReader()
    cuts = sorted(rng.sample(range(1, len(arrivals) + 1), min(batches, len(arrivals))))
    for cut in cuts:
        reader.read_untrusted(document(arrivals[:cut], None))
    if cuts[-1] != len(arrivals):
        reader.read_untrusted(document(arrivals, None))
    view = reader.view
    assert view is not None
    assert view.status == COMPLETED and view.outcome == HONEST
    assert view.results() == [i * i for i in range(N)]
    assert set(view.breaches) == {f"{t}/{s}" for t, s, _, _ in lies}
