"""Delta-state CRDTs: counters, last-writer-wins registers, add-wins sets, nested maps.

Theory of operation
-------------------
We use **delta-state CRDTs** (Almeida, Shoker, Baquero, "Delta State Replicated
Data Types", JPDC 2018), not op-based CRDTs with causal buffering. Every state
is an element of a join-semilattice and a local operation returns a *delta*:
a small state of the same lattice. Applying a delta (or a peer's full state)
is the lattice join, which is idempotent, commutative and associative, so
deltas may be delivered in any order, duplicated, or replaced by a full state
after loss, and replicas that have joined the same set of deltas are equal
(R9.3, Property 28). No causal delivery buffer is needed: the causal order is
recorded *inside* the state as dots (see :mod:`p2pnode.crdt.dots`), not
imposed on the network. The price is that a remove delta carries the dots it
observed, and anti-entropy must eventually deliver every delta (or a full
state) for replicas to converge.

A document is a :class:`DocState`: a root :class:`ORMap` plus one shared
:class:`~p2pnode.crdt.dots.DotContext` (paper §6, "causal CRDTs"). Joining
``(s, c)`` with ``(s', c')`` keeps a dot held by one side unless the other side's
context has seen it and dropped it — ``(s ∩ s') ∪ (s − c') ∪ (s' − c)``.

Types (kind numbers are part of the wire format, docs/protocol/gossip.md):

* :class:`GCounter` (1): per-replica counts, join = pointwise max.
* :class:`PNCounter` (2): a pair of G-Counters (increments, decrements).
* :class:`LWWRegister` (3): ``(timestamp, replica id, value)``; the greatest
  triple wins, so ties on timestamp break deterministically on replica id and
  then on the canonical encoding of the value. A writer stamps
  ``max(now, current + 1)`` so its write supersedes what it has seen.
* :class:`ORSet` (4): add-wins observed-remove set; element -> dots.
* :class:`ORMap` (5): string key -> (presence dots, nested CRDT). A key is
  present while it holds a dot; every write below a key adds a fresh dot, so a
  concurrent write beats a remove (add-wins). Removing a key hides it but keeps
  its nested state (no reset), which keeps the join a plain product of lattices.
  If replicas concurrently create different kinds under one key, the higher
  kind number wins (an ordinal sum of lattices: deterministic everywhere).

Cost: joining a small delta touches the entries it names plus a cheap check of
every sibling map entry (each entry caches the set of dots below it, so an
entry holding none of the delta's context dots is skipped without descent);
joining a full state is linear in both states.
"""

from __future__ import annotations

import abc
import enum
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.wire import canonical_pack
from p2pnode.crdt.clock import (
    MAX_COUNTER,
    CRDTError,
    check_replica_id,
    valid_counter_untrusted,
    valid_replica_id_untrusted,
)
from p2pnode.crdt.dots import Dot, DotContext, dots_from_wire_untrusted, dots_to_wire
from p2pnode.crdt.ops import CounterAdd, MapRemove, Op, RegisterSet, SetAdd, SetRemove

#: Deepest nesting of ORMaps a decoded state may have.
MAX_MAP_DEPTH = 8
#: Longest map key / string set element / string register value accepted from peers.
MAX_KEY_LEN = 256
MAX_VALUE_LEN = 64 * 1024

Scalar = None | bool | int | float | str | bytes
Element = int | str | bytes


class Kind(enum.IntEnum):
    """Wire tag and conflict order of each CRDT type."""

    GCOUNTER = 1
    PNCOUNTER = 2
    LWW = 3
    ORSET = 4
    ORMAP = 5


def causal_join(s: set[Dot], s2: set[Dot], c: DotContext, c2: DotContext) -> set[Dot]:
    return (s & s2) | {d for d in s if d not in c2} | {d for d in s2 if d not in c}


def valid_str_untrusted(obj: object, limit: int, what: str) -> str:
    if not isinstance(obj, str) or len(obj) > limit:
        raise CRDTError(f"bad {what}: {obj!r:.80}")
    return obj


class CRDT(abc.ABC):
    """A mutable CRDT value owned by one document. Joins happen in place."""

    __slots__ = ()
    kind: ClassVar[Kind]

    @abc.abstractmethod
    def join(self, other: Any, ctx: DotContext, other_ctx: DotContext) -> None:
        """Join ``other`` (same kind) into self; ``other`` is not modified or aliased."""

    def join_bottom(self, other_ctx: DotContext) -> None:  # noqa: B027 - a no-op by default
        """Join the empty state of a peer whose context is ``other_ctx`` (drops removed dots)."""

    @abc.abstractmethod
    def value(self) -> Any:
        """The plain Python value."""

    @abc.abstractmethod
    def to_wire(self) -> Any:
        """Payload (without the kind tag) as canonical msgpack-ready data."""


def check_scalar(value: object) -> Scalar:
    if value is None or isinstance(value, bool | int | str | bytes):
        big = isinstance(value, int) and not -(2**63) <= value < 2**64
        if big:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "integer out of msgpack range")
        if isinstance(value, str) and len(value) > MAX_VALUE_LEN:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"string longer than {MAX_VALUE_LEN}")
        return value
    if isinstance(value, float) and not math.isnan(value):
        return value
    raise LocalError(ErrorCode.INVALID_ARGUMENT, f"register value must be a scalar: {value!r}")


def check_element(e: object) -> Element:
    # The same limits peers enforce, so nothing we produce is rejected downstream.
    if isinstance(e, bool) or not isinstance(e, int | str | bytes):
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"set elements are int/str/bytes: {e!r}")
    if isinstance(e, int) and not -(2**63) <= e < 2**64:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "set element out of msgpack range")
    if isinstance(e, str | bytes) and len(e) > MAX_KEY_LEN:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"set element longer than {MAX_KEY_LEN}")
    return e


@dataclass(slots=True, eq=True)
class GCounter(CRDT):
    """Grow-only counter: replica id -> that replica's total."""

    kind: ClassVar[Kind] = Kind.GCOUNTER
    counts: dict[str, int] = field(default_factory=dict)

    def join(self, other: GCounter, ctx: DotContext, other_ctx: DotContext) -> None:
        for r, n in other.counts.items():
            if n > self.counts.get(r, 0):
                self.counts[r] = n

    def value(self) -> int:
        return sum(self.counts.values())

    def increment_delta(self, rid: str, amount: int) -> GCounter:
        """Delta for adding ``amount`` (>= 1) at ``rid``."""
        total = self.counts.get(rid, 0) + amount
        if amount < 1 or total > MAX_COUNTER:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"bad increment {amount}")
        return GCounter({rid: total})

    def to_wire(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))

    @classmethod
    def from_wire_untrusted(cls, obj: object) -> GCounter:
        if not isinstance(obj, dict):
            raise CRDTError("g-counter is not a map")
        return cls(
            {valid_replica_id_untrusted(r): valid_counter_untrusted(n) for r, n in obj.items()}
        )


@dataclass(slots=True, eq=True)
class PNCounter(CRDT):
    """Counter supporting decrements: increments ``p`` minus decrements ``n``."""

    kind: ClassVar[Kind] = Kind.PNCOUNTER
    p: GCounter = field(default_factory=GCounter)
    n: GCounter = field(default_factory=GCounter)

    def join(self, other: PNCounter, ctx: DotContext, other_ctx: DotContext) -> None:
        self.p.join(other.p, ctx, other_ctx)
        self.n.join(other.n, ctx, other_ctx)

    def value(self) -> int:
        return self.p.value() - self.n.value()

    def add_delta(self, rid: str, amount: int) -> PNCounter:
        """Delta for adding ``amount`` (non-zero, either sign) at ``rid``."""
        if amount > 0:
            return PNCounter(p=self.p.increment_delta(rid, amount))
        if amount < 0:
            return PNCounter(n=self.n.increment_delta(rid, -amount))
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "amount must be non-zero")

    def to_wire(self) -> list[Any]:
        return [self.p.to_wire(), self.n.to_wire()]

    @classmethod
    def from_wire_untrusted(cls, obj: object) -> PNCounter:
        if not isinstance(obj, list) or len(obj) != 2:
            raise CRDTError("pn-counter is not a [p, n] pair")
        return cls(GCounter.from_wire_untrusted(obj[0]), GCounter.from_wire_untrusted(obj[1]))


@dataclass(slots=True, eq=True)
class LWWRegister(CRDT):
    """Last-writer-wins register; the greatest ``(timestamp, replica, value)`` wins.

    The bottom element is ``timestamp == 0`` (never written); writes use
    timestamps >= 1.
    """

    kind: ClassVar[Kind] = Kind.LWW
    timestamp: int = 0
    replica: str = ""
    val: Scalar = None

    def _key(self) -> tuple[int, str, bytes]:
        return (self.timestamp, self.replica, canonical_pack(self.val))

    def join(self, other: LWWRegister, ctx: DotContext, other_ctx: DotContext) -> None:
        if other._key() > self._key():
            self.timestamp, self.replica, self.val = other.timestamp, other.replica, other.val

    def value(self) -> Scalar:
        return self.val

    def set_delta(self, rid: str, value: Scalar, now: int) -> LWWRegister:
        """Delta for writing ``value`` at logical/wall time ``now`` (>= 1)."""
        if type(now) is not int or now < 1:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"bad timestamp {now!r}")
        ts = max(now, self.timestamp + 1)
        if ts > MAX_COUNTER:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "timestamp overflow")
        return LWWRegister(ts, rid, check_scalar(value))

    def to_wire(self) -> list[Any]:
        return [self.timestamp, self.replica, self.val]

    @classmethod
    def from_wire_untrusted(cls, obj: object) -> LWWRegister:
        if not isinstance(obj, list) or len(obj) != 3:
            raise CRDTError("lww register is not [timestamp, replica, value]")
        ts = valid_counter_untrusted(obj[0], minimum=0)
        if ts == 0:
            if obj[1] != "" or obj[2] is not None:
                raise CRDTError("unwritten lww register carries a value")
            return cls()
        val = obj[2]
        ok = val is None or isinstance(val, bool | int | bytes)
        ok = ok or (isinstance(val, float) and not math.isnan(val))
        ok = ok or (isinstance(val, str) and len(val) <= MAX_VALUE_LEN)
        if not ok:
            raise CRDTError(f"bad lww value {val!r:.80}")
        return cls(ts, valid_replica_id_untrusted(obj[1]), val)


@dataclass(slots=True, eq=True)
class ORSet(CRDT):
    """Add-wins observed-remove set: element -> the dots of the adds still live."""

    kind: ClassVar[Kind] = Kind.ORSET
    entries: dict[Element, set[Dot]] = field(default_factory=dict)

    def join(self, other: ORSet, ctx: DotContext, other_ctx: DotContext) -> None:
        entries, theirs = self.entries, other.entries
        for e, dots_there in theirs.items():
            dots = causal_join(entries.get(e, set()), dots_there, ctx, other_ctx)
            if dots:
                entries[e] = dots
            else:
                entries.pop(e, None)
        # An element only we hold keeps the dots the other side has not seen. With a small
        # context (a delta's), an element holding none of its dots is skipped at once, as
        # map entries are: a delta then costs a set test per element, not a causal join.
        explicit = other_ctx.explicit()
        changed: list[tuple[Element, set[Dot]]] = []
        for e, mine in entries.items():
            if e in theirs or (explicit is not None and explicit.isdisjoint(mine)):
                continue
            kept = {d for d in mine if d not in other_ctx}
            if len(kept) != len(mine):
                changed.append((e, kept))
        for e, kept in changed:
            if kept:
                entries[e] = kept
            else:
                del entries[e]

    def join_bottom(self, other_ctx: DotContext) -> None:
        for e in list(self.entries):
            dots = {d for d in self.entries[e] if d not in other_ctx}
            if dots:
                self.entries[e] = dots
            else:
                del self.entries[e]

    def value(self) -> frozenset[Element]:
        return frozenset(self.entries)

    def add_delta(self, element: Element, dot: Dot) -> tuple[ORSet, set[Dot]]:
        """Delta adding ``element`` with ``dot``, and the dots it supersedes."""
        return ORSet({check_element(element): {dot}}), set(self.entries.get(element, ()))

    def remove_delta(self, element: Element) -> tuple[ORSet, set[Dot]]:
        """Delta removing the observed adds of ``element``, and those dots."""
        return ORSet(), set(self.entries.get(check_element(element), ()))

    def to_wire(self) -> list[Any]:
        items = sorted(self.entries.items(), key=lambda kv: canonical_pack(kv[0]))
        return [[e, dots_to_wire(ds)] for e, ds in items]

    @classmethod
    def from_wire_untrusted(cls, obj: object) -> ORSet:
        if not isinstance(obj, list):
            raise CRDTError("or-set is not a list")
        entries: dict[Element, set[Dot]] = {}
        for item in obj:
            if not isinstance(item, list) or len(item) != 2:
                raise CRDTError("or-set entry is not [element, dots]")
            e = item[0]
            if isinstance(e, bool) or not isinstance(e, int | str | bytes):
                raise CRDTError(f"bad or-set element {e!r:.80}")
            if isinstance(e, str | bytes) and len(e) > MAX_KEY_LEN:
                raise CRDTError("or-set element too long")
            dots = dots_from_wire_untrusted(item[1])
            if not dots or e in entries:
                raise CRDTError("or-set entry without dots or repeated")
            entries[e] = dots
        return cls(entries)


@dataclass(slots=True, eq=True)
class MapEntry:
    """One key of an :class:`ORMap`: its presence dots and its nested value."""

    dots: set[Dot]
    value: CRDT
    #: Every dot in this entry and below it; a cache rebuilt after the entry changes.
    below: frozenset[Dot] | None = field(default=None, compare=False, repr=False)

    def all_dots(self) -> frozenset[Dot]:
        """Presence dots plus every dot nested in the value (cached)."""
        if self.below is None:
            found = set(self.dots)
            v = self.value
            if isinstance(v, ORSet):
                for ds in v.entries.values():
                    found |= ds
            elif isinstance(v, ORMap):
                for e in v.entries.values():
                    found |= e.all_dots()
            self.below = frozenset(found)
        return self.below

    def drop_seen(self, other_ctx: DotContext, explicit: frozenset[Dot] | None) -> None:
        """Join the empty entry of a peer with context ``other_ctx`` (drop what it removed).

        ``explicit`` is ``other_ctx`` as a set when small: an entry holding none
        of those dots cannot change, so it is skipped without a traversal.
        """
        if explicit is not None and explicit.isdisjoint(self.all_dots()):
            return
        self.dots = {d for d in self.dots if d not in other_ctx}
        self.value.join_bottom(other_ctx)
        self.below = None


def _empty(kind: Kind) -> CRDT:
    return _CLASSES[kind]()


def _join_value(mine: CRDT | None, other: CRDT, ctx: DotContext, other_ctx: DotContext) -> CRDT:
    """Join ``other`` into ``mine`` (higher kind wins a kind conflict); may return a new object."""
    if mine is None or other.kind > mine.kind:
        fresh = _empty(other.kind)
        fresh.join(other, ctx, other_ctx)
        return fresh
    if other.kind < mine.kind:
        mine.join_bottom(other_ctx)
    else:
        mine.join(other, ctx, other_ctx)
    return mine


@dataclass(slots=True, eq=True)
class ORMap(CRDT):
    """Add-wins map from string keys to nested CRDTs (see the module docstring)."""

    kind: ClassVar[Kind] = Kind.ORMAP
    entries: dict[str, MapEntry] = field(default_factory=dict)

    def join(self, other: ORMap, ctx: DotContext, other_ctx: DotContext) -> None:
        for k, theirs in other.entries.items():
            mine = self.entries.get(k)
            if mine is None:
                dots = {d for d in theirs.dots if d not in ctx}
                self.entries[k] = MapEntry(dots, _join_value(None, theirs.value, ctx, other_ctx))
            else:
                mine.dots = causal_join(mine.dots, theirs.dots, ctx, other_ctx)
                mine.value = _join_value(mine.value, theirs.value, ctx, other_ctx)
                mine.below = None
        explicit = other_ctx.explicit()
        for k, mine in self.entries.items():
            if k not in other.entries:
                mine.drop_seen(other_ctx, explicit)

    def join_bottom(self, other_ctx: DotContext) -> None:
        explicit = other_ctx.explicit()
        for entry in self.entries.values():
            entry.drop_seen(other_ctx, explicit)

    def value(self) -> dict[str, Any]:
        """Present keys only (a key with no presence dots was removed)."""
        return {k: e.value.value() for k, e in sorted(self.entries.items()) if e.dots}

    def to_wire(self) -> list[Any]:
        return [
            [k, dots_to_wire(e.dots), value_to_wire(e.value)]
            for k, e in sorted(self.entries.items())
        ]

    @classmethod
    def from_wire_untrusted(cls, obj: object, depth: int = 1) -> ORMap:
        if depth > MAX_MAP_DEPTH:
            raise CRDTError(f"maps nested deeper than {MAX_MAP_DEPTH}")
        if not isinstance(obj, list):
            raise CRDTError("or-map is not a list")
        entries: dict[str, MapEntry] = {}
        for item in obj:
            if not isinstance(item, list) or len(item) != 3:
                raise CRDTError("or-map entry is not [key, dots, value]")
            key = valid_str_untrusted(item[0], MAX_KEY_LEN, "map key")
            if key in entries:
                raise CRDTError("repeated map key")
            dots = dots_from_wire_untrusted(item[1])
            entries[key] = MapEntry(dots, value_from_wire_untrusted(item[2], depth))
        return cls(entries)


_CLASSES: dict[Kind, type[CRDT]] = {
    Kind.GCOUNTER: GCounter,
    Kind.PNCOUNTER: PNCounter,
    Kind.LWW: LWWRegister,
    Kind.ORSET: ORSet,
    Kind.ORMAP: ORMap,
}


def value_to_wire(v: CRDT) -> list[Any]:
    """A CRDT value as ``[kind, payload]``."""
    return [int(v.kind), v.to_wire()]


def value_from_wire_untrusted(obj: object, depth: int = 0) -> CRDT:
    """Validate decoded ``[kind, payload]`` data. Raises CRDTError."""
    if not isinstance(obj, list) or len(obj) != 2 or type(obj[0]) is not int:
        raise CRDTError("crdt value is not [kind, payload]")
    try:
        kind = Kind(obj[0])
    except ValueError:
        raise CRDTError(f"unknown crdt kind {obj[0]}") from None
    if kind is Kind.ORMAP:
        return ORMap.from_wire_untrusted(obj[1], depth + 1)
    decoder = _CLASSES[kind].from_wire_untrusted  # type: ignore[attr-defined]
    result: CRDT = decoder(obj[1])
    return result


def _copy(v: CRDT) -> CRDT:
    return _join_value(None, v, DotContext(), DotContext())


def op_kind(op: Op) -> Kind:
    """The CRDT kind an operation acts on."""
    if isinstance(op, CounterAdd):
        return Kind.GCOUNTER if op.grow_only else Kind.PNCOUNTER
    if isinstance(op, RegisterSet):
        return Kind.LWW
    if isinstance(op, SetAdd | SetRemove):
        return Kind.ORSET
    if isinstance(op, MapRemove):
        return Kind.ORMAP
    raise LocalError(ErrorCode.INVALID_ARGUMENT, f"unknown operation {op!r}")


@dataclass(slots=True, eq=True)
class DocState:
    """A document's CRDT state: the root map and its causal context.

    Also the shape of every delta: a delta is a small DocState.
    """

    root: ORMap = field(default_factory=ORMap)
    ctx: DotContext = field(default_factory=DotContext)

    def join(self, other: DocState) -> None:
        """Join ``other`` into self (lattice join; ``other`` is not modified)."""
        self.root.join(other.root, self.ctx, other.ctx)
        self.ctx.join(other.ctx)

    def copy(self) -> DocState:
        """An independent deep copy."""
        root = _copy(self.root)
        assert isinstance(root, ORMap)
        return DocState(root, self.ctx.copy())

    def value(self) -> dict[str, Any]:
        """The document as plain Python data (present keys only)."""
        return self.root.value()

    def to_wire(self) -> list[Any]:
        """``[root_map_payload, context]`` as canonical msgpack-ready data."""
        return [self.root.to_wire(), self.ctx.to_wire()]

    @classmethod
    def from_wire_untrusted(cls, obj: object) -> DocState:
        """Validate decoded peer data; checks every stored dot is in the context."""
        if not isinstance(obj, list) or len(obj) != 2:
            raise CRDTError("document state is not [root, context]")
        state = cls(ORMap.from_wire_untrusted(obj[0]), DotContext.from_wire_untrusted(obj[1]))
        if not _dots_within(state.root, state.ctx):
            raise CRDTError("state holds a dot outside its causal context")
        return state

    def mutate(self, rid: str, op: Op) -> DocState:
        """The delta for local operation ``op`` by replica ``rid`` (self is unchanged).

        Raises LocalError(INVALID_ARGUMENT) for an empty path, a path through a
        non-map, or an op whose kind differs from the value already at the path.
        """
        check_replica_id(rid)
        op_kind(op)
        path = op.path
        if (
            len(path) > MAX_MAP_DEPTH
            or not path
            or any(not isinstance(k, str) or not 0 < len(k) <= MAX_KEY_LEN for k in path)
        ):
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"bad path {path!r}")
        delta = DocState()
        # max_for, not the prefix: a dot of ours that a peer put in our context
        # must never be reissued, or the write would count as already removed.
        counter = [self.ctx.max_for(rid)]

        def fresh() -> Dot:
            counter[0] += 1
            d = (rid, counter[0])
            delta.ctx.add(d)
            return d

        node: ORMap | None = self.root
        dnode = delta.root
        removing = isinstance(op, MapRemove)
        for i, key in enumerate(path):
            entry = node.entries.get(key) if node is not None else None
            last = i == len(path) - 1
            if removing and last:
                if entry is not None:
                    delta.ctx.update(entry.dots)
                break
            want = op_kind(op) if last else Kind.ORMAP
            if entry is not None and entry.value.kind is not want:
                raise LocalError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"{'/'.join(path[: i + 1])} holds {entry.value.kind.name}, not {want.name}",
                )
            dots: set[Dot] = set()
            if not removing:
                # A write re-asserts the key with a fresh dot, superseding the old ones.
                dots = {fresh()}
                if entry is not None:
                    delta.ctx.update(entry.dots)
            if last:
                cur = entry.value if entry is not None else _empty(want)
                value = _leaf_delta(cur, rid, op, fresh, delta.ctx)
                dnode.entries[key] = MapEntry(dots, value)
            else:
                child = ORMap()
                dnode.entries[key] = MapEntry(dots, child)
                dnode = child
                node = entry.value if entry is not None else None  # type: ignore[assignment]
        return delta


def _leaf_delta(cur: CRDT, rid: str, op: Op, fresh: Any, ctx: DotContext) -> CRDT:
    if isinstance(op, CounterAdd):
        if isinstance(cur, GCounter):
            return cur.increment_delta(rid, op.amount)
        assert isinstance(cur, PNCounter)
        return cur.add_delta(rid, op.amount)
    if isinstance(op, RegisterSet):
        assert isinstance(cur, LWWRegister)
        return cur.set_delta(rid, check_scalar(op.value), op.timestamp)
    assert isinstance(cur, ORSet)
    if isinstance(op, SetAdd):
        dset, superseded = cur.add_delta(op.element, fresh())
    else:
        assert isinstance(op, SetRemove)
        dset, superseded = cur.remove_delta(op.element)
    ctx.update(superseded)
    return dset


def _dots_within(v: CRDT, ctx: DotContext) -> bool:
    if isinstance(v, ORMap):
        return all(
            all(d in ctx for d in e.dots) and _dots_within(e.value, ctx) for e in v.entries.values()
        )
    if isinstance(v, ORSet):
        return all(d in ctx for ds in v.entries.values() for d in ds)
    return True


__all__ = [
    "CRDT",
    "MAX_KEY_LEN",
    "MAX_MAP_DEPTH",
    "MAX_VALUE_LEN",
    "DocState",
    "Element",
    "GCounter",
    "Kind",
    "LWWRegister",
    "MapEntry",
    "ORMap",
    "ORSet",
    "PNCounter",
    "Scalar",
    "op_kind",
    "value_from_wire_untrusted",
    "value_to_wire",
]
