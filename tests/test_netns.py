"""A swarm across Linux network namespaces (scripts/netns_swarm.py): distinct addresses
on a bridge, one ``p2pnode run`` each; discovery, requests, broadcast and a shared
document, then a partition and its heal. Skipped where namespaces cannot be made."""

from __future__ import annotations

import subprocess
from pathlib import Path

import netns_swarm
import pytest
from netns_swarm import NetnsError

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        (reason := netns_swarm.unavailable()) is not None, reason=f"no namespaces: {reason}"
    ),
]


def _listed() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line.split()[0] for line in out.stdout.splitlines() if line.strip()]


def test_a_swarm_across_namespaces_survives_a_partition() -> None:
    lines: list[str] = []
    before = set(_listed())
    try:
        results = netns_swarm.run(5, out=lines.append)
    finally:
        print("\n".join(lines))
    assert results["ok"]
    assert results["discovery"] == results["requests"] == 5
    assert results["broadcast"] == 4
    # Every update of both sides of the partition is in the converged document.
    assert results["document"]["hits"] == 5 + 10 + 100
    assert {"node1-while-cut", "node5-while-cut"} <= set(results["document"]["seen"])
    assert any("heal" in line for line in lines)
    assert set(_listed()) == before  # every namespace (and so veth and bridge) is gone


def test_every_namespace_goes_when_a_step_fails(tmp_path: Path) -> None:
    made: list[str] = []
    with (  # noqa: PT012
        pytest.raises(NetnsError, match="a step failed"),
        netns_swarm.swarm(5, tmp_path) as (topo, daemons, _),
    ):
        made = list(topo.namespaces)
        assert set(made) <= set(_listed())
        daemons[0].start(None)
        raise NetnsError("a step failed")
    assert len(made) == 7
    assert not set(made) & set(_listed())
    assert daemons[0].proc is not None and daemons[0].proc.poll() is not None
