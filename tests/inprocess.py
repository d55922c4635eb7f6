"""The ``p2pnode`` command line run inside the test process.

A command that only talks to a running daemon over its control socket and prints
what it got (``tools list``, ``find``, ``task propose``, ``status``) behaves the same
whether ``p2pnode.cli.main.main(argv)`` runs in a new interpreter or in this one; in
this one it costs milliseconds instead of an interpreter start and the package's
imports (about half a second each on a 2-core machine). Tests that are about what only
a process shows — signals, locks, exit on a busy port, a daemon's restart — keep
starting real ``p2pnode`` processes.
"""

from __future__ import annotations

import io
import os
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import trio

from p2pnode.cli.main import main


@dataclass(frozen=True, slots=True)
class Ran:
    """One finished ``p2pnode`` command: its exit code and what it printed."""

    code: int
    out: str
    err: str


def run_cli(*argv: str, cwd: Path | None = None) -> Ran:
    """``p2pnode ARGV`` in this process (in ``cwd`` if given): exit code, stdout, stderr.

    argparse's own exits (usage errors, ``--help``) give their code as a process would.
    """
    out, err = io.StringIO(), io.StringIO()
    before = Path.cwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(list(argv))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        os.chdir(before)
    return Ran(code, out.getvalue(), err.getvalue())


async def p2pnode(*argv: str, cwd: Path | None = None, seconds: float = 30.0) -> Ran:
    """:func:`run_cli` from a trio test: in a worker thread, so the test's own tasks
    (the daemons' output readers) keep running while the command waits for its node;
    it fails after ``seconds``."""
    with trio.fail_after(seconds):
        return await trio.to_thread.run_sync(
            lambda: run_cli(*argv, cwd=cwd), abandon_on_cancel=True
        )
