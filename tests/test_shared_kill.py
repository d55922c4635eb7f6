"""Durability with real OS processes: a node killed with SIGKILL after acknowledging
updates through its control socket restarts on the same data directory with every one
of them, and its peers converge (DESIGN.md "Durability"; seed R9)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import trio

from p2pnode.cli.process import NodeProcess

pytestmark = pytest.mark.slow  # OS processes

DOC = "ledger"
CONVERGE_TIMEOUT = 40.0
# The processes import this checkout whatever the working directory.
ENV = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))


def daemon(root: Path, agent: str) -> NodeProcess:
    process = NodeProcess(root / agent, ENV)
    process.prepare(agent, 3)
    return process


async def test_kill_9_loses_no_acknowledged_update(tmp_path: Path) -> None:
    hub, writer, reader = (daemon(tmp_path, a) for a in ("hub", "writer", "reader"))
    daemons = [hub, writer, reader]
    try:
        async with trio.open_nursery() as nursery:
            await hub.start(nursery, None)
            await writer.start(nursery, hub.address)
            await reader.start(nursery, hub.address)
            for d in daemons:
                await d.call({"op": "doc.subscribe", "doc": DOC})
            n = 40
            acked = []
            for i in range(n):
                op = (
                    {"op": "counter.add", "path": ["count"], "amount": 1}
                    if i % 2 == 0
                    else {"op": "set.add", "path": ["items"], "element": f"item{i}"}
                )
                result = await writer.call({"op": "doc.update", "doc": DOC, "update": op})
                assert result["durable"] is True
                acked.append(result["seq"])
            assert acked == list(range(1, n + 1))
            await writer.kill()  # right after the last acknowledgement
            assert writer.process is not None and writer.process.returncode == -signal.SIGKILL

            # Restarted alone (no bootstrap: no peer can refill it), it has every update.
            await writer.start(nursery, None)
            state = await writer.call({"op": "doc.read", "doc": DOC})
            items = sorted(f"item{i}" for i in range(1, n, 2))
            expected = {"count": n // 2, "items": items}
            assert state["value"] == expected
            origin = next(iter(state["clock"]))
            assert state["clock"] == {origin: n}
            assert writer.process is not None
            await writer.kill()  # and once more, then back into the swarm
            await writer.start(nursery, hub.address)

            with trio.move_on_after(CONVERGE_TIMEOUT):
                while True:
                    states = [await d.call({"op": "doc.read", "doc": DOC}) for d in daemons]
                    if all(s["value"] == expected and s["clock"] == {origin: n} for s in states):
                        break
                    await trio.sleep(0.2)
            assert [s["value"] for s in states] == [expected] * 3, [d.log[-5:] for d in daemons]
            # The same through the command line.
            cli = [sys.executable, "-m", "p2pnode", "--data-dir", str(reader.data_dir), "doc"]
            update = json.dumps({"op": "register.set", "path": ["by"], "value": "cli"})
            done = await trio.run_process(
                [*cli, "update", DOC, update], capture_stdout=True, env=ENV
            )
            assert json.loads(done.stdout)["durable"] is True
            done = await trio.run_process([*cli, "read", DOC], capture_stdout=True, env=ENV)
            assert json.loads(done.stdout)["value"] == {**expected, "by": "cli"}
            nursery.cancel_scope.cancel()
    finally:
        for d in daemons:
            await d.kill()
