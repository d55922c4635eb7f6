"""The members' side of swarms on a node: participating, reading the swarm document,
and noticing when the coordinator must be replaced.

A part of the :class:`~p2pnode.services.swarms.service.SwarmService`. Theory of operation
(docs/protocol/tasks.md §5-6):

* **Participating** (:meth:`SwarmMembers.join`, the task service's joiner):
  a local agent that accepted an invitation subscribes to the swarm
  document, then until the swarm ends: beats to the coordinator every third
  of the lease (its capabilities, capacity and outside load: R8.2), runs the
  sub-tasks assigned to it (at most its ``on_task`` capacity at once) with its
  ``on_task`` handler, and sends each result or failure to the coordinator.
  It keeps each result until the document shows the sub-task done, and sends
  what is still missing again to each new coordinator (results are not lost
  when a coordinator dies).
* **Reading** (:meth:`SwarmMembers.refresh`, every third of the lease and at
  an ``end``): the plan, the coordinator lease, the journal's fold. Journal
  assignments to a local participant that it never got as a message are
  taken from there. The coordinator lease is *renewed* when its register
  changes; when it has not changed for :func:`~p2pnode.services.swarms.coordinator.claim_after`
  seconds the first live local participant in the succession claims it.
* The swarm ends for this node when the journal says ``completed`` or
  ``canceled``, or the opener set ``cancel``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from p2pnode.agent.task import Proposal, TaskError
from p2pnode.agent.taskwork import TaskHandlers, Work
from p2pnode.core.card import AgentCard
from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.node.service import ServiceHost
from p2pnode.services.swarms.coordinator import Participation, claim_after, successors
from p2pnode.services.swarms.document import (
    ASSIGNED,
    CANCELED,
    COMPLETED,
    Breach,
    CoordLease,
    DocReader,
    Plan,
    Record,
    SubTask,
    SwarmView,
    authored,
    encode_result,
    log_key,
    member_address,
)
from p2pnode.services.swarms.protocols import Documents, Tasks

logger = logging.getLogger("p2pnode.swarms")

#: Payload key of swarm messages (``stream-data`` envelopes; its value is the swarm id).
SWARM_MARKER = "swarm"


@dataclass(slots=True)
class SwarmStats:
    """Counters of one node's swarm service (``status`` shows them)."""

    swarms_opened: int = 0
    swarms_completed: int = 0
    takeovers: int = 0
    reassignments: int = 0
    duplicates: int = 0
    escalations: int = 0
    invitations: int = 0
    journal_records: int = 0
    messages_sent: int = 0
    subtasks_run: int = 0
    bad_messages: int = 0
    #: Entries and messages refused by the rules of §4.6 (each a security event).
    forged: int = 0

    def to_dict(self) -> dict[str, int]:
        return {
            "swarmsOpened": self.swarms_opened,
            "swarmsCompleted": self.swarms_completed,
            "takeovers": self.takeovers,
            "reassignments": self.reassignments,
            "duplicateResults": self.duplicates,
            "escalations": self.escalations,
            "invitations": self.invitations,
            "journalRecords": self.journal_records,
            "messagesSent": self.messages_sent,
            "subtasksRun": self.subtasks_run,
            "badMessages": self.bad_messages,
            "forgedEntries": self.forged,
        }


@dataclass(slots=True)
class _Part:
    """A local agent participating in a swarm."""

    core: Participation
    handlers: TaskHandlers
    proposer: str
    capabilities: list[str]
    defs: dict[int, SubTask] = field(default_factory=dict)
    wake: trio.Event = field(default_factory=trio.Event)
    #: When each kept result was last sent, and to which coordinator.
    sent: dict[int, tuple[float, str]] = field(default_factory=dict)

    def poke(self) -> None:
        self.wake.set()


@dataclass(eq=False, slots=True)
class SwarmNode:
    """This node's view of one swarm: what its replica says, and its local members."""

    swarm: str
    doc: str
    plan: Plan | None = None
    opener: str | None = None
    view: SwarmView | None = None
    lease: CoordLease | None = None
    lease_seen: float = 0.0
    parts: dict[str, _Part] = field(default_factory=dict)
    reader: DocReader = field(default_factory=DocReader)
    canceled: bool = False
    ended: bool = False
    finished: trio.Event = field(default_factory=trio.Event)
    #: Breaches seen, with when first seen (reported once they outlive a lease).
    suspects: dict[str, float] = field(default_factory=dict)
    reported: set[str] = field(default_factory=set)

    def coordinator(self, part: _Part) -> str:
        """Where a participant sends: the admitted coordinator lease's member address
        (before one is read, the invitation's proposer)."""
        return self.lease.agent if self.lease is not None else part.proposer


def _term(lease: CoordLease) -> str:
    return log_key(lease.epoch, lease.agent) + "/"


class Coordination(Protocol):
    """What the members' side asks of the coordinating side (the swarm service)."""

    async def claim(
        self, node: SwarmNode, agent: str, lease: CoordLease, view: SwarmView
    ) -> None: ...

    def step_down(self, node: SwarmNode, lease: CoordLease) -> None: ...

    def absorb(self, node: SwarmNode, key: str, record: Record) -> None: ...

    def follow(self, node: SwarmNode, view: SwarmView) -> None: ...

    def canceled(self, node: SwarmNode) -> None: ...


class _SubtaskChannel:
    """A sub-task reports nothing along the way and cannot ask for input."""

    async def progress(self, fraction: float | None, message: str) -> None:
        return None

    async def ask(self, question: str) -> Any:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "a swarm's sub-task cannot ask for input")


class SwarmMembers:
    """The swarms this node follows and their local participants (module docstring)."""

    def __init__(
        self,
        host: ServiceHost,
        tasks: Tasks,
        shared: Documents,
        stats: SwarmStats,
        coordination: Coordination,
    ) -> None:
        self.host = host
        self.tasks = tasks
        self.shared = shared
        self.stats = stats
        self._coordination = coordination
        self._nodes: dict[str, SwarmNode] = {}
        self.nursery: trio.Nursery | None = None

    def node(self, swarm: str, doc: str) -> SwarmNode:
        """The node's view of ``swarm``, followed from now on."""
        node = self._nodes.get(swarm)
        if node is None:
            node = self._nodes[swarm] = SwarmNode(swarm, doc, lease_seen=trio.current_time())
            if self.nursery is None:
                raise LocalError(ErrorCode.INVALID_ARGUMENT, "the swarm service is not running")
            self.nursery.start_soon(self._watch, node)
        return node

    def address(self, agent_id: str) -> str:
        """A local agent's member address (``agent@peer``)."""
        return self.address_of(self.host.local_agent(agent_id))

    @staticmethod
    def address_of(card: AgentCard) -> str:
        return member_address(card.id, str(card.peer_id))

    def authored(self, doc: str) -> dict[str, Any]:
        """This replica's ``doc`` with each register's writer (:func:`authored`)."""
        try:
            return authored(self.shared.root(doc))
        except LocalError:
            return {}

    def get(self, swarm: str) -> SwarmNode | None:
        return self._nodes.get(swarm)

    def active(self) -> int:
        """Swarms not ended that this node follows."""
        return sum(1 for n in self._nodes.values() if not n.ended)

    # -- participating ----------------------------------------------------------------------

    async def join(self, agent_id: str, proposal: Proposal, work: Work) -> Any:
        """Participate in the swarm ``proposal`` invites to (the task's work; returns when
        the swarm ended for this node)."""
        invite = proposal.swarm
        handlers = self.tasks.handlers(agent_id)
        if invite is None or handlers is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "not a swarm invitation")
        node = self.node(invite.swarm, invite.doc)
        if agent_id in node.parts:
            return {"swarm": node.swarm, "finished": 0, "already": True}
        if not self.shared.subscriptions().get(invite.doc):
            # The node's replica serves all its agents: one member per node is enough
            # (each subscription re-publishes a card).
            await self.shared.subscribe(agent_id, invite.doc)
        card = self.host.local_agent(agent_id)
        part = _Part(
            Participation(agent_id, handlers.capacity),
            handlers,
            proposal.proposer,
            sorted(card.capability_ids()),
        )
        node.parts[agent_id] = part
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._beat, node, agent_id, part, invite.lease)
                while not node.ended:
                    started = part.core.next()
                    if started is None:
                        await part.wake.wait()
                        part.wake = trio.Event()
                        continue
                    nursery.start_soon(self._run, node, agent_id, part, *started)
                nursery.cancel_scope.cancel()
        finally:
            node.parts.pop(agent_id, None)
        return {"swarm": node.swarm, "finished": part.core.finished}

    async def _beat(self, node: SwarmNode, agent: str, part: _Part, lease: float) -> None:
        while True:
            external = max(0, self.tasks.load(agent) - 1)  # its tasks besides this one
            beat = {"op": "beat", "caps": part.capabilities, "capacity": part.handlers.capacity,
                    "load": external}  # fmt: skip
            await self.send(agent, node.coordinator(part), node.swarm, beat)
            await trio.sleep(lease / 3)

    async def _run(
        self, node: SwarmNode, agent: str, part: _Part, index: int, attempt: int
    ) -> None:
        sub = part.defs.get(index)
        if sub is None and node.plan is not None:
            sub = node.plan.subtasks[index]
        if sub is None:
            part.core.failed(index, attempt, "UNKNOWN_SUBTASK")
            return
        work = Work(f"{node.swarm}/{sub.id}", sub.task, node.coordinator(part), _SubtaskChannel(),
                    node.swarm)  # fmt: skip
        body: dict[str, Any]
        try:
            value = encode_result(await part.handlers.perform(work))
        except P2PError as exc:
            part.core.failed(index, attempt, str(exc.code))
            body = {"op": "done", "failed": [[index, attempt, str(exc.code)]]}
        except Exception:
            logger.exception("swarm %s: %s failed on %s", node.swarm, agent, sub.id)
            part.core.failed(index, attempt, ErrorCode.HANDLER_FAILED)
            body = {"op": "done", "failed": [[index, attempt, str(ErrorCode.HANDLER_FAILED)]]}
        else:
            part.core.succeeded(index, attempt, value)
            coordinator = node.coordinator(part)
            part.sent[index] = (trio.current_time(), coordinator)
            body = {"op": "done", "results": [[index, attempt, value]]}
        self.stats.subtasks_run += 1
        part.poke()
        await self.send(agent, node.coordinator(part), node.swarm, body)

    async def send(self, sender: str, agent: str, swarm: str, body: dict[str, Any]) -> None:
        """A swarm message from local agent ``sender``; a failure is logged."""
        payload = {SWARM_MARKER: swarm, **body}
        try:
            envelope = self.host.envelope(
                sender, agent, MessageType.STREAM_DATA, payload, correlation_id=swarm
            )
            await self.host.send(envelope)
            self.stats.messages_sent += 1
        except P2PError as exc:
            logger.info("swarm %s: %s to %s not sent: %s", swarm, body.get("op"), agent, exc)

    def on_message(self, source: AgentCard, agent_id: str, envelope: Envelope) -> None:
        """A swarm message to a local member (intercepted: never blocks)."""
        payload = envelope.payload
        swarm = payload.get(SWARM_MARKER) if isinstance(payload, dict) else None
        node = self._nodes.get(swarm) if isinstance(swarm, str) else None
        if node is None:
            return
        op = payload.get("op")
        part = node.parts.get(agent_id)
        # Assignments only from the coordinator the admitted lease names, agent and peer.
        sender = self.address_of(source) if node.lease is not None else source.id
        if op == "assign" and part is not None and sender == node.coordinator(part):
            try:
                items = []
                for index, attempt, definition in payload["tasks"]:
                    if type(index) is not int or type(attempt) is not int:
                        raise TaskError(ErrorCode.MALFORMED_MESSAGE, "bad index or attempt")
                    part.defs[index] = SubTask.from_dict(definition)
                    items.append((index, attempt))
            except (RemoteError, KeyError, TypeError, ValueError):
                self.stats.bad_messages += 1
                return
            for index in part.core.assigned(items):
                part.sent.pop(index, None)  # sent again at the next read, as this attempt
            part.poke()
        elif op in ("end", "report") and self.nursery is not None:
            self.nursery.start_soon(self.refresh, node)

    # -- reading the document ---------------------------------------------------------------

    async def _watch(self, node: SwarmNode) -> None:
        while not node.ended:
            await self.refresh(node)
            lease = node.plan.lease if node.plan is not None else 1.0
            await trio.sleep(lease / 3)

    async def refresh(self, node: SwarmNode) -> None:
        """Read the replica of the swarm's document now (see the module docstring)."""
        reader = node.reader
        try:
            new = reader.read_untrusted(self.authored(node.doc))
        except RemoteError as exc:
            logger.info("swarm %s: bad document: %s", node.swarm, exc)
            return
        if node.plan is None:
            node.plan = reader.plan
        view = reader.view
        if node.plan is None or view is None:
            return
        now = trio.current_time()
        if reader.coord is not None and reader.coord != node.lease:
            node.lease, node.lease_seen = reader.coord, now
            self._coordination.step_down(node, reader.coord)
        node.view = view
        for key, record in new:
            self._coordination.absorb(node, key, record)
        self._coordination.follow(node, view)
        if node.lease is not None and any(k.startswith(_term(node.lease)) for k, _ in new):
            # The holder's journal shows it alive too: a peer overwriting ``coord`` with a
            # claim the rules refuse cannot make its silence look like a lapse.
            node.lease_seen = now
        if reader.canceled and not node.canceled:
            node.canceled = True
            self._coordination.canceled(node)
        for agent, part in node.parts.items():
            self._catch_up(node, agent, part, view, now)
        self._report(node, [*view.breaches.values(), *reader.breaches.values()], now)
        # Completed once every result is here too: another term's records may still be
        # on their way when the completing coordinator's arrives.
        if view.status == CANCELED or (view.status == COMPLETED and view.complete):
            self._report(node, [*view.breaches.values(), *reader.breaches.values()], None)
            node.ended = True
            node.finished.set()
            for part in node.parts.values():
                part.poke()
            return
        await self._maybe_claim(node, view, now)

    def _catch_up(
        self, node: SwarmNode, agent: str, part: _Part, view: SwarmView, now: float
    ) -> None:
        part.core.accepted(view)
        me = self.address(agent)
        mine = [(i, s.attempt) for i, s in enumerate(view.subtasks)
                if s.status == ASSIGNED and s.assignee == me]  # fmt: skip
        before = part.core.load
        for index in part.core.assigned(mine):
            part.sent.pop(index, None)  # sent again below, as the attempt now assigned
        if part.core.load != before:
            part.poke()
        lease = node.plan.lease if node.plan is not None else 1.0
        coordinator = node.coordinator(part)
        missing = []
        for index, (attempt, value) in part.core.results.items():
            when, to = part.sent.get(index, (-1e18, ""))
            if to != coordinator or now - when >= lease:
                part.sent[index] = (now, coordinator)
                missing.append([index, attempt, value])
        if missing and self.nursery is not None:
            body = {"op": "done", "results": missing}
            self.nursery.start_soon(self.send, agent, coordinator, node.swarm, body)

    async def _maybe_claim(self, node: SwarmNode, view: SwarmView, now: float) -> None:
        lease = node.lease
        if lease is None or node.plan is None or not node.parts:
            return
        # Participants on the coordinator's own peer went down with it: passed over.
        order = successors(view, lease.agent)
        local = {self.address(a): a for a in node.parts}
        mine = [a for a in order if a in local]
        if not mine:
            return
        rank = order.index(mine[0])
        if now - node.lease_seen >= claim_after(rank, node.plan.lease):
            node.lease_seen = now  # one claim per silence
            await self._coordination.claim(node, local[mine[0]], lease, view)

    def _report(self, node: SwarmNode, breaches: list[Breach], now: float | None) -> None:
        """Report each breach as a security event once it has stood for a lease (or at
        the end, ``now`` None): one that a record still in flight would admit is not."""
        lease = node.plan.lease if node.plan is not None else 1.0
        standing = {f"{b.key}#{b.writer}#{b.rule}": b for b in breaches}
        for gone in set(node.suspects) - set(standing):
            del node.suspects[gone]
        for name, breach in standing.items():
            first = node.suspects.setdefault(name, now if now is not None else 0.0)
            if name in node.reported or (now is not None and now - first < lease):
                continue
            node.reported.add(name)
            self.stats.forged += 1
            self.host.events.security(
                ErrorCode.PERMISSION_DENIED,
                f"swarm {node.swarm}: {breach.key} ignored: {breach.rule}",
                breach.writer,
                None,
            )

    def status(self, swarm: str, coordinating: str | None) -> dict[str, Any]:
        """The swarm as this node knows it (``swarm status``)."""
        node = self._nodes.get(swarm)
        if node is None or node.plan is None:
            raise LocalError(
                ErrorCode.INVALID_ARGUMENT, f"this node does not follow swarm {swarm!r}"
            )
        plan, view = node.plan, node.view
        subs = view.subtasks if view is not None else []
        return {
            "swarm": swarm,
            "doc": node.doc,
            "description": plan.description,
            "status": view.status if view is not None else "submitted",
            "done": view.done if view is not None else 0,
            "total": len(plan.subtasks),
            "coordinator": node.lease.agent if node.lease is not None else None,
            "epoch": node.lease.epoch if node.lease is not None else 0,
            "coordinatingHere": coordinating,
            "members": [
                {"agent": a, "alive": m.alive, "leaseUntil": m.lease_ms, "capacity": m.capacity}
                for a, m in sorted((view.members if view is not None else {}).items())
            ],
            "duplicates": view.duplicates if view is not None else 0,
            "outcome": view.outcome if view is not None else None,
            "subtasks": [
                {
                    "id": plan.ids[i],
                    "status": s.status,
                    "assignee": s.assignee,
                    "attempt": s.attempt,
                    "resultRef": s.ref,
                }
                for i, s in enumerate(subs)
            ],
        }


__all__ = ["SWARM_MARKER", "Coordination", "SwarmMembers", "SwarmNode", "SwarmStats"]
