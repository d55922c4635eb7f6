"""Shared state: vector clocks, delta-state CRDTs, replicas and gossip.

This namespace holds the sans-IO parts only, so importing it loads neither
trio nor sqlite3: durable storage is :mod:`p2pnode.crdt.store`
(``CRDTStore``, ``AsyncCRDTStore``, ``Batch``).

May import: core.
"""

from p2pnode.crdt.clock import CRDTError, Ordering, VectorClock
from p2pnode.crdt.delta import Delta, Opened
from p2pnode.crdt.dots import Dot, DotContext
from p2pnode.crdt.gossip import (
    DeltaBatch,
    DeltaPush,
    Digest,
    GossipConfig,
    GossipError,
    GossipMessage,
    GossipNode,
    GossipStats,
    Graft,
    IHave,
    Prune,
    Received,
)
from p2pnode.crdt.ops import CounterAdd, MapRemove, Op, RegisterSet, SetAdd, SetRemove
from p2pnode.crdt.replica import Changes, Document, Replica
from p2pnode.crdt.signing import ForgedDeltaError, Sealed, Signer
from p2pnode.crdt.simulate import GossipSimulation, NetConfig
from p2pnode.crdt.types import (
    CRDT,
    DocState,
    GCounter,
    Kind,
    LWWRegister,
    MapEntry,
    ORMap,
    ORSet,
    PNCounter,
)

__all__ = [
    "CRDT",
    "CRDTError",
    "Changes",
    "CounterAdd",
    "Delta",
    "DeltaBatch",
    "DeltaPush",
    "Digest",
    "DocState",
    "Document",
    "Dot",
    "DotContext",
    "ForgedDeltaError",
    "GCounter",
    "GossipConfig",
    "GossipError",
    "GossipMessage",
    "GossipNode",
    "GossipSimulation",
    "GossipStats",
    "Graft",
    "IHave",
    "Kind",
    "LWWRegister",
    "MapEntry",
    "MapRemove",
    "NetConfig",
    "ORMap",
    "ORSet",
    "Op",
    "Opened",
    "Ordering",
    "PNCounter",
    "Prune",
    "Received",
    "RegisterSet",
    "Replica",
    "Sealed",
    "SetAdd",
    "SetRemove",
    "Signer",
    "VectorClock",
]
