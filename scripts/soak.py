"""Soak test: a swarm of real ``p2pnode run`` daemons under steady load and churn.

What it does:

1. starts ``--nodes`` daemons (20) on 127.0.0.1 with p2pnode.cli.process.NodeProcess,
   each hosting one agent ``soak<i>`` that echoes requests, all bootstrapped off
   the first; every node subscribes to one shared document;
2. for ``--minutes`` minutes keeps ``--workers`` request loops busy (a request
   from a random node's agent to another's, through the control socket, each
   awaited; ``--rate`` requests a second in all, 300 by default) and a gossip
   loop (a ``counter.add`` on the document from a random node every
   ``--gossip-every`` seconds);
3. churn: at every minute a ``--churn`` fraction of the nodes (10%, never the
   first; ``--churn 0``: none) is stopped, alternately with SIGTERM and SIGKILL,
   and started again on its data directory (same identity, new port);
4. at the end of every minute prints, for every node, its resident memory (MB,
   VmRSS) and open descriptors (entries of /proc/PID/fd), marking a node that
   restarted in that minute with ``*``, and the requests and updates that
   succeeded or failed.

At the end: for the nodes that were never restarted after the ``--baseline``
minute (the second), the last minute's RSS and descriptor count against that
minute's (FLAT when within ``--tolerance``, 10%; the hostile peer's victim is held
to ``--rss-slack`` alone), and whether the document
converged on every node (its value read from each). Linux only (/proc).

What a node remembers per envelope is also bounded by age, so that under
steady load memory levels off within the first two minutes rather than when
the count bounds are reached: finished request threads leave the thread
store a minute after their answer, and the duplicate window holds the ids of
the last one to two minutes. (Before, the thread store's 10,000 threads and
the duplicate window filled over about 8 minutes, and RSS rose from 41-45 MB
at minute 2 to 57-58 MB.) What is still bounded by count only grows slowly
toward its bound: the ids of requests the node let through (whose answers,
a task's among them, may come much later) and the router's askers, about
200 bytes per request a node answers. The load is paced (``--rate``):
unpaced, the request rate follows whatever else the machine runs, and so
does what nodes hold for a minute.

With ``--hostile`` (the default; ``--no-hostile`` for honest traffic only) a
hostile peer (scripts/soak_hostile.py) runs beside the honest traffic for the
whole soak: its own daemon (agent ``mallory``) and raw channels cycle a
squatter of an honest agent's id that comes and goes, floods of requests,
task proposals and tool calls at one daemon (the *victim*, node 1, never
restarted), oversized and over-deep tool-call arguments, calls of a tool
that never returns, and an attached client that writes ops without reading
and closes. The victim hosts an attached ``toolbox`` agent (tools ``add``
and ``hang``); honest nodes call ``toolbox.add`` ``--tool-rate`` times a
second beside their requests.

The end prints, with a PASS/FAIL line each: the honest success rate of
requests and of tool calls (at least ``--min-success``, 99.9%; a call whose
source or target was restarted while it ran is counted as cut by churn, not
as failed), every daemon's RSS at its start against the end (within
``--rss-slack``, 50 MB; a restarted daemon from its last start), and the
tracebacks found in the daemons' logs (none). ``--heap-trace DIR`` makes
the ``--trace-nodes`` (node 1, the victim) write heap growth reports to DIR
(p2pnode.node.heaptrace; ``P2PNODE_HEAP_TRACE_EVERY`` seconds apart, 60).

Usage: python scripts/soak.py [--minutes 10] [--nodes 20] [--churn 0.1] [--no-hostile]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from soak_hostile import HOSTILE_AGENT, Hostile

from p2pnode.agent.definition import Agent
from p2pnode.cli.process import NodeProcess
from p2pnode.core.errors import P2PError
from p2pnode.hosting.client import AgentClient
from p2pnode.node.heaptrace import HEAP_TRACE_ENV

DOC = "soak.board"
CALL_TIMEOUT = 15.0
#: Lines of a daemon's stderr kept between two scans for tracebacks (once a minute).
LOG_LINES = 100_000
VICTIM = 1  # the hostile peer's target (never restarted)
FAILURES = (P2PError, OSError, trio.TooSlowError, trio.BrokenResourceError)


@dataclass
class Member:
    """One daemon of the swarm and what happened to it."""

    index: int
    process: NodeProcess
    restarts: list[int] = field(default_factory=list)  # minutes at whose start it restarted
    up: bool = False
    generation: int = 0  # starts so far: a call that saw it change was cut by churn
    start_rss: float = math.nan  # RSS when it last started

    @property
    def agent(self) -> str:
        return f"soak{self.index}"


@dataclass
class Stream:
    """Outcomes of one kind of honest call."""

    ok: int = 0
    failed: int = 0
    cut: int = 0  # source or target restarted while the call ran
    reasons: Counter[str] = field(default_factory=Counter)

    def rate(self) -> float:
        done = self.ok + self.failed
        return self.ok / done if done else 1.0


@dataclass
class Counters:
    requests: Stream = field(default_factory=Stream)
    tools: Stream = field(default_factory=Stream)
    updates_ok: int = 0
    updates_failed: int = 0
    added: int = 0  # total of the counter increments acknowledged
    sent: int = 0  # increments sent, acknowledged or not (one may land unacknowledged)
    tracebacks: int = 0
    traceback_heads: list[str] = field(default_factory=list)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def process_rss(process: NodeProcess) -> float:
    """The RSS of ``process`` in MB; NaN when it is not running."""
    child = process.process
    if child is None or child.returncode is not None:
        return math.nan
    try:
        return rss_mb(child.pid)
    except OSError:
        return math.nan


def toolbox() -> Agent:
    """The victim's attached agent: a tool that answers and one that never returns."""
    agent = Agent("toolbox", tier=3)

    @agent.tool()
    def add(a: int, b: int = 1) -> int:
        """Add two numbers."""
        return a + b

    @agent.tool()
    async def hang() -> None:
        """Never returns (until the soak ends)."""
        await trio.sleep_forever()

    return agent


def _reason(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    return str(code) if code is not None else type(exc).__name__


class Soak:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.root = root
        self.rng = random.Random(args.seed)
        self.members: list[Member] = []
        self.counters = Counters()
        self.table: list[dict[int, tuple[float, int, bool]]] = []  # minute -> node -> row
        self.hostile: Hostile | None = None

    async def call(self, member: Member, request: dict[str, Any]) -> Any:
        with trio.fail_after(CALL_TIMEOUT):
            return await member.process.call(request)

    async def start(self, member: Member, nursery: trio.Nursery) -> None:
        bootstrap = None if member.index == 0 else self.members[0].process.address
        await member.process.start(nursery, bootstrap)
        member.generation += 1
        member.up = True
        await self.call(member, {"op": "doc.subscribe", "doc": DOC})
        member.start_rss = process_rss(member.process)

    def node_env(self, index: int) -> dict[str, str] | None:
        if self.args.heap_trace is None or index not in self.args.trace_nodes:
            return None
        path = Path(self.args.heap_trace) / f"heap-n{index}.txt"
        return dict(os.environ, **{HEAP_TRACE_ENV: str(path)})

    def pair(self) -> tuple[Member, Member] | None:
        up = [m for m in self.members if m.up]
        if len(up) < 2:
            return None
        source, target = self.rng.sample(up, 2)
        return source, target

    async def paced(self, rate: float, share: int, one: Any) -> None:
        # Paced to ``rate`` (this loop's share of it): an unpaced loop runs as fast as the
        # machine lets it, and what nodes hold for a time (a minute of finished threads,
        # of envelope ids) then follows other people's load on the machine, not a leak.
        gap = share / rate if rate > 0 else 0.0
        due = trio.current_time()
        while True:
            if gap:
                due = max(due + gap, trio.current_time() - gap)  # no bursts to catch up
                await trio.sleep_until(due)
            if not await one():
                await trio.sleep(0.2)  # a node restarting: do not spin on it

    async def judged(
        self, stream: Stream, members: tuple[Member, ...], request: dict[str, Any], check: Any
    ) -> bool:
        """One honest call through ``members[0]``'s control socket, counted in ``stream``."""
        generations = [m.generation for m in members]
        try:
            ok = bool(check(await self.call(members[0], request)))
            reason = "wrong answer"
        except FAILURES as exc:
            ok, reason = False, _reason(exc)
        if ok:
            stream.ok += 1
        elif [m.generation for m in members] != generations or not all(m.up for m in members):
            stream.cut += 1
        else:
            stream.failed += 1
            stream.reasons[reason] += 1
        return ok

    async def one_request(self) -> bool:
        picked = self.pair()
        if picked is None:
            return False
        source, target = picked
        ask = {"op": "send", "from": source.agent, "to": target.agent, "type": "request",
               "payload": {"n": self.rng.random()}}  # fmt: skip
        return await self.judged(
            self.counters.requests,
            (source, target),
            ask,
            lambda reply: reply.get("sender") == target.agent,
        )

    async def one_tool_call(self) -> bool:
        victim = self.members[VICTIM]
        others = [m for m in self.members if m.up and m is not victim]
        if not others or not victim.up:
            return False
        source = self.rng.choice(others)
        a = self.rng.randrange(1000)
        ask = {"op": "tools.call", "agent": source.agent, "name": "toolbox.add",
               "arguments": {"a": a, "b": 1}}  # fmt: skip
        return await self.judged(
            self.counters.tools, (source, victim), ask, lambda reply: reply["result"] == a + 1
        )

    async def gossip_loop(self) -> None:
        while True:
            await trio.sleep(self.args.gossip_every)
            up = [m for m in self.members if m.up]
            if not up:
                continue
            writer = self.rng.choice(up)
            update = {"op": "counter.add", "path": "hits", "amount": 1}
            self.counters.sent += 1
            try:
                await self.call(writer, {"op": "doc.update", "doc": DOC, "update": update})
            except FAILURES:
                self.counters.updates_failed += 1
            else:
                self.counters.updates_ok += 1
                self.counters.added += 1

    async def attach_toolbox(self, *, task_status: trio.TaskStatus[None]) -> None:
        """Keep the toolbox attached to the victim for the whole soak; started once node 0
        can call it (bounded: 30 s)."""
        victim = self.members[VICTIM].process
        async with AgentClient(toolbox(), data_dir=victim.data_dir) as client:
            ask = {"op": "tools.call", "name": "toolbox.add", "arguments": {"a": 1}}
            for _ in range(60):
                try:
                    await self.call(self.members[0], ask)
                    break
                except FAILURES:
                    await trio.sleep(0.5)
            task_status.started()
            await client.wait_closed()

    async def churn(self, minute: int, nursery: trio.Nursery) -> None:
        count = round(self.args.churn * len(self.members))  # --churn 0: none
        candidates = self.members[VICTIM + 1 :] if self.args.hostile else self.members[1:]
        for i, member in enumerate(self.rng.sample(candidates, min(count, len(candidates)))):
            member.up = False
            if i % 2:
                await member.process.kill()
            else:
                await member.process.stop()
                with trio.move_on_after(10):
                    await member.process.wait()
                await member.process.kill()
            for attempt in (1, 2):  # a start that was late is killed and tried again
                try:
                    await self.start(member, nursery)
                    break
                except FAILURES as exc:
                    print(f"  restart {attempt} of {member.agent} failed: {exc}", file=sys.stderr)
                    await member.process.kill()
            member.restarts.append(minute + 1)

    def scan_logs(self) -> None:
        """Count tracebacks in what the daemons wrote since the last scan."""
        processes = [m.process for m in self.members]
        if self.hostile is not None:
            processes.append(self.hostile.process)
        for process in processes:
            for n, line in enumerate(process.log):
                if line.startswith("Traceback"):
                    self.counters.tracebacks += 1
                    if len(self.counters.traceback_heads) < 5:
                        tail = [x for x in process.log[n + 1 : n + 40] if not x.startswith(" ")]
                        where = process.data_dir.name
                        self.counters.traceback_heads.append(f"{where}: {tail[:1]}")
            del process.log[:]

    def sample(self, minute: int) -> None:
        row: dict[int, tuple[float, int, bool]] = {}
        for member in self.members:
            process = member.process.process
            if process is None or process.returncode is not None:
                continue
            try:
                row[member.index] = (
                    rss_mb(process.pid),
                    fd_count(process.pid),
                    minute in member.restarts,
                )
            except OSError:
                continue
        self.table.append(row)
        self.scan_logs()
        c = self.counters
        cells = " ".join(
            f"{m.agent}={rss:.0f}MB/{fds}fd{'*' if again else ''}"
            for m in self.members
            if (cell := row.get(m.index)) is not None
            for rss, fds, again in [cell]
        )
        hostile = ""
        if self.hostile is not None:
            hostile = f", hostile {process_rss(self.hostile.process):.0f}MB"
        print(
            f"minute {minute}: requests {c.requests.ok} ok {c.requests.failed} failed "
            f"{c.requests.cut} cut, tool calls {c.tools.ok} ok {c.tools.failed} failed "
            f"{c.tools.cut} cut, updates {c.updates_ok} ok {c.updates_failed} failed, "
            f"tracebacks {c.tracebacks}{hostile}\n  {cells}",
            flush=True,
        )

    async def open_members(self, nursery: trio.Nursery) -> None:
        for i in range(self.args.nodes):
            process = NodeProcess(self.root / f"n{i}", self.node_env(i), log_lines=LOG_LINES)
            member = Member(i, process)
            member.process.prepare(
                member.agent,
                3,
                [{"id": f"{member.agent}.echo", "name": "Echo", "description": "echo"}],
            )
            self.members.append(member)
            await self.start(member, nursery)

    async def open_hostile(self, nursery: trio.Nursery) -> Hostile:
        process = NodeProcess(self.root / "hostile", log_lines=LOG_LINES)
        process.prepare(HOSTILE_AGENT, 3)
        await process.start(nursery, self.members[0].process.address)
        victim = self.members[VICTIM]
        names = [m.agent for m in self.members if m.index != VICTIM]
        return Hostile(process, lambda: victim.process, victim.agent, names)

    async def load(self, nursery: trio.Nursery) -> None:
        """The honest traffic (and the hostile peer) for ``--minutes``, sampled each minute."""
        args = self.args
        async with trio.open_nursery() as load:
            for _ in range(args.workers):
                load.start_soon(self.paced, args.rate, args.workers, self.one_request)
            if self.hostile is not None:
                load.start_soon(self.paced, args.tool_rate, 1, self.one_tool_call)
            load.start_soon(self.gossip_loop)
            start = trio.current_time()
            if self.hostile is not None:
                load.start_soon(self.hostile.run, start + 60.0 * args.minutes - 5.0)
            for minute in range(1, args.minutes + 1):
                await trio.sleep_until(start + 60.0 * minute - 1.0)
                self.sample(minute)
                if minute < args.minutes:
                    await self.churn(minute, nursery)
            load.cancel_scope.cancel()

    async def run(self) -> int:
        args = self.args
        async with trio.open_nursery() as nursery:
            await self.open_members(nursery)
            if args.hostile:
                self.hostile = await self.open_hostile(nursery)
                await nursery.start(self.attach_toolbox)
            print(f"{args.nodes} nodes up; soaking for {args.minutes} minutes", flush=True)
            await self.load(nursery)
            converged = await self.converged()
            ends = {m.index: process_rss(m.process) for m in self.members}
            processes = [m.process for m in self.members]
            if self.hostile is not None:
                processes.append(self.hostile.process)
            for process in processes:
                await process.stop()
            for process in processes:
                with trio.move_on_after(10):
                    await process.wait()
                await process.kill()
            self.scan_logs()
            nursery.cancel_scope.cancel()
        return self.report(converged, ends)

    async def converged(self) -> bool:
        # Wait (bounded) for every replica to hold the same value, with every
        # acknowledged increment in it. An increment whose call failed or was cut
        # short by the end of the load (sent, not acknowledged) may have landed too.
        low, high = self.counters.added, self.counters.sent
        values: list[Any] = []
        for _ in range(60):
            values = []
            for member in self.members:
                try:
                    read = await self.call(member, {"op": "doc.read", "doc": DOC})
                    values.append(read["value"].get("hits"))
                except (*FAILURES, AttributeError):
                    values.append(None)
            if len(set(values)) == 1 and isinstance(values[0], int) and low <= values[0] <= high:
                return True
            await trio.sleep(1.0)
        print(f"document not converged: want {low}..{high}, replicas hold {values}")
        return False

    def flat(self) -> bool | None:
        """The steady nodes' RSS and fds, the baseline minute against the last (None:
        too short to judge)."""
        if len(self.table) < 2:
            print("too short to compare minutes (need at least 2)")
            return None
        base = min(self.args.baseline, len(self.table) - 1)
        first, last = self.table[base - 1], self.table[-1]
        # The victim of the hostile peer is held to the RSS slack instead: each round of
        # floods leaves it a little higher until its budgets are full.
        steady = [
            m
            for m in self.members
            if all(minute <= base for minute in m.restarts)
            and m.index in first
            and m.index in last
            and not (self.args.hostile and m.index == VICTIM)
        ]
        tol = self.args.tolerance
        flat = True
        print(
            f"\nminute {base} vs minute {len(self.table)}, "
            f"nodes never restarted since minute {base}:"
        )
        print(f"node       RSS MB ({base} -> last)   fds ({base} -> last)")
        for m in steady:
            (r2, f2, _), (rl, fl, _) = first[m.index], last[m.index]
            ok = rl <= r2 * (1 + tol) and fl <= f2 * (1 + tol) + 1
            flat = flat and ok
            mark = "" if ok else "  <- grew"
            print(f"{m.agent:<10} {r2:6.1f} -> {rl:6.1f}      {f2:4d} -> {fl:4d}{mark}")
        return flat

    def judge_rss(self, ends: dict[int, float]) -> bool:
        slack = self.args.rss_slack
        print(f"\nRSS at start -> end (MB; * restarted: from its last start), slack {slack:g} MB")
        ok = True
        for m in self.members:
            end = ends.get(m.index, math.nan)
            good = not end > m.start_rss + slack
            ok = ok and good
            mark = "*" if m.restarts else " "
            grew = "" if good else "  <- grew"
            print(f"  {m.agent:<8}{mark} {m.start_rss:6.1f} -> {end:6.1f}{grew}")
        return ok

    def report(self, converged: bool, ends: dict[int, float]) -> int:
        flat = self.flat()
        c = self.counters
        print(f"\nupdates {c.updates_ok} ok, {c.updates_failed} failed; document "
              f"{'converged' if converged else 'NOT converged'}")  # fmt: skip
        if self.hostile is not None:
            print(self.hostile.summary())
        verdicts: list[tuple[str, bool]] = []
        streams = [("requests", c.requests)] + ([("tool calls", c.tools)] if self.hostile else [])
        for name, stream in streams:
            reasons = ", ".join(f"{k} {v}" for k, v in stream.reasons.most_common(5))
            print(f"honest {name}: {stream.ok} ok, {stream.failed} failed ({reasons or '-'}), "
                  f"{stream.cut} cut by churn; success {stream.rate():.4%}")  # fmt: skip
            verdicts.append((f"honest {name} success >= {self.args.min_success:.1%}",
                             stream.rate() >= self.args.min_success))  # fmt: skip
        verdicts.append((f"every daemon's RSS within {self.args.rss_slack:g} MB of its start",
                         self.judge_rss(ends)))  # fmt: skip
        print(f"\ntracebacks in daemon logs: {c.tracebacks}")
        for head in c.traceback_heads:
            print(f"  {head}")
        verdicts.append(("no traceback in daemon logs", c.tracebacks == 0))
        verdicts.append(("document converged", converged))
        if flat is not None:
            verdicts.append((f"steady RSS and fds within {self.args.tolerance:.0%}", flat))
        print()
        for what, good in verdicts:
            print(f"{'PASS' if good else 'FAIL'}  {what}")
        return 0 if all(good for _, good in verdicts) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=int, default=10)
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--churn", type=float, default=0.1, help="fraction restarted a minute")
    parser.add_argument("--workers", type=int, default=4, help="concurrent request loops")
    parser.add_argument(
        "--rate", type=float, default=300.0, help="requests a second in all (0: unpaced)"
    )
    parser.add_argument("--tool-rate", type=float, default=2.0, help="honest tool calls a second")
    parser.add_argument("--gossip-every", type=float, default=1.0, help="seconds per update")
    parser.add_argument("--tolerance", type=float, default=0.1)
    parser.add_argument("--baseline", type=int, default=2, help="minute compared with the last")
    parser.add_argument(
        "--hostile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the hostile peer beside the honest traffic (default: on)",
    )
    parser.add_argument("--min-success", type=float, default=0.999)
    parser.add_argument("--rss-slack", type=float, default=50.0, help="MB above a daemon's start")
    parser.add_argument("--heap-trace", metavar="DIR", help="heap growth reports to DIR")
    parser.add_argument(
        "--trace-nodes", default="1", help="comma-separated nodes that --heap-trace traces"
    )
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    args.trace_nodes = {int(n) for n in args.trace_nodes.split(",") if n}
    if args.nodes < 2 + args.hostile or args.minutes < 1 or args.baseline < 1:
        parser.error("need at least 2 nodes (3 with --hostile), 1 minute and a baseline >= 1")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="p2pnode-soak-") as root:
        code = trio.run(Soak(args, Path(root)).run)
    print(f"done in {time.monotonic() - started:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
