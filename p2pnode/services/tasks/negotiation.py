"""Contract Net negotiation, sans-IO: one task's thread on the proposer's side and on the
executor's side.

Theory of operation (docs/protocol/tasks.md §3; FIPA SC00029H, "Contract Net
Interaction Protocol"):

* :class:`ProposerThread` is one task as its proposer holds it. It is
  created ``submitted`` with its targets, a response deadline and a
  :class:`~p2pnode.agent.task.Selection`. Answers come in as
  :meth:`~ProposerThread.on_accept` / :meth:`~ProposerThread.on_reject`;
  each returns a :class:`Decision`: whom to award the task to, whom to
  release. ``first-accept`` awards the first acceptor at once; the other
  policies wait until every target answered or the deadline passed, then
  award the best acceptor (earliest estimated completion, or lowest load per
  capacity; ties go to the earlier answer). With no acceptor the thread ends
  ``rejected`` when every target rejected, else ``timed-out`` at the deadline
  (R7.4). An acceptor arriving after the award is released.
* A target is an agent id or ``agent@peer`` (that peer's agent, however many
  peers claim the id). The executor answers as its bare id; the driver says
  which peer the answer came from, and :meth:`ProposerThread.target_of`
  matches it to the target it answers: ``agent@peer`` first, else the bare id.
  Accepts, rejects, the assignee and releases are keyed by the target as the
  proposer named it.
* Once awarded the thread is ``working``. The executor's updates move it
  (``working``, ``input-required``, then ``completed``, ``failed`` or
  ``canceled``); only the assignee's updates count. An executor reports at
  least every ``keepalive`` seconds; after ``silence_limit`` such periods
  without a word the thread fails with ``TIMEOUT`` (its node is presumed dead).
* :class:`ExecutorThread` is the same task on the executor: ``considering``
  (its proposal handler runs), ``reserved`` (it accepted and waits up to
  ``award_timeout`` for the award or a release), ``working`` /
  ``input-required``, then ``done``.
* :meth:`TaskConfig.quota` bounds what one peer's proposals hold on the
  executor (docs/protocol/tasks.md §3.6): a rate, open threads and bytes per
  peer; a proposal beyond them is answered ``task-reject`` ``BUSY`` with
  ``retryAfterMs``.
* Both are state machines with explicit transition tables: an illegal
  transition raises LocalError(ILLEGAL_TRANSITION) and changes nothing.
  Time is the caller's ``now`` (seconds on any monotonic clock);
  ``next_deadline()`` and ``handle_timer(now)`` are the timers.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from p2pnode.agent.task import (
    TERMINAL_STATES,
    Accepted,
    Rejected,
    Selection,
    TaskState,
    Update,
)
from p2pnode.core.card import pinned_address
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.node.limits import PeerQuota


@dataclass(frozen=True, slots=True)
class TaskConfig:
    """Timers and bounds of the task service. Raises LocalError(CONFIG_ERROR)."""

    #: Seconds a proposal waits for answers unless the proposer says otherwise.
    deadline: float = 10.0
    #: Seconds an executor that accepted waits for the award before forgetting it.
    award_timeout: float = 10.0
    #: Seconds between an executor's reports on a task it is working on.
    keepalive: float = 10.0
    #: Keepalive periods of silence after which the proposer fails the task.
    silence_limit: int = 3
    #: Agents one call for proposals reaches at most.
    max_targets: int = 16
    #: Open threads (proposed and executing) at most; new ones beyond are refused.
    max_threads: int = 10_000
    #: Proposals one peer may make to this node's agents, per second (bursts below).
    proposal_rate: float = 50.0
    proposal_burst: int = 200
    #: Open executor threads (considering, reserved, working) for one peer at most.
    max_proposals_per_peer: int = 128
    #: Bytes of proposals (envelope sizes) held for one peer, and for all peers, at most.
    max_proposal_bytes_per_peer: int = 8 * 1024 * 1024
    max_proposal_bytes: int = 64 * 1024 * 1024
    #: Seconds a proposer refused for holding too much is told to wait (``retryAfterMs``).
    busy_retry: float = 1.0
    #: Refusals being sent to one peer at most; more are dropped (the peer is not reading).
    max_refusals_in_flight: int = 8

    def __post_init__(self) -> None:
        if min(self.deadline, self.award_timeout, self.keepalive, self.busy_retry) <= 0:
            raise LocalError(ErrorCode.CONFIG_ERROR, "task timers must be positive")
        if min(self.silence_limit, self.max_targets, self.max_threads,
               self.max_refusals_in_flight) < 1:  # fmt: skip
            raise LocalError(ErrorCode.CONFIG_ERROR, "task bounds must be positive")
        self.quota()  # checks the proposal limits

    def quota(self) -> PeerQuota:
        """A fresh :class:`~p2pnode.node.limits.PeerQuota` of the proposal limits.
        Raises LocalError(CONFIG_ERROR) when they are not positive."""
        return PeerQuota(
            self.proposal_rate,
            self.proposal_burst,
            self.max_proposals_per_peer,
            self.max_proposal_bytes_per_peer,
            max_total_bytes=self.max_proposal_bytes,
            busy_retry=self.busy_retry,
        )


class Decision(NamedTuple):
    """What the proposer must send after an event: an award, and releases."""

    award: str | None = None
    release: tuple[str, ...] = ()


_PROPOSER_MOVES: dict[TaskState, frozenset[TaskState]] = {
    TaskState.SUBMITTED: frozenset(
        {TaskState.WORKING, TaskState.REJECTED, TaskState.TIMED_OUT, TaskState.CANCELED}
    ),
    TaskState.WORKING: frozenset(
        {
            TaskState.WORKING,
            TaskState.INPUT_REQUIRED,
            TaskState.COMPLETED,
            TaskState.FAILED,
            TaskState.CANCELED,
        }
    ),
}
_PROPOSER_MOVES[TaskState.INPUT_REQUIRED] = _PROPOSER_MOVES[TaskState.WORKING]


def _illegal(what: str, state: enum.Enum, new: enum.Enum) -> LocalError:
    return LocalError(ErrorCode.ILLEGAL_TRANSITION, f"{what}: {state.value} -> {new.value}")


@dataclass(slots=True)
class ProposerThread:
    """One task on the proposer's side (see the module docstring)."""

    task_id: str
    targets: tuple[str, ...]
    deadline: float
    selection: Selection = Selection.FIRST_ACCEPT
    config: TaskConfig = field(default_factory=TaskConfig)
    state: TaskState = TaskState.SUBMITTED
    assignee: str | None = None
    accepts: dict[str, Accepted] = field(default_factory=dict)
    rejects: dict[str, Rejected] = field(default_factory=dict)
    #: Agents that answered, in the order they did.
    answered: list[str] = field(default_factory=list)
    progress: float | None = None
    message: str = ""
    result: Any = None
    error: dict[str, str] | None = None
    last_heard: float = 0.0

    def __post_init__(self) -> None:
        if not self.targets or len(set(self.targets)) != len(self.targets):
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "targets must be distinct and present")

    @property
    def settled(self) -> bool:
        """Past negotiation: awarded, or ended without an award."""
        return self.state is not TaskState.SUBMITTED

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_STATES

    def _move(self, new: TaskState) -> None:
        if new not in _PROPOSER_MOVES.get(self.state, frozenset()):
            raise _illegal(f"task {self.task_id}", self.state, new)
        self.state = new

    # -- answers --------------------------------------------------------------------------

    def target_of(self, agent: str, peer: str | None = None) -> str | None:
        """The target an answer from ``agent`` (a bare id) of ``peer`` is for: ``agent@peer``
        when the proposer named it so, else ``agent``; None when neither is a target.
        ``peer`` None (an answer the driver made up, such as a send failure): ``agent``
        as it is."""
        if peer is not None:
            pinned = pinned_address(agent, peer)
            if pinned in self.targets:
                return pinned
        return agent if agent in self.targets else None

    def on_accept(self, accept: Accepted, now: float, peer: str | None = None) -> Decision:
        """A target accepted (``peer``: whose agent answered, see :meth:`target_of`).
        Answers from non-targets and second answers are ignored."""
        agent = self.target_of(accept.agent, peer)
        if agent is None or agent in self.answered:
            return Decision()
        self.answered.append(agent)
        self.accepts[agent] = accept
        if self.settled:
            return Decision(release=(agent,))
        if self.selection is Selection.FIRST_ACCEPT:
            return self._award(agent, now)
        if len(self.answered) == len(self.targets):
            return self._choose(now)
        return Decision()

    def on_reject(self, reject: Rejected, now: float, peer: str | None = None) -> Decision:
        """A target rejected (also how a proposal that could not be sent is recorded)."""
        agent = self.target_of(reject.agent, peer)
        if agent is None or agent in self.answered:
            return Decision()
        self.answered.append(agent)
        self.rejects[agent] = reject
        if not self.settled and len(self.answered) == len(self.targets):
            return self._choose(now)
        return Decision()

    def _choose(self, now: float) -> Decision:
        if not self.accepts:
            everyone = len(self.rejects) == len(self.targets)
            self._move(TaskState.REJECTED if everyone else TaskState.TIMED_OUT)
            return Decision()
        order = {a: i for i, a in enumerate(self.answered)}
        if self.selection is Selection.LOWEST_LOAD:
            best = min(self.accepts.items(), key=lambda t: (t[1].load / t[1].capacity, order[t[0]]))
        else:
            best = min(
                self.accepts.items(), key=lambda t: (t[1].estimated_completion_ms, order[t[0]])
            )
        return self._award(best[0], now)

    def _award(self, agent: str, now: float) -> Decision:
        self._move(TaskState.WORKING)
        self.assignee = agent
        self.last_heard = now
        return Decision(agent, tuple(a for a in self.accepts if a != agent))

    # -- the executor's reports -----------------------------------------------------------

    def on_update(self, sender: str, update: Update, now: float, peer: str | None = None) -> bool:
        """The assignee (``sender`` of ``peer``, see :meth:`target_of`) reported; False
        (nothing changed) for anyone else, or for a state the thread cannot move to (a
        report after the end)."""
        if self.assignee is None or self.target_of(sender, peer) != self.assignee:
            return False
        if self.state not in _PROPOSER_MOVES or not self.settled:
            return False
        if update.state not in _PROPOSER_MOVES[self.state]:
            return False
        self._move(update.state)
        self.last_heard = now
        if update.progress is not None:
            self.progress = update.progress
        self.message = update.message or self.message
        if update.state is TaskState.COMPLETED:
            self.result = update.result
            self.progress = 1.0
        elif update.state is TaskState.FAILED:
            self.error = update.error or {"code": ErrorCode.INTERNAL, "message": "failed"}
        return True

    def input_sent(self, now: float) -> None:
        """The proposer answered an ``input-required``."""
        if self.state is not TaskState.INPUT_REQUIRED:
            raise _illegal(f"task {self.task_id}", self.state, TaskState.WORKING)
        self._move(TaskState.WORKING)
        self.last_heard = now

    def cancel(self) -> tuple[str, ...]:
        """Cancel: the agents to tell (the assignee, or every acceptor while
        negotiating). Raises LocalError(ILLEGAL_TRANSITION) once the task ended."""
        was_settled = self.settled
        self._move(TaskState.CANCELED)
        if was_settled:
            return (self.assignee,) if self.assignee is not None else ()
        return tuple(self.accepts)

    # -- timers ---------------------------------------------------------------------------

    def next_deadline(self) -> float:
        if self.state is TaskState.SUBMITTED:
            return self.deadline
        if self.done:
            return math.inf
        return self.last_heard + self.config.keepalive * self.config.silence_limit

    def handle_timer(self, now: float) -> Decision:
        """The response deadline (award the best acceptor, else time out) or the
        assignee's silence (fail with TIMEOUT)."""
        if now < self.next_deadline():
            return Decision()
        if self.state is TaskState.SUBMITTED:
            if self.accepts:
                return self._choose(now)
            self._move(TaskState.TIMED_OUT)
            return Decision()
        self._move(TaskState.FAILED)
        self.error = {
            "code": ErrorCode.TIMEOUT,
            "message": f"{self.assignee} sent nothing for "
            f"{self.config.keepalive * self.config.silence_limit:g} s",
        }
        return Decision()


class ExecState(enum.StrEnum):
    """One task on its executor's side."""

    CONSIDERING = "considering"
    RESERVED = "reserved"
    WORKING = "working"
    INPUT_REQUIRED = "input-required"
    DONE = "done"


_EXECUTOR_MOVES: dict[ExecState, frozenset[ExecState]] = {
    ExecState.CONSIDERING: frozenset({ExecState.RESERVED, ExecState.DONE}),
    ExecState.RESERVED: frozenset({ExecState.WORKING, ExecState.DONE}),
    ExecState.WORKING: frozenset({ExecState.INPUT_REQUIRED, ExecState.DONE}),
    ExecState.INPUT_REQUIRED: frozenset({ExecState.WORKING, ExecState.DONE}),
}


class ExecTimer(enum.Enum):
    """What :meth:`ExecutorThread.handle_timer` asks the driver to do."""

    NOTHING = enum.auto()
    #: The award never came: forget the reservation.
    EXPIRED = enum.auto()
    #: Report ``working`` (a keepalive).
    KEEPALIVE = enum.auto()


@dataclass(slots=True)
class ExecutorThread:
    """One task on the executor's side (see the module docstring). ``answer_by`` is the
    proposal's response deadline on the executor's clock."""

    task_id: str
    proposer: str
    answer_by: float
    config: TaskConfig = field(default_factory=TaskConfig)
    state: ExecState = ExecState.CONSIDERING
    #: When the state last changed, or a report was last sent.
    since: float = 0.0

    def _move(self, new: ExecState, now: float) -> None:
        if new not in _EXECUTOR_MOVES.get(self.state, frozenset()):
            raise _illegal(f"task {self.task_id}", self.state, new)
        self.state = new
        self.since = now

    def decided(self, accept: bool, now: float) -> bool:
        """The proposal handler answered; False when the answer comes too late to count
        (the thread is then done: the proposer has moved on)."""
        in_time = now <= self.answer_by
        self._move(ExecState.RESERVED if accept and in_time else ExecState.DONE, now)
        return in_time

    def award(self, now: float) -> None:
        self._move(ExecState.WORKING, now)

    def release(self, now: float) -> None:
        self._move(ExecState.DONE, now)

    def asked(self, now: float) -> None:
        self._move(ExecState.INPUT_REQUIRED, now)

    def answered(self, now: float) -> None:
        self._move(ExecState.WORKING, now)

    def reported(self, now: float) -> None:
        """A report went to the proposer: the keepalive timer restarts."""
        self.since = now

    def finish(self, now: float) -> None:
        """Done (completed, failed, canceled or released); idempotent."""
        if self.state is not ExecState.DONE:
            self._move(ExecState.DONE, now)

    def next_deadline(self) -> float:
        if self.state is ExecState.RESERVED:
            return self.since + self.config.award_timeout
        if self.state in (ExecState.WORKING, ExecState.INPUT_REQUIRED):
            return self.since + self.config.keepalive
        return math.inf

    def handle_timer(self, now: float) -> ExecTimer:
        if now < self.next_deadline():
            return ExecTimer.NOTHING
        if self.state is ExecState.RESERVED:
            self._move(ExecState.DONE, now)
            return ExecTimer.EXPIRED
        self.since = now
        return ExecTimer.KEEPALIVE


@dataclass(slots=True)
class TaskStats:
    """Counters of one node's task service (``status`` shows them)."""

    proposals_sent: int = 0
    proposals_accepted: int = 0
    proposals_rejected: int = 0
    proposals_timed_out: int = 0
    proposals_received: int = 0
    #: Proposals refused for the proposing peer's rate, open threads or bytes.
    proposals_refused: int = 0
    tasks_completed: int = 0
    tasks_failed: int = 0
    tasks_canceled: int = 0
    bad_messages: int = 0

    def to_dict(self) -> dict[str, int]:
        return {
            "proposalsSent": self.proposals_sent,
            "proposalsAccepted": self.proposals_accepted,
            "proposalsRejected": self.proposals_rejected,
            "proposalsTimedOut": self.proposals_timed_out,
            "proposalsReceived": self.proposals_received,
            "proposalsRefused": self.proposals_refused,
            "tasksCompleted": self.tasks_completed,
            "tasksFailed": self.tasks_failed,
            "tasksCanceled": self.tasks_canceled,
            "badMessages": self.bad_messages,
        }


__all__ = [
    "Decision",
    "ExecState",
    "ExecTimer",
    "ExecutorThread",
    "ProposerThread",
    "TaskConfig",
    "TaskStats",
]
