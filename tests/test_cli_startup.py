"""What a ``p2pnode`` process loads before it knows its command: the parser and the
commands that only read files or ask a running node, not the composed node, its
services or the bridges (those load when ``run``, ``mcp`` or ``a2a`` runs). Each command
line is a new interpreter, so what the parser drags in is paid by every call."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import p2pnode

ROOT = Path(p2pnode.__file__).parent.parent

#: Loaded only by the commands that run a node or a bridge.
HEAVY = (
    "p2pnode.runtime",
    "p2pnode.node.kernel",
    "p2pnode.node.config",
    "p2pnode.services.shared.service",
    "p2pnode.services.swarms",
    "p2pnode.services.metrics",
    "p2pnode.transport.relayserve",
    "p2pnode.bridges.mcp",
    "p2pnode.bridges.a2a",
    "asyncio",
)


def _loaded(statements: str) -> list[str]:
    """Which of HEAVY a new interpreter holds after ``statements``."""
    script = (
        "import json, sys\n"
        f"{statements}\n"
        f"print(json.dumps([m for m in {list(HEAVY)!r} if m in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=ROOT,
    )
    loaded: list[str] = json.loads(done.stdout)
    return loaded


@pytest.mark.slow
def test_building_the_parser_loads_no_node_service_or_bridge() -> None:
    assert _loaded("from p2pnode.cli.main import build_parser; build_parser()") == []


@pytest.mark.slow
def test_the_watched_modules_are_what_running_a_node_loads() -> None:
    # The check above would pass vacuously if a name in HEAVY were misspelt.
    statements = (
        "import p2pnode.runtime, p2pnode.services.metrics, p2pnode.transport.relayserve\n"
        "import p2pnode.bridges.mcp, p2pnode.bridges.a2a, p2pnode.node.config\n"
        "import p2pnode.hosting.aio  # the asyncio node of `a2a serve`"
    )
    assert _loaded(statements) == list(HEAVY)
