"""Swarms, sans-IO: the coordinator's decisions, a participant's bookkeeping and the
takeover rule (seed R8; Properties 25-26).

Theory of operation (docs/protocol/tasks.md §4-5):

* :class:`Coordinator` holds one swarm's state as its coordinator sees it and
  decides, once per ``tick``:

  1. *Leases* (R8.5). Each participant holds a lease of ``plan.lease``
     seconds, renewed by each of its beats (every third of it). A participant
     whose lease ran out is dead: the sub-tasks it held become pending again
     (a *reassignment*; each attempt gets the next attempt number).
  2. *Assignment* (R8.2). Pending sub-tasks, longest first (their complexity
     is read as seconds of work), go to the live participant offering all
     of their capabilities that will be free soonest (one that failed the
     sub-task before only if no other can): least outstanding work
     of this swarm plus its advertised outside load, per unit of capacity
     (ties: agent id). A participant holds at most ``capacity + prefetch``
     sub-tasks. A sub-task no live participant can do is *escalated* (the
     swarm is ``input-required`` and its opener told) until a capable agent
     joins; so is one that failed ``max_attempts`` times.
  3. *Results* (R8.4). The first result of a sub-task is accepted and
     journaled; any later one is a duplicate, dropped (exactly once). A result
     counts only from a member that some journaled or decided assignment gave
     that attempt of the sub-task (docs/protocol/tasks.md §4.6): an attempt
     assigned by a coordinator that died still counts, a result from anyone
     else is refused (a security event at the driver).
  4. *Outcome* (R8.6). When every sub-task is done the swarm is
     ``completed`` with the outcome of its aggregation.

  Each decision is also appended to the pending journal :class:`Record`,
  which the driver writes to the swarm document (:meth:`take_record`).
* A coordinator taking over builds its state from the journal's fold
  (:class:`~p2pnode.services.swarms.document.SwarmView`): it keeps results and
  assignments, and gives every live participant a fresh lease to beat to it.
  Every coordinator then follows the fold after each read of its replica
  (:meth:`Coordinator.follow`): results and assignments of overlapping terms
  count, including records admitted only once the records before them arrived.
* :func:`successors` orders who takes over when the coordinator's lease
  lapses: the live participants by agent id (the driver passes over those
  on the coordinator's own node: they went down with it); the one of rank
  ``r`` claims after :func:`claim_after` seconds of silence.
* :class:`Participation` is a participant's side: the sub-tasks assigned to
  it (deduplicated: a sub-task reassigned to it while it runs is not started
  twice), what it runs, and the results it keeps until the document shows
  them accepted (to resend them to a new coordinator).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.services.swarms.document import (
    ASSIGNED,
    CANCELED,
    COMPLETED,
    DONE,
    ESCALATED,
    INPUT_REQUIRED,
    PENDING,
    WORKING,
    Plan,
    Record,
    SubState,
    SwarmView,
    aggregate,
    peer_of,
)

#: How many leases a takeover coordinator gives each live participant to find it and
#: beat to it before journaling it dead (docs/protocol/tasks.md §5): the new ``coord``
#: spreads by gossip, in the 50-agent simulation up to 10 s (5 leases of 2 s) after it
#: was written.
TAKEOVER_LEASES = 8


@dataclass(frozen=True, slots=True)
class SwarmConfig:
    """Timers and bounds of swarms. Raises LocalError(CONFIG_ERROR)."""

    #: Seconds between a coordinator's decisions (and journal writes).
    tick: float = 0.5
    #: Sub-tasks queued at a participant beyond what it runs at once.
    prefetch: int = 1
    #: Seconds invited agents have to answer.
    join_deadline: float = 5.0
    #: Seconds between looks for more agents while some sub-task has no capable one.
    recruit_interval: float = 30.0
    #: Failed attempts after which a sub-task is escalated.
    max_attempts: int = 5
    #: Agents invited per capability lookup, at most.
    max_invites: int = 64

    def __post_init__(self) -> None:
        if min(self.tick, self.join_deadline, self.recruit_interval) <= 0:
            raise LocalError(ErrorCode.CONFIG_ERROR, "swarm timers must be positive")
        if self.prefetch < 0 or self.max_attempts < 1 or self.max_invites < 1:
            raise LocalError(ErrorCode.CONFIG_ERROR, "bad prefetch, max_attempts or max_invites")


class Verdict(enum.Enum):
    """What became of a reported result."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    #: Not from the assignee of that attempt (or not a sub-task): a rule broken.
    REFUSED = "refused"


class Orders(NamedTuple):
    """What one tick decided: assignments to send (agent -> [(index, attempt)]), the
    sub-tasks newly escalated, whether the swarm's status changed."""

    assign: dict[str, list[tuple[int, int]]]
    escalated: list[int]
    status_changed: bool


@dataclass(slots=True)
class _Participant:
    capabilities: frozenset[str]
    capacity: int
    lease_until: float
    external: int = 0
    alive: bool = True
    outstanding: set[int] = field(default_factory=set)
    work: float = 0.0
    lease_logged: float = -1e18


class Coordinator:
    """One swarm, as its coordinator sees it and decides (see the module docstring).
    Times are seconds of the caller's monotonic clock; ``now_ms`` the wall clock."""

    def __init__(
        self,
        plan: Plan,
        me: str,
        epoch: int,
        *,
        now: float,
        config: SwarmConfig | None = None,
        view: SwarmView | None = None,
    ) -> None:
        self.plan = plan
        self.me = me
        self.epoch = epoch
        self.config = config or SwarmConfig()
        self._needs = [frozenset(s.task.capabilities) for s in plan.subtasks]
        self._cost = [float(s.task.complexity) for s in plan.subtasks]
        self._mean = sum(self._cost) / len(self._cost)
        self.subs = [SubState() for _ in plan.subtasks]
        self._parts: dict[str, _Participant] = {}
        self._holder: dict[int, str] = {}
        #: Who failed each sub-task: another capable agent is preferred for it.
        self._failed_by: dict[int, set[str]] = {}
        #: Every (attempt, member) each sub-task was assigned: who may report it.
        self._attempts: list[set[tuple[int, str]]] = [set() for _ in plan.subtasks]
        #: Of those, the ones read from another term after this one began (:meth:`follow`):
        #: a result for one is journaled with its assignment, since that term's records
        #: may sort after this one's.
        self._learned: list[set[tuple[int, str]]] = [set() for _ in plan.subtasks]
        #: Results refused: not from the assignee of that attempt.
        self.refused = 0
        self.status = WORKING
        self.outcome: Any = None
        self.record = Record()
        self._seq = 0
        self.reassignments = 0
        self.duplicates = 0
        self.assignments = 0
        #: No sub-task is escalated before the invited agents had time to answer.
        self._escalate_after = now + self.config.join_deadline
        if view is not None:
            self._resume(view, now)

    def _resume(self, view: SwarmView, now: float) -> None:
        """Take over from the journal's fold: results and assignments stay; every live
        participant gets a takeover lease (:data:`TAKEOVER_LEASES` leases): the new
        ``coord`` reaches participants by gossip, some of them seconds later, and one
        that has not read it yet beats the old coordinator, not this one."""
        first_lease = now + self.plan.lease * TAKEOVER_LEASES
        for agent, member in view.members.items():
            self._parts[agent] = _Participant(
                member.capabilities, member.capacity, first_lease, alive=member.alive
            )
        for index, seen in enumerate(view.subtasks):
            sub = self.subs[index]
            sub.attempt, sub.failures, sub.result, sub.ref = (
                seen.attempt,
                seen.failures,
                seen.result,
                seen.ref,
            )
            sub.assignee = seen.assignee
            self._attempts[index] |= seen.attempts
            if seen.status == DONE:
                sub.status = DONE
            elif seen.status == ASSIGNED and seen.assignee in self._parts:
                part = self._parts[seen.assignee]
                if part.alive:
                    sub.status = ASSIGNED
                    self._hold(index, seen.assignee, part)
            # pending or escalated sub-tasks are decided afresh at the next tick
        if view.status == CANCELED:
            self.status = CANCELED
        elif view.status == COMPLETED and view.complete:
            self.status = COMPLETED
            self.outcome = view.outcome
        # Every result in but no admitted ``completed``: the first tick journals it (the
        # term that finished may have stopped, or its record sorted before some results).

    # -- what the participants say ------------------------------------------------------------

    def join(
        self,
        agent: str,
        capabilities: Iterable[str],
        capacity: int,
        *,
        now: float,
        now_ms: int,
        external: int = 0,
    ) -> None:
        """``agent`` joined (accepted the invitation) or beat with its capabilities."""
        caps = frozenset(capabilities)
        capacity = max(1, capacity)
        part = self._parts.get(agent)
        if part is None or not part.alive or part.capabilities != caps or part.capacity != capacity:
            self.record.joined.append((agent, tuple(sorted(caps)), capacity))
        if part is None:
            part = self._parts[agent] = _Participant(caps, capacity, now + self.plan.lease)
        part.capabilities, part.capacity, part.alive = caps, capacity, True
        self.beat(agent, external, now=now, now_ms=now_ms)
        for index, sub in enumerate(self.subs):
            if sub.status == ESCALATED and self._needs[index] <= caps:
                sub.status = PENDING  # a capable agent at last

    def beat(self, agent: str, external: int = 0, *, now: float, now_ms: int) -> bool:
        """``agent`` renewed its lease; False when it is not a live participant (it must
        join again: it was declared dead, or the coordinator is new)."""
        part = self._parts.get(agent)
        if part is None or not part.alive:
            return False
        part.lease_until = now + self.plan.lease
        part.external = max(0, external)
        if now - part.lease_logged >= self.plan.lease / 2:
            part.lease_logged = now
            self.record.leases[agent] = now_ms + int(self.plan.lease * 1000)
        return True

    def result(self, agent: str, index: int, attempt: int, value: Any) -> Verdict:
        """A result of member ``agent``: accepted when it is the first for that sub-task
        and ``agent`` was assigned that attempt; else a duplicate or refused."""
        if not 0 <= index < len(self.subs) or (attempt, agent) not in self._attempts[index]:
            self.refused += 1
            return Verdict.REFUSED
        sub = self.subs[index]
        if sub.status == DONE:
            self.duplicates += 1
            return Verdict.DUPLICATE
        self._release(index)
        sub.status, sub.assignee, sub.attempt, sub.result = DONE, agent, attempt, value
        if (attempt, agent) in self._learned[index]:
            self.record.assigned.append((index, agent, attempt))
        self.record.done.append((index, attempt, agent, value))
        return Verdict.ACCEPTED

    def failure(self, agent: str, index: int, attempt: int, code: str) -> None:
        """``agent`` reports that its attempt at sub-task ``index`` failed."""
        if not 0 <= index < len(self.subs):
            return
        sub = self.subs[index]
        if sub.status != ASSIGNED or sub.assignee != agent or sub.attempt != attempt:
            return
        self._release(index)
        sub.failures += 1
        self._failed_by.setdefault(index, set()).add(agent)
        self.record.failed.append((index, agent, attempt, code))
        sub.status = PENDING
        if sub.failures >= self.config.max_attempts:
            self._escalate(index)

    def absorb(self, record: Record) -> None:
        """A journal record of another coordinator (an overlapping term): its accepted
        results and dead participants count here too (they are in the document)."""
        for index, attempt, agent, value in record.done:
            sub = self.subs[index]
            if sub.status != DONE:
                self._release(index)
                sub.status, sub.assignee, sub.attempt, sub.result = DONE, agent, attempt, value
        for agent in record.dead:
            part = self._parts.get(agent)
            if part is not None and part.alive:
                self._expire(agent, part)

    def follow(self, view: SwarmView) -> bool:
        """The journal's fold as this node's replica reads it now (after each read):
        every result it shows accepted is done here too, and every attempt it shows
        assigned may report. Records are not enough: a term refused when its record
        arrived is admitted once the records before it do, and is never new again.
        True when some sub-task became done."""
        changed = False
        for index, seen in enumerate(view.subtasks):
            learned = seen.attempts - self._attempts[index]
            if learned:
                self._attempts[index] |= learned
                self._learned[index] |= learned
            sub = self.subs[index]
            if seen.status == DONE and sub.status != DONE:
                self._release(index)
                sub.status, sub.assignee, sub.attempt = DONE, seen.assignee, seen.attempt
                sub.result, sub.ref = seen.result, seen.ref
                changed = True
        return changed

    def cancel(self) -> None:
        if self.status not in (COMPLETED, CANCELED):
            self.status = CANCELED
            self.record.status = CANCELED

    # -- decisions --------------------------------------------------------------------------

    def tick(self, now: float) -> Orders:
        """Expire leases, assign, escalate, complete (see the module docstring)."""
        if self.status in (COMPLETED, CANCELED):
            return Orders({}, [], False)
        for agent, part in self._parts.items():
            if part.alive and part.lease_until < now:
                self._expire(agent, part)
                self.record.dead.append(agent)
        assign: dict[str, list[tuple[int, int]]] = {}
        escalated: list[int] = []
        pending = [i for i, s in enumerate(self.subs) if s.status == PENDING]
        pending.sort(key=lambda i: (-self._cost[i], i))
        capable: dict[frozenset[str], list[tuple[str, _Participant]]] = {}
        full: set[frozenset[str]] = set()
        limit = self.config.prefetch
        for index in pending:
            needs = self._needs[index]
            if needs in full:
                continue
            able = capable.get(needs)
            if able is None:
                able = capable[needs] = [
                    (a, p) for a, p in self._parts.items() if p.alive and needs <= p.capabilities
                ]
            if not able:
                if now >= self._escalate_after:
                    self._escalate(index)
                    escalated.append(index)
                continue
            roomy = [(a, p) for a, p in able if len(p.outstanding) < p.capacity + limit]
            if not roomy:
                full.add(needs)
                continue
            cost = self._cost[index]
            failed = self._failed_by.get(index, set())
            agent, part = min(
                roomy,
                key=lambda ap: (
                    ap[0] in failed,
                    (ap[1].work + ap[1].external * self._mean + cost) / ap[1].capacity,
                    ap[0],
                ),
            )
            sub = self.subs[index]
            sub.attempt += 1
            sub.status, sub.assignee = ASSIGNED, agent
            self._hold(index, agent, part)
            self._attempts[index].add((sub.attempt, agent))
            self.assignments += 1
            self.record.assigned.append((index, agent, sub.attempt))
            assign.setdefault(agent, []).append((index, sub.attempt))
        return Orders(assign, escalated, self._update_status())

    def _update_status(self) -> bool:
        if all(s.status == DONE for s in self.subs):
            status = COMPLETED
        elif any(s.status == ESCALATED for s in self.subs):
            status = INPUT_REQUIRED
        else:
            status = WORKING
        if status == self.status:
            return False
        self.status = status
        self.record.status = status
        if status == COMPLETED:
            self.outcome = aggregate(self.plan.aggregate, self.plan.ids, self.results())
            self.record.outcome = self.outcome
        return True

    def _expire(self, agent: str, part: _Participant) -> None:
        part.alive = False
        for index in sorted(part.outstanding):
            sub = self.subs[index]
            if sub.status == ASSIGNED and sub.assignee == agent:
                sub.status = PENDING
                self.reassignments += 1
            self._holder.pop(index, None)
        part.outstanding.clear()
        part.work = 0.0

    def _escalate(self, index: int) -> None:
        sub = self.subs[index]
        sub.status, sub.escalated = ESCALATED, True
        self.record.escalated.append(index)

    def _hold(self, index: int, agent: str, part: _Participant) -> None:
        part.outstanding.add(index)
        part.work += self._cost[index]
        self._holder[index] = agent

    def _release(self, index: int) -> None:
        holder = self._holder.pop(index, None)
        if holder is not None:
            part = self._parts[holder]
            part.outstanding.discard(index)
            part.work = max(0.0, part.work - self._cost[index])

    # -- reading ----------------------------------------------------------------------------

    def take_record(self) -> tuple[str, Record] | None:
        """The journal entry to write now (its key under this term's map), or None."""
        if not self.record:
            return None
        record, self.record = self.record, Record()
        self._seq += 1
        return f"{self._seq:010d}", record

    def results(self) -> list[Any]:
        return [s.result for s in self.subs]

    @property
    def done(self) -> int:
        return sum(1 for s in self.subs if s.status == DONE)

    def escalated(self) -> list[int]:
        return [i for i, s in enumerate(self.subs) if s.status == ESCALATED]

    def members(self) -> list[str]:
        """Live participants."""
        return sorted(a for a, p in self._parts.items() if p.alive)

    def known(self, agent: str) -> bool:
        return agent in self._parts

    def missing_capabilities(self) -> set[frozenset[str]]:
        """The capability sets of escalated sub-tasks (what recruiting looks for)."""
        return {self._needs[i] for i in self.escalated()}


def invitees(
    cards: Iterable[tuple[str, frozenset[str]]],
    needs: Iterable[frozenset[str]],
    exclude: Iterable[str] = (),
) -> list[str]:
    """Of ``cards`` (agent id, capabilities offered), the agents to invite: those that
    offer every capability of at least one of ``needs`` (R8.1, Property 25), less
    ``exclude``, in the order given."""
    wanted = list(needs)
    skip = set(exclude)
    return [
        agent
        for agent, offered in cards
        if agent not in skip and any(caps <= offered for caps in wanted)
    ]


def successors(view: SwarmView, coordinator: str) -> list[str]:
    """Who takes over from ``coordinator``, in order: the live participants by member
    address (agent id first), less those on the coordinator's own peer (they went down
    with it)."""
    home = peer_of(coordinator)
    return [a for a in view.live_members()
            if a != coordinator and (home is None or peer_of(a) != home)]  # fmt: skip


def claim_after(rank: int, lease: float) -> float:
    """Seconds of the coordinator's silence after which the successor of ``rank`` claims:
    one lease, plus one per successor before it (each had its turn, and time for its
    claim to spread)."""
    return lease * (1 + rank)


@dataclass(slots=True)
class Participation:
    """One agent's part in one swarm (see the module docstring)."""

    agent: str
    capacity: int
    queue: deque[tuple[int, int]] = field(default_factory=deque)
    running: set[int] = field(default_factory=set)
    #: Results kept until the document shows the sub-task done: index -> (attempt, value).
    results: dict[int, tuple[int, Any]] = field(default_factory=dict)
    failures: dict[int, tuple[int, str]] = field(default_factory=dict)
    finished: int = 0

    def assigned(self, items: Iterable[tuple[int, int]]) -> list[int]:
        """Take assignments (from a message or the journal), skipping what it already
        runs, queued or finished. A kept result of the sub-task now stands for the later
        attempt assigned to it (the coordinator takes a result only for an attempt it
        knows: an earlier one may be from a term it does not count); returns those
        indices, to be sent again."""
        queued = {i for i, _ in self.queue}
        relabeled: list[int] = []
        for index, attempt in items:
            kept = self.results.get(index)
            if kept is not None and kept[0] < attempt:
                self.results[index] = (attempt, kept[1])
                relabeled.append(index)
            if index in self.running or index in queued or index in self.results:
                continue
            self.queue.append((index, attempt))
            queued.add(index)
        return relabeled

    def next(self) -> tuple[int, int] | None:
        """The next sub-task to start, if it has room."""
        if len(self.running) >= self.capacity or not self.queue:
            return None
        index, attempt = self.queue.popleft()
        self.running.add(index)
        return index, attempt

    def succeeded(self, index: int, attempt: int, value: Any) -> None:
        self.running.discard(index)
        self.results[index] = (attempt, value)
        self.finished += 1

    def failed(self, index: int, attempt: int, code: str) -> None:
        self.running.discard(index)
        self.failures[index] = (attempt, code)

    def accepted(self, view: SwarmView) -> None:
        """Forget results (and queued work) the journal shows done."""
        for index in [i for i in self.results if view.subtasks[i].status == DONE]:
            del self.results[index]
        self.queue = deque((i, a) for i, a in self.queue if view.subtasks[i].status != DONE)

    @property
    def load(self) -> int:
        return len(self.running) + len(self.queue)


__all__ = [
    "Coordinator",
    "Orders",
    "Participation",
    "SwarmConfig",
    "Verdict",
    "claim_after",
    "invitees",
    "successors",
]
