"""The public namespace of p2pnode.crdt is what we mean it to be."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import p2pnode.crdt as crdt


def test_public_names() -> None:
    expected = {
        # clocks and causal contexts
        "VectorClock", "Ordering", "CRDTError", "Dot", "DotContext",
        # CRDT types and operations
        "CRDT", "Kind", "GCounter", "PNCounter", "LWWRegister", "ORSet", "ORMap", "MapEntry",
        "DocState", "Op", "CounterAdd", "RegisterSet", "SetAdd", "SetRemove", "MapRemove",
        # replicas
        "Replica", "Document", "Delta", "FullState", "Changes",
        # gossip
        "GossipNode", "GossipConfig", "GossipStats", "GossipMessage", "GossipError", "Received",
        "DeltaPush", "Digest", "DeltaBatch", "StatePush", "GossipSimulation", "NetConfig",
        # storage
        "CRDTStore", "AsyncCRDTStore", "Batch",
    }  # fmt: skip
    assert set(crdt.__all__) == expected
    for name in expected - {"Dot"}:  # Dot is a type alias of tuple[str, int]
        obj = getattr(crdt, name)
        assert getattr(obj, "__module__", "p2pnode.crdt").startswith("p2pnode.crdt")


def test_crdt_layer_imports_only_wire_and_errors() -> None:
    """DESIGN.md: crdt depends on wire only (plus errors); a fresh interpreter proves it."""
    code = (
        "import sys, p2pnode.crdt; "
        "print(sorted(m for m in sys.modules if m.startswith('p2pnode.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    ).stdout
    mods = {m for m in ast.literal_eval(out) if not m.startswith("p2pnode.crdt")}
    # p2pnode/__init__.py itself imports identity; nothing else may appear.
    assert mods <= {"p2pnode.errors", "p2pnode.wire", "p2pnode.identity"}
