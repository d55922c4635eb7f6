"""Task negotiation without a node: the payloads (Property 23) and the two sides' state
machines (p2pnode.agent.task, p2pnode.services.tasks.negotiation)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.agent.task import (
    TERMINAL_STATES,
    Accepted,
    Control,
    Instruction,
    Rejected,
    RejectReason,
    Selection,
    SwarmInvite,
    Task,
    TaskError,
    TaskState,
    Update,
    parse_proposal_untrusted,
    parse_thread_untrusted,
    proposal_payload,
)
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.services.tasks.negotiation import (
    ExecState,
    ExecTimer,
    ExecutorThread,
    ProposerThread,
    TaskConfig,
)

ids = st.from_regex(r"[a-z][a-z0-9.-]{0,15}", fullmatch=True)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
tasks = st.builds(
    Task,
    description=st.text(max_size=200),
    capabilities=st.lists(ids, max_size=4).map(tuple),
    complexity=st.floats(0, 1e6, allow_nan=False) | st.integers(0, 10**6),
    input=json_values,
)
ms = st.integers(1, 2**62)


# -- Property 23: what the messages carry -------------------------------------------------------


@given(tasks, ids, ms, st.none() | st.builds(SwarmInvite, ids, ids, st.floats(0.01, 3600)))
def test_p23_a_proposal_carries_description_capabilities_complexity_and_deadline(
    task: Task, task_id: str, deadline: int, swarm: SwarmInvite | None
) -> None:
    payload = proposal_payload(task_id, task, deadline, swarm)
    body = payload["task"]
    assert {"description", "capabilities", "complexity"} <= set(body)
    assert payload["deadline"] == deadline
    parsed = parse_proposal_untrusted(payload, "boss")
    assert (parsed.task, parsed.task_id, parsed.deadline_ms, parsed.swarm) == (
        task,
        task_id,
        deadline,
        swarm,
    )
    assert parsed.proposer == "boss"


@given(ids, ids, ms, st.integers(0, 2**31 - 1), st.integers(1, 2**31 - 1))
def test_p23_an_acceptance_names_the_agent_and_its_estimated_completion(
    task_id: str, agent: str, when: int, load: int, capacity: int
) -> None:
    accepted = Accepted(task_id, agent, when, load, capacity)
    payload = accepted.to_payload()
    assert payload["agentId"] == agent and payload["estimatedCompletion"] == when
    assert Accepted.from_payload_untrusted(payload) == accepted


@given(
    ids,
    ids,
    st.sampled_from(list(RejectReason)) | ids,
    st.text(max_size=50),
    st.none() | ids,
)
def test_p23_a_rejection_carries_a_reason_code_and_maybe_an_alternative(
    task_id: str, agent: str, reason: str, message: str, alternative: str | None
) -> None:
    rejected = Rejected(task_id, agent, str(reason), message, alternative)
    payload = rejected.to_payload()
    assert payload["reason"] == reason
    assert payload.get("alternative") == alternative
    assert Rejected.from_payload_untrusted(payload) == rejected


@given(
    ids,
    st.sampled_from(
        [TaskState.WORKING, TaskState.INPUT_REQUIRED, TaskState.COMPLETED, TaskState.CANCELED]
    ),
    st.none() | st.floats(0, 1),
    json_values,
)
def test_thread_messages_round_trip(
    task_id: str, state: TaskState, progress: float | None, result: Any
) -> None:
    update = Update(task_id, state, progress, "m", result if state is TaskState.COMPLETED else None)
    assert parse_thread_untrusted(update.to_payload()) == update
    failed = Update(task_id, TaskState.FAILED, error={"code": "HANDLER_FAILED", "message": "x"})
    assert parse_thread_untrusted(failed.to_payload()) == failed
    for control in Control:
        value = result if control is Control.INPUT else None
        instruction = Instruction(task_id, control, value, "why")
        assert parse_thread_untrusted(instruction.to_payload()) == instruction


junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=10)
    | st.binary(max_size=5),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(
        st.sampled_from(
            ["taskId", "task", "deadline", "swarm", "agentId", "reason", "state", "control",
             "description", "capabilities", "complexity", "input", "estimatedCompletion",
             "load", "capacity", "task", "progress", "error", "x"]
        ),
        inner,
        max_size=6,
    ),
    max_leaves=12,
)  # fmt: skip


@given(junk)
def test_parsers_raise_only_task_errors(payload: Any) -> None:
    parsers = [
        lambda p: parse_proposal_untrusted(p, "x"),
        Accepted.from_payload_untrusted,
        Rejected.from_payload_untrusted,
        parse_thread_untrusted,
    ]
    for parse in parsers:
        try:
            parse(payload)
        except TaskError as exc:
            assert exc.code is ErrorCode.MALFORMED_MESSAGE


def test_bad_tasks_are_refused_with_the_field_named() -> None:
    with pytest.raises(LocalError, match="complexity"):
        Task("x", (), -1)
    with pytest.raises(LocalError, match="capabilities"):
        Task("x", ("not an id",))
    with pytest.raises(LocalError, match="input"):
        Task("x", input=float("nan"))
    with pytest.raises(TaskError, match="unknown"):
        Task.from_dict_untrusted({"description": "", "capabilities": [], "complexity": 1, "y": 1})


# -- the proposer's state machine -----------------------------------------------------------------

AGENTS = ("a", "b", "c", "d")
events = st.lists(
    st.tuples(
        st.sampled_from(["accept", "reject", "tick"]),
        st.sampled_from((*AGENTS, "stranger")),
        st.integers(1, 1000),  # estimated completion
        st.integers(0, 5),  # load
    ),
    max_size=12,
)


@settings(max_examples=300)
@given(st.sampled_from(list(Selection)), st.integers(1, 4), events)
def test_the_proposer_awards_one_acceptor_and_releases_the_others(
    selection: Selection, n: int, script: list[tuple[str, str, int, int]]
) -> None:
    targets = AGENTS[:n]
    thread = ProposerThread("t1", targets, deadline=10.0, selection=selection)
    awarded: list[str] = []
    released: list[str] = []
    at_award: dict[str, Accepted] = {}
    now = 0.0
    for kind, agent, estimate, load in script:
        before = thread.state
        if kind == "tick":
            now += 4.0
            decision = thread.handle_timer(now)
        elif kind == "accept":
            decision = thread.on_accept(Accepted("t1", agent, estimate, load, 2), now)
        else:
            decision = thread.on_reject(Rejected("t1", agent, "DECLINED"), now)
        if decision.award is not None:
            awarded.append(decision.award)
            at_award = dict(thread.accepts)
        released.extend(decision.release)
        if before in TERMINAL_STATES:
            assert thread.state is before  # terminal states stay
    assert len(awarded) <= 1
    assert set(thread.answered) <= set(targets)  # strangers are ignored
    if awarded:
        winner = awarded[0]
        assert thread.assignee == winner and winner in thread.accepts
        assert set(released) == set(thread.accepts) - {winner}  # every other acceptor
        if selection is Selection.FIRST_ACCEPT:
            assert winner == next(a for a in thread.answered if a in thread.accepts)
        elif selection is Selection.BEST_ESTIMATE:
            best = min(a.estimated_completion_ms for a in at_award.values())
            assert at_award[winner].estimated_completion_ms == best
        else:
            best_load = min(a.load / a.capacity for a in at_award.values())
            assert at_award[winner].load / at_award[winner].capacity == best_load
    elif thread.state is TaskState.REJECTED:
        assert set(thread.rejects) == set(targets)
    elif thread.state is TaskState.TIMED_OUT:
        assert now >= 10.0
        assert set(released) == set(thread.accepts)  # late acceptors are released
    else:
        assert thread.state is TaskState.SUBMITTED


def test_best_estimate_waits_for_every_answer_then_takes_the_earliest() -> None:
    thread = ProposerThread("t", ("a", "b", "c"), 10.0, Selection.BEST_ESTIMATE)
    assert thread.on_accept(Accepted("t", "a", 900, 0, 1), 1.0).award is None
    assert thread.on_accept(Accepted("t", "b", 300, 3, 1), 1.0).award is None
    decision = thread.on_reject(Rejected("t", "c", "BUSY"), 2.0)
    assert decision == ("b", ("a",))
    late = ProposerThread("t", ("a", "b"), 10.0, Selection.LOWEST_LOAD)
    late.on_accept(Accepted("t", "a", 900, 3, 4), 1.0)
    assert late.handle_timer(9.0).award is None  # not yet
    assert late.handle_timer(10.0).award == "a"  # the deadline: the best so far
    assert late.on_accept(Accepted("t", "b", 1, 0, 4), 11.0).release == ("b",)


def test_lowest_load_compares_load_per_capacity() -> None:
    thread = ProposerThread("t", ("a", "b"), 10.0, Selection.LOWEST_LOAD)
    thread.on_accept(Accepted("t", "a", 1, 1, 1), 0.0)
    assert thread.on_accept(Accepted("t", "b", 9, 3, 8), 0.0).award == "b"


def test_the_proposer_follows_the_assignee_and_fails_it_when_silent() -> None:
    config = TaskConfig(keepalive=2.0, silence_limit=3)
    thread = ProposerThread("t", ("a",), 10.0, config=config)
    thread.on_accept(Accepted("t", "a", 1, 0, 1), 1.0)
    assert thread.assignee == "a"
    assert not thread.on_update("b", Update("t", TaskState.COMPLETED), 2.0)  # not the assignee
    assert thread.on_update("a", Update("t", TaskState.INPUT_REQUIRED, message="?"), 2.0)
    thread.input_sent(3.0)
    assert thread.on_update("a", Update("t", TaskState.WORKING, 0.5), 4.0)
    assert thread.progress == 0.5 and thread.next_deadline() == 10.0
    thread.handle_timer(10.0)
    assert thread.state is TaskState.FAILED and thread.error is not None
    assert thread.error["code"] == ErrorCode.TIMEOUT
    assert not thread.on_update("a", Update("t", TaskState.COMPLETED), 11.0)  # after the end
    assert thread.next_deadline() == math.inf
    with pytest.raises(LocalError) as info:
        thread.cancel()
    assert info.value.code is ErrorCode.ILLEGAL_TRANSITION
    assert thread.state is TaskState.FAILED


def test_canceling_while_negotiating_releases_the_acceptors() -> None:
    thread = ProposerThread("t", ("a", "b", "c"), 10.0, Selection.BEST_ESTIMATE)
    thread.on_accept(Accepted("t", "a", 1, 0, 1), 0.0)
    thread.on_reject(Rejected("t", "b", "BUSY"), 0.0)
    assert thread.cancel() == ("a",)
    assert thread.state is TaskState.CANCELED


def test_targets_must_be_distinct() -> None:
    with pytest.raises(LocalError):
        ProposerThread("t", ("a", "a"), 1.0)
    with pytest.raises(LocalError):
        ProposerThread("t", (), 1.0)


# -- the executor's state machine -----------------------------------------------------------------


def test_the_executor_reserves_then_works_then_ends() -> None:
    config = TaskConfig(award_timeout=5.0, keepalive=2.0)
    thread = ExecutorThread("t", "boss", answer_by=10.0, config=config)
    assert thread.decided(True, 1.0)
    assert thread.next_deadline() == 6.0  # reserved: waiting for the award
    thread.award(2.0)
    assert thread.handle_timer(3.0) is ExecTimer.NOTHING
    assert thread.handle_timer(4.0) is ExecTimer.KEEPALIVE
    thread.asked(4.5)
    thread.answered(5.0)
    thread.finish(6.0)
    thread.finish(6.0)  # idempotent
    assert thread.state is ExecState.DONE and thread.next_deadline() == math.inf


def test_an_unawarded_reservation_expires_and_a_late_decision_does_not_count() -> None:
    thread = ExecutorThread("t", "boss", 10.0, TaskConfig(award_timeout=5.0))
    thread.decided(True, 1.0)
    assert thread.handle_timer(6.0) is ExecTimer.EXPIRED
    assert thread.state is ExecState.DONE
    late = ExecutorThread("t", "boss", 10.0)
    assert not late.decided(True, 11.0)
    assert late.state is ExecState.DONE


def test_illegal_executor_transitions_raise_and_change_nothing() -> None:
    thread = ExecutorThread("t", "boss", 10.0)
    for move in (thread.award, thread.asked, thread.answered):
        with pytest.raises(LocalError) as info:
            move(0.0)
        assert info.value.code is ErrorCode.ILLEGAL_TRANSITION
        assert thread.state is ExecState.CONSIDERING


def test_config_is_checked() -> None:
    with pytest.raises(LocalError):
        TaskConfig(keepalive=0)
    with pytest.raises(LocalError):
        TaskConfig(silence_limit=0)
