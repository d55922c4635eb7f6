"""The swarm service: decentralized swarms on a running node (seed R8).

The trio driver of :mod:`p2pnode.services.swarms.coordinator` over the task service
(invitations are task proposals) and the shared-state service (the swarm
document). Theory of operation (docs/protocol/tasks.md §4-6):

* **Opening** (:meth:`SwarmService.open`). The opener subscribes to
  ``swarm.<id>``, writes the plan and the first coordinator lease (itself,
  epoch 1), starts coordinating, and invites the agents that the DHT says
  offer every capability of at least one sub-task (R8.1, Property 25): one
  task proposal each, carrying the swarm's id, document and lease. An
  agent that accepts is awarded the invitation and *participates*: the work
  of its task is this service's joiner (:mod:`p2pnode.services.swarms.member`).
* **Coordinating** (:class:`_Coordinating`). Every ``tick`` the core
  decides; assignments go to participants as ``stream-data`` messages
  (marker ``swarm``); the decisions are journaled in the document; the
  coordinator lease is renewed every third of the lease. Escalations are
  reported to the opener and start a search for more agents.
* **Takeover.** Every node with a member of the swarm reads the document
  every third of the lease. When the coordinator lease has not been renewed
  for :func:`~p2pnode.services.swarms.coordinator.claim_after` seconds, the first live
  participant (by id) on this node claims the next epoch and coordinates
  from the journal's fold. A coordinator that sees a later claim stops.
* The opener's :class:`SwarmHandle` follows the document: ``await
  handle.result()`` is the outcome once every sub-task is done (the opener's
  own aggregation function if it gave one, else the plan's).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from p2pnode.agent.task import SwarmInvite, Task
from p2pnode.core.card import AgentCard
from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode, LocalError, P2PError
from p2pnode.core.jsonutil import dumps
from p2pnode.crdt.ops import RegisterSet
from p2pnode.node.service import ServiceHost
from p2pnode.services.swarms.coordinator import Coordinator, Orders, SwarmConfig, Verdict, invitees
from p2pnode.services.swarms.document import (
    CANCELED,
    COMPLETED,
    CoordLease,
    Plan,
    Record,
    SwarmView,
    doc_name,
    lease_stamp,
    log_key,
)
from p2pnode.services.swarms.member import SWARM_MARKER, SwarmMembers, SwarmNode, SwarmStats
from p2pnode.services.swarms.protocols import Documents, Joiner, Tasks

logger = logging.getLogger("p2pnode.swarms")

Aggregate = Callable[[list[Any]], Any]
_ASSIGN_BYTES = 1024 * 1024


class SwarmHandle:
    """A swarm as its opener holds it: ``status()``, ``progress``, ``await result()``,
    ``cancel()``."""

    def __init__(self, service: SwarmService, node: SwarmNode, aggregate: Aggregate | None) -> None:
        self._service = service
        self._node = node
        self._aggregate = aggregate

    @property
    def swarm(self) -> str:
        return self._node.swarm

    @property
    def doc(self) -> str:
        return self._node.doc

    def view(self) -> SwarmView | None:
        """The swarm as this node's replica of its document says."""
        return self._node.view

    @property
    def progress(self) -> tuple[int, int]:
        """(sub-tasks done, sub-tasks)."""
        view = self._node.view
        plan = self._node.plan
        total = len(plan.subtasks) if plan is not None else 0
        return (view.done if view is not None else 0, total)

    @property
    def escalated(self) -> list[str]:
        """Sub-tasks that no live participant can do (R8.5), by id."""
        view, plan = self._node.view, self._node.plan
        if view is None or plan is None:
            return []
        return [plan.ids[i] for i, s in enumerate(view.subtasks) if s.escalated]

    async def result(self) -> Any:
        """The outcome once the swarm completed (R8.6). Raises LocalError(TASK_CANCELED)."""
        await self._node.finished.wait()
        view = self._node.view
        assert view is not None
        if view.status == CANCELED:
            raise LocalError(ErrorCode.TASK_CANCELED, f"swarm {self.swarm} was canceled")
        if self._aggregate is not None:
            return self._aggregate(view.results())
        return view.outcome

    def status(self) -> dict[str, Any]:
        return self._service.status(self.swarm)

    async def cancel(self) -> None:
        """Cancel the swarm: participants stop when they read it."""
        await self._service.cancel(self.swarm)


@dataclass(slots=True)
class _Coordinating:
    """A local agent coordinating a swarm: its core and its term."""

    agent: str
    core: Coordinator
    beat: int = 0
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    last_recruit: float = -1e18
    #: Agents invited whose answer has not come yet.
    inviting: set[str] = field(default_factory=set)
    #: Set when something the coordinator decides on arrived (a result, a join).
    wake: trio.Event = field(default_factory=trio.Event)


class SwarmService:
    """Swarms on one node (see the module docstring). Start it with
    ``await node.open_swarms()`` (p2pnode.runtime), which also hands it to the task
    service as what runs accepted invitations (:meth:`joiner`)."""

    def __init__(
        self,
        host: ServiceHost,
        tasks: Tasks,
        shared: Documents,
        config: SwarmConfig | None = None,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self.host = host
        self.tasks = tasks
        self.shared = shared
        self.config = config or SwarmConfig()
        self.stats = SwarmStats()
        self._rng = rng or random.SystemRandom()
        self._coordinating: dict[str, _Coordinating] = {}
        self._nursery: trio.Nursery | None = None
        self.members = SwarmMembers(host, tasks, shared, self.stats, self)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled. Raises LocalError(INVALID_ARGUMENT) when the node runs
        another swarm service (its marker is intercepted already)."""
        self.host.intercept_stream(SWARM_MARKER, self._on_message)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.members.nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            self.members.nursery = None
            self.host.intercept_stream(SWARM_MARKER, None)

    def _running(self) -> trio.Nursery:
        if self._nursery is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "the swarm service is not running")
        return self._nursery

    @property
    def running(self) -> bool:
        return self._nursery is not None

    def joiner(self) -> Joiner | None:
        """What runs an accepted invitation (a participation), while the service runs."""
        return self.members.join if self._nursery is not None else None

    def statistics(self) -> dict[str, int]:
        """The swarm counters ``status`` shows with the tasks'."""
        out = self.stats.to_dict()
        out["swarmsActive"] = self.members.active()
        out["reassignments"] += sum(c.core.reassignments for c in self._coordinating.values())
        out["duplicateResults"] += sum(c.core.duplicates for c in self._coordinating.values())
        return out

    # -- opening ----------------------------------------------------------------------------

    async def open(
        self,
        opener: str,
        plan: Plan | dict[str, Any],
        *,
        aggregate: Aggregate | None = None,
        swarm: str | None = None,
    ) -> SwarmHandle:
        """Open a swarm for ``plan`` (a :class:`Plan`, or its JSON form) as local agent
        ``opener``, coordinate it and invite capable agents; returns at once.
        ``aggregate`` (a function of the results in plan order) computes the outcome
        the handle returns, instead of the plan's aggregation.

        Raises LocalError: AGENT_NOT_FOUND, INVALID_ARGUMENT (a bad plan)."""
        nursery = self._running()
        self.host.local_agent(opener)
        swarm_id = swarm or f"s{self._rng.getrandbits(64):016x}"
        if isinstance(plan, Plan):
            plan = Plan(
                swarm_id, plan.description, plan.subtasks, plan.aggregate, plan.lease, opener
            )
        else:
            plan = Plan.from_json(plan, swarm=swarm_id, opener=opener)
        doc = doc_name(swarm_id)
        await self.shared.subscribe(opener, doc)
        now_ms = self.host.now_ms()
        for key, text in plan.chunks():
            await self.shared.update(opener, doc, RegisterSet(("plan", key), text, now_ms))
        node = self.members.node(swarm_id, doc)
        node.plan, node.opener = plan, opener
        self.stats.swarms_opened += 1
        me = self.members.address(opener)
        core = Coordinator(plan, me, 1, now=trio.current_time(), config=self.config)
        await self._start_coordinating(node, opener, core)
        nursery.start_soon(self._recruit, node, opener, None)
        return SwarmHandle(self, node, aggregate)

    async def _start_coordinating(self, node: SwarmNode, agent: str, core: Coordinator) -> None:
        term = _Coordinating(agent, core)
        self._coordinating[node.swarm] = term
        await self._renew(node, term)
        self._running().start_soon(self._coordinate, node, term)

    async def _renew(self, node: SwarmNode, term: _Coordinating) -> None:
        """Renew the coordinator lease, unless the document names a later coordinator
        (then step down). The register's timestamp leads with the epoch, so a later
        term's claim outranks any renewal of an earlier one."""
        epoch = term.core.epoch
        # Only a claim the rules admit moves this coordinator (§4.6): a forged one is
        # overwritten by this renewal (its LWW stamp is above the register's).
        held, why = node.reader.check_coord(self.members.authored(node.doc).get("coord"))
        if (
            held is not None
            and why is None
            and held.epoch >= epoch
            and (held.epoch, held.agent) != (epoch, term.core.me)
        ):
            self.step_down(node, held)
            return
        lease = CoordLease(term.core.me, epoch, term.beat)
        term.beat += 1
        stamp = lease_stamp(epoch, self.host.now_ms())
        await self.shared.update(
            term.agent, node.doc, RegisterSet(("coord",), lease.to_json(), stamp)
        )

    # -- coordinating -----------------------------------------------------------------------

    async def _coordinate(self, node: SwarmNode, term: _Coordinating) -> None:
        core = term.core
        plan = core.plan
        renew_every = plan.lease / 3
        next_renew = trio.current_time() + renew_every
        next_journal = trio.current_time()
        with term.scope:
            try:
                while True:
                    now = trio.current_time()
                    orders = core.tick(now)
                    await self._send_orders(node, term, orders)
                    # Decisions go out at once; the journal is written once per tick.
                    finished = core.status in (COMPLETED, CANCELED)
                    if now >= next_journal or finished:
                        next_journal = now + self.config.tick
                        await self._journal(node, term)
                    if now >= next_renew:
                        next_renew = now + renew_every
                        await self._renew(node, term)
                    if finished:
                        await self._finish(node, term)
                        return
                    if core.missing_capabilities() and (
                        now - term.last_recruit >= self.config.recruit_interval
                    ):
                        term.last_recruit = now
                        self._running().start_soon(
                            self._recruit, node, term.agent, core.missing_capabilities()
                        )
                    # A result (room at a participant) or a join wakes the coordinator
                    # before the tick; the tick is what expires leases.
                    with trio.move_on_at(next_journal):
                        await term.wake.wait()
                    term.wake = trio.Event()
            finally:
                if self._coordinating.get(node.swarm) is term:
                    del self._coordinating[node.swarm]
                    self.stats.reassignments += core.reassignments
                    self.stats.duplicates += core.duplicates

    async def _journal(self, node: SwarmNode, term: _Coordinating) -> None:
        taken = term.core.take_record()
        if taken is None:
            return
        key, record = taken
        term_key = log_key(term.core.epoch, term.core.me)
        for part, piece in enumerate(record.split()):
            # Keys sort as written: "<seq>", then "<seq>.0001", "<seq>.0002", ...
            path = ("log", term_key, key if part == 0 else f"{key}.{part:04d}")
            text = dumps(piece.to_json())
            await self.shared.update(
                term.agent, node.doc, RegisterSet(path, text, self.host.now_ms())
            )
            self.stats.journal_records += 1

    async def _send_orders(self, node: SwarmNode, term: _Coordinating, orders: Orders) -> None:
        plan = term.core.plan
        for agent, items in orders.assign.items():
            batch: list[list[Any]] = []
            size = 0
            for position, (index, attempt) in enumerate(items):
                # Messages of at most about 1 MiB (an envelope carries 4 MiB).
                entry = [index, attempt, plan.subtasks[index].to_dict()]
                batch.append(entry)
                size += len(dumps(entry))
                if size >= _ASSIGN_BYTES or position == len(items) - 1:
                    body = {"op": "assign", "epoch": term.core.epoch, "tasks": batch}
                    await self._send(term.agent, agent, node.swarm, body)
                    batch, size = [], 0
        if orders.escalated or orders.status_changed:
            opener = plan.opener
            escalated = [plan.ids[i] for i in term.core.escalated()]
            report = {"op": "report", "status": term.core.status, "escalated": escalated}
            if escalated:
                self.stats.escalations += len(orders.escalated)
            opener = node.reader.opener or opener
            if opener and opener != term.core.me:
                await self._send(term.agent, opener, node.swarm, report)

    async def _finish(self, node: SwarmNode, term: _Coordinating) -> None:
        """The swarm ended: journal it, tell the participants and the opener."""
        await self._journal(node, term)
        if term.core.status == COMPLETED:
            self.stats.swarms_completed += 1
        end = {"op": "end", "status": term.core.status}
        for agent in term.core.members():
            await self._send(term.agent, agent, node.swarm, end)
        opener = node.reader.opener or term.core.plan.opener
        if opener and opener != term.core.me and opener not in term.core.members():
            await self._send(term.agent, opener, node.swarm, end)
        await self.members.refresh(node)

    async def _send(self, sender: str, agent: str, swarm: str, body: dict[str, Any]) -> None:
        await self.members.send(sender, agent, swarm, body)

    # -- recruiting -------------------------------------------------------------------------

    async def _recruit(
        self, node: SwarmNode, agent: str, wanted: set[frozenset[str]] | None
    ) -> None:
        """Invite agents offering the capabilities of some sub-task (``wanted``: only
        these sets), found through discovery (R8.1, Property 25)."""
        plan = node.plan
        term = self._coordinating.get(node.swarm)
        if plan is None or term is None:
            return
        needs = wanted or {frozenset(s.task.capabilities) for s in plan.subtasks}
        source = self.host.local_agent(agent)
        found: dict[str, AgentCard] = {}
        for capability in sorted({c for caps in needs for c in caps}):
            try:
                cards = await self.host.find(capability)
            except P2PError as exc:
                logger.info("swarm %s: finding %s failed: %s", node.swarm, capability, exc)
                continue
            for card in cards:
                found.setdefault(self.members.address_of(card), card)
        if not any(needs):  # sub-tasks needing no capability: any agent that takes tasks
            found.update({self.members.address_of(c): c for c in self.host.registry
                          if c.id != agent})  # fmt: skip
        exclude = {term.core.me, *term.core.members(), *term.inviting}
        chosen = invitees(((a, c.capability_ids()) for a, c in found.items()), needs, exclude)
        policy = self.host.policy
        allowed = [
            found[a]
            for a in chosen
            if policy.check_message(source, found[a], MessageType.TASK_PROPOSAL, None).allowed
        ]
        async with trio.open_nursery() as nursery:
            for card in allowed[: self.config.max_invites]:
                nursery.start_soon(self._invite, node, term, card)

    async def _invite(self, node: SwarmNode, term: _Coordinating, card: AgentCard) -> None:
        plan = term.core.plan
        offered = card.capability_ids() & plan.capabilities
        mine = [s for s in plan.subtasks if set(s.task.capabilities) <= offered]
        task = Task(
            f"join swarm {plan.swarm}: {plan.description}"[:4096],
            tuple(sorted(offered))[:16],
            sum(s.task.complexity for s in mine),
            {"swarm": plan.swarm, "subtasks": len(mine)},
        )
        invite = SwarmInvite(plan.swarm, node.doc, plan.lease)
        self.stats.invitations += 1
        address = self.members.address_of(card)
        term.inviting.add(address)
        try:
            # Addressed as agent@peer: a squatter of the id never receives the invitation.
            handle = await self.tasks.propose(
                term.agent, address, task, deadline=self.config.join_deadline, swarm=invite
            )
        except P2PError as exc:
            logger.info("swarm %s: %s did not join: %s", plan.swarm, card.id, exc)
            return
        finally:
            term.inviting.discard(address)
        accepted = handle.acceptance(card.id) or handle.acceptance(address)
        capacity = accepted.capacity if accepted is not None else 1
        external = accepted.load if accepted is not None else 0
        if self._coordinating.get(node.swarm) is term:
            now = trio.current_time()
            term.wake.set()
            term.core.join(
                address,  # the invitee accepted: a member, as agent@peer
                offered,
                capacity,
                now=now,
                now_ms=self.host.now_ms(),
                external=external,
            )

    # -- messages ---------------------------------------------------------------------------

    async def _on_message(self, source: AgentCard, agent_id: str, envelope: Envelope) -> None:
        """A swarm message for local agent ``agent_id`` (intercepted: must not block)."""
        payload = envelope.payload
        swarm = payload.get(SWARM_MARKER) if isinstance(payload, dict) else None
        term = self._coordinating.get(swarm) if isinstance(swarm, str) else None
        if term is not None and term.agent == agent_id and payload.get("op") in ("beat", "done"):
            self._to_coordinator(term, source, payload)
            return
        self.members.on_message(source, agent_id, envelope)

    def _to_coordinator(
        self, term: _Coordinating, source: AgentCard, payload: dict[str, Any]
    ) -> None:
        core = term.core
        now, now_ms = trio.current_time(), self.host.now_ms()
        agent = self.members.address_of(source)
        if not core.known(agent):
            # Only members (invitations accepted) beat and report (§4.6 rule 1).
            self._refused(term, source, f"{payload['op']} from {agent}, not a member")
            return
        try:
            if payload["op"] == "beat":
                caps = payload.get("caps")
                capacity = payload.get("capacity")
                external = payload.get("load")
                external = external if type(external) is int else 0
                if not core.beat(agent, external, now=now, now_ms=now_ms) and (
                    isinstance(caps, list)
                    and all(isinstance(c, str) for c in caps)
                    and type(capacity) is int
                ):
                    core.join(
                        agent,
                        frozenset(caps) & core.plan.capabilities,
                        capacity,
                        now=now,
                        now_ms=now_ms,
                        external=external,
                    )
                return
            core.beat(agent, 0, now=now, now_ms=now_ms)
            term.wake.set()
            refused = 0
            for index, attempt, value in payload.get("results", []):
                if type(index) is int and type(attempt) is int:
                    refused += core.result(agent, index, attempt, value) is Verdict.REFUSED
            if refused:
                self._refused(term, source, f"{refused} results from {agent}, not the assignee")
            for index, attempt, code in payload.get("failed", []):
                if type(index) is int and type(attempt) is int and isinstance(code, str):
                    core.failure(agent, index, attempt, code)
        except (TypeError, ValueError, KeyError) as exc:
            self.stats.bad_messages += 1
            logger.info(
                "swarm %s: bad %s from %s: %s", core.plan.swarm, payload.get("op"), agent, exc
            )

    def _refused(self, term: _Coordinating, source: AgentCard, what: str) -> None:
        self.stats.forged += 1
        self.host.events.security(
            ErrorCode.PERMISSION_DENIED,
            f"swarm {term.core.plan.swarm}: refused {what}",
            str(source.peer_id),
            None,
        )

    # -- takeover (called by the members part) ----------------------------------------------

    async def claim(self, node: SwarmNode, agent: str, lease: CoordLease, view: SwarmView) -> None:
        """Local participant ``agent`` takes over coordination from ``lease``'s holder."""
        plan = node.plan
        if plan is None or node.swarm in self._coordinating:
            return
        if agent not in self.shared.subscriptions().get(node.doc, []):
            await self.shared.subscribe(agent, node.doc)  # it writes the journal now
        epoch = max(lease.epoch, max(view.terms, default=0)) + 1
        me = self.members.address(agent)
        core = Coordinator(plan, me, epoch, now=trio.current_time(), config=self.config, view=view)
        self.stats.takeovers += 1
        logger.info(
            "swarm %s: %s takes over from %s (epoch %d)", node.swarm, agent, lease.agent, core.epoch
        )
        await self._start_coordinating(node, agent, core)

    def step_down(self, node: SwarmNode, lease: CoordLease) -> None:
        """The document names another coordinator, of a later (or the winning) term."""
        term = self._coordinating.get(node.swarm)
        if term is None:
            return
        mine = (term.core.epoch, term.core.me)
        if (lease.epoch, lease.agent) != mine and lease.epoch >= term.core.epoch:
            logger.info("swarm %s: %s steps down for %s", node.swarm, term.agent, lease.agent)
            term.scope.cancel()

    def absorb(self, node: SwarmNode, key: str, record: Record) -> None:
        """A journal record read from the document: another term's counts here too."""
        term = self._coordinating.get(node.swarm)
        if term is not None and not key.startswith(log_key(term.core.epoch, term.core.me) + "/"):
            term.core.absorb(record)

    def follow(self, node: SwarmNode, view: SwarmView) -> None:
        """The replica's fold after a read: what it shows done or assigned counts for a
        local coordinator too (records admitted late, or read while it was claiming)."""
        term = self._coordinating.get(node.swarm)
        if term is not None and term.core.follow(view):
            term.wake.set()

    def canceled(self, node: SwarmNode) -> None:
        """The opener set ``cancel`` in the document."""
        term = self._coordinating.get(node.swarm)
        if term is not None:
            term.core.cancel()

    # -- reading ----------------------------------------------------------------------------

    def status(self, swarm: str) -> dict[str, Any]:
        """The swarm as this node knows it: its plan's sub-tasks with status, assignee,
        attempt and result reference; members; status; outcome. Raises
        LocalError(INVALID_ARGUMENT) for a swarm this node does not follow."""
        term = self._coordinating.get(swarm)
        return self.members.status(swarm, term.agent if term is not None else None)

    async def cancel(self, swarm: str) -> None:
        node = self.members.get(swarm)
        if node is None or node.opener is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"this node did not open swarm {swarm!r}")
        await self.shared.update(
            node.opener, node.doc, RegisterSet(("cancel",), True, self.host.now_ms())
        )
        term = self._coordinating.get(swarm)
        if term is not None:
            term.core.cancel()


__all__ = ["Aggregate", "SwarmHandle", "SwarmService"]
