"""Vector clocks: the causal summary every CRDT update carries (R9.4, Property 27).

Theory of operation: a vector clock maps a replica id to the number of
operations from that replica that the holder has seen (Fidge 1988, Mattern
1989). Clocks are partially ordered pointwise; :meth:`VectorClock.compare`
returns one of four :class:`Ordering` values and :meth:`VectorClock.merge` is
the least upper bound (pointwise maximum). A :class:`VectorClock` is immutable
and canonical: zero entries are never stored, so equal clocks compare and hash
equal and encode to the same bytes.

Wire form: a msgpack map ``{replica_id (str): counter (uint)}``. Decoding peer
bytes goes through :func:`p2pnode.core.wire.unpack_untrusted` and then
:meth:`VectorClock.from_wire_untrusted`, which bounds the number of entries, the
id length and the counter range and raises only :class:`CRDTError`.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from typing import Any

from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.wire import WireError, WireLimits, pack, unpack_untrusted

#: Most entries a decoded clock may hold (one per replica that ever wrote a document).
MAX_CLOCK_ENTRIES = 4096
#: Longest replica id, in characters.
MAX_REPLICA_ID_LEN = 128
#: Counters are unsigned 63-bit so they fit every msgpack integer decoder.
MAX_COUNTER = 2**63 - 1


class CRDTError(RemoteError):
    """A peer's CRDT bytes could not be decoded or violate an invariant.

    ``code`` is always ``CRDT_DESERIALIZATION_FAILED`` (R9.5).
    """

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(ErrorCode.CRDT_DESERIALIZATION_FAILED, message, **details)


class Ordering(enum.Enum):
    """How two vector clocks relate in the causal partial order."""

    BEFORE = "before"
    AFTER = "after"
    EQUAL = "equal"
    CONCURRENT = "concurrent"


def check_replica_id(rid: object) -> str:
    """Return ``rid`` if it is a valid replica id, else raise LocalError(INVALID_ARGUMENT)."""
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REPLICA_ID_LEN:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"bad replica id {rid!r}")
    return rid


def valid_replica_id_untrusted(rid: object) -> str:
    """Return ``rid`` if it is a valid replica id from a peer, else raise CRDTError."""
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REPLICA_ID_LEN:
        raise CRDTError(f"bad replica id {rid!r:.80}")
    return rid


def valid_counter_untrusted(n: object, *, minimum: int = 1) -> int:
    """Return ``n`` if it is an int in ``[minimum, MAX_COUNTER]``, else raise CRDTError."""
    if type(n) is not int or not minimum <= n <= MAX_COUNTER:
        raise CRDTError(f"bad counter {n!r:.80}")
    return n


class VectorClock(Mapping[str, int]):
    """An immutable vector clock; a read-only mapping of replica id to counter.

    Missing ids read as 0. Construct from a mapping (zeros are dropped);
    raises LocalError(INVALID_ARGUMENT) on bad ids or negative counters.
    """

    __slots__ = ("_entries", "_hash")

    def __init__(self, entries: Mapping[str, int] | None = None) -> None:
        clean: dict[str, int] = {}
        for rid, n in (entries or {}).items():
            check_replica_id(rid)
            if type(n) is not int or not 0 <= n <= MAX_COUNTER:
                raise LocalError(ErrorCode.INVALID_ARGUMENT, f"bad counter {n!r} for {rid!r}")
            if n:
                clean[rid] = n
        # Sorted so iteration order (and therefore the encoding) is canonical.
        self._entries = dict(sorted(clean.items()))
        self._hash: int | None = None

    @classmethod
    def _trusted(cls, entries: dict[str, int]) -> VectorClock:
        """Build from already-validated positive entries (internal fast path)."""
        vc = cls.__new__(cls)
        vc._entries = dict(sorted(entries.items()))
        vc._hash = None
        return vc

    # Mapping protocol -----------------------------------------------------------------
    def __getitem__(self, rid: str) -> int:
        return self._entries[rid]

    def get(self, rid: str, default: Any = 0) -> Any:
        """The counter for ``rid`` (0 if absent)."""
        return self._entries.get(rid, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, VectorClock):
            return self._entries == other._entries
        return NotImplemented

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(tuple(self._entries.items()))
        return self._hash

    def __repr__(self) -> str:
        return f"VectorClock({self._entries!r})"

    # Clock operations -----------------------------------------------------------------
    def increment(self, rid: str) -> VectorClock:
        """A new clock with ``rid``'s counter one higher."""
        check_replica_id(rid)
        entries = dict(self._entries)
        entries[rid] = entries.get(rid, 0) + 1
        return VectorClock._trusted(entries)

    def merge(self, other: Mapping[str, int]) -> VectorClock:
        """The least upper bound: pointwise maximum."""
        other_vc = other if isinstance(other, VectorClock) else VectorClock(other)
        entries = dict(self._entries)
        for rid, n in other_vc.items():
            if n > entries.get(rid, 0):
                entries[rid] = n
        return VectorClock._trusted(entries)

    def compare(self, other: VectorClock) -> Ordering:
        """Where ``self`` stands relative to ``other`` in the causal order."""
        less = greater = False
        for rid in self._entries.keys() | other._entries.keys():
            a, b = self._entries.get(rid, 0), other._entries.get(rid, 0)
            if a < b:
                less = True
            elif a > b:
                greater = True
            if less and greater:
                return Ordering.CONCURRENT
        if less:
            return Ordering.BEFORE
        if greater:
            return Ordering.AFTER
        return Ordering.EQUAL

    def dominates(self, other: Mapping[str, int]) -> bool:
        """True if every counter of ``other`` is <= ours (self >= other)."""
        return all(self._entries.get(rid, 0) >= n for rid, n in other.items())

    # Encoding -------------------------------------------------------------------------
    def to_wire(self) -> dict[str, int]:
        """The clock as plain msgpack-ready data (canonical key order)."""
        return dict(self._entries)

    def encode(self) -> bytes:
        """msgpack bytes of :meth:`to_wire`."""
        return pack(self.to_wire())

    @classmethod
    def from_wire_untrusted(
        cls, obj: object, *, max_entries: int = MAX_CLOCK_ENTRIES
    ) -> VectorClock:
        """Validate decoded peer data as a clock. Raises CRDTError."""
        if not isinstance(obj, dict):
            raise CRDTError("vector clock is not a map")
        if len(obj) > max_entries:
            raise CRDTError(f"vector clock has {len(obj)} entries (limit {max_entries})")
        for rid, n in obj.items():
            # Inline checks: this runs for every clock of every delta received.
            if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REPLICA_ID_LEN:
                raise CRDTError(f"bad replica id {rid!r:.80}")
            if type(n) is not int or not 1 <= n <= MAX_COUNTER:
                raise CRDTError(f"bad counter {n!r:.80}")
        return cls._trusted(obj)

    @classmethod
    def decode_untrusted(cls, data: bytes, *, max_entries: int = MAX_CLOCK_ENTRIES) -> VectorClock:
        """Decode peer bytes produced by :meth:`encode`. Raises CRDTError."""
        limits = WireLimits(max_size=64 + max_entries * (MAX_REPLICA_ID_LEN + 16), max_depth=1)
        try:
            obj = unpack_untrusted(data, limits)
        except WireError as exc:
            raise CRDTError(f"undecodable vector clock: {exc.message}") from exc
        return cls.from_wire_untrusted(obj, max_entries=max_entries)
