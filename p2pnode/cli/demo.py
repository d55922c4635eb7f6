"""``p2pnode demo``: a real multi-node swarm on 127.0.0.1, in separate OS processes.

It starts N ``p2pnode run`` processes, each with its own identity and an
agent card with different capabilities and tiers, joins them through the
first one, then shows discovery by capability, a request/response across
processes, a broadcast, a cross-tier message refused by policy, a shared
CRDT document every node writes to and that converges by gossip, and one
more process hosting an agent written with the Agent API
(:mod:`p2pnode.cli.demo_agent`, ``run --agent``) whose input schema is enforced and
whose tool the orchestrator calls from another process while the tool's access
rule refuses an L3 agent, and a swarm of worker processes that finishes its
sub-tasks although one worker is killed mid-run (:mod:`p2pnode.cli.demo_swarm`). It
exits 0 when all of that worked, and always stops every process it started.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from p2pnode.cli.demo_swarm import CAPABILITY, WORKER_AGENT, swarm_check
from p2pnode.cli.process import NodeProcess
from p2pnode.core.errors import ErrorCode, LocalError, P2PError

# (agent id, tier, capability): planetary agents keep their assigned tiers.
ROSTER: list[tuple[str, int, str]] = [
    ("sun", 0, "orchestrate.swarm"),
    ("mercury", 1, "plan.strategy"),
    ("venus", 2, "design.ui"),
    ("mars", 2, "build.backend"),
    ("io", 3, "test.unit"),
    ("europa", 3, "docs.write"),
    ("titan", 2, "data.pipeline"),
    ("callisto", 3, "review.code"),
]
DISCOVERY_TIMEOUT = 30.0
ORACLE = "p2pnode.cli.demo_agent:agent"
#: The oracle's tool (p2pnode.cli.demo_agent.estimate), open to L0 agents only.
TOOL = "oracle.estimate"
#: Worker processes of the swarm check (p2pnode.cli.demo_swarm).
WORKERS = 3


def roster(n: int) -> list[tuple[str, int, str]]:
    out = []
    for i in range(n):
        agent, tier, capability = ROSTER[i % len(ROSTER)]
        if i >= len(ROSTER):
            agent, capability = f"agent{i}", f"{capability}.{i}"
            tier = 3
        out.append((agent, tier, capability))
    return out


class DemoNode(NodeProcess):
    """A demo daemon: its place in the roster and its agent."""

    def __init__(
        self,
        index: int,
        agent: str,
        tier: int,
        capability: str,
        data_dir: Path,
        run_args: tuple[str, ...] = (),
    ) -> None:
        super().__init__(data_dir)
        self.index, self.agent, self.tier, self.capability = index, agent, tier, capability
        self.run_args = run_args


class Demo:
    def __init__(self, n: int, root: Path, out: Any = sys.stdout) -> None:
        self.nodes = [
            DemoNode(i, agent, tier, cap, root / f"node{i}")
            for i, (agent, tier, cap) in enumerate(roster(n))
        ]
        # One more process: an agent written with the Agent API, hosted by `run --agent`.
        self.oracle = DemoNode(n, "oracle", 3, "demo.answer", root / "oracle", ("--agent", ORACLE))
        # And the swarm's workers, each an Agent API agent in a process of its own.
        names = [f"worker{i + 1}" for i in range(WORKERS)]
        self.workers = [
            DemoNode(n + 1 + i, name, 3, CAPABILITY, root / name, ("--agent", WORKER_AGENT))
            for i, name in enumerate(names)
        ]
        for worker in self.workers:
            worker.env["DEMO_WORKER_ID"] = worker.agent
        self.out = out
        self.checks: list[tuple[str, bool, str]] = []
        self.started = time.monotonic()

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:6.2f}s] {text}", file=self.out, flush=True)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append((name, ok, detail))
        self.say(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")

    def prepare(self) -> None:
        self.oracle.prepare("oracle", 3)
        for worker in self.workers:
            worker.prepare(worker.agent, 3)
        for node in self.nodes:
            node.prepare(node.agent, node.tier, [
                {"id": node.capability, "name": node.capability, "description":
                 f"{node.agent} does {node.capability}", "inputSchema": {"type": "object"},
                 "outputSchema": {"type": "object"}},
                {"id": "echo", "name": "Echo", "description": "Echoes the payload"},
            ])  # fmt: skip

    async def start(self, nursery: trio.Nursery, node: DemoNode, bootstrap: str | None) -> None:
        await node.start(nursery, bootstrap, run_args=node.run_args)
        self.say(f"node {node.index} up: agent {node.agent} (L{node.tier}, {node.capability}) "
                 f"at {node.address}")  # fmt: skip

    async def find(self, node: DemoNode, capability: str) -> list[Any]:
        """Ask ``node`` for providers of ``capability`` until the DHT has them."""
        found: list[Any] = []
        with trio.move_on_after(DISCOVERY_TIMEOUT):
            while not found:
                found = await node.call({"op": "find", "capability": capability})
                if not found:
                    await trio.sleep(0.2)
        return found

    async def run_scenario(self) -> None:
        first, asker = self.nodes[0], self.nodes[-1]
        # The last node met only the bootstrap node; it finds the others through the DHT.
        target = self.nodes[1] if len(self.nodes) > 2 else self.nodes[0]
        self.say(f"discovery: {asker.agent} looks up capability {target.capability!r} in the DHT")
        found = await self.find(asker, target.capability)
        self.check(
            "discovery by capability",
            bool(found) and found[0]["id"] == target.agent,
            f"found {[c['id'] for c in found]} for {target.capability!r}",
        )
        reply = await asker.call({
            "op": "send", "from": asker.agent, "to": target.capability, "capability": True,
            "type": "request", "payload": {"task": "hello from " + asker.agent},
        })  # fmt: skip
        self.check(
            "request/response across processes",
            reply["type"] == "response" and reply["sender"] == target.agent,
            f"{asker.agent} -> {reply['sender']}: {json.dumps(reply['payload'])}",
        )
        result = await first.call({
            "op": "send", "from": first.agent, "to": "*", "type": "notification",
            "payload": {"directive": "stand up"},
        })  # fmt: skip
        expected = len(self.nodes) - 1
        self.check(
            "broadcast from L0",
            len(result["targets"]) >= expected,
            f"{first.agent} reached {len(result['targets'])} agents: {result['targets']}",
        )
        await self._refused_cross_tier()
        await self._shared_document()
        # The oracle is L3: L1 and L2 agents may not send to it (the default tier rules).
        await self._agent_api(next(n for n in reversed(self.nodes) if n.tier in (0, 3)))
        await self._tool()
        await swarm_check(self.nodes[0], self.workers, self.check, self.find)

    async def _shared_document(self) -> None:
        doc = "demo.board"
        for node in self.nodes:
            await node.call({"op": "doc.subscribe", "doc": doc})
        for node in self.nodes:
            update = {"op": "set.add", "path": ["agents"], "element": node.agent}
            await node.call({"op": "doc.update", "doc": doc, "update": update})
        everyone = sorted(n.agent for n in self.nodes)
        values: list[Any] = []
        with trio.move_on_after(DISCOVERY_TIMEOUT):
            while True:
                values = [(await n.call({"op": "doc.read", "doc": doc}))["value"]
                          for n in self.nodes]  # fmt: skip
                if all(v.get("agents") == everyone for v in values):
                    break
                await trio.sleep(0.2)
        self.check(
            "shared document converged",
            all(v.get("agents") == everyone for v in values),
            f"every node's {doc!r} lists {len(everyone)} agents (CRDT set, gossip)",
        )

    async def _refused_cross_tier(self) -> None:
        l1 = next((n for n in self.nodes if n.tier == 1), None)
        low = next((n for n in self.nodes if n.tier >= 2), None)
        if l1 is None or low is None:
            self.check("refused cross-tier message", True, "skipped: needs L1 and L2/L3 agents")
            return
        await self.find(l1, low.capability)  # learn the target's signed card
        try:
            await l1.call({"op": "send", "from": l1.agent, "to": low.agent,
                                 "type": "request", "payload": {}})  # fmt: skip
        except P2PError as exc:
            self.check(
                "refused cross-tier message",
                exc.code is ErrorCode.TIER_VIOLATION,
                f"{l1.agent} (L1) -> {low.agent} (L{low.tier}) refused with {exc.code}",
            )
            return
        self.check("refused cross-tier message", False, f"{l1.agent} -> {low.agent} went through")

    async def _agent_api(self, asker: DemoNode) -> None:
        await self.find(asker, "demo.answer")
        question = {"question": "how many nodes?"}
        reply = await asker.call({"op": "send", "from": asker.agent, "to": "demo.answer",
                                  "capability": True, "payload": question})  # fmt: skip
        try:
            await asker.call({"op": "send", "from": asker.agent, "to": "demo.answer",
                              "capability": True, "payload": {"question": 42}})  # fmt: skip
            refused = "accepted"
        except P2PError as exc:
            refused = str(exc.code)
        self.check(
            "agent written with the Agent API",
            reply["sender"] == "oracle" and refused == ErrorCode.INVALID_INPUT,
            f"{asker.agent} -> oracle ({ORACLE}, own process): "
            f"{json.dumps(reply['payload'])}; a number as the question: {refused}",
        )

    async def _tool(self) -> None:
        first = self.nodes[0]  # sun, L0: what the tool's access rule admits
        arguments = {"tasks": 6, "agents": 2}
        call = {"op": "tools.call", "name": TOOL, "arguments": arguments}
        try:
            answer = await first.call({**call, "agent": first.agent})
            result = json.dumps(answer["result"])
        except P2PError as exc:
            result = str(exc)
        self.check(
            "tool called across processes",
            result == json.dumps({"hours": 4.5}),
            f"{first.agent} (L{first.tier}) -> {TOOL} {json.dumps(arguments)}: {result}",
        )
        l3 = next((n for n in self.nodes if n.tier == 3), None)
        if l3 is None:
            self.check("tool refused by its access rule", True, "skipped: needs an L3 agent")
            return
        try:
            await l3.call({**call, "agent": l3.agent})
            code, refused = None, "accepted"
        except P2PError as exc:
            code, refused = exc.code, str(exc)
        self.check(
            "tool refused by its access rule",
            code is ErrorCode.PERMISSION_DENIED,
            f"{l3.agent} (L3) -> {TOOL}: {refused}",
        )

    async def stop(self) -> None:
        nodes = [*self.nodes, self.oracle, *self.workers]
        async with trio.open_nursery() as nursery:
            for node in nodes:
                nursery.start_soon(node.stop)
        self.say(f"stopped {len(nodes)} node processes")

    async def main(self) -> bool:
        """Run the scenario; the summary is printed only when it ran to its end (an
        interrupted demo's checks are not all run: it claims none)."""
        self.prepare()
        async with trio.open_nursery() as nursery:
            try:
                await self.start(nursery, self.nodes[0], None)
                for node in [*self.nodes[1:], self.oracle, *self.workers]:
                    await self.start(nursery, node, self.nodes[0].address)
                await self.run_scenario()
            except P2PError as exc:
                self.check("demo", False, str(exc))
            finally:
                with trio.CancelScope(shield=True):
                    await self.stop()
                nursery.cancel_scope.cancel()
        passed = sum(ok for _, ok, _ in self.checks)
        self.say(f"summary: {passed}/{len(self.checks)} checks passed with "
                 f"{len(self.nodes)} nodes")  # fmt: skip
        return bool(self.checks) and all(ok for _, ok, _ in self.checks)


def _demo_root(args: argparse.Namespace) -> Path | None:
    """``--data-dir``, where the demo keeps its nodes' directories, or None (a temporary
    one). It must be new or empty: the demo never writes into a node's own directory."""
    if not args.data_dir:
        return None
    root = Path(args.data_dir)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise LocalError(
            ErrorCode.CONFIG_ERROR,
            f"{root} is not an empty directory: the demo keeps its nodes' directories "
            "in a new or empty one",
        )
    root.mkdir(parents=True, exist_ok=True)
    return root


def _run_demo(args: argparse.Namespace, root: Path) -> int:
    demo = Demo(args.nodes, root)
    interrupted = False
    try:
        ok = trio.run(demo.main)
    except* KeyboardInterrupt:
        interrupted = True
    if interrupted:
        passed = sum(ok for _, ok, _ in demo.checks)
        print(f"p2pnode: interrupted: the demo stopped its nodes after {len(demo.checks)} "
              f"checks ({passed} passed); the rest did not run", file=sys.stderr)  # fmt: skip
        return 130
    return 0 if ok else 1


def cmd_demo(args: argparse.Namespace) -> int:
    if args.nodes < 2:
        print("p2pnode: error: --nodes must be at least 2", file=sys.stderr)
        return 2
    root = _demo_root(args)
    if root is not None:
        return _run_demo(args, root)
    with tempfile.TemporaryDirectory(prefix="p2pnode-demo-") as temporary:
        return _run_demo(args, Path(temporary))


def add_demo_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = sub.add_parser("demo", help="run a multi-node swarm on 127.0.0.1 and show it working")
    demo.add_argument("--nodes", type=int, default=5, help="number of node processes (>= 2)")
    # --data-dir (a global option) is where the nodes' directories go, kept afterwards.
    demo.description = (
        "Run a swarm of node processes on 127.0.0.1 and check that it works. With "
        "--data-dir (a new or empty directory) the nodes' directories are kept "
        "there; by default they live in a temporary directory, removed at the end."
    )
    demo.set_defaults(handler=cmd_demo)
