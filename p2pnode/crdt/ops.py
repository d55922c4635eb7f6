"""Local operations on a document: small frozen records naming a path and a change.

A path is a tuple of map keys from the document's root map; every key but the
last names a nested map (created on first write). The last key holds the
value the operation acts on, whose CRDT type the operation implies.
:meth:`p2pnode.crdt.types.DocState.mutate` turns an operation into a delta.
"""

from __future__ import annotations

from dataclasses import dataclass

Path = tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Op:
    """Base of every local operation."""

    #: Keys from the root map down to the value operated on.
    path: Path


@dataclass(frozen=True, slots=True)
class CounterAdd(Op):
    """Add ``amount`` to a counter: a PN-Counter (any non-zero amount) or, with
    ``grow_only``, a G-Counter (amount >= 1)."""

    amount: int = 1
    grow_only: bool = False


@dataclass(frozen=True, slots=True)
class RegisterSet(Op):
    """Write ``value`` (None, bool, int, float, str or bytes) to an LWW register.

    ``timestamp`` (int >= 1, e.g. milliseconds since the epoch, supplied by the
    caller because the core reads no clock) is raised to one past the current
    stamp when needed so the write supersedes what this replica has seen.
    """

    value: object = None
    timestamp: int = 1


@dataclass(frozen=True, slots=True)
class SetAdd(Op):
    """Add ``element`` (int, str or bytes) to an add-wins OR-Set."""

    element: int | str | bytes = ""


@dataclass(frozen=True, slots=True)
class SetRemove(Op):
    """Remove the observed adds of ``element`` from an OR-Set."""

    element: int | str | bytes = ""


@dataclass(frozen=True, slots=True)
class MapRemove(Op):
    """Remove the key ``path[-1]`` from its map (concurrent writes below it win)."""
