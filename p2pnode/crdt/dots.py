"""Dots and dot contexts: the causal bookkeeping behind observed-remove CRDTs.

A *dot* ``(replica_id, n)`` names the n-th event a replica generated. A
:class:`DotContext` is a set of dots stored compactly as a version vector
(every dot ``(r, 1..vv[r])``) plus a *cloud* of dots beyond the contiguous
prefix (Almeida, Shoker, Baquero, "Delta State Replicated Data Types", 2018,
§4.3: "causal context"). Joining two contexts is set union; :meth:`compact`
moves cloud dots into the vector whenever they extend the prefix, so a
context that saw every dot stays as small as a vector clock.

The same structure serves two purposes in this package: the causal context of
a document's CRDT state (which dots the state has seen, so a missing dot means
"removed"), and a replica's record of which operations ``(origin, seq)`` it has
applied (the contiguous prefix is the vector clock it advertises).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from p2pnode.crdt.clock import (
    CRDTError,
    VectorClock,
    valid_counter_untrusted,
    valid_replica_id_untrusted,
)

Dot = tuple[str, int]


def dot_to_wire(d: Dot) -> list[Any]:
    """A dot as ``[replica_id, n]``."""
    return [d[0], d[1]]


def dot_from_wire_untrusted(obj: object) -> Dot:
    """Validate a decoded ``[replica_id, n]`` pair. Raises CRDTError."""
    if not isinstance(obj, list) or len(obj) != 2:
        raise CRDTError("dot is not a [replica, n] pair")
    return (valid_replica_id_untrusted(obj[0]), valid_counter_untrusted(obj[1]))


def dots_to_wire(dots: Iterable[Dot]) -> list[list[Any]]:
    """A set of dots in canonical (sorted) order."""
    return [dot_to_wire(d) for d in sorted(dots)]


def dots_from_wire_untrusted(obj: object) -> set[Dot]:
    """Validate a decoded list of dots. Raises CRDTError."""
    if not isinstance(obj, list):
        raise CRDTError("dot set is not a list")
    return {dot_from_wire_untrusted(item) for item in obj}


class DotContext:
    """A mutable set of dots: compact version vector plus a cloud of stragglers."""

    __slots__ = ("cloud", "vv")

    def __init__(self, vv: dict[str, int] | None = None, cloud: Iterable[Dot] = ()) -> None:
        self.vv: dict[str, int] = {r: n for r, n in (vv or {}).items() if n > 0}
        self.cloud: set[Dot] = set(cloud)
        self.compact()

    def __contains__(self, d: Dot) -> bool:
        return d[1] <= self.vv.get(d[0], 0) or d in self.cloud

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DotContext):
            return self.vv == other.vv and self.cloud == other.cloud
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"DotContext({self.vv!r}, {sorted(self.cloud)!r})"

    def __iter__(self) -> Iterator[Dot]:
        """Every dot in the context (the prefix expanded); for tests and small contexts."""
        for r, n in self.vv.items():
            for i in range(1, n + 1):
                yield (r, i)
        yield from self.cloud

    def copy(self) -> DotContext:
        """An independent copy."""
        new = DotContext.__new__(DotContext)
        new.vv = dict(self.vv)
        new.cloud = set(self.cloud)
        return new

    def add(self, d: Dot) -> None:
        """Insert one dot, keeping the representation compact."""
        r, n = d
        top = self.vv.get(r, 0)
        if n <= top:
            return
        if n == top + 1:
            self.vv[r] = n
            self._absorb(r)
        else:
            self.cloud.add(d)

    def update(self, dots: Iterable[Dot]) -> None:
        """Insert many dots."""
        for d in dots:
            self.add(d)

    def join(self, other: DotContext) -> None:
        """Set union, in place.

        Both contexts are compact, so only the replicas ``other`` raises or adds cloud
        dots for can change: they alone are compacted again. (Sorting the whole cloud
        on every join made a batch of deltas cost quadratic time in the cloud's size.)
        """
        vv, cloud = self.vv, self.cloud
        raised = {r for r, n in other.vv.items() if n > vv.get(r, 0)}
        for r in raised:
            vv[r] = other.vv[r]
        if raised and cloud:
            cloud.difference_update([d for d in cloud if d[0] in raised and d[1] <= vv[d[0]]])
        touched = raised
        for d in other.cloud:
            if d[1] > vv.get(d[0], 0) and d not in cloud:
                cloud.add(d)
                touched.add(d[0])
        for r in touched:
            self._absorb(r)

    def _absorb(self, r: str) -> None:
        # Pull any cloud dots that now extend r's prefix.
        top = self.vv.get(r, 0)
        n = top
        while (r, n + 1) in self.cloud:
            self.cloud.discard((r, n + 1))
            n += 1
        if n > top:
            self.vv[r] = n

    def compact(self) -> None:
        """Move cloud dots that extend the contiguous prefix into the vector."""
        if not self.cloud:
            return
        for r, n in sorted(self.cloud):
            top = self.vv.get(r, 0)
            if n <= top:
                self.cloud.discard((r, n))
            elif n == top + 1:
                self.cloud.discard((r, n))
                self.vv[r] = n

    def clock(self) -> VectorClock:
        """The contiguous prefix as an immutable vector clock."""
        return VectorClock._trusted(self.vv)

    def explicit(self, limit: int = 64) -> frozenset[Dot] | None:
        """The context as a plain set if it holds at most ``limit`` dots, else None."""
        if sum(self.vv.values()) + len(self.cloud) > limit:
            return None
        return frozenset(self)

    def max_for(self, r: str) -> int:
        """Highest n of any dot of ``r`` in the context (0 if none)."""
        top = self.vv.get(r, 0)
        for rr, n in self.cloud:
            if rr == r and n > top:
                top = n
        return top

    def to_wire(self) -> list[Any]:
        """``[{replica: n}, [[replica, n], ...]]`` in canonical order."""
        return [dict(sorted(self.vv.items())), dots_to_wire(self.cloud)]

    @classmethod
    def from_wire_untrusted(cls, obj: object) -> DotContext:
        """Validate decoded peer data. Raises CRDTError."""
        if not isinstance(obj, list) or len(obj) != 2:
            raise CRDTError("dot context is not a [vector, cloud] pair")
        vv = VectorClock.from_wire_untrusted(obj[0])
        return cls(vv.to_wire(), dots_from_wire_untrusted(obj[1]))
