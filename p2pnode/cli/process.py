"""A ``p2pnode run`` daemon as a child process, driven through its control socket.

Used by the demo and by tests that need real OS processes: it prepares a
data directory (identity and card file), starts the daemon, waits for its
``ready`` line, keeps the last lines of its log, and stops it.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import trio

from p2pnode.core.cardfile import CARD_FILE_NAME, starter_template
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.identity import KEY_FILE_NAME, Identity, save_identity, write_private_file
from p2pnode.node.control import CONTROL_SOCKET_NAME, control_call

READY_TIMEOUT = 30.0
CALL_TIMEOUT = 20.0
STOP_TIMEOUT = 5.0
_LOG_LINES = 100


# ``python -m p2pnode ARGS`` with RLIMIT_NOFILE (soft and hard) lowered to argv[1] first
# (never raised: an unprivileged process cannot). A launcher rather than ``preexec_fn``:
# that runs Python between fork and exec, which Python documents as unsafe in a process
# with threads, and trio keeps worker threads.
_FD_LIMITED = (
    "import resource, runpy, sys; n = int(sys.argv.pop(1)); "
    "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
    "n = n if hard == resource.RLIM_INFINITY else min(n, hard); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); "
    "runpy.run_module('p2pnode', run_name='__main__', alter_sys=True)"
)


class NodeProcess:
    """One ``python -m p2pnode run`` process with its own data directory.

    ``log_lines`` is how many of the last stderr lines :attr:`log` keeps;
    ``fd_limit`` starts the daemon with that many file descriptors at most
    (tests of descriptor exhaustion); ``prefix`` goes before the command (e.g.
    ``ip netns exec NS`` to run the daemon in a network namespace).
    """

    def __init__(
        self,
        data_dir: Path,
        env: dict[str, str] | None = None,
        *,
        log_lines: int = _LOG_LINES,
        fd_limit: int | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        self.data_dir = data_dir
        self.env = dict(env if env is not None else os.environ, PYTHONUNBUFFERED="1")
        self.process: trio.Process | None = None
        self.address = ""
        self.log: list[str] = []
        self._log_lines = log_lines
        self._fd_limit = fd_limit
        self._prefix = list(prefix)
        self._drained = trio.Event()

    def prepare(
        self, agent: str, tier: int, capabilities: list[dict[str, Any]] | None = None
    ) -> None:
        """Write a fresh identity and a card file for one agent."""
        save_identity(Identity.generate(), self.data_dir / KEY_FILE_NAME)
        template = starter_template(agent, agent.upper(), tier)
        if capabilities is not None:
            template["capabilities"] = capabilities
        text = json.dumps(template, indent=2).encode()
        write_private_file(self.data_dir / CARD_FILE_NAME, text)

    @property
    def control(self) -> Path:
        return self.data_dir / CONTROL_SOCKET_NAME

    async def start(
        self,
        nursery: trio.Nursery,
        bootstrap: str | None,
        *,
        listen: str = "127.0.0.1:0",
        run_args: Sequence[str] = (),
    ) -> None:
        """Start the daemon (``run_args`` are added to its ``run`` options) and wait for its
        ``ready`` line.

        Raises LocalError(TIMEOUT) when it is not ready within READY_TIMEOUT, or
        at once when it exits first (the error names the exit code and the last
        lines of its log).
        """
        args = ["--data-dir", str(self.data_dir), "run", "--listen", listen,
                "--log-level", "WARNING"]  # fmt: skip
        if bootstrap:
            args += ["--bootstrap", bootstrap]
        args += run_args
        if self._fd_limit is None:
            argv = [sys.executable, "-m", "p2pnode", *args]
        else:
            argv = [sys.executable, "-c", _FD_LIMITED, str(self._fd_limit), *args]
        self.address = ""
        self._drained = trio.Event()
        self.process = await trio.lowlevel.open_process(
            [*self._prefix, *argv],
            stdout=-1,
            stderr=-1,
            stdin=-3,
            env=self.env,  # PIPE, PIPE, DEVNULL
        )
        ready = trio.Event()
        nursery.start_soon(self._read, self.process, ready)
        with trio.move_on_after(READY_TIMEOUT):
            await ready.wait()
        if not self.address:
            if self._drained.is_set():
                code = await self.process.wait()
                what = f"exited with code {code}"
            else:
                what = f"was not ready within {READY_TIMEOUT:g} s"
            raise LocalError(
                ErrorCode.TIMEOUT,
                f"{self.data_dir} {what}: {' | '.join(self.log[-5:])}",
            )

    async def _read(self, process: trio.Process, ready: trio.Event) -> None:
        assert process.stdout is not None and process.stderr is not None
        stderr = process.stderr

        async def drain_stderr() -> None:
            pending = b""
            async for chunk in stderr:
                pending += chunk
                *lines, pending = pending.split(b"\n")
                self.log.extend(line.decode(errors="replace") for line in lines)
                del self.log[: -self._log_lines]
            if pending:
                self.log.append(pending.decode(errors="replace"))

        try:
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
                        if isinstance(event, dict) and event.get("event") == "ready":
                            self.address = event["addresses"][0]
                            ready.set()
        finally:
            # Both pipes are at their end: the process is gone (or closed them), and the
            # log holds everything it wrote.
            self._drained.set()
            ready.set()

    async def call(self, request: dict[str, Any]) -> Any:
        """One control-socket request (see :mod:`p2pnode.node.control`)."""
        with trio.fail_after(CALL_TIMEOUT):
            return await control_call(self.control, request)

    async def wait(self) -> int:
        """Wait until the process has exited and its output is read; its exit code."""
        assert self.process is not None
        code = await self.process.wait()
        await self._drained.wait()
        return code

    async def kill(self) -> None:
        """SIGKILL, and wait for the process to be gone."""
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)
            with trio.CancelScope(shield=True):
                await self.process.wait()

    async def stop(self) -> None:
        """SIGTERM (a clean shutdown), then SIGKILL after STOP_TIMEOUT."""
        if self.process is None or self.process.returncode is not None:
            return
        self.process.terminate()
        with trio.CancelScope(shield=True):
            with trio.move_on_after(STOP_TIMEOUT):
                await self.process.wait()
            await self.kill()
