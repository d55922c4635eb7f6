"""``p2pnode demo``: a real multi-node swarm on 127.0.0.1, in separate OS processes.

It starts N ``p2pnode run`` processes, each with its own identity and an
agent card with different capabilities and tiers, joins them through the
first one, then shows discovery by capability, a request/response across
processes, a broadcast, and a cross-tier message refused by policy. It exits
0 when all of that worked, and always stops every process it started.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from p2pnode.cardfile import CARD_FILE_NAME, starter_template
from p2pnode.errors import ErrorCode, P2PError
from p2pnode.identity import KEY_FILE_NAME, Identity, save_identity, write_private_file
from p2pnode.node.control import CONTROL_SOCKET_NAME, control_call

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
READY_TIMEOUT = 30.0
DISCOVERY_TIMEOUT = 30.0
CALL_TIMEOUT = 20.0


def roster(n: int) -> list[tuple[str, int, str]]:
    out = []
    for i in range(n):
        agent, tier, capability = ROSTER[i % len(ROSTER)]
        if i >= len(ROSTER):
            agent, capability = f"agent{i}", f"{capability}.{i}"
            tier = 3
        out.append((agent, tier, capability))
    return out


@dataclass
class DemoNode:
    index: int
    agent: str
    tier: int
    capability: str
    data_dir: Path
    process: trio.Process | None = None
    address: str = ""
    log: list[str] = field(default_factory=list)

    @property
    def control(self) -> Path:
        return self.data_dir / CONTROL_SOCKET_NAME


class Demo:
    def __init__(self, n: int, root: Path, out: Any = sys.stdout) -> None:
        self.nodes = [
            DemoNode(i, agent, tier, cap, root / f"node{i}")
            for i, (agent, tier, cap) in enumerate(roster(n))
        ]
        self.out = out
        self.checks: list[tuple[str, bool, str]] = []
        self.started = time.monotonic()

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:6.2f}s] {text}", file=self.out, flush=True)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append((name, ok, detail))
        self.say(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")

    def prepare(self) -> None:
        for node in self.nodes:
            identity = Identity.generate()
            save_identity(identity, node.data_dir / KEY_FILE_NAME)
            template = starter_template(node.agent, node.agent.upper(), node.tier)
            template["capabilities"] = [
                {"id": node.capability, "name": node.capability, "description":
                 f"{node.agent} does {node.capability}", "inputSchema": {"type": "object"},
                 "outputSchema": {"type": "object"}},
                {"id": "echo", "name": "Echo", "description": "Echoes the payload"},
            ]  # fmt: skip
            text = json.dumps(template, indent=2).encode()
            write_private_file(node.data_dir / CARD_FILE_NAME, text)

    async def start(self, nursery: trio.Nursery, node: DemoNode, bootstrap: str | None) -> None:
        argv = [sys.executable, "-m", "p2pnode", "--data-dir", str(node.data_dir), "run",
                "--listen", "127.0.0.1:0", "--log-level", "WARNING"]  # fmt: skip
        if bootstrap:
            argv += ["--bootstrap", bootstrap]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        node.process = await trio.lowlevel.open_process(
            argv,
            stdout=-1,
            stderr=-1,
            env=env,
            stdin=-3,  # PIPE, PIPE, DEVNULL
        )
        ready = trio.Event()
        nursery.start_soon(self._read_stdout, node, ready)
        nursery.start_soon(self._read_stderr, node)
        with trio.move_on_after(READY_TIMEOUT):
            await ready.wait()
        if not node.address:
            raise RuntimeError(f"node {node.index} did not start: {' | '.join(node.log[-5:])}")
        self.say(f"node {node.index} up: agent {node.agent} (L{node.tier}, {node.capability}) "
                 f"at {node.address}")  # fmt: skip

    async def _read_stdout(self, node: DemoNode, ready: trio.Event) -> None:
        assert node.process is not None and node.process.stdout is not None
        buffer = b""
        async for chunk in node.process.stdout:
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") == "ready":
                    node.address = event["addresses"][0]
                    ready.set()

    async def _read_stderr(self, node: DemoNode) -> None:
        assert node.process is not None and node.process.stderr is not None
        async for chunk in node.process.stderr:
            node.log.extend(chunk.decode(errors="replace").splitlines())
            del node.log[:-50]

    async def call(self, node: DemoNode, request: dict[str, Any]) -> Any:
        with trio.fail_after(CALL_TIMEOUT):
            return await control_call(node.control, request)

    async def find(self, node: DemoNode, capability: str) -> list[Any]:
        """Ask ``node`` for providers of ``capability`` until the DHT has them."""
        found: list[Any] = []
        with trio.move_on_after(DISCOVERY_TIMEOUT):
            while not found:
                found = await self.call(node, {"op": "find", "capability": capability})
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
        reply = await self.call(asker, {
            "op": "send", "from": asker.agent, "to": target.capability, "capability": True,
            "type": "request", "payload": {"task": "hello from " + asker.agent},
        })  # fmt: skip
        self.check(
            "request/response across processes",
            reply["type"] == "response" and reply["sender"] == target.agent,
            f"{asker.agent} -> {reply['sender']}: {json.dumps(reply['payload'])}",
        )
        result = await self.call(first, {
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

    async def _refused_cross_tier(self) -> None:
        l1 = next((n for n in self.nodes if n.tier == 1), None)
        low = next((n for n in self.nodes if n.tier >= 2), None)
        if l1 is None or low is None:
            self.check("refused cross-tier message", True, "skipped: needs L1 and L2/L3 agents")
            return
        await self.find(l1, low.capability)  # learn the target's signed card
        try:
            await self.call(l1, {"op": "send", "from": l1.agent, "to": low.agent,
                                 "type": "request", "payload": {}})  # fmt: skip
        except P2PError as exc:
            self.check(
                "refused cross-tier message",
                exc.code is ErrorCode.TIER_VIOLATION,
                f"{l1.agent} (L1) -> {low.agent} (L{low.tier}) refused with {exc.code}",
            )
            return
        self.check("refused cross-tier message", False, f"{l1.agent} -> {low.agent} went through")

    async def stop(self) -> None:
        for node in self.nodes:
            if node.process is not None and node.process.returncode is None:
                node.process.terminate()
        for node in self.nodes:
            if node.process is None:
                continue
            with trio.move_on_after(5):
                await node.process.wait()
            if node.process.returncode is None:
                node.process.kill()
                await node.process.wait()
        self.say(f"stopped {len(self.nodes)} node processes")

    async def main(self) -> bool:
        self.prepare()
        try:
            async with trio.open_nursery() as nursery:
                try:
                    await self.start(nursery, self.nodes[0], None)
                    for node in self.nodes[1:]:
                        await self.start(nursery, node, self.nodes[0].address)
                    await self.run_scenario()
                except (P2PError, RuntimeError) as exc:
                    self.check("demo", False, str(exc))
                finally:
                    with trio.CancelScope(shield=True):
                        await self.stop()
                    nursery.cancel_scope.cancel()
        finally:
            passed = sum(ok for _, ok, _ in self.checks)
            self.say(f"summary: {passed}/{len(self.checks)} checks passed with "
                     f"{len(self.nodes)} nodes")  # fmt: skip
        return bool(self.checks) and all(ok for _, ok, _ in self.checks)


def cmd_demo(args: argparse.Namespace) -> int:
    if args.nodes < 2:
        print("p2pnode: error: --nodes must be at least 2", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="p2pnode-demo-") as root:
        ok = trio.run(Demo(args.nodes, Path(root)).main)
    return 0 if ok else 1


def add_demo_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = sub.add_parser("demo", help="run a multi-node swarm on 127.0.0.1 and show it working")
    demo.add_argument("--nodes", type=int, default=5, help="number of node processes (>= 2)")
    demo.set_defaults(handler=cmd_demo)
