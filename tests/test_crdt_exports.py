"""The public namespace of p2pnode.crdt is what we mean it to be."""

from __future__ import annotations

import p2pnode.crdt as crdt


def test_public_names() -> None:
    expected = {
        # clocks and causal contexts
        "VectorClock", "Ordering", "CRDTError", "Dot", "DotContext",
        # CRDT types and operations
        "CRDT", "Kind", "GCounter", "PNCounter", "LWWRegister", "ORSet", "ORMap", "MapEntry",
        "DocState", "Op", "CounterAdd", "RegisterSet", "SetAdd", "SetRemove", "MapRemove",
        # replicas
        "Replica", "Document", "Delta", "Changes", "Opened",
        # origin signatures
        "Signer", "Sealed", "ForgedDeltaError",
        # gossip
        "GossipNode", "GossipConfig", "GossipStats", "GossipMessage", "GossipError", "Received",
        "DeltaPush", "Digest", "DeltaBatch", "IHave", "Graft", "Prune", "GossipSimulation",
        "NetConfig",
    }  # fmt: skip
    # Durable storage (sqlite3, trio) is imported from p2pnode.crdt.store, not the namespace.
    assert set(crdt.__all__) == expected
    for name in expected - {"Dot"}:  # Dot is a type alias of tuple[str, int]
        obj = getattr(crdt, name)
        assert getattr(obj, "__module__", "p2pnode.crdt").startswith("p2pnode.crdt")
