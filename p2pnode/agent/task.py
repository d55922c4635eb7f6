"""Tasks between agents: the data model of negotiation (seed R7), its payloads and the
handlers an agent declares for it.

Theory of operation (docs/protocol/tasks.md has the bytes):

* The steps are FIPA's Contract Net (SC00029H): a *call for proposals* is a
  ``task-proposal`` envelope carrying a :class:`Task` (description, required
  capabilities, estimated complexity, input) and a response deadline (R7.1);
  the receiver answers ``task-accept`` (its agent id, an estimated completion
  time, its load; R7.2) or ``task-reject`` (a reason code and an optional
  alternative agent; R7.3). The proposer *awards* the task to one acceptor and
  *releases* the others; the executor then reports ``working``,
  ``input-required``, ``completed`` (inform-done) or ``failed`` (failure).
  No answer by the deadline is ``PROPOSAL_TIMEOUT`` for the proposer (R7.4).
* Every envelope of one task, the proposal included, carries the task id as
  its ``correlationId``: one thread per task (R7.5, Property 24).
* Task states are A2A's (``submitted``, ``working``, ``input-required``,
  ``completed``, ``canceled``, ``failed``, ``rejected``) plus ``timed-out``
  for a proposal nobody answered in time.
* Payload parsers end in ``_untrusted`` and raise only :class:`TaskError`.

An agent declares ``@agent.on_proposal`` (decides: :class:`Accept` or
:class:`Reject`) and ``@agent.on_task`` (does the work): see
:mod:`p2pnode.agent.taskwork`.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass
from typing import Any

from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.jsonutil import is_json_value

MAX_DESCRIPTION = 4096
MAX_CAPABILITIES = 16
MAX_COMPLEXITY = 1e9
MAX_TEXT = 4096
#: The largest ``retryAfterMs`` a ``task-reject`` may carry (an hour).
MAX_RETRY_AFTER_MS = 3_600_000
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
#: Payload key of the messages of a task's thread (``stream-data`` envelopes).
TASK_MARKER = "task"


class TaskError(RemoteError):
    """A peer's task payload is malformed."""


class TaskState(enum.StrEnum):
    """A task's state as its proposer sees it: A2A's task states, plus ``timed-out``."""

    SUBMITTED = "submitted"
    WORKING = "working"
    INPUT_REQUIRED = "input-required"
    COMPLETED = "completed"
    CANCELED = "canceled"
    FAILED = "failed"
    REJECTED = "rejected"
    TIMED_OUT = "timed-out"


TERMINAL_STATES = frozenset(
    {
        TaskState.COMPLETED,
        TaskState.CANCELED,
        TaskState.FAILED,
        TaskState.REJECTED,
        TaskState.TIMED_OUT,
    }
)
#: The states an executor reports on a thread (``update`` messages).
REPORTED_STATES = frozenset(
    {
        TaskState.WORKING,
        TaskState.INPUT_REQUIRED,
        TaskState.COMPLETED,
        TaskState.FAILED,
        TaskState.CANCELED,
    }
)


class RejectReason(enum.StrEnum):
    """Why an agent rejects a proposal (the ``reason`` of ``task-reject``)."""

    #: At capacity: it runs as many tasks as it takes.
    BUSY = "BUSY"
    #: It does not offer a required capability.
    INCAPABLE = "INCAPABLE"
    #: Its proposal handler said no.
    DECLINED = "DECLINED"
    #: The deadline had passed when it decided.
    DEADLINE = "DEADLINE"
    #: It takes no tasks (no task handlers; or no swarm service for a swarm).
    UNSUPPORTED = "UNSUPPORTED"
    #: The proposal's payload was not a valid proposal.
    INVALID = "INVALID"


class Selection(enum.StrEnum):
    """How a call for proposals picks among the agents that accepted."""

    #: The first to accept, at once.
    FIRST_ACCEPT = "first-accept"
    #: The earliest estimated completion, once all answered or the deadline passed.
    BEST_ESTIMATE = "best-estimate"
    #: The lowest load per capacity, once all answered or the deadline passed.
    LOWEST_LOAD = "lowest-load"


class Control(enum.StrEnum):
    """What a proposer tells an executor on the thread."""

    AWARD = "award"
    RELEASE = "release"
    CANCEL = "cancel"
    INPUT = "input"


def _fail(message: str) -> TaskError:
    return TaskError(ErrorCode.MALFORMED_MESSAGE, message)


def _local(message: str) -> LocalError:
    return LocalError(ErrorCode.INVALID_ARGUMENT, message)


def valid_id(value: object) -> bool:
    """An agent, capability, task or swarm id: 1-128 of ``A-Z a-z 0-9 . _ : / -``."""
    return isinstance(value, str) and _ID.match(value) is not None


def _text(value: object, limit: int) -> bool:
    return isinstance(value, str) and len(value) <= limit


def _number(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value <= MAX_COMPLEXITY
    )


def _ms(value: object) -> bool:
    return type(value) is int and 0 < value < 2**63


@dataclass(frozen=True, slots=True)
class Task:
    """What is proposed: a description, the capabilities it needs, its estimated
    complexity (any non-negative unit the agents agree on; swarms read it as seconds
    of work) and its input (JSON data). Raises LocalError(INVALID_ARGUMENT)."""

    description: str
    capabilities: tuple[str, ...] = ()
    complexity: float = 1.0
    input: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "capabilities", tuple(self.capabilities))
        problem = _task_problem(self.to_dict())
        if problem is not None:
            raise _local(problem)

    def to_dict(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "capabilities": list(self.capabilities),
            "complexity": self.complexity,
            "input": self.input,
        }

    @classmethod
    def from_dict_untrusted(cls, data: object) -> Task:
        """Raises TaskError(MALFORMED_MESSAGE)."""
        if not isinstance(data, dict):
            raise _fail("task: must be a map")
        problem = _task_problem(data)
        if problem is not None:
            raise _fail(problem)
        return cls(
            data["description"],
            tuple(data["capabilities"]),
            data["complexity"],
            data.get("input"),
        )


def _task_problem(data: dict[str, Any]) -> str | None:
    if set(data) - {"description", "capabilities", "complexity", "input"}:
        return "task: unknown fields"
    if not _text(data.get("description"), MAX_DESCRIPTION):
        return f"task.description: a string of at most {MAX_DESCRIPTION} characters"
    caps = data.get("capabilities")
    if (
        not isinstance(caps, list | tuple)
        or len(caps) > MAX_CAPABILITIES
        or not all(valid_id(c) for c in caps)
    ):
        return f"task.capabilities: at most {MAX_CAPABILITIES} capability ids"
    if not _number(data.get("complexity")):
        return f"task.complexity: a number from 0 to {MAX_COMPLEXITY:g}"
    if not is_json_value(data.get("input")):
        return "task.input: must be JSON data"
    return None


@dataclass(frozen=True, slots=True)
class SwarmInvite:
    """What a proposal to join a swarm adds: the swarm, its document and its lease."""

    swarm: str
    doc: str
    lease: float

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.swarm, "doc": self.doc, "lease": self.lease}

    @classmethod
    def from_dict_untrusted(cls, data: object) -> SwarmInvite:
        if not isinstance(data, dict) or set(data) != {"id", "doc", "lease"}:
            raise _fail("swarm: must be {id, doc, lease}")
        lease = data["lease"]
        if not (valid_id(data["id"]) and valid_id(data["doc"])):
            raise _fail("swarm: bad id or doc")
        if not _number(lease) or not 0.01 <= lease <= 3600:
            raise _fail("swarm.lease: 0.01 to 3600 seconds")
        return cls(data["id"], data["doc"], float(lease))


@dataclass(frozen=True, slots=True)
class Proposal:
    """A proposal as its receiver sees it (``@agent.on_proposal`` gets one).

    ``proposer`` is the authenticated sending agent; ``deadline_ms`` the wall-clock
    time (ms) by which it wants an answer; ``swarm`` is set for an invitation to
    join a swarm (the tasks then come as its sub-tasks).
    """

    task_id: str
    task: Task
    proposer: str
    deadline_ms: int
    swarm: SwarmInvite | None = None


def proposal_payload(
    task_id: str, task: Task, deadline_ms: int, swarm: SwarmInvite | None = None
) -> dict[str, Any]:
    """The payload of a ``task-proposal``."""
    out: dict[str, Any] = {"taskId": task_id, "task": task.to_dict(), "deadline": deadline_ms}
    if swarm is not None:
        out["swarm"] = swarm.to_dict()
    return out


def parse_proposal_untrusted(payload: object, proposer: str) -> Proposal:
    """A ``task-proposal`` payload from ``proposer``. Raises TaskError."""
    if not isinstance(payload, dict) or not {"taskId", "task", "deadline"} <= set(payload):
        raise _fail("proposal: must hold taskId, task and deadline")
    if set(payload) - {"taskId", "task", "deadline", "swarm"}:
        raise _fail("proposal: unknown fields")
    if not valid_id(payload["taskId"]) or not _ms(payload["deadline"]):
        raise _fail("proposal: bad taskId or deadline")
    swarm = payload.get("swarm")
    return Proposal(
        payload["taskId"],
        Task.from_dict_untrusted(payload["task"]),
        proposer,
        payload["deadline"],
        SwarmInvite.from_dict_untrusted(swarm) if swarm is not None else None,
    )


@dataclass(frozen=True, slots=True)
class Accept:
    """An agent takes a proposed task (a proposal handler returns it).

    ``estimated_seconds``: how long it expects to take once awarded (default: the
    task's complexity, read as seconds)."""

    estimated_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.estimated_seconds is not None and not _number(self.estimated_seconds):
            raise _local("estimated_seconds must be a non-negative number")


@dataclass(frozen=True, slots=True)
class Reject:
    """An agent turns a proposed task down, with a reason code and optionally another
    agent to ask instead."""

    reason: str = RejectReason.DECLINED
    message: str = ""
    alternative: str | None = None

    def __post_init__(self) -> None:
        if not valid_id(self.reason) or len(self.reason) > 64:
            raise _local("reason must be a short code")
        if not _text(self.message, MAX_TEXT):
            raise _local(f"message: at most {MAX_TEXT} characters")
        if self.alternative is not None and not valid_id(self.alternative):
            raise _local("alternative must be an agent id")


@dataclass(frozen=True, slots=True)
class Accepted:
    """A ``task-accept`` payload: who accepts, when it expects to be done, its load."""

    task_id: str
    agent: str
    estimated_completion_ms: int
    load: int = 0
    capacity: int = 1

    def to_payload(self) -> dict[str, Any]:
        return {
            "taskId": self.task_id,
            "agentId": self.agent,
            "estimatedCompletion": self.estimated_completion_ms,
            "load": self.load,
            "capacity": self.capacity,
        }

    @classmethod
    def from_payload_untrusted(cls, payload: object) -> Accepted:
        keys = {"taskId", "agentId", "estimatedCompletion", "load", "capacity"}
        if not isinstance(payload, dict) or set(payload) != keys:
            raise _fail(f"task-accept: must be {sorted(keys)}")
        load, capacity = payload["load"], payload["capacity"]
        if (
            not valid_id(payload["taskId"])
            or not valid_id(payload["agentId"])
            or not _ms(payload["estimatedCompletion"])
            or type(load) is not int
            or type(capacity) is not int
            or not 0 <= load < 2**31
            or not 1 <= capacity < 2**31
        ):
            raise _fail("task-accept: bad field")
        return cls(
            payload["taskId"], payload["agentId"], payload["estimatedCompletion"], load, capacity
        )


@dataclass(frozen=True, slots=True)
class Rejected:
    """A ``task-reject`` payload: who rejects, why, whom to ask instead, and (for a
    ``BUSY`` refusal of the proposing peer) milliseconds to wait before proposing again."""

    task_id: str
    agent: str
    reason: str
    message: str = ""
    alternative: str | None = None
    retry_after_ms: int | None = None

    def to_payload(self) -> dict[str, Any]:
        out: dict[str, Any] = {"taskId": self.task_id, "agentId": self.agent}
        out["reason"] = self.reason
        if self.message:
            out["message"] = self.message
        if self.alternative is not None:
            out["alternative"] = self.alternative
        if self.retry_after_ms is not None:
            out["retryAfterMs"] = self.retry_after_ms
        return out

    @classmethod
    def from_payload_untrusted(cls, payload: object) -> Rejected:
        if not isinstance(payload, dict) or not {"taskId", "agentId", "reason"} <= set(payload):
            raise _fail("task-reject: must hold taskId, agentId and reason")
        if set(payload) - {"taskId", "agentId", "reason", "message", "alternative", "retryAfterMs"}:
            raise _fail("task-reject: unknown fields")
        alternative = payload.get("alternative")
        message = payload.get("message", "")
        retry = payload.get("retryAfterMs")
        if (
            not valid_id(payload["taskId"])
            or not valid_id(payload["agentId"])
            or not valid_id(payload["reason"])
            or len(payload["reason"]) > 64
            or not _text(message, MAX_TEXT)
            or (alternative is not None and not valid_id(alternative))
            or not (retry is None or (type(retry) is int and 0 <= retry <= MAX_RETRY_AFTER_MS))
        ):
            raise _fail("task-reject: bad field")
        return cls(
            payload["taskId"], payload["agentId"], payload["reason"], message, alternative, retry
        )


@dataclass(frozen=True, slots=True)
class Update:
    """An executor's report on a thread: its state and what goes with it.

    ``progress`` is a fraction (0..1) or None; ``result`` is set for ``completed``,
    ``error`` (``{"code", "message"}``) for ``failed``; ``message`` is free text
    (the question, for ``input-required``)."""

    task_id: str
    state: TaskState
    progress: float | None = None
    message: str = ""
    result: Any = None
    error: dict[str, str] | None = None

    def to_payload(self) -> dict[str, Any]:
        out: dict[str, Any] = {TASK_MARKER: self.task_id, "state": self.state.value}
        if self.progress is not None:
            out["progress"] = self.progress
        if self.message:
            out["message"] = self.message
        if self.state is TaskState.COMPLETED:
            out["result"] = self.result
        if self.error is not None:
            out["error"] = self.error
        return out


@dataclass(frozen=True, slots=True)
class Instruction:
    """A proposer's message to an executor on a thread (award, release, cancel, input)."""

    task_id: str
    control: Control
    input: Any = None
    reason: str = ""

    def to_payload(self) -> dict[str, Any]:
        out: dict[str, Any] = {TASK_MARKER: self.task_id, "control": self.control.value}
        if self.control is Control.INPUT:
            out["input"] = self.input
        if self.reason:
            out["reason"] = self.reason
        return out


def parse_thread_untrusted(payload: object) -> Update | Instruction:
    """A ``stream-data`` payload of a task thread. Raises TaskError."""
    if not isinstance(payload, dict) or not valid_id(payload.get(TASK_MARKER)):
        raise _fail("thread message: needs a task id")
    task_id = payload[TASK_MARKER]
    if "control" in payload:
        if set(payload) - {TASK_MARKER, "control", "input", "reason"}:
            raise _fail("instruction: unknown fields")
        try:
            control = Control(payload["control"])
        except ValueError:
            raise _fail("instruction: unknown control") from None
        reason = payload.get("reason", "")
        if not _text(reason, MAX_TEXT) or not is_json_value(payload.get("input")):
            raise _fail("instruction: bad reason or input")
        return Instruction(task_id, control, payload.get("input"), reason)
    if set(payload) - {TASK_MARKER, "state", "progress", "message", "result", "error"}:
        raise _fail("update: unknown fields")
    try:
        state = TaskState(str(payload.get("state")))
    except ValueError:
        raise _fail("update: unknown state") from None
    progress, message, error = payload.get("progress"), payload.get("message", ""), None
    if state not in REPORTED_STATES:
        raise _fail(f"update: {state} is not reported by an executor")
    if progress is not None and not (_number(progress) and progress <= 1):
        raise _fail("update.progress: a fraction from 0 to 1")
    if not _text(message, MAX_TEXT) or not is_json_value(payload.get("result")):
        raise _fail("update: bad message or result")
    if "error" in payload:
        error = payload["error"]
        if (
            not isinstance(error, dict)
            or set(error) != {"code", "message"}
            or not valid_id(error["code"])
            or not _text(error["message"], MAX_TEXT)
        ):
            raise _fail("update.error: must be {code, message}")
    return Update(task_id, state, progress, message, payload.get("result"), error)


__all__ = [
    "MAX_CAPABILITIES",
    "MAX_DESCRIPTION",
    "MAX_TEXT",
    "TASK_MARKER",
    "TERMINAL_STATES",
    "Accept",
    "Accepted",
    "Control",
    "Instruction",
    "Proposal",
    "Reject",
    "RejectReason",
    "Rejected",
    "Selection",
    "SwarmInvite",
    "Task",
    "TaskError",
    "TaskState",
    "Update",
    "parse_proposal_untrusted",
    "parse_thread_untrusted",
    "proposal_payload",
    "valid_id",
]
