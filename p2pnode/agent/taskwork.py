"""An agent's side of tasks: the handlers it declares and the work it is given.

``@agent.on_proposal`` and ``@agent.on_task`` (p2pnode.agent.definition) fill the agent's
:class:`TaskHandlers`; the node hosting the agent calls them (and binds
``proposer``, through which ``agent.propose`` reaches the node). A task being
done is a :class:`Work`: its task and input, and a :class:`WorkChannel` to
report progress and ask the proposer for input. Nothing here does I/O
itself: the node's task service implements the channel.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, Protocol

from p2pnode.agent.task import (
    MAX_TEXT,
    Accept,
    Proposal,
    Reject,
    RejectReason,
    Selection,
    Task,
    TaskState,
)
from p2pnode.core.errors import ErrorCode, LocalError


def _local(message: str) -> LocalError:
    return LocalError(ErrorCode.INVALID_ARGUMENT, message)


class WorkChannel(Protocol):
    """How a running task talks to its proposer (implemented by the node's task service)."""

    async def progress(self, fraction: float | None, message: str) -> None: ...

    async def ask(self, question: str) -> Any: ...


class Work:
    """One task being done: what ``@agent.on_task`` receives.

    ``await work.progress(0.5, "halfway")`` reports progress (``working``);
    ``answer = await work.ask("which branch?")`` reports ``input-required`` and
    returns the input the proposer sends. The handler's return value (JSON data) is
    the result; a P2PError it raises fails the task with its code, anything else
    with ``HANDLER_FAILED``.
    """

    def __init__(
        self,
        task_id: str,
        task: Task,
        proposer: str,
        channel: WorkChannel,
        swarm: str | None = None,
    ) -> None:
        self.task_id = task_id
        self.task = task
        self.proposer = proposer
        self.swarm = swarm
        self._channel = channel

    @property
    def input(self) -> Any:
        return self.task.input

    async def progress(self, fraction: float | None = None, message: str = "") -> None:
        """Report progress. Raises LocalError(INVALID_ARGUMENT) for a bad fraction."""
        if fraction is not None and (isinstance(fraction, bool) or not 0 <= fraction <= 1):
            raise _local("progress is a fraction from 0 to 1")
        await self._channel.progress(fraction, message[:MAX_TEXT])

    async def ask(self, question: str) -> Any:
        """Ask the proposer for input and wait for it."""
        return await self._channel.ask(question[:MAX_TEXT])


class TaskThread(Protocol):
    """A task as its proposer holds it (the node's ``TaskHandle``)."""

    @property
    def task_id(self) -> str: ...

    @property
    def state(self) -> TaskState: ...

    @property
    def assignee(self) -> str | None: ...

    @property
    def progress(self) -> float | None: ...

    @property
    def message(self) -> str: ...

    async def result(self) -> Any: ...

    def updates(self) -> AsyncIterator[TaskState]: ...

    async def cancel(self, reason: str = "") -> None: ...

    async def send_input(self, value: Any) -> None: ...


class Proposer(Protocol):
    """What a hosted agent proposes through (bound by the node hosting it)."""

    async def propose(
        self,
        sender: str,
        target: str | Iterable[str],
        task: Task,
        *,
        deadline: float | None = None,
        capability: bool = False,
        selection: Selection = Selection.FIRST_ACCEPT,
        justification: str | None = None,
    ) -> TaskThread: ...


ProposalHandler = Callable[[Proposal], Any]
WorkHandler = Callable[[Work], Any]


class TaskHandlers:
    """An agent's task handlers (``agent.tasks``) and its binding to a hosting node.

    ``consider`` answers a proposal: ``Reject(INCAPABLE)`` when the agent does not
    offer a required capability, ``Reject(BUSY)`` at capacity, else what the proposal
    handler returns (``Accept``/``Reject``, or a bool; no handler: accept).
    ``perform`` runs the work handler.
    """

    def __init__(self, agent_id: str) -> None:
        self.agent_id = agent_id
        self.proposal: ProposalHandler | None = None
        self.work: WorkHandler | None = None
        #: Tasks run at once; proposals beyond it are rejected as BUSY.
        self.capacity = 1
        #: Set by the node hosting the agent (None: not hosted by a trio node).
        self.proposer: Proposer | None = None

    @property
    def declared(self) -> bool:
        """Does the agent take tasks at all?"""
        return self.work is not None

    def set_proposal(self, handler: ProposalHandler) -> None:
        if self.proposal is not None:
            raise _local(f"{self.agent_id}: on_proposal is declared")
        self.proposal = handler

    def set_work(self, handler: WorkHandler, capacity: int) -> None:
        if self.work is not None:
            raise _local(f"{self.agent_id}: on_task is declared")
        if type(capacity) is not int or not 1 <= capacity <= 10_000:
            raise _local("capacity must be an integer from 1 to 10000")
        self.work = handler
        self.capacity = capacity

    async def consider(
        self, proposal: Proposal, offered: Iterable[str], load: int
    ) -> Accept | Reject:
        """The answer to ``proposal`` (see the class docstring); a failing handler
        rejects (its exception propagates to the caller, which logs it)."""
        if not self.declared:
            return Reject(RejectReason.UNSUPPORTED, f"{self.agent_id} takes no tasks")
        missing = sorted(set(proposal.task.capabilities) - set(offered))
        if missing:
            return Reject(RejectReason.INCAPABLE, f"does not offer {', '.join(missing)}")
        if proposal.swarm is None and load >= self.capacity:
            return Reject(RejectReason.BUSY, f"runs {load} of {self.capacity} tasks")
        if self.proposal is None:
            return Accept()
        answer = self.proposal(proposal)
        if inspect.isawaitable(answer):
            answer = await answer
        if answer is True or answer is None:
            return Accept()
        if answer is False:
            return Reject()
        if isinstance(answer, Accept | Reject):
            return answer
        raise _local(f"{self.agent_id}: on_proposal returned {type(answer).__name__}")

    async def perform(self, work: Work) -> Any:
        """Run the work handler; its result. Raises what it raises."""
        if self.work is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"{self.agent_id} takes no tasks")
        result = self.work(work)
        if inspect.isawaitable(result):
            result = await result
        return result


__all__ = [
    "ProposalHandler",
    "Proposer",
    "TaskHandlers",
    "TaskThread",
    "Work",
    "WorkChannel",
    "WorkHandler",
]
