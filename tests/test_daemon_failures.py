"""`p2pnode run`'s own failure modes, in process: the data-directory lock, a busy
--listen port and an unexpected exception are one line on stderr and exit 1."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

import p2pnode.runtime
from p2pnode.cli.datalock import LOCK_FILE_NAME, hold_data_dir
from p2pnode.cli.main import main
from p2pnode.core.errors import ErrorCode, LocalError

# A child that takes the lock, says so, then waits to be killed.
_HOLDER = """
import sys, time
from pathlib import Path
from p2pnode.cli.datalock import hold_data_dir
with hold_data_dir(Path(sys.argv[1]), Path(sys.argv[1]) / "control.sock"):
    print("locked", flush=True)
    time.sleep(60)
"""


def test_lock_names_the_holder_and_is_free_after_release(tmp_path: Path) -> None:
    data_dir = tmp_path / "new" / "dir"
    with hold_data_dir(data_dir, data_dir / "control.sock") as path:
        assert path == data_dir / LOCK_FILE_NAME
        assert data_dir.stat().st_mode & 0o777 == 0o700
        assert json.loads(path.read_text()) == {
            "pid": os.getpid(),
            "control": str(data_dir / "control.sock"),
        }
        with (
            pytest.raises(LocalError) as info,
            hold_data_dir(data_dir, data_dir / "other.sock"),
        ):
            pass  # pragma: no cover - the lock is held
        assert info.value.code is ErrorCode.BUSY
        assert f"pid {os.getpid()}" in info.value.message
        assert str(data_dir / "control.sock") in info.value.message
        # The loser must not have overwritten the holder's line.
        assert json.loads(path.read_text())["control"] == str(data_dir / "control.sock")
    with hold_data_dir(data_dir, data_dir / "control.sock"):
        pass


@pytest.mark.slow
def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "locked"
        with pytest.raises(LocalError) as info, hold_data_dir(tmp_path, tmp_path / "c.sock"):
            pass  # pragma: no cover - the child holds the lock
        assert f"pid {child.pid}" in info.value.message
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        assert child.stdout is not None
        child.stdout.close()
    # The file (with the dead pid in it) is still there; the lock is not.
    assert (tmp_path / LOCK_FILE_NAME).exists()
    with hold_data_dir(tmp_path, tmp_path / "control.sock"):
        pass


def test_an_unusable_lock_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / LOCK_FILE_NAME).mkdir()  # a directory cannot be opened read-write
    with pytest.raises(LocalError) as info, hold_data_dir(tmp_path, tmp_path / "control.sock"):
        pass  # pragma: no cover
    assert info.value.code is ErrorCode.CONFIG_ERROR


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    # `run` installs a handler on the captured stderr and sets the level: neither may
    # outlive the test.
    logger = logging.getLogger("p2pnode")
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_line(err: str, *parts: str) -> None:
    lines = [line for line in err.splitlines() if line.startswith("p2pnode: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for part in parts:
        assert part in lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", [socket.SOCK_STREAM, socket.SOCK_DGRAM])
def test_run_on_a_busy_port_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: int
) -> None:
    with socket.socket(socket.AF_INET, kind) as busy:
        busy.bind(("127.0.0.1", 0))
        if kind == socket.SOCK_STREAM:
            busy.listen()
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        code, out, err = _run(capsys, "--data-dir", str(tmp_path), "run", "--listen", address)
    assert code == 1
    assert out == ""
    protocol = "TCP" if kind == socket.SOCK_STREAM else "UDP"
    _assert_one_line(err, "CONFIG_ERROR", f"{protocol} {address}", "in use")


def test_run_on_a_locked_data_dir_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with hold_data_dir(tmp_path, tmp_path / "control.sock"):
        code, out, err = _run(capsys, "--data-dir", str(tmp_path), "run")
    assert code == 1
    assert out == ""
    _assert_one_line(err, "BUSY", f"pid {os.getpid()}", str(tmp_path / "control.sock"))
    # Refused before anything else was opened: no identity was created.
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_FILE_NAME]


@asynccontextmanager
async def _broken_node(*args: Any) -> AsyncIterator[Any]:
    raise RuntimeError("a defect\nwith a second line")
    yield  # pragma: no cover


@pytest.mark.parametrize("level", ["INFO", "DEBUG"])
def test_an_unexpected_exception_is_one_line_with_the_traceback_at_debug(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    level: str,
) -> None:
    # `run` imports open_node from the runtime when it runs (the CLI loads it lazily).
    monkeypatch.setattr(p2pnode.runtime, "open_node", _broken_node)
    code, out, err = _run(capsys, "--data-dir", str(tmp_path), "run", "--log-level", level)
    assert code == 1
    assert out == ""
    lines = [line for line in err.splitlines() if line.startswith("p2pnode: error:")]
    assert len(lines) == 1
    assert "INTERNAL" in lines[0] and "RuntimeError: a defect" in lines[0]
    assert ("Traceback" in err) == (level == "DEBUG")


@pytest.mark.slow
async def test_sigterm_during_startup_cancels_it(tmp_path: Path) -> None:
    """A daemon stuck joining (its bootstrap peer accepts TCP and never answers the
    handshake) stops at once on SIGTERM, exit 0, without a traceback."""
    with trio.socket.socket() as silent:
        await silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        bootstrap = f"127.0.0.1:{silent.getsockname()[1]}"
        argv = [sys.executable, "-m", "p2pnode", "--data-dir", str(tmp_path), "run",
                "--bootstrap", bootstrap, "--log-level", "INFO"]  # fmt: skip
        process = await trio.lowlevel.open_process(argv, stdout=-1, stderr=-1, stdin=-3)
        assert process.stderr is not None and process.stdout is not None
        with trio.fail_after(20):
            # Its dial reaching us means the node is open and joining.
            peer, _ = await silent.accept()
            with peer:
                process.terminate()
                code = await process.wait()
            err = b"".join([chunk async for chunk in process.stderr])
            out = b"".join([chunk async for chunk in process.stdout])
    assert code == 0, err.decode()
    assert b"Traceback" not in err
    assert b'"ready"' not in out  # it never got that far
    assert b"while starting: shutting down" in err
