"""An honest takeover under the swarm document's rules (docs/protocol/tasks.md §4.6, §5):
terms that overlap in one epoch (a successor that had not yet read the first claim) each
journal their part; the swarm still completes once every result is in, readers take a
claim once the records that admit it arrive, a takeover coordinator journals the
completion a stopped term left out, and a kept result follows its sub-task's later
attempt."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.jsonutil import dumps
from p2pnode.services.swarms.coordinator import Coordinator, Participation, Verdict
from p2pnode.services.swarms.document import (
    COMPLETED,
    WORKING,
    Authored,
    CoordLease,
    DocReader,
    Record,
    fold_checked,
    log_key,
)
from tests.test_swarm_integrity import (
    HONEST,
    OPENER,
    OWNER,
    P1,
    P2,
    PLAN,
    W1,
    W2,
    N,
    document,
    read,
    rec,
    term,
)

JOINS = [[W1, ["sq"], 1], [W2, ["sq"], 1]]
FIRST = [[i, W1 if i % 2 == 0 else W2, 1] for i in range(N)]


def overlapping() -> list[tuple[str, str, str, str]]:
    """The opener dies with every sub-task assigned; w1 and w2 both claim epoch 2 (w2 had
    not read w1's claim). w1's term (sorting first) takes half the results and says
    ``completed`` once it absorbed the rest from w2's term, which sorts after it."""
    t1, a, b = term(1, OPENER), term(2, W1), term(2, W2)
    return [
        (t1, "0000000001", rec(j=JOINS, a=FIRST), OWNER),
        (a, "0000000001", rec(d=[[i, 1, FIRST[i][1], i * i] for i in range(0, N, 2)]), P1),
        (a, "0000000002", rec(s=COMPLETED), P1),
        (b, "0000000001", rec(d=[[i, 1, FIRST[i][1], i * i] for i in range(1, N, 2)]), P2),
    ]


def test_a_completion_from_an_overlapping_term_holds_until_every_result_is_in() -> None:
    view = read(overlapping()).view
    assert view is not None and view.complete
    assert view.status == COMPLETED and view.outcome == HONEST and view.breaches == {}
    assert sorted(view.terms[2]) == [W1, W2]
    # Without the other term's results the swarm is not complete, whatever was said.
    early = read(overlapping()[:3]).view
    assert early is not None and early.status == WORKING and early.done == N // 2


@settings(max_examples=40, deadline=None)
@given(st.permutations(range(4)))
def test_overlapping_terms_fold_the_same_in_any_arrival_order(order: list[int]) -> None:
    entries = overlapping()
    reader = DocReader()
    for count in range(1, 5):
        reader.read_untrusted(document([entries[i] for i in order[:count]], None))
    assert reader.view is not None and reader.view.status == COMPLETED
    assert reader.view.outcome == HONEST


def test_a_later_status_replaces_a_held_completion() -> None:
    t1 = term(1, OPENER)
    entries = [
        (t1, "0000000001", rec(j=JOINS, a=FIRST), OWNER),
        (t1, "0000000002", rec(s=COMPLETED), OWNER),
        (t1, "0000000003", rec(s="input-required"), OWNER),
        (t1, "0000000004", rec(d=[[i, 1, FIRST[i][1], i * i] for i in range(N)]), OWNER),
    ]
    view = read(entries).view
    assert view is not None and view.complete and view.status == "input-required"


def test_a_refused_claim_is_taken_once_the_records_admitting_it_arrive() -> None:
    claim = Authored(CoordLease(W2, 2, 0).to_json(), P2)
    t1 = term(1, OPENER)
    reader = DocReader()
    reader.read_untrusted(document([(t1, "0000000001", rec(a=FIRST[:1]), OWNER)], claim))
    assert reader.coord is None and reader.breaches  # w2 is no member yet
    reader.read_untrusted(document([(t1, "0000000002", rec(j=JOINS), OWNER)], claim))
    assert reader.coord == CoordLease(W2, 2, 0) and reader.breaches == {}


def test_a_takeover_journals_the_completion_a_stopped_term_left_out() -> None:
    t1 = term(1, OPENER)
    entries = [
        (f"{t1}/0000000001", Record.from_json_untrusted({"j": JOINS, "a": FIRST}, N), OWNER),
        (f"{t1}/0000000002", Record.from_json_untrusted(
            {"d": [[i, 1, FIRST[i][1], i * i] for i in range(N)]}, N), OWNER),
    ]  # fmt: skip
    view = fold_checked(N, OPENER, entries)
    assert view.complete and view.status == WORKING
    heir = Coordinator(PLAN, W2, 2, now=0.0, view=view)
    heir.tick(0.0)
    taken = heir.take_record()
    assert taken is not None and taken[1].status == COMPLETED
    entries.append((f"{log_key(2, W2)}/{taken[0]}", taken[1], P2))
    done = fold_checked(N, OPENER, entries)
    assert done.status == COMPLETED and done.breaches == {}


def test_a_kept_result_follows_the_later_attempt_assigned_to_it() -> None:
    part = Participation("w1", capacity=1)
    part.assigned([(0, 1)])
    assert part.next() == (0, 1)
    part.succeeded(0, 1, 0)
    # A new coordinator never counted attempt 1 (its term was refused) and assigns
    # attempt 3 to the same participant: the result is not run again, it is sent as 3.
    assert part.assigned([(0, 3)]) == [0]
    assert part.results == {0: (3, 0)} and part.next() is None
    assert part.assigned([(0, 2)]) == []  # never back to an earlier attempt
    core = Coordinator(PLAN, W2, 2, now=0.0)
    core.join(W1, {"sq"}, 1, now=0.0, now_ms=0)
    core.tick(0.0)
    index, attempt = next((i, s.attempt) for i, s in enumerate(core.subs) if s.assignee == W1)
    assert core.result(W1, index, attempt + 5, 0) is Verdict.REFUSED  # not its attempt
    assert core.result(W1, index, attempt, index * index) is Verdict.ACCEPTED


def test_results_of_a_term_admitted_late_count_for_the_coordinator() -> None:
    """A term's record that arrives before the records admitting it is refused, then
    admitted by the refold once they arrive; it is never a new record again. The
    coordinator still counts its results (it follows the fold, not only new records),
    so it journals the completion instead of waiting for results nobody sends again."""
    t1, late = term(1, OPENER), term(2, W1)
    opener = [
        (t1, "0000000001", rec(j=JOINS, a=FIRST), OWNER),
        (t1, "0000000002", rec(d=[[i, 1, FIRST[i][1], i * i] for i in range(0, N, 2)]), OWNER),
    ]
    odd = (late, "0000000001", rec(d=[[i, 1, FIRST[i][1], i * i] for i in range(1, N, 2)]), P1)
    reader = DocReader()
    reader.read_untrusted(document([odd], None))
    assert reader.view is not None and f"{late}/0000000001" in reader.view.breaches
    new = reader.read_untrusted(document([odd, *opener], None))
    assert [k for k, _ in new] == [f"{t1}/0000000001", f"{t1}/0000000002"]
    view = reader.view
    assert view is not None and view.complete and view.breaches == {}
    heir = Coordinator(PLAN, W2, 2, now=0.0, view=read(opener).view)
    for _key, record in new:
        heir.absorb(record)
    assert heir.done == N // 2  # the records alone leave the odd results out
    assert heir.follow(view) and heir.done == N and not heir.follow(view)
    heir.tick(0.0)
    taken = heir.take_record()
    assert taken is not None and taken[1].status == COMPLETED
    entries = [*opener, odd, (term(2, W2), taken[0], dumps(taken[1].to_json()), P2)]
    done = read(entries).view
    assert done is not None and done.status == COMPLETED and done.outcome == HONEST
    assert done.breaches == {}


def test_a_result_for_an_attempt_another_term_assigned_is_journaled_with_it() -> None:
    """Two terms of epoch 2: w1's (sorting first, coordinating on) and w2's, which
    assigned sub-task 5 to itself and stepped down. w2's result for that attempt is
    accepted by w1 once its fold shows it, and journaled with the assignment, so readers
    admit it although w2's record sorts after w1's."""
    t1, mine, other = term(1, OPENER), term(2, W1), term(2, W2)
    opener = [(t1, "0000000001", rec(j=JOINS), OWNER)]
    core = Coordinator(PLAN, W1, 2, now=0.0, view=read(opener).view)
    orders = core.tick(0.0)
    assert 5 not in {i for items in orders.assign.values() for i, _ in items}
    assert core.result(W2, 5, 1, 25) is Verdict.REFUSED  # no term assigned it yet
    first = core.take_record()
    assert first is not None
    theirs = (other, "0000000001", rec(a=[[5, W2, 1]]), P2)
    entries = [*opener, (mine, first[0], dumps(first[1].to_json()), P1), theirs]
    view = read(entries).view
    assert view is not None and view.subtasks[5].attempts == {(1, W2)}
    assert not core.follow(view)
    assert core.result(W1, 5, 1, -1) is Verdict.REFUSED  # not the assignee of that attempt
    assert core.result(W2, 5, 2, -1) is Verdict.REFUSED  # no such attempt
    assert core.result(W2, 5, 1, 25) is Verdict.ACCEPTED
    second = core.take_record()
    assert second is not None and second[1].assigned == [(5, W2, 1)]
    entries.append((mine, second[0], dumps(second[1].to_json()), P1))
    folded = read(entries).view
    assert folded is not None and folded.breaches == {}
    assert folded.subtasks[5].result == 25 and folded.subtasks[5].assignee == W2


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([W1, W2]), st.integers(0, N - 1), st.integers(1, 6)),
        min_size=1,
        max_size=30,
    ),
    st.randoms(use_true_random=False),
)
def test_p_the_fold_names_an_assignment_that_was_made(
    assignments: list[tuple[str, int, int]], rng: Any
) -> None:
    """However overlapping terms number their attempts and however their records sort,
    an assigned sub-task's (attempt, assignee) in the fold is one an admitted record
    made, its latest attempt: the participant it names works on (and reports) an
    attempt its coordinator can count."""
    t1 = term(1, OPENER)
    entries = [(t1, "0000000001", rec(j=JOINS), OWNER)]
    for seq, (agent, index, attempt) in enumerate(assignments, 1):
        writer = P1 if agent == W1 else P2
        entries.append((term(2, agent), f"{seq:010d}", rec(a=[[index, agent, attempt]]), writer))
    rng.shuffle(entries)
    view = read(entries).view
    assert view is not None and view.breaches == {}
    for index, sub in enumerate(view.subtasks):
        made = {(a, agent) for agent, i, a in assignments if i == index}
        assert sub.attempts == made
        if made:
            assert sub.status == "assigned" and (sub.attempt, sub.assignee) in made
            assert sub.attempt == max(a for a, _ in made)


def test_an_overlapping_term_cannot_refuse_a_claim_of_its_own_epoch() -> None:
    """w1 and w2 both claim epoch 2. w2 beats to itself, so w1 (whose term sorts first)
    journals it dead: that neither refuses w2's term nor its lease, since a claim is
    judged on the records of the earlier epochs. A member dead there may not claim,
    nor may one that epoch 2 journaled dead claim epoch 3."""
    t1, second = term(1, OPENER), term(2, W2)
    entries = _w2_killed_by_w1()
    reader = read(entries, Authored(CoordLease(W2, 2, 9).to_json(), P2))
    _holds_w2_term(reader)
    later = read(entries, Authored(CoordLease(W2, 3, 0).to_json(), P2))
    assert later.coord is None and later.breaches  # dead when epoch 3 would begin
    dead_before = [(t1, "0000000002", rec(x=[W2]), OWNER), *entries[1:3]]
    refused = read([entries[0], *dead_before]).view
    assert refused is not None and f"{second}/0000000001" in refused.breaches


def _w2_killed_by_w1() -> list[tuple[str, str, str, str]]:
    t1, first, second = term(1, OPENER), term(2, W1), term(2, W2)
    return [
        (t1, "0000000001", rec(j=JOINS, a=FIRST), OWNER),
        (first, "0000000001", rec(x=[W2]), P1),
        (second, "0000000001", rec(d=[[i, 1, FIRST[i][1], i * i] for i in range(N)]), P2),
        (second, "0000000002", rec(s=COMPLETED), P2),
    ]


def _holds_w2_term(reader: DocReader) -> None:
    view = reader.view
    assert view is not None and view.breaches == {} and reader.breaches == {}
    assert view.status == COMPLETED and view.outcome == HONEST
    assert reader.coord == CoordLease(W2, 2, 9)
    assert not view.members[W2].alive


@settings(max_examples=60, deadline=None)
@given(st.permutations(range(4)), st.integers(1, 4))
def test_p_a_claim_judged_on_earlier_epochs_holds_in_any_arrival_order(
    order: list[int], batches: int
) -> None:
    entries = _w2_killed_by_w1()
    claim = Authored(CoordLease(W2, 2, 9).to_json(), P2)
    reader = DocReader()
    for count in [*range(1, 4, max(1, 4 // batches)), 4]:
        reader.read_untrusted(document([entries[i] for i in order[:count]], claim))
    _holds_w2_term(reader)
