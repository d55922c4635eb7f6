"""Durability with real OS processes: a node killed with SIGKILL after acknowledging
updates through its control socket restarts on the same data directory with every one
of them, and its peers converge (DESIGN.md "Durability"; seed R9)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import trio

from p2pnode.cardfile import CARD_FILE_NAME, starter_template
from p2pnode.identity import KEY_FILE_NAME, Identity, save_identity, write_private_file
from p2pnode.node.control import CONTROL_SOCKET_NAME, control_call

DOC = "ledger"
READY_TIMEOUT = 30.0
CALL_TIMEOUT = 20.0
CONVERGE_TIMEOUT = 40.0
# The processes import this checkout whatever the working directory.
ENV = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))


class Daemon:
    """One ``python -m p2pnode run`` process."""

    def __init__(self, root: Path, agent: str) -> None:
        self.agent = agent
        self.data_dir = root / agent
        save_identity(Identity.generate(), self.data_dir / KEY_FILE_NAME)
        template = json.dumps(starter_template(agent, agent.upper(), 3)).encode()
        write_private_file(self.data_dir / CARD_FILE_NAME, template)
        self.process: trio.Process | None = None
        self.address = ""
        self.log: list[str] = []

    async def start(self, nursery: trio.Nursery, bootstrap: str | None) -> None:
        argv = [sys.executable, "-m", "p2pnode", "--data-dir", str(self.data_dir), "run",
                "--listen", "127.0.0.1:0", "--log-level", "WARNING"]  # fmt: skip
        if bootstrap:
            argv += ["--bootstrap", bootstrap]
        self.address = ""
        self.process = await trio.lowlevel.open_process(
            argv, stdout=-1, stderr=-1, stdin=-3, env=ENV
        )
        ready = trio.Event()
        nursery.start_soon(self._read, self.process, ready)
        with trio.move_on_after(READY_TIMEOUT):
            await ready.wait()
        assert self.address, f"{self.agent} did not start: {self.log[-10:]}"

    async def _read(self, process: trio.Process, ready: trio.Event) -> None:
        assert process.stdout is not None and process.stderr is not None
        stderr = process.stderr

        async def drain_stderr() -> None:
            async for chunk in stderr:
                self.log.extend(chunk.decode(errors="replace").splitlines())
                del self.log[:-100]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain_stderr)
            buffer = b""
            async for chunk in process.stdout:
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    if event.get("event") == "ready":
                        self.address = event["addresses"][0]
                        ready.set()

    async def call(self, request: dict[str, Any]) -> Any:
        with trio.fail_after(CALL_TIMEOUT):
            return await control_call(self.data_dir / CONTROL_SOCKET_NAME, request)

    async def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)
            with trio.CancelScope(shield=True):
                await self.process.wait()


async def test_kill_9_loses_no_acknowledged_update(tmp_path: Path) -> None:
    hub, writer, reader = (Daemon(tmp_path, a) for a in ("hub", "writer", "reader"))
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
