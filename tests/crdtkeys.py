"""Signing replicas for CRDT tests: a name gives a fixed Ed25519 identity, and the replica
id is that identity's peer id text, as on a node (docs/protocol/gossip.md §3.1)."""

from __future__ import annotations

import functools
import hashlib
from typing import Any

from p2pnode.core.identity import Identity
from p2pnode.crdt.replica import Replica


@functools.cache
def identity(name: str) -> Identity:
    """The identity a name stands for (the same in every test)."""
    return Identity(hashlib.sha256(b"crdt-test-" + name.encode()).digest())


def rid(name: str) -> str:
    """The replica id of ``name``'s identity."""
    return str(identity(name).peer_id)


def replica(name: str, **kwargs: Any) -> Replica:
    """A replica of ``name`` that signs its deltas."""
    return Replica(rid(name), signer=identity(name), **kwargs)


__all__ = ["identity", "replica", "rid"]
