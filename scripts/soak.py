"""Soak test: a swarm of real ``p2pnode run`` daemons under steady load and churn.

What it does:

1. starts ``--nodes`` daemons (20) on 127.0.0.1 with p2pnode.process.NodeProcess,
   each hosting one agent ``soak<i>`` that echoes requests, all bootstrapped off
   the first; every node subscribes to one shared document;
2. for ``--minutes`` minutes keeps ``--workers`` request loops busy (a request
   from a random node's agent to another's, through the control socket, each
   awaited; ``--rate`` requests a second in all, 300 by default) and a gossip
   loop (a ``counter.add`` on the document from a random node every
   ``--gossip-every`` seconds);
3. churn: at every minute a ``--churn`` fraction of the nodes (10%, never the
   first) is stopped, alternately with SIGTERM and SIGKILL, and started again on
   its data directory (same identity, new port);
4. at the end of every minute prints, for every node, its resident memory (MB,
   VmRSS) and open descriptors (entries of /proc/PID/fd), marking a node that
   restarted in that minute with ``*``, and the requests and updates that
   succeeded or failed.

At the end: for the nodes that were never restarted after the ``--baseline``
minute (the second), the last minute's RSS and descriptor count against that
minute's (FLAT when within ``--tolerance``, 10%), and whether the document
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

Usage: python scripts/soak.py [--minutes 10] [--nodes 20] [--churn 0.1]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from p2pnode.errors import P2PError
from p2pnode.process import NodeProcess

DOC = "soak.board"
CALL_TIMEOUT = 15.0


@dataclass
class Member:
    """One daemon of the swarm and what happened to it."""

    index: int
    process: NodeProcess
    restarts: list[int] = field(default_factory=list)  # minutes at whose start it restarted
    up: bool = False

    @property
    def agent(self) -> str:
        return f"soak{self.index}"


@dataclass
class Counters:
    requests_ok: int = 0
    requests_failed: int = 0
    updates_ok: int = 0
    updates_failed: int = 0
    added: int = 0  # total of the counter increments acknowledged
    sent: int = 0  # increments sent, acknowledged or not (one may land unacknowledged)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


class Soak:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.root = root
        self.rng = random.Random(args.seed)
        self.members: list[Member] = []
        self.counters = Counters()
        self.table: list[dict[int, tuple[float, int, bool]]] = []  # minute -> node -> row

    async def call(self, member: Member, request: dict[str, Any]) -> Any:
        with trio.fail_after(CALL_TIMEOUT):
            return await member.process.call(request)

    async def start(self, member: Member, nursery: trio.Nursery) -> None:
        bootstrap = None if member.index == 0 else self.members[0].process.address
        await member.process.start(nursery, bootstrap)
        member.up = True
        await self.call(member, {"op": "doc.subscribe", "doc": DOC})

    async def request_loop(self) -> None:
        # Paced to --rate (this loop's share of it): an unpaced loop runs as fast as the
        # machine lets it, and what nodes hold for a time (a minute of finished threads,
        # of envelope ids) then follows other people's load on the machine, not a leak.
        gap = self.args.workers / self.args.rate if self.args.rate > 0 else 0.0
        due = trio.current_time()
        while True:
            if gap:
                due = max(due + gap, trio.current_time() - gap)  # no bursts to catch up
                await trio.sleep_until(due)
            up = [m for m in self.members if m.up]
            if len(up) < 2:
                await trio.sleep(0.1)
                continue
            source, target = self.rng.sample(up, 2)
            ask = {"op": "send", "from": source.agent, "to": target.agent, "type": "request"}
            try:
                reply = await self.call(source, {**ask, "payload": {"n": self.rng.random()}})
                ok = reply.get("sender") == target.agent
            except (P2PError, OSError, trio.TooSlowError, trio.BrokenResourceError):
                ok = False
            if ok:
                self.counters.requests_ok += 1
            else:
                self.counters.requests_failed += 1
                await trio.sleep(0.2)  # a node restarting: do not spin on it

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
            except (P2PError, OSError, trio.TooSlowError, trio.BrokenResourceError):
                self.counters.updates_failed += 1
            else:
                self.counters.updates_ok += 1
                self.counters.added += 1

    async def churn(self, minute: int, nursery: trio.Nursery) -> None:
        count = max(1, round(self.args.churn * len(self.members)))
        for i, member in enumerate(self.rng.sample(self.members[1:], count)):
            member.up = False
            if i % 2:
                await member.process.kill()
            else:
                await member.process.stop()
                with trio.move_on_after(10):
                    await member.process.wait()
                await member.process.kill()
            try:
                await self.start(member, nursery)
            except (P2PError, OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
                print(f"  restart of {member.agent} failed: {exc}", file=sys.stderr)
            member.restarts.append(minute + 1)

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
        c = self.counters
        cells = " ".join(
            f"{m.agent}={rss:.0f}MB/{fds}fd{'*' if again else ''}"
            for m in self.members
            if (cell := row.get(m.index)) is not None
            for rss, fds, again in [cell]
        )
        print(
            f"minute {minute}: requests {c.requests_ok} ok {c.requests_failed} failed, "
            f"updates {c.updates_ok} ok {c.updates_failed} failed\n  {cells}",
            flush=True,
        )

    async def run(self) -> int:
        args = self.args
        async with trio.open_nursery() as nursery:
            for i in range(args.nodes):
                member = Member(i, NodeProcess(self.root / f"n{i}", log_lines=200))
                member.process.prepare(
                    member.agent,
                    3,
                    [{"id": f"{member.agent}.echo", "name": "Echo", "description": "echo"}],
                )
                self.members.append(member)
                await self.start(member, nursery)
            print(f"{args.nodes} nodes up; soaking for {args.minutes} minutes", flush=True)
            async with trio.open_nursery() as load:
                for _ in range(args.workers):
                    load.start_soon(self.request_loop)
                load.start_soon(self.gossip_loop)
                start = trio.current_time()
                for minute in range(1, args.minutes + 1):
                    await trio.sleep_until(start + 60.0 * minute - 1.0)
                    self.sample(minute)
                    if minute < args.minutes:
                        await self.churn(minute, nursery)
                load.cancel_scope.cancel()
            converged = await self.converged()
            for member in self.members:
                await member.process.stop()
            for member in self.members:
                with trio.move_on_after(10):
                    await member.process.wait()
                await member.process.kill()
            nursery.cancel_scope.cancel()
        return self.report(converged)

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
                except (
                    P2PError,
                    OSError,
                    trio.TooSlowError,
                    trio.BrokenResourceError,
                    AttributeError,
                ):
                    values.append(None)
            if len(set(values)) == 1 and isinstance(values[0], int) and low <= values[0] <= high:
                return True
            await trio.sleep(1.0)
        print(f"document not converged: want {low}..{high}, replicas hold {values}")
        return False

    def report(self, converged: bool) -> int:
        if len(self.table) < 2:
            print("too short to judge (need at least 2 minutes)")
            return 0
        base = min(self.args.baseline, len(self.table) - 1)
        first, last = self.table[base - 1], self.table[-1]
        steady = [
            m
            for m in self.members
            if all(minute <= base for minute in m.restarts) and m.index in first and m.index in last
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
        c = self.counters
        print(
            f"\nrequests {c.requests_ok} ok, {c.requests_failed} failed; updates "
            f"{c.updates_ok} ok, {c.updates_failed} failed; document "
            f"{'converged' if converged else 'NOT converged'}"
        )
        print(f"RSS and fds {'FLAT' if flat else 'NOT FLAT'} (within {tol:.0%})")
        return 0 if flat and converged else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=int, default=10)
    parser.add_argument("--nodes", type=int, default=20)
    parser.add_argument("--churn", type=float, default=0.1, help="fraction restarted a minute")
    parser.add_argument("--workers", type=int, default=4, help="concurrent request loops")
    parser.add_argument(
        "--rate", type=float, default=300.0, help="requests a second in all (0: unpaced)"
    )
    parser.add_argument("--gossip-every", type=float, default=1.0, help="seconds per update")
    parser.add_argument("--tolerance", type=float, default=0.1)
    parser.add_argument("--baseline", type=int, default=2, help="minute compared with the last")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.nodes < 2 or args.minutes < 1 or args.baseline < 1:
        parser.error("need at least 2 nodes, 1 minute and a baseline minute >= 1")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="p2pnode-soak-") as root:
        code = trio.run(Soak(args, Path(root)).run)
    print(f"done in {time.monotonic() - started:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
