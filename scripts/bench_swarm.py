"""Benchmark: a simulated swarm of 200 agents doing 2,000 sub-tasks of known duration.

Drives the swarm's sans-IO cores (p2pnode.services.swarms.coordinator: the coordinator's
decisions and each participant's bookkeeping; p2pnode.services.swarms.document: the
journal and its fold) in a discrete-event simulation: every message takes
10-30 ms, the journal and the coordinator lease reach each participant 50-250
ms after they are written (gossip), each participant runs one sub-task at a
time for exactly its complexity in seconds, beats every third of the lease and
sends each result when done. The coordinator decides as the swarm service
does: at once when a result or a join arrives, and at least every tick; it
journals once per tick and renews its lease every third of the lease.

Scenarios (each a median of ``--runs`` seeds):

* ``none``         no failure;
* ``kill 20%``     a fifth of the participants killed at half the ideal time;
* ``coordinator``  the coordinator killed at half the ideal time: the first live
  participant by id claims the lease after ``claim_after`` seconds of
  silence and resumes from the journal it has (work the old one assigned but had
  not journaled runs again; results are sent again to the new coordinator).

Reported: the makespan against the ideal (total work / agents), coordination
messages per sub-task (assign, done, beat, join; journal writes and lease
renewals, and the deliveries their gossip costs at ``--fanout`` copies per
replica), the time from a kill to the reassignment of the victims' sub-tasks
(or to the takeover), and whether the targets are met: makespan <= 1.15 x ideal
with no kill, <= 1.5 x with 20 % killed; reassignment within 2 lease periods.
Every run also checks the journal's fold: each sub-task's result accepted once.

Usage: python scripts/bench_swarm.py [--agents 200] [--subtasks 2000] [--lease 10]
       [--runs 3] [--seed 1]
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from p2pnode.agent.task import Task
from p2pnode.services.swarms.coordinator import (
    Coordinator,
    Participation,
    SwarmConfig,
    claim_after,
    successors,
)
from p2pnode.services.swarms.document import (
    COMPLETED,
    Plan,
    Record,
    SubTask,
    SwarmView,
    apply,
    fold,
    log_key,
)

EPOCH_MS = 1_800_000_000_000
CAP = "work"


@dataclass
class Stats:
    """What one run measured."""

    makespan: float = 0.0
    ideal: float = 0.0
    messages: int = 0
    journal_writes: int = 0
    lease_writes: int = 0
    reassign_after: list[float] = field(default_factory=list)
    takeover_after: float | None = None
    reassignments: int = 0
    runs_twice: int = 0
    ok: bool = False


class Sim:
    """The event loop: a heap of (time, sequence, action)."""

    def __init__(self, seed: int) -> None:
        self.now = 0.0
        self.rng = random.Random(seed)
        self._queue: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def at(self, when: float, action: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (when, self._seq, action))

    def after(self, delay: float, action: Callable[[], None]) -> None:
        self.at(self.now + delay, action)

    def latency(self) -> float:
        return self.rng.uniform(0.010, 0.030)

    def gossip_delay(self) -> float:
        return self.rng.uniform(0.050, 0.250)

    def run(self, until: Callable[[], bool], limit: float) -> None:
        while self._queue and not until():
            when, _, action = heapq.heappop(self._queue)
            if when > limit:
                break
            self.now = when
            action()


@dataclass
class Agent:
    """A participant: its bookkeeping core and what it knows of the coordinator."""

    id: str
    core: Participation
    alive: bool = True
    busy: bool = False
    coordinator: str = "boss"
    journal: dict[str, Record] = field(default_factory=dict)
    lease_seen: float = 0.0
    resent: float = 0.0
    view: SwarmView | None = None
    last_key: str = ""


class Swarm:
    """One simulated swarm run (see the module docstring)."""

    def __init__(self, plan: Plan, agents: int, seed: int, lease: float, config: SwarmConfig):
        self.sim = Sim(seed)
        self.plan = plan
        self.config = config
        self.lease = lease
        self.stats = Stats()
        self.agents = {
            f"a{i:04d}": Agent(f"a{i:04d}", Participation(f"a{i:04d}", 1)) for i in range(agents)
        }
        self.coordinator_id = "boss"
        self.coordinator: Coordinator | None = Coordinator(plan, "boss", 1, now=0.0, config=config)
        self.coordinator_alive = True
        self.journal: dict[str, Record] = {}  # every record written, by key
        self.tick_pending = False
        self.next_journal = 0.0
        self.victims: set[str] = set()
        self.killed_at: float | None = None
        self.victim_held: set[int] = set()
        self.started: dict[int, int] = {}

    # -- messages ---------------------------------------------------------------------------

    def send(self, action: Callable[[], None]) -> None:
        self.stats.messages += 1
        self.sim.after(self.sim.latency(), action)

    def write(self, key: str, record: Record) -> None:
        """A journal record: replicated to every participant after a gossip delay."""
        self.journal[key] = record
        self.stats.journal_writes += 1
        for agent in self.agents.values():
            self.sim.after(self.sim.gossip_delay(), partial(self._replicated, agent, key, record))

    def renew(self) -> None:
        self.stats.lease_writes += 1
        for agent in self.agents.values():
            self.sim.after(
                self.sim.gossip_delay(), partial(self._lease, agent, self.coordinator_id)
            )

    def _replicated(self, agent: Agent, key: str, record: Record) -> None:
        """A record reaches a participant's replica: its fold grows (in key order; a
        record arriving out of order refolds)."""
        if not agent.alive:
            return
        agent.journal[key] = record
        if agent.view is None or key < agent.last_key:
            agent.view = fold(len(self.plan.subtasks), agent.journal.items())
        else:
            apply(agent.view, key, record)
        agent.last_key = max(agent.last_key, key)

    def _lease(self, agent: Agent, coordinator: str) -> None:
        if not agent.alive:
            return
        if coordinator != agent.coordinator:
            agent.coordinator = coordinator
            self._resend(agent)
        agent.lease_seen = self.sim.now

    # -- the coordinator ------------------------------------------------------------------------

    def wake(self) -> None:
        if not self.tick_pending:
            self.tick_pending = True
            self.sim.after(0.0, self.tick)

    def tick(self, scheduled: object = None) -> None:
        """Decide; ``scheduled`` is the coordinator the periodic tick belongs to."""
        if scheduled is None:
            self.tick_pending = False
        core = self.coordinator
        if core is None or not self.coordinator_alive or scheduled not in (None, core):
            return
        now = self.sim.now
        before = core.reassignments
        orders = core.tick(now)
        if core.reassignments > before and self.killed_at is not None:
            self.stats.reassign_after.append(now - self.killed_at)
        for agent_id, items in orders.assign.items():
            self.send(partial(self._assigned, self.agents[agent_id], items, self.coordinator_id))
        if now >= self.next_journal or core.status == COMPLETED:
            self.next_journal = now + self.config.tick
            taken = core.take_record()
            if taken is not None:
                self.write(f"{log_key(core.epoch, self.coordinator_id)}/{taken[0]}", taken[1])
        if core.status == COMPLETED:
            self.stats.makespan = now
            return
        if scheduled is not None:
            self.sim.after(self.config.tick, lambda: self.tick(core))

    def renew_loop(self) -> None:
        if (
            self.coordinator is None
            or not self.coordinator_alive
            or self.coordinator.status == COMPLETED
        ):
            return
        self.renew()
        self.sim.after(self.lease / 3, self.renew_loop)

    def to_coordinator(self, target: str, deliver: Callable[[Coordinator], object]) -> None:
        if (
            self.coordinator_alive
            and target == self.coordinator_id
            and self.coordinator is not None
        ):
            deliver(self.coordinator)
            self.wake()

    # -- participants -------------------------------------------------------------------------

    def _assigned(self, agent: Agent, items: list[tuple[int, int]], sender: str) -> None:
        if agent.alive and sender == agent.coordinator:
            agent.core.assigned(items)
            self._start(agent)

    def _start(self, agent: Agent) -> None:
        if not agent.alive or agent.busy:
            return
        started = agent.core.next()
        if started is None:
            return
        index, attempt = started
        agent.busy = True
        self.started[index] = self.started.get(index, 0) + 1
        duration = self.plan.subtasks[index].task.complexity
        self.sim.after(duration, lambda: self._finish(agent, index, attempt))

    def _finish(self, agent: Agent, index: int, attempt: int) -> None:
        if not agent.alive:
            return
        agent.busy = False
        value = self.plan.subtasks[index].task.input
        agent.core.succeeded(index, attempt, value)
        self.send(partial(self._result, agent.id, agent.coordinator, index, attempt, value))
        self._start(agent)

    def beat(self, agent: Agent) -> None:
        if not agent.alive:
            return
        coordinator = agent.coordinator

        def deliver(core: Coordinator) -> None:
            now, now_ms = self.sim.now, EPOCH_MS + int(self.sim.now * 1000)
            if not core.beat(agent.id, now=now, now_ms=now_ms):
                core.join(agent.id, {CAP}, 1, now=now, now_ms=now_ms)

        self.send(lambda: self.to_coordinator(coordinator, deliver))
        self.sim.after(self.lease / 3, lambda: self.beat(agent))
        self._watch(agent)

    def _watch(self, agent: Agent) -> None:
        """What a participant does with its replica every beat: drop accepted results,
        and claim the coordinator lease when it lapsed and its turn came."""
        view = agent.view or fold(len(self.plan.subtasks), ())
        agent.core.accepted(view)
        if agent.core.results and self.sim.now - agent.resent >= self.lease:
            self._resend(agent)
        order = successors(view, agent.coordinator)
        if agent.id in order and self.sim.now - agent.lease_seen >= claim_after(
            order.index(agent.id), self.lease
        ):
            self._claim(agent, view)

    def _claim(self, agent: Agent, view: Any) -> None:
        if self.coordinator_id == agent.id:
            return
        old = self.coordinator
        epoch = (old.epoch if old is not None else 1) + 1
        self.coordinator_id = agent.id
        self.coordinator = Coordinator(
            self.plan, agent.id, epoch, now=self.sim.now, config=self.config, view=view
        )
        self.coordinator_alive = True
        if self.killed_at is not None and self.stats.takeover_after is None:
            self.stats.takeover_after = self.sim.now - self.killed_at
        agent.coordinator = agent.id
        self._resend(agent)
        self.renew_loop()
        self.tick(self.coordinator)

    def _resend(self, agent: Agent) -> None:
        """Send the results not yet accepted in the journal to the coordinator again."""
        agent.resent = self.sim.now
        for index, (attempt, value) in list(agent.core.results.items()):
            self.send(partial(self._result, agent.id, agent.coordinator, index, attempt, value))

    def _result(self, agent: str, coordinator: str, index: int, attempt: int, value: Any) -> None:
        self.to_coordinator(coordinator, lambda c: c.result(agent, index, attempt, value))

    # -- the run ------------------------------------------------------------------------------

    def run(self, kill: str) -> Stats:
        core = self.coordinator
        assert core is not None
        total = sum(s.task.complexity for s in self.plan.subtasks)
        self.stats.ideal = total / len(self.agents)
        for agent in self.agents.values():  # invitations: proposal, accept, award
            self.stats.messages += 3
            self.sim.after(self.sim.latency() * 3, partial(self._join, agent))
        self.renew_loop()
        self.sim.after(0.0, lambda: self.tick(core))
        if kill == "participants":
            self.sim.at(self.stats.ideal / 2, self._kill_participants)
        elif kill == "coordinator":
            self.sim.at(self.stats.ideal / 2, self._kill_coordinator)
        self.sim.run(lambda: self.stats.makespan > 0, limit=self.stats.ideal * 10)
        final = self.coordinator
        assert final is not None
        self.stats.reassignments = final.reassignments + (
            core.reassignments if final is not core else 0
        )
        self.stats.runs_twice = sum(1 for n in self.started.values() if n > 1)
        view = fold(len(self.plan.subtasks), self.journal.items())
        expected = [s.task.input for s in self.plan.subtasks]
        self.stats.ok = view.status == COMPLETED and view.results() == expected
        return self.stats

    def _join(self, agent: Agent) -> None:
        core = self.coordinator
        assert core is not None
        core.join(agent.id, {CAP}, 1, now=self.sim.now, now_ms=EPOCH_MS + int(self.sim.now * 1000))
        agent.lease_seen = self.sim.now
        self.sim.after(self.lease / 3, lambda: self.beat(agent))
        self.wake()

    def _kill_participants(self) -> None:
        ids = sorted(self.agents)
        victims = self.sim.rng.sample(ids, len(ids) // 5)
        for victim in victims:
            self.agents[victim].alive = False
        self.victims = set(victims)
        self.killed_at = self.sim.now

    def _kill_coordinator(self) -> None:
        self.coordinator_alive = False
        self.killed_at = self.sim.now


def make_plan(n: int, seed: int, mean: float) -> Plan:
    rng = random.Random(seed)
    subtasks = tuple(
        SubTask(
            f"t{i}", Task(f"part {i}", (CAP,), round(rng.uniform(0.5 * mean, 1.5 * mean), 3), i)
        )
        for i in range(n)
    )
    return Plan("bench", "bench", subtasks, "sum", 10.0, "boss")


def _seconds(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}s"


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=200)
    parser.add_argument("--subtasks", type=int, default=2000)
    parser.add_argument("--lease", type=float, default=10.0)
    parser.add_argument("--mean", type=float, default=10.0, help="mean sub-task seconds")
    parser.add_argument("--fanout", type=int, default=4, help="gossip copies per replica")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    config = SwarmConfig()
    print(f"{args.agents} agents, {args.subtasks} sub-tasks of {0.5 * args.mean:g}-"
          f"{1.5 * args.mean:g} s, lease {args.lease:g} s, tick {config.tick:g} s, "
          f"median of {args.runs} runs")  # fmt: skip
    header = (f"{'scenario':<12} {'makespan':>9} {'ideal':>7} {'ratio':>6} {'msgs/sub':>8} "
              f"{'writes/sub':>10} {'gossip/sub':>10} {'reassign':>9} {'ran 2x':>6} {'ok':>3} "
              f"{'wall':>6}")  # fmt: skip
    print(header)
    results: dict[str, dict[str, float]] = {}
    for scenario in ("none", "participants", "coordinator"):
        rows = []
        for run in range(args.runs):
            seed = args.seed + run
            plan = make_plan(args.subtasks, seed, args.mean)
            plan = Plan(
                plan.swarm, plan.description, plan.subtasks, plan.aggregate, args.lease, "boss"
            )
            start = time.perf_counter()
            stats = Swarm(plan, args.agents, seed, args.lease, config).run(scenario)
            rows.append((stats, time.perf_counter() - start))
        n = args.subtasks
        ratio = median([s.makespan / s.ideal for s, _ in rows])
        msgs = median([s.messages / n for s, _ in rows])
        writes = median([(s.journal_writes + s.lease_writes) / n for s, _ in rows])
        gossip = writes * args.agents * args.fanout
        if scenario == "coordinator":
            reassign = median([s.takeover_after or float("nan") for s, _ in rows])
        elif scenario == "participants":
            reassign = median(
                [max(s.reassign_after) if s.reassign_after else float("nan") for s, _ in rows]
            )
        else:
            reassign = float("nan")
        results[scenario] = {"ratio": ratio, "reassign": reassign}
        twice = median([s.runs_twice for s, _ in rows])
        ok = all(s.ok for s, _ in rows)
        label = {"none": "none", "participants": "kill 20%", "coordinator": "coordinator"}[scenario]
        print(f"{label:<12} {median([s.makespan for s, _ in rows]):>8.1f}s "
              f"{median([s.ideal for s, _ in rows]):>6.1f}s {ratio:>6.3f} {msgs:>8.2f} "
              f"{writes:>10.3f} {gossip:>10.0f} {_seconds(reassign):>9} {twice:>6.0f} "
              f"{'yes' if ok else 'NO':>3} {median([w for _, w in rows]):>5.1f}s")  # fmt: skip
    lease = args.lease
    checks = [
        ("makespan <= 1.15 x ideal, no kill", results["none"]["ratio"] <= 1.15,
         f"{results['none']['ratio']:.3f}"),
        ("makespan <= 1.5 x ideal, 20% killed", results["participants"]["ratio"] <= 1.5,
         f"{results['participants']['ratio']:.3f}"),
        ("reassignment within 2 leases", results["participants"]["reassign"] <= 2 * lease,
         f"{results['participants']['reassign']:.1f} s <= {2 * lease:g} s"),
    ]  # fmt: skip
    print(f"(coordinator killed: taken over after {results['coordinator']['reassign']:.1f} s, "
          f"makespan {results['coordinator']['ratio']:.3f} x ideal)")  # fmt: skip
    for name, met, value in checks:
        print(f"{'MET' if met else 'NOT MET':<8} {name}: {value}")


if __name__ == "__main__":
    main()
