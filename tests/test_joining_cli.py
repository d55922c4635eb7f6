"""``p2pnode run`` and joining: a malformed bootstrap address is one line and exit 1
before anything starts (in this process: nothing but output is read); a daemon whose
bootstrap peers cannot be resolved or reached says so in its ready line and status,
and warns once per address however often it tries again (a real process)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.inprocess import run_cli


@pytest.mark.parametrize(
    ("address", "why"),
    [
        (
            "http://127.0.0.1:7400",
            "a URL (http://) is not a bootstrap address; write HOST:PORT (127.0.0.1:7400)",
        ),
        ("localhost", "no port; write HOST:PORT"),
        ("localhost:0", "the port must be 1-65535"),
        ("localhost:70000", "the port must be 1-65535"),
    ],
)
def test_a_malformed_bootstrap_address_is_one_line_and_exit_1(
    tmp_path: Path, address: str, why: str
) -> None:
    data = tmp_path / "node"
    ran = run_cli("--data-dir", str(data), "run", "--bootstrap", address)
    assert ran.code == 1
    assert ran.out == ""
    assert ran.err == f"p2pnode: error: CONFIG_ERROR: bootstrap address {address!r}: {why}\n"
    assert not data.exists()  # refused before the node touched its data directory


def test_a_bootstrap_file_line_is_checked_as_well(tmp_path: Path) -> None:
    listing = tmp_path / "bootstrap.list"
    listing.write_text("127.0.0.1:7400  # the seed\nseed.example.org\n", encoding="utf-8")
    ran = run_cli("--data-dir", str(tmp_path / "node"), "run", "--bootstrap-file", str(listing))
    assert ran.code == 1
    assert ran.err.splitlines() == [
        "p2pnode: error: CONFIG_ERROR: bootstrap address 'seed.example.org': "
        "no port; write HOST:PORT"
    ]


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


def _status(data: Path) -> dict[str, object]:
    ran = run_cli("--data-dir", str(data), "status", "--json")
    assert ran.code == 0, ran.err
    status: dict[str, object] = json.loads(ran.out)
    return status


@pytest.mark.slow
def test_unreachable_bootstrap_peers_are_reported_once_and_retried(tmp_path: Path) -> None:
    data = tmp_path / "node"
    unreachable = f"127.0.0.1:{_closed_port()}"
    command = [
        sys.executable, "-m", "p2pnode", "--data-dir", str(data), "run",
        "--listen", "127.0.0.1:0",
        "--bootstrap", "no-such-host.invalid:7400", "--bootstrap", unreachable,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    daemon = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert daemon.stdout is not None
        ready = json.loads(daemon.stdout.readline())  # the daemon prints it within ~15 s
        assert ready["event"] == "ready"
        assert ready["joined"] is False and ready["peers"] == 0
        assert ready["join"].startswith("not joined: no bootstrap peer answered; retrying")
        deadline = time.monotonic() + 60
        while True:  # bounded: at most a minute
            join = _status(data)["join"]
            assert isinstance(join, dict)
            if join["attempts"] >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert join["attempts"] >= 2 and join["state"] == "retrying"
        assert join["bootstrap"] == 2 and join["reached"] == 0
    finally:
        daemon.terminate()
        _, err = daemon.communicate(timeout=30)
    warnings = [line for line in err.splitlines() if " WARNING " in line]
    assert len(warnings) == 2, err
    unresolved = [w for w in warnings if "bootstrap no-such-host.invalid:7400: cannot resolve" in w]
    refused = [w for w in warnings if f"bootstrap {unreachable}: unreachable: " in w]
    assert len(unresolved) == 1 and len(refused) == 1, warnings
    assert "Traceback" not in err
