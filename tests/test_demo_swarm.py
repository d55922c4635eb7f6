"""The demo's swarm check (p2pnode.cli.demo_swarm) in real processes: three workers, one
killed mid-run, and the swarm still completes."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import trio

from p2pnode.cli.demo import Demo
from p2pnode.cli.demo_swarm import SUBTASKS


@pytest.mark.slow
async def test_the_demo_passes_with_its_swarm_check(tmp_path: Path) -> None:
    out = io.StringIO()
    demo = Demo(2, tmp_path, out)
    with trio.fail_after(120):
        assert await demo.main(), out.getvalue()
    checks = {name: (ok, detail) for name, ok, detail in demo.checks}
    ok, detail = checks["swarm with a participant killed"]
    assert ok, detail
    assert f"{SUBTASKS}/{SUBTASKS} sub-tasks done" in detail and "worker1 killed" in detail
