"""Every command, given bad input: one error line on stderr (``p2pnode: error: ...``),
a non-zero exit code, never a traceback. ``run`` and the bare command are run as a user
runs them (a subprocess: a daemon that cannot start is a process's exit); the others
only read files or ask a control socket and run ``main(argv)`` in this process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from p2pnode.cli.main import main
from tests.inprocess import run_cli

pytestmark = pytest.mark.slow

# Paths are relative to a prepared directory (the fixture below): `ok` has an identity,
# `none` does not exist, `afile` is a file, `bad.json` is not JSON, `array.json` is JSON
# but not an object, `template.json` is a card template with problems,
# `foreign-signed.json` a card signed by another identity.
CASES: list[tuple[str, ...]] = [
    # init
    ("init", "--tier", "9"),
    ("init", "--agent-id"),
    ("--data-dir", "afile", "init"),
    ("--data-dir", "ok", "init"),
    ("--data-dir", "ok", "init", "--agent-id", "not valid!"),
    # id
    ("--data-dir", "none", "id"),
    ("--data-dir", "corrupt", "id"),
    ("--data-dir", "ok", "id", "--bogus"),
    # card show / validate / sign / export
    ("card", "show"),
    ("--data-dir", "ok", "card", "show", "bad.json"),
    ("--data-dir", "ok", "card", "show", "missing.json"),
    ("--data-dir", "ok", "card", "show", "array.json"),
    ("card", "validate"),
    ("card", "validate", "bad.json"),
    ("card", "validate", "missing.json"),
    ("card", "validate", "array.json"),
    ("card", "frobnicate"),
    ("--data-dir", "ok", "card", "sign", "-o", "no/such/dir/card.json"),
    ("--data-dir", "ok", "card", "sign", "template.json"),
    ("--data-dir", "none", "card", "sign"),
    ("--data-dir", "ok", "card", "export"),
    ("--data-dir", "ok", "card", "export", "--a2a", "bad.json"),
    ("--data-dir", "ok", "card", "export", "--a2a", "template.json"),
    # run
    ("--data-dir", "run1", "run", "--listen", "nohost"),
    ("--data-dir", "run2", "run", "--listen", "127.0.0.1:99999"),
    ("--data-dir", "run3", "run", "--bootstrap", "not-an-address"),
    ("--data-dir", "run4", "run", "--bootstrap-file", "missing.list"),
    ("--data-dir", "run5", "run", "--card", "missing.json"),
    ("--data-dir", "run6", "run", "--card", "bad.json"),
    ("--data-dir", "run7", "run", "--authority-key", "not-a-key"),
    ("--data-dir", "run8", "run", "--log-level", "LOUD"),
    ("--data-dir", "run9", "run", "--agent", "no_such_module:agent"),
    ("--data-dir", "run10", "run", "--endorse-with", "missing.key"),
    ("--data-dir", "afile", "run"),
    ("--data-dir", "corrupt", "run"),
    ("--data-dir", "run11", "run", "--bogus"),
    ("--data-dir", "run12", "run", "--card", "template.json"),
    ("--data-dir", "run13", "run", "--card", "foreign-signed.json"),
    ("--data-dir", "run14", "run", "--advertise-host", "not a host"),
    ("--data-dir", "run15", "run", "--role", "ops"),
    # control clients with no daemon running (one has a stale socket file)
    ("--data-dir", "none", "status"),
    ("--data-dir", "stale", "status"),
    ("--data-dir", "none", "status", "--bogus"),
    ("--data-dir", "none", "find"),
    ("--data-dir", "none", "find", "echo"),
    ("--data-dir", "none", "send", "someone"),
    ("--data-dir", "none", "send", "someone", "--payload", "{not json"),
    ("--data-dir", "none", "send"),
    ("--data-dir", "none", "doc"),
    ("--data-dir", "none", "doc", "subscribe", "d"),
    ("--data-dir", "none", "doc", "update", "d", "{not json"),
    ("--data-dir", "none", "doc", "update", "d", '{"op": "counter.add", "path": "n"}'),
    ("--data-dir", "none", "doc", "read", "d"),
    ("--data-dir", "none", "doc", "read"),
    ("--data-dir", "none", "tools"),
    ("--data-dir", "none", "tools", "list"),
    ("--data-dir", "none", "tools", "call"),
    ("--data-dir", "none", "tools", "call", "toolbox.estimate"),
    ("--data-dir", "none", "tools", "call", "estimate"),
    ("--data-dir", "none", "tools", "call", "toolbox.estimate", "--args", "{not json"),
    ("--data-dir", "none", "tools", "call", "toolbox.estimate", "--args", "[1]"),
    ("--data-dir", "none", "tools", "history"),
    ("--data-dir", "none", "resources", "list"),
    ("--data-dir", "none", "resources", "read"),
    ("--data-dir", "none", "resources", "read", "memo://checklist"),
    ("--data-dir", "none", "prompts", "list"),
    ("--data-dir", "none", "prompts", "get", "kickoff"),
    ("--data-dir", "none", "prompts", "get", "toolbox.kickoff", "--args", '"text"'),
    # the command itself
    ("frobnicate",),
    (),
    ("demo", "--nodes", "1"),
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli-errors")
    assert main(["--data-dir", str(root / "ok"), "init"]) == 0
    assert main(["--data-dir", str(root / "foreign"), "init"]) == 0
    signed = str(root / "foreign-signed.json")
    assert main(["--data-dir", str(root / "foreign"), "card", "sign", "-o", signed]) == 0
    (root / "afile").write_text("not a directory\n")
    (root / "bad.json").write_text("{not json\n")
    (root / "array.json").write_text("[1, 2]\n")
    (root / "template.json").write_text('{"id": "x", "tier": 7}\n')
    (root / "corrupt").mkdir(mode=0o700)
    (root / "corrupt" / "identity.key").write_text("garbage\n")
    os.chmod(root / "corrupt" / "identity.key", 0o600)
    (root / "stale").mkdir(mode=0o700)
    (root / "stale" / "control.sock").write_text("")  # left behind, nobody listens
    return root


def _starts_a_process(argv: tuple[str, ...]) -> bool:
    """``run`` (a daemon) and the command itself: what a user sees is a process's exit."""
    return "run" in argv or "demo" in argv or argv in {(), ("frobnicate",)}


PROCESS_CASES = [c for c in CASES if _starts_a_process(c)]
IN_PROCESS_CASES = [c for c in CASES if not _starts_a_process(c)]


def _ids(cases: list[tuple[str, ...]]) -> list[str]:
    return [" ".join(c) or "(nothing)" for c in cases]


def _assert_one_error_line(code: int, out: str, err: str) -> None:
    assert code != 0, out
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("p2pnode: error: "), err


@pytest.mark.parametrize("argv", PROCESS_CASES, ids=_ids(PROCESS_CASES))
def test_bad_input_is_one_error_line(workdir: Path, argv: tuple[str, ...]) -> None:
    env = dict(os.environ, P2PNODE_HOME=str(workdir / "home"), PYTHONUNBUFFERED="1")
    result = subprocess.run(
        [sys.executable, "-m", "p2pnode", *argv],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    _assert_one_error_line(result.returncode, result.stdout, result.stderr)


@pytest.mark.parametrize("argv", IN_PROCESS_CASES, ids=_ids(IN_PROCESS_CASES))
def test_bad_input_to_a_command_is_one_error_line(
    workdir: Path, argv: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("P2PNODE_HOME", str(workdir / "home"))
    done = run_cli(*argv, cwd=workdir)
    _assert_one_error_line(done.code, done.out, done.err)


def test_the_cases_cover_both_ways() -> None:
    assert len(PROCESS_CASES) + len(IN_PROCESS_CASES) == len(CASES)
    assert ("--data-dir", "run2", "run", "--listen", "127.0.0.1:99999") in PROCESS_CASES
    assert ("--data-dir", "stale", "status") in IN_PROCESS_CASES
