"""The executor's side of task negotiation on a node: proposals to local agents.

A part of the :class:`~p2pnode.services.tasks.service.TaskService` (which intercepts the
envelopes and hands this part the ones for executors). Theory of operation
(docs/protocol/tasks.md §3.2):

* A proposal to a local agent that declares ``on_task`` gets one task in the
  service's nursery, driving an :class:`~p2pnode.services.tasks.negotiation.ExecutorThread`:
  the agent's ``on_proposal`` decision (its capabilities and load checked
  first), the ``task-accept`` (estimated completion, load, capacity) or
  ``task-reject`` (reason, alternative), then up to ``award_timeout`` seconds
  for the award.
* Awarded, the work handler runs in a cancel scope that a ``cancel`` from the
  proposer cancels; a keepalive task reports the state at least every
  ``keepalive`` seconds; ``Work.ask`` reports ``input-required`` and waits for
  the proposer's ``input``. The end is reported ``completed`` (the handler's
  return value), ``failed`` (a P2PError's code; anything else
  ``HANDLER_FAILED``) or ``canceled``.
* Each proposing peer is held to :meth:`TaskConfig.quota
  <p2pnode.services.tasks.negotiation.TaskConfig.quota>` (a rate, open threads and
  bytes; docs/protocol/tasks.md §3.6), and the node to ``max_threads``. A
  proposal beyond them is answered at once with ``task-reject`` ``BUSY`` and
  ``retryAfterMs``, without a task of its own; at most
  ``max_refusals_in_flight`` such answers are being sent to one peer, more are
  dropped and counted (a peer that outruns them is not reading), and the
  refusals are reported as a security event at most once a minute per peer.
  An execution gives its share of the quota back when it ends.
* Answers and reports go to ``proposer@peer`` of the peer the proposal came
  from, and only that peer's proposer instructs the thread: another owner of
  the proposer's agent id reaches none of it.
* An invitation to a swarm runs the swarm service's joiner as its work
  (:mod:`p2pnode.services.swarms.service`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from p2pnode.agent.task import (
    Accept,
    Accepted,
    Control,
    Instruction,
    Proposal,
    Reject,
    Rejected,
    RejectReason,
    TaskError,
    TaskState,
    Update,
    parse_proposal_untrusted,
)
from p2pnode.agent.taskwork import TaskHandlers, Work
from p2pnode.core.card import AgentCard, Origin, pinned_address
from p2pnode.core.envelope import Envelope, MessageType, envelope_size
from p2pnode.core.errors import ErrorCode, P2PError
from p2pnode.node.limits import ReportGate
from p2pnode.node.service import ServiceHost
from p2pnode.services.tasks.negotiation import ExecTimer, ExecutorThread, TaskConfig, TaskStats

logger = logging.getLogger("p2pnode.tasks")

#: What runs an accepted invitation to a swarm (the swarm service's): called with the
#: local agent, the proposal and the participation's Work; returns its result.
Joiner = Callable[[str, Proposal, Work], Awaitable[Any]]


class SwarmRunner(Protocol):
    """What runs accepted swarm invitations: the node's swarm service, when it runs one
    (the composition root, p2pnode.runtime, passes it to the task service)."""

    def joiner(self) -> Joiner | None:
        """The running swarm service's joiner; None when none runs (an invitation is
        then refused ``unsupported``)."""

    def statistics(self) -> dict[str, int]:
        """The swarm counters ``status`` shows with the tasks' (empty when none runs)."""


@dataclass(slots=True)
class Execution:
    """A task proposed to one of this node's agents."""

    agent: str
    thread: ExecutorThread
    #: The proposing peer (its quota) and the address answers go to (``proposer@peer``).
    peer: str = ""
    reply_to: str = ""
    #: Bytes of the proposal, charged to the peer's quota while the execution is open.
    size: int = 0
    event: trio.Event = field(default_factory=trio.Event)
    instruction: Control | None = None
    input: Any = None
    question: str = ""
    canceled: bool = False
    scope: trio.CancelScope | None = None

    def instruct(self, message: Instruction) -> None:
        """Take the proposer's instruction (from the thread's interceptor: never blocks)."""
        if message.control is Control.CANCEL:
            self.canceled = True
            if self.scope is not None:
                self.scope.cancel()
        elif message.control is Control.INPUT:
            self.input = message.input
        self.instruction = message.control
        self.event.set()

    async def next_instruction(self, deadline: float | None = None) -> Control | None:
        """The next instruction, or None when ``deadline`` (default: the thread's
        timer) came first."""
        with trio.move_on_at(self.thread.next_deadline() if deadline is None else deadline):
            await self.event.wait()
        self.event = trio.Event()
        control, self.instruction = self.instruction, None
        return control


class _Channel:
    """How the work of one execution reports to its proposer (a WorkChannel)."""

    def __init__(self, executor: TaskExecutor, execution: Execution) -> None:
        self._executor = executor
        self._execution = execution

    async def progress(self, fraction: float | None, message: str) -> None:
        update = Update("", TaskState.WORKING, fraction, message)
        await self._executor.report(self._execution, update)

    async def ask(self, question: str) -> Any:
        execution = self._execution
        execution.thread.asked(trio.current_time())
        execution.question = question
        await self._executor.report(
            execution, Update("", TaskState.INPUT_REQUIRED, message=question)
        )
        # Keepalives go on meanwhile (the keepalive task); a cancel ends the work's
        # scope, and with it this wait.
        while await execution.next_instruction(math.inf) is not Control.INPUT:
            pass
        execution.thread.answered(trio.current_time())
        await self._executor.report(execution, Update("", TaskState.WORKING))
        return execution.input


class TaskExecutor:
    """Proposals to this node's agents (see the module docstring). ``handlers`` are the
    bound agents' task handlers, shared with the service."""

    def __init__(
        self,
        host: ServiceHost,
        config: TaskConfig,
        stats: TaskStats,
        handlers: dict[str, TaskHandlers],
        swarms: SwarmRunner | None = None,
    ) -> None:
        self.host = host
        self.config = config
        self.stats = stats
        self._handlers = handlers
        self.executing: dict[tuple[str, str], Execution] = {}
        self._load: dict[str, int] = {}
        #: What each proposing peer holds here (rate, open threads, bytes).
        self.quota = config.quota()
        #: Refusals being sent, per peer (at most max_refusals_in_flight each).
        self._refusing: dict[str, int] = {}
        self._reports = ReportGate()
        #: Runs accepted swarm invitations, when the node runs a swarm service.
        self._swarms = swarms

    def load(self, agent_id: str) -> int:
        """Tasks local agent ``agent_id`` runs now."""
        return self._load.get(agent_id, 0)

    def _joiner(self) -> Joiner | None:
        return self._swarms.joiner() if self._swarms is not None else None

    def cancel_agent(self, agent_id: str) -> None:
        """Cancel what local agent ``agent_id`` runs (it was removed)."""
        for (agent, task_id), execution in list(self.executing.items()):
            if agent == agent_id:
                execution.instruct(Instruction(task_id, Control.CANCEL))

    def instruct(self, source: AgentCard, agent_id: str, message: Instruction) -> None:
        """An instruction on a thread: taken when it comes from the thread's proposer."""
        execution = self.executing.get((agent_id, message.task_id))
        if (
            execution is not None
            and execution.thread.proposer == source.id
            and execution.peer == str(source.peer_id)
        ):
            execution.instruct(message)

    async def on_proposal(
        self,
        nursery: trio.Nursery,
        source: AgentCard,
        agent_id: str,
        envelope: Envelope,
        room: bool,
    ) -> None:
        """A proposal for local agent ``agent_id`` from ``source`` (intercepted; never
        blocks but to hand it to the agent's handler when the agent takes no tasks).
        ``room``: the service has room for another thread."""
        handlers = self._handlers.get(agent_id)
        if handlers is None or not handlers.declared:
            await self.host.deliver(agent_id, envelope)  # the agent takes it its own way
            return
        self.stats.proposals_received += 1
        try:
            proposal = parse_proposal_untrusted(envelope.payload, source.id)
            if proposal.task_id != envelope.correlation_id:
                raise TaskError(ErrorCode.MALFORMED_MESSAGE, "taskId is not the correlationId")
        except TaskError as exc:
            self.stats.bad_messages += 1
            self.host.events.security(
                exc.code,
                f"bad proposal from {source.id}: {exc.message}",
                str(source.peer_id),
                envelope,
            )
            return
        key = (agent_id, proposal.task_id)
        if key in self.executing:
            return  # a duplicate
        now = trio.current_time()
        remaining = (proposal.deadline_ms - self.host.now_ms()) / 1000
        thread = ExecutorThread(
            proposal.task_id, source.id, now + remaining, self.config, since=now
        )
        local = source.origin is Origin.LOCAL
        reply_to = source.id if local else pinned_address(source.id, source.peer_id)
        execution = Execution(agent_id, thread, str(source.peer_id), reply_to)
        if not room:
            self._refuse(nursery, execution, "too many open tasks", self.config.busy_retry)
            return
        size = envelope_size(envelope)
        retry = self.quota.admit(execution.peer, size, now)
        if retry is not None:
            held, held_bytes = self.quota.held(execution.peer)
            why = f"too many proposals from peer {execution.peer} ({held} open, {held_bytes} B)"
            self._refuse(nursery, execution, why, retry)
            return
        execution.size = size
        self.executing[key] = execution
        nursery.start_soon(self._execute, handlers, proposal, execution)

    def _refuse(
        self, nursery: trio.Nursery, execution: Execution, why: str, retry: float
    ) -> None:
        """Answer a proposal the limits refuse: ``BUSY`` with ``retryAfterMs``, unless the
        peer already has ``max_refusals_in_flight`` refusals being sent (dropped then)."""
        self.stats.proposals_refused += 1
        peer, now = execution.peer, trio.current_time()
        if self._reports.due(peer, now):
            self.host.events.security(
                ErrorCode.BUSY, f"task proposals refused: {why}", peer
            )
        if self._refusing.get(peer, 0) >= self.config.max_refusals_in_flight:
            return
        self._refusing[peer] = self._refusing.get(peer, 0) + 1
        thread = execution.thread
        refusal = Rejected(
            thread.task_id, execution.agent, RejectReason.BUSY, why,
            retry_after_ms=math.ceil(retry * 1000),
        )  # fmt: skip
        nursery.start_soon(self._send_refusal, execution, refusal)

    async def _send_refusal(self, execution: Execution, refusal: Rejected) -> None:
        try:
            envelope = self.host.envelope(
                execution.agent,
                execution.reply_to,
                MessageType.TASK_REJECT,
                refusal.to_payload(),
                correlation_id=refusal.task_id,
            )
            await self.host.send(envelope)
        except P2PError as exc:
            logger.info("refusal of %s to %s not sent: %s", refusal.task_id, execution.peer, exc)
        finally:
            left = self._refusing[execution.peer] - 1
            if left:
                self._refusing[execution.peer] = left
            else:
                del self._refusing[execution.peer]

    async def _execute(
        self, handlers: TaskHandlers, proposal: Proposal, execution: Execution
    ) -> None:
        thread, agent = execution.thread, execution.agent
        try:
            try:
                offered = self.host.local_agent(agent).capability_ids()
                answer = await handlers.consider(proposal, offered, self.load(agent))
            except Exception as exc:
                logger.exception("%s: the proposal handler failed", agent)
                failed = f"the proposal handler failed: {type(exc).__name__}"
                answer = Reject(RejectReason.DECLINED, failed)
            if isinstance(answer, Accept) and proposal.swarm is not None and self._joiner() is None:
                answer = Reject(RejectReason.UNSUPPORTED, "this node runs no swarm service")
            if not thread.decided(isinstance(answer, Accept), trio.current_time()):
                answer = Reject(RejectReason.DEADLINE, "decided after the deadline")
            await self._answer(execution, answer, proposal)
            if isinstance(answer, Reject):
                return
            if await execution.next_instruction() is not Control.AWARD or execution.canceled:
                return  # released, canceled, or never awarded
            thread.award(trio.current_time())
            self._load[agent] = self.load(agent) + 1
            try:
                await self._work(handlers, proposal, execution)
            finally:
                self._load[agent] -= 1
        finally:
            thread.finish(trio.current_time())
            self.executing.pop((agent, thread.task_id), None)
            self.quota.release(execution.peer, execution.size)

    async def _answer(
        self, execution: Execution, answer: Accept | Reject, proposal: Proposal
    ) -> None:
        thread, agent = execution.thread, execution.agent
        if isinstance(answer, Accept):
            handlers = self._handlers.get(agent)
            seconds = answer.estimated_seconds
            if seconds is None:
                seconds = proposal.task.complexity
            accepted = Accepted(
                thread.task_id,
                agent,
                self.host.now_ms() + int(seconds * 1000),
                self.load(agent),
                handlers.capacity if handlers is not None else 1,
            )
            type_, payload = MessageType.TASK_ACCEPT, accepted.to_payload()
        else:
            rejected = Rejected(
                thread.task_id, agent, str(answer.reason), answer.message, answer.alternative
            )
            type_, payload = MessageType.TASK_REJECT, rejected.to_payload()
        try:
            envelope = self.host.envelope(
                agent, execution.reply_to, type_, payload, correlation_id=thread.task_id
            )
            await self.host.send(envelope)
        except P2PError as exc:
            logger.info("answer to %s of %s not sent: %s", thread.proposer, thread.task_id, exc)
            execution.instruct(Instruction(thread.task_id, Control.RELEASE))

    async def report(self, execution: Execution, update: Update) -> None:
        """Send ``update`` (its task id filled in) to the execution's proposer."""
        thread = execution.thread
        payload = Update(
            thread.task_id,
            update.state,
            update.progress,
            update.message,
            update.result,
            update.error,
        ).to_payload()
        thread.reported(trio.current_time())
        try:
            envelope = self.host.envelope(
                execution.agent,
                execution.reply_to,
                MessageType.STREAM_DATA,
                payload,
                correlation_id=thread.task_id,
            )
            await self.host.send(envelope)
        except P2PError as exc:
            logger.info("report on %s to %s not sent: %s", thread.task_id, thread.proposer, exc)

    async def _keepalive(self, execution: Execution) -> None:
        thread = execution.thread
        while True:
            await trio.sleep_until(thread.next_deadline())
            if thread.handle_timer(trio.current_time()) is ExecTimer.KEEPALIVE:
                state = TaskState(thread.state.value)
                question = execution.question if state is TaskState.INPUT_REQUIRED else ""
                await self.report(execution, Update("", state, message=question))

    async def _work(self, handlers: TaskHandlers, proposal: Proposal, execution: Execution) -> None:
        swarm = proposal.swarm
        channel = _Channel(self, execution)
        work = Work(
            proposal.task_id,
            proposal.task,
            proposal.proposer,
            channel,
            swarm.swarm if swarm else None,
        )
        await self.report(execution, Update("", TaskState.WORKING))
        final = Update("", TaskState.CANCELED)
        async with trio.open_nursery() as nursery:
            execution.scope = nursery.cancel_scope
            if execution.canceled:
                nursery.cancel_scope.cancel()
            nursery.start_soon(self._keepalive, execution)
            try:
                joiner = self._joiner() if swarm is not None else None
                if joiner is not None:
                    result = await joiner(execution.agent, proposal, work)
                else:
                    result = await handlers.perform(work)
                final = Update("", TaskState.COMPLETED, 1.0, result=result)
            except P2PError as exc:
                error = {"code": str(exc.code), "message": exc.message}
                final = Update("", TaskState.FAILED, error=error)
            except Exception as exc:
                logger.exception("%s: the task handler of %s failed", execution.agent, work.task_id)
                failed = f"the task handler failed: {type(exc).__name__}"
                error = {"code": ErrorCode.HANDLER_FAILED, "message": failed}
                final = Update("", TaskState.FAILED, error=error)
            nursery.cancel_scope.cancel()
        execution.scope = None
        if execution.canceled and final.state is not TaskState.COMPLETED:
            final = Update("", TaskState.CANCELED)
        # The end is reported even while the service closes, for at most a keepalive.
        with trio.CancelScope(shield=True), trio.move_on_after(self.config.keepalive):
            await self.report(execution, final)


__all__ = ["Execution", "Joiner", "TaskExecutor"]
