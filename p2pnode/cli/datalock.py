"""One ``p2pnode run`` per data directory: an OS lock on ``run.lock``.

Theory of operation: the daemon takes ``flock(LOCK_EX | LOCK_NB)`` on
``<data dir>/run.lock`` before it opens anything else in the directory, and
holds it until it exits. The kernel drops a flock when the last descriptor of
the open file closes, which includes every way a process can die (``kill -9``
and crashes too): a lock left behind never blocks the next run, so there is
no pid-liveness guessing (pids are reused). The file holds the holder's pid
and control socket as one JSON line, only so that a second run can say which
daemon it met; the lock, not the content, is what counts.

The file is never deleted. Unlinking it on exit would let a later run lock a
new file while an earlier one still waits on, then takes, the old inode: two
daemons on one directory. A stale pid in the file is harmless; the lock is free.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from p2pnode.core.errors import ErrorCode, LocalError

LOCK_FILE_NAME = "run.lock"
_MAX_HOLDER_BYTES = 4096


@contextmanager
def hold_data_dir(data_dir: Path, control: Path) -> Iterator[Path]:
    """Hold the run lock of ``data_dir`` (created 0700 if missing) for the ``with`` body;
    ``control`` is recorded as the holder's control socket. Yields the lock file's path.

    Raises LocalError(BUSY) naming the running daemon (pid, control socket) when
    another process holds the lock, LocalError(CONFIG_ERROR) when the directory or
    the lock file cannot be opened or locked.
    """
    path = data_dir / LOCK_FILE_NAME
    try:
        data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # O_CLOEXEC (Python's default): a child process must not inherit, and so
        # outlive us holding, the lock.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise LocalError(
            ErrorCode.CONFIG_ERROR, f"cannot open {path}: {exc.strerror or exc}", path=str(path)
        ) from exc
    try:
        _lock(fd, path, data_dir)
        # Truncate only once the lock is ours: the loser of a race must not erase
        # the winner's pid.
        os.ftruncate(fd, 0)
        holder = {"pid": os.getpid(), "control": str(control)}
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock


def _lock(fd: int, path: Path, data_dir: Path) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise LocalError(
                ErrorCode.CONFIG_ERROR, f"cannot lock {path}: {exc.strerror or exc}", path=str(path)
            ) from exc
        raise LocalError(
            ErrorCode.BUSY,
            f"{data_dir} is in use by another `p2pnode run` ({_describe_holder(fd)}); "
            "stop it or choose another --data-dir",
            path=str(path),
        ) from None


def _describe_holder(fd: int) -> str:
    """``pid N, control socket P`` from the holder's line, as far as it can be read."""
    try:
        text = os.pread(fd, _MAX_HOLDER_BYTES, 0).decode("utf-8", errors="replace")
        holder = json.loads(text)
    except (OSError, ValueError):
        holder = None
    if not isinstance(holder, dict):
        # The holder has locked but not yet written its line (or the file is foreign).
        return "pid unknown"
    pid, control = holder.get("pid"), holder.get("control")
    parts = [f"pid {pid}" if isinstance(pid, int) else "pid unknown"]
    if isinstance(control, str):
        parts.append(f"control socket {control}")
    return ", ".join(parts)


__all__ = ["LOCK_FILE_NAME", "hold_data_dir"]
