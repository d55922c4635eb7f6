"""The task service: negotiation between agents (seed R7) on a running node.

The trio driver of :mod:`p2pnode.services.tasks.negotiation`, a protocol service on the
node's :class:`~p2pnode.node.service.ServiceHost`. Theory of operation
(docs/protocol/tasks.md):

* **Proposing.** :meth:`TaskService.propose` sends one ``task-proposal`` per
  target, each with the new task id as ``correlationId`` (Property 24),
  then waits until the :class:`~p2pnode.services.tasks.negotiation.ProposerThread`
  settles: it sends the award and returns a :class:`TaskHandle`, or raises
  ``TASK_REJECTED`` (every target rejected; the reasons and alternatives in
  the details) or ``PROPOSAL_TIMEOUT`` (R7.4). A capability as target is a
  call for proposals to the agents offering it (DHT, policy-filtered).
* **Answers and reports** (``task-accept``, ``task-reject`` and the thread's
  ``stream-data`` updates) are intercepted by type and by the ``task``
  payload marker, so they reach the thread at once, never waiting in the
  proposer agent's inbox (which may be busy awaiting the very task).
* **Executing.** A proposal to a local agent that declares ``on_task`` is
  answered by its ``on_proposal`` decision (one task per proposal, in the
  service's nursery): ``task-accept`` with the agent's load and capacity, or
  ``task-reject``. An award starts the work handler; it reports ``working``
  at least every ``keepalive`` seconds, ``input-required`` when it asks, and
  ends with ``completed``, ``failed`` or ``canceled``. A proposal to an agent
  that declares no task handler reaches its ordinary handler unchanged.
* Timers: one task sleeps until the earliest proposer deadline; each
  executing task keeps its own keepalive timer.
"""

from __future__ import annotations

import logging
import math
import random
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable
from typing import Any

import trio

from p2pnode.agent.definition import Agent
from p2pnode.agent.task import (
    TASK_MARKER,
    Accepted,
    Control,
    Instruction,
    Rejected,
    Selection,
    SwarmInvite,
    Task,
    TaskError,
    TaskState,
    parse_thread_untrusted,
    proposal_payload,
)
from p2pnode.agent.taskwork import TaskHandlers
from p2pnode.core.card import AgentCard, pinned_address, split_address
from p2pnode.core.envelope import Envelope, MessageType, Metadata
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.node.service import ServiceHost
from p2pnode.services.tasks.executor import SwarmRunner, TaskExecutor
from p2pnode.services.tasks.negotiation import (
    Decision,
    ProposerThread,
    TaskConfig,
    TaskStats,
)

logger = logging.getLogger("p2pnode.tasks")

#: Ended tasks remembered, so an answer arriving after the end is recognised.
_ENDED_KEPT = 4096
_ANSWERS = (MessageType.TASK_PROPOSAL, MessageType.TASK_ACCEPT, MessageType.TASK_REJECT)


class TaskHandle:
    """A proposed task, as its proposer holds it (returned by :meth:`TaskService.propose`).

    ``state``, ``assignee``, ``progress`` and ``message`` follow the executor's reports;
    ``await handle.result()`` waits for the end; ``async for state in handle.updates()``
    watches it; ``cancel()`` and ``send_input(value)`` act on it.
    """

    def __init__(self, service: TaskService, sender: str, thread: ProposerThread) -> None:
        self._service = service
        self.sender = sender
        self.thread = thread
        self._changed = trio.Event()

    @property
    def task_id(self) -> str:
        return self.thread.task_id

    @property
    def state(self) -> TaskState:
        return self.thread.state

    @property
    def assignee(self) -> str | None:
        return self.thread.assignee

    @property
    def progress(self) -> float | None:
        return self.thread.progress

    @property
    def message(self) -> str:
        return self.thread.message

    def acceptance(self, agent: str) -> Accepted | None:
        """The ``task-accept`` ``agent`` sent (named as proposed to: an id or
        ``agent@peer``); None if it did not accept."""
        return self.thread.accepts.get(agent)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_changed(self) -> None:
        """Return at the next change of the task's state or progress."""
        await self._changed.wait()

    async def result(self) -> Any:
        """The result once the task completed.

        Raises RemoteError with the executor's code when it failed (``TIMEOUT`` when it
        fell silent), LocalError(TASK_CANCELED) when it was canceled."""
        while not self.thread.done:
            await self._changed.wait()
        return self.outcome()

    def outcome(self) -> Any:
        """The result of a completed task (raises as :meth:`result`; LocalError
        (INVALID_ARGUMENT) while it runs)."""
        thread = self.thread
        if thread.state is TaskState.COMPLETED:
            return thread.result
        if thread.state is TaskState.CANCELED:
            raise LocalError(ErrorCode.TASK_CANCELED, f"task {self.task_id} was canceled")
        if thread.state is TaskState.FAILED:
            error = thread.error or {}
            code = error.get("code", ErrorCode.INTERNAL)
            raise RemoteError(
                ErrorCode(code) if code in ErrorCode.__members__ else ErrorCode.INTERNAL,
                str(error.get("message", "the task failed")),
                taskId=self.task_id,
                responder=thread.assignee,
                reported=code,
            )
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"task {self.task_id} is {thread.state}")

    async def updates(self) -> AsyncIterator[TaskState]:
        """The state after each change (progress counts), until and including the end."""
        while True:
            changed = self._changed
            yield self.thread.state
            if self.thread.done:
                return
            await changed.wait()

    async def cancel(self, reason: str = "") -> None:
        """Cancel the task: the executor is told and stops. Raises
        LocalError(ILLEGAL_TRANSITION) once it ended."""
        await self._service._cancel(self, reason)

    async def send_input(self, value: Any) -> None:
        """Answer the executor's ``input-required`` with ``value`` (JSON data). Raises
        LocalError(ILLEGAL_TRANSITION) when it asked for nothing."""
        await self._service._send_input(self, value)


class TaskService:
    """Task negotiation on one node (see the module docstring). While it runs it binds
    each :class:`~p2pnode.agent.definition.Agent` the node hosts (:meth:`bind`).
    ``swarms`` runs accepted swarm invitations (the composition root passes the node's
    swarm service; without it they are refused)."""

    def __init__(
        self,
        host: ServiceHost,
        config: TaskConfig | None = None,
        *,
        rng: random.Random | None = None,
        swarms: SwarmRunner | None = None,
    ) -> None:
        self.host = host
        self.config = config or TaskConfig()
        self.stats = TaskStats()
        self._rng = rng or random.SystemRandom()
        self._handlers: dict[str, TaskHandlers] = {}
        self._proposed: dict[str, TaskHandle] = {}
        #: Tasks that ended here, with their proposer: a late acceptor is released.
        self._ended: OrderedDict[str, str] = OrderedDict()
        self._nursery: trio.Nursery | None = None
        self._wake = trio.Event()
        #: The executor's side: proposals to this node's agents.
        self.executor = TaskExecutor(host, self.config, self.stats, self._handlers, swarms)
        self._swarms = swarms

    # -- lifecycle and agents ---------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled."""
        self.host.intercept_types(_ANSWERS, self._on_envelope)
        self.host.intercept_stream(TASK_MARKER, self._on_thread)
        unwatch = self.host.watch_agents(added=self.bind, removed=self.unbind)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._timer_loop)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            unwatch()
            self.host.intercept_types(_ANSWERS, None)
            self.host.intercept_stream(TASK_MARKER, None)

    def _running(self) -> trio.Nursery:
        if self._nursery is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "the task service is not running")
        return self._nursery

    def bind(self, agent: Agent) -> None:
        """Serve ``agent``'s task handlers, and let it propose (``agent.propose``)."""
        self._handlers[agent.id] = agent.tasks
        agent.tasks.proposer = self

    def unbind(self, agent_id: str) -> None:
        """Forget a local agent that was removed; its running tasks are canceled."""
        handlers = self._handlers.pop(agent_id, None)
        if handlers is not None and handlers.proposer is self:
            handlers.proposer = None
        self.executor.cancel_agent(agent_id)

    def handlers(self, agent_id: str) -> TaskHandlers | None:
        """The task handlers of bound local agent ``agent_id``."""
        return self._handlers.get(agent_id)

    def load(self, agent_id: str) -> int:
        """Tasks local agent ``agent_id`` runs now."""
        return self.executor.load(agent_id)

    def statistics(self) -> dict[str, int]:
        """The counters ``status`` shows, and the threads open now."""
        out = self.stats.to_dict()
        out["open"] = self._open()
        if self._swarms is not None:
            out.update(self._swarms.statistics())
        return out

    def _open(self) -> int:
        return len(self._proposed) + len(self.executor.executing)

    def _new_id(self) -> str:
        return f"task-{self._rng.getrandbits(64):016x}"

    # -- proposing --------------------------------------------------------------------------

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
        swarm: SwarmInvite | None = None,
    ) -> TaskHandle:
        """Propose ``task`` from local agent ``sender`` and return it once awarded.

        ``target``: an agent id; several (a call for proposals); or with ``capability``
        a capability id, proposed to the agents offering it (at most
        ``config.max_targets``). ``deadline``: seconds to answer (default
        ``config.deadline``). ``justification`` goes in the envelope's metadata
        (needed from L2/L3 to L0/L1, R11.2).

        Raises LocalError: PROPOSAL_TIMEOUT (no acceptor by the deadline),
        AGENT_NOT_FOUND, CAPABILITY_NOT_FOUND, BUSY (too many open threads), what
        sending to a single target raised (policy refusals); RemoteError(TASK_REJECTED)
        when every target rejected (``details["rejections"]``)."""
        self._running()
        source = self.host.local_agent(sender)
        seconds = self.config.deadline if deadline is None else deadline
        if not 0 < seconds <= 3600:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "deadline: 0 to 3600 seconds")
        meta = Metadata(escalation_justification=justification) if justification else None
        targets = await self._targets(source, target, capability, meta)
        if self._open() >= self.config.max_threads:
            raise LocalError(ErrorCode.BUSY, "too many open task threads")
        now = trio.current_time()
        thread = ProposerThread(self._new_id(), targets, now + seconds, selection, self.config)
        handle = TaskHandle(self, sender, thread)
        self._proposed[thread.task_id] = handle
        self._wake.set()
        payload = proposal_payload(
            thread.task_id, task, self.host.now_ms() + int(seconds * 1000), swarm
        )
        try:
            return await self._negotiate(handle, payload, meta)
        except BaseException:
            if not thread.settled:
                self._spawn_controls(handle, thread.cancel(), Control.RELEASE)
            self._forget(handle)
            raise

    async def _targets(
        self,
        source: AgentCard,
        target: str | Iterable[str],
        capability: bool,
        meta: Metadata | None,
    ) -> tuple[str, ...]:
        if isinstance(target, str) and not capability:
            return (_canonical(target),)
        if not isinstance(target, str):
            targets = tuple(dict.fromkeys(_canonical(t) for t in target))
            if not 0 < len(targets) <= self.config.max_targets:
                raise LocalError(
                    ErrorCode.INVALID_ARGUMENT, f"1 to {self.config.max_targets} targets"
                )
            return targets
        policy = self.host.policy
        cards = [
            card
            for card in await self.host.find(target)
            if card.id != source.id
            and policy.can_discover(source, card)
            and policy.check_message(source, card, MessageType.TASK_PROPOSAL, meta).allowed
        ]
        if not cards:
            raise LocalError(
                ErrorCode.CAPABILITY_NOT_FOUND,
                f"no agent that {source.id!r} may propose to offers {target!r}",
                capability=target,
            )
        return tuple(c.id for c in cards[: self.config.max_targets])

    async def _negotiate(
        self, handle: TaskHandle, payload: dict[str, Any], meta: Metadata | None
    ) -> TaskHandle:
        thread = handle.thread
        errors: list[P2PError] = []
        for target in thread.targets:
            envelope = self.host.envelope(
                handle.sender,
                target,
                MessageType.TASK_PROPOSAL,
                payload,
                correlation_id=thread.task_id,
                metadata=meta,
            )
            try:
                await self.host.send(envelope)
            except P2PError as exc:
                errors.append(exc)
                refused = Rejected(thread.task_id, target, str(exc.code), exc.message)
                self._apply(handle, thread.on_reject(refused, trio.current_time()))
            else:
                self.stats.proposals_sent += 1
        if len(errors) == len(thread.targets) and len(errors) == 1:
            raise errors[0]  # one target, not reached: what sending raised
        while not thread.settled:
            await handle.wait_changed()
        if thread.state is TaskState.WORKING:
            assert thread.assignee is not None
            try:
                await self._send_control(
                    handle.sender, thread.assignee, thread.task_id, Control.AWARD
                )
            except P2PError as exc:
                thread.state = TaskState.FAILED
                thread.error = {"code": exc.code, "message": f"the award was not sent: {exc}"}
                self._settled(handle)
            return handle
        self._forget(handle)
        if thread.state is TaskState.REJECTED:
            raise _rejected(thread)
        if thread.state is TaskState.CANCELED:
            raise LocalError(ErrorCode.TASK_CANCELED, f"task {thread.task_id} was canceled")
        raise LocalError(
            ErrorCode.PROPOSAL_TIMEOUT,
            f"no agent accepted task {thread.task_id} by its deadline",
            taskId=thread.task_id,
            unanswered=[t for t in thread.targets if t not in thread.answered],
        )

    def _apply(
        self, handle: TaskHandle, decision: Decision, before: TaskState | None = None
    ) -> None:
        """Perform the proposer's ``decision`` (releases; the award is sent by the caller
        of propose, who wakes now) and note a change."""
        if decision.release:
            self._spawn_controls(handle, decision.release, Control.RELEASE)
        handle._notify()
        self._wake.set()
        if before is TaskState.SUBMITTED and handle.state is TaskState.TIMED_OUT:
            self.stats.proposals_timed_out += sum(
                1 for t in handle.thread.targets if t not in handle.thread.answered
            )
        self._settled(handle)

    def _settled(self, handle: TaskHandle) -> None:
        """Count and forget a task that ended after its award."""
        thread = handle.thread
        if thread.assignee is None or not thread.done:
            return
        if not self._forget(handle):
            return
        if thread.state is TaskState.COMPLETED:
            self.stats.tasks_completed += 1
        elif thread.state is TaskState.FAILED:
            self.stats.tasks_failed += 1
        elif thread.state is TaskState.CANCELED:
            self.stats.tasks_canceled += 1
        handle._notify()

    def _forget(self, handle: TaskHandle) -> bool:
        """Stop following an ended task (remembering it a while); False if it was not
        followed."""
        if self._proposed.pop(handle.task_id, None) is None:
            return False
        self._ended[handle.task_id] = handle.sender
        while len(self._ended) > _ENDED_KEPT:
            self._ended.popitem(last=False)
        return True

    async def _cancel(self, handle: TaskHandle, reason: str) -> None:
        agents = handle.thread.cancel()
        self._settled(handle)
        self._forget(handle)
        handle._notify()
        for agent in agents:
            try:
                await self._send_control(
                    handle.sender, agent, handle.task_id, Control.CANCEL, reason=reason
                )
            except P2PError as exc:
                logger.info("cancel of %s to %s not sent: %s", handle.task_id, agent, exc)

    async def _send_input(self, handle: TaskHandle, value: Any) -> None:
        thread = handle.thread
        thread.input_sent(trio.current_time())
        handle._notify()
        assert thread.assignee is not None
        await self._send_control(
            handle.sender, thread.assignee, thread.task_id, Control.INPUT, value
        )

    async def _send_control(
        self,
        sender: str,
        agent: str,
        task_id: str,
        control: Control,
        value: Any = None,
        *,
        reason: str = "",
    ) -> None:
        payload = Instruction(task_id, control, value, reason).to_payload()
        envelope = self.host.envelope(
            sender, agent, MessageType.STREAM_DATA, payload, correlation_id=task_id
        )
        await self.host.send(envelope)

    def _spawn_controls(self, handle: TaskHandle, agents: Iterable[str], control: Control) -> None:
        nursery = self._nursery
        if nursery is None:
            return
        for agent in agents:
            nursery.start_soon(self._control_quietly, handle.sender, agent, handle.task_id, control)

    async def _control_quietly(
        self, sender: str, agent: str, task_id: str, control: Control
    ) -> None:
        try:
            await self._send_control(sender, agent, task_id, control)
        except P2PError as exc:
            logger.info("%s of %s to %s not sent: %s", control, task_id, agent, exc)

    async def _timer_loop(self) -> None:
        while True:
            deadline = min(
                (h.thread.next_deadline() for h in self._proposed.values()), default=math.inf
            )
            with trio.move_on_at(deadline):
                await self._wake.wait()
            self._wake = trio.Event()
            now = trio.current_time()
            for handle in list(self._proposed.values()):
                thread = handle.thread
                if thread.next_deadline() <= now:
                    before = thread.state
                    self._apply(handle, thread.handle_timer(now), before)

    # -- inbound ----------------------------------------------------------------------------

    def _bad(self, source: AgentCard, envelope: Envelope, exc: P2PError) -> None:
        self.stats.bad_messages += 1
        self.host.events.security(
            exc.code,
            f"bad task message from {source.id}: {exc.message}",
            str(source.peer_id),
            envelope,
        )

    async def _on_envelope(self, source: AgentCard, agent_id: str, envelope: Envelope) -> None:
        if envelope.type is MessageType.TASK_PROPOSAL:
            room = self._open() < self.config.max_threads
            await self.executor.on_proposal(self._running(), source, agent_id, envelope, room)
            return
        task_id = envelope.correlation_id or ""
        handle = self._proposed.get(task_id)
        if handle is None or handle.sender != agent_id:
            if self._ended.get(task_id) == agent_id:
                if envelope.type is MessageType.TASK_ACCEPT:  # too late: released
                    nursery = self._running()
                    nursery.start_soon(
                        self._control_quietly, agent_id, source.id, task_id, Control.RELEASE
                    )
                return
            await self.host.deliver(agent_id, envelope)  # not a thread of ours: the agent's
            return
        thread = handle.thread
        try:
            answer: Accepted | Rejected
            if envelope.type is MessageType.TASK_ACCEPT:
                answer = Accepted.from_payload_untrusted(envelope.payload)
            else:
                answer = Rejected.from_payload_untrusted(envelope.payload)
            if answer.agent != source.id or answer.task_id != thread.task_id:
                raise TaskError(ErrorCode.SENDER_MISMATCH, "answer for another agent or task")
        except TaskError as exc:
            self._bad(source, envelope, exc)
            return
        peer = str(source.peer_id)
        target = thread.target_of(answer.agent, peer)
        if target is None or target in thread.answered:
            return
        now, before = trio.current_time(), thread.state
        if isinstance(answer, Accepted):
            self.stats.proposals_accepted += 1
            self._apply(handle, thread.on_accept(answer, now, peer), before)
        else:
            self.stats.proposals_rejected += 1
            self._apply(handle, thread.on_reject(answer, now, peer), before)

    async def _on_thread(self, source: AgentCard, agent_id: str, envelope: Envelope) -> None:
        try:
            message = parse_thread_untrusted(envelope.payload)
            if envelope.correlation_id != message.task_id:
                raise TaskError(ErrorCode.MALFORMED_MESSAGE, "thread message out of its thread")
        except TaskError as exc:
            self._bad(source, envelope, exc)
            return
        if isinstance(message, Instruction):
            self.executor.instruct(source, agent_id, message)
            return
        handle = self._proposed.get(message.task_id)
        if handle is None or handle.sender != agent_id:
            return  # a report on a task that ended here, or is not ours
        peer = str(source.peer_id)
        if handle.thread.on_update(source.id, message, trio.current_time(), peer):
            handle._notify()
            self._wake.set()
            self._settled(handle)


def _rejected(thread: ProposerThread) -> RemoteError:
    """TASK_REJECTED for a thread every target rejected: each rejection (its target as the
    proposer named it) in ``details["rejections"]``; ``retryAfterMs`` (the longest) when
    a target refused the proposing peer as BUSY with a hint."""
    rejections: list[dict[str, Any]] = []
    for target, r in thread.rejects.items():
        rejection: dict[str, Any] = {"agent": target, "reason": r.reason, "message": r.message}
        if r.alternative:
            rejection["alternative"] = r.alternative
        if r.retry_after_ms is not None:
            rejection["retryAfterMs"] = r.retry_after_ms
        rejections.append(rejection)
    hints = [r["retryAfterMs"] for r in rejections if "retryAfterMs" in r]
    extra = {"retryAfterMs": max(hints)} if hints else {}
    return RemoteError(
        ErrorCode.TASK_REJECTED,
        f"task {thread.task_id} rejected by "
        + ", ".join(f"{r['agent']} ({r['reason']})" for r in rejections),
        taskId=thread.task_id,
        rejections=rejections,
        **extra,
    )


def _canonical(target: str) -> str:
    """``target`` as routing spells it: ``agent@peer`` with the peer id in its canonical
    form (answers are matched to it by that text), or a bare id as it is."""
    agent, owner = split_address(target)
    return target if owner is None else pinned_address(agent, owner)


__all__ = ["TaskHandle", "TaskService"]
