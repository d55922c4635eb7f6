"""Deltas: one operation's CRDT state (or a checkpoint of many), as replicas exchange them.

Theory of operation
-------------------
A :class:`Delta` covers the operations ``(origin, first..seq)`` of one document:

* ``first == seq``: the delta of one operation (Almeida, Shoker, Baquero,
  "Delta State Replicated Data Types", 2018, §3);
* ``first == 1 < seq``: a **checkpoint**, the join of the origin's deltas
  ``1..seq`` (a delta-group, ibid. §4). Joining it has the effect of joining
  each of them, so a replica that evicted old deltas from its log serves the
  origin's checkpoint instead: it is signed by the origin like any delta, so it
  can be verified wherever it travels (docs/protocol/gossip.md §3 and §5).

Deltas travel **sealed** (:mod:`p2pnode.crdt.signing`): the encoded body with the
origin's key and signature. :class:`Opened` takes a peer's sealed delta apart
just far enough to read its ids in clear, so duplicates are dropped before any
signature is checked or state decoded; :meth:`Opened.verify` then checks the
signature and authorship and decodes the state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.wire import WireError, WireLimits, pack, unpack_untrusted
from p2pnode.crdt.clock import (
    CRDTError,
    VectorClock,
    valid_counter_untrusted,
    valid_replica_id_untrusted,
)
from p2pnode.crdt.signing import Sealed, Signer, check_authorship, seal
from p2pnode.crdt.types import MAX_KEY_LEN, DocState

#: Limits for one encoded delta body.
DELTA_LIMITS = WireLimits(max_size=1024 * 1024, max_depth=32)
_FIELDS = frozenset({"doc", "o", "f", "s", "vc", "st"})

#: ``(doc, origin, first, seq)`` of a delta.
DeltaId = tuple[str, str, int, int]


def doc_name_untrusted(name: object) -> str:
    """A peer's document name (1-256 characters). Raises CRDTError."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_KEY_LEN:
        raise CRDTError(f"bad document name {name!r:.80}")
    return name


def decode_map(data: bytes, limits: WireLimits, what: str) -> dict[str, Any]:
    """msgpack-decode peer bytes that must hold a map. Raises CRDTError."""
    try:
        obj = unpack_untrusted(data, limits)
    except WireError as exc:
        raise CRDTError(f"undecodable {what}: {exc.message}") from exc
    if not isinstance(obj, dict):
        raise CRDTError(f"{what} is not a map")
    return obj


@dataclass(frozen=True, slots=True)
class Delta:
    """Operations ``(origin, first..seq)`` of a document as a CRDT state to join.

    ``state`` must be treated as read-only once the delta exists.
    """

    #: Document name.
    doc: str
    #: Replica that performed the operations.
    origin: str
    #: The origin's last operation number covered (1, 2, ...).
    seq: int
    #: The origin's vector clock after the operation (``clock[origin] == seq``).
    clock: VectorClock
    #: The delta: a small document state to join.
    state: DocState
    #: The first operation covered: ``seq`` (one operation; 0 is read as ``seq``) or 1
    #: (a checkpoint of operations 1..seq).
    first: int = 0
    #: The sealed bytes the origin signed (empty until sealed; see :meth:`sealed_bytes`).
    sealed: bytes = field(default=b"", compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.first == 0:
            object.__setattr__(self, "first", self.seq)
        if self.first not in (1, self.seq):
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "a delta covers one operation or 1..seq")

    @property
    def is_checkpoint(self) -> bool:
        """Whether this covers more than one operation (``1..seq``)."""
        return self.first < self.seq

    @property
    def id(self) -> DeltaId:
        """``(doc, origin, first, seq)``."""
        return (self.doc, self.origin, self.first, self.seq)

    def to_wire(self) -> dict[str, Any]:
        """Plain msgpack-ready data of the body (see docs/protocol/gossip.md §3)."""
        return {
            "doc": self.doc,
            "o": self.origin,
            "f": self.first,
            "s": self.seq,
            "vc": self.clock.to_wire(),
            "st": self.state.to_wire(),
        }

    def encode(self) -> bytes:
        """msgpack bytes of the body (:meth:`to_wire`): what the origin signs."""
        return pack(self.to_wire())

    def sign(self, signer: Signer | None) -> Delta:
        """This delta sealed by ``signer`` (None: sealed without a signature, which
        only local storage accepts)."""
        return Delta(
            self.doc,
            self.origin,
            self.seq,
            self.clock,
            self.state,
            self.first,
            seal(self.encode(), signer),
        )

    def sealed_bytes(self) -> bytes:
        """The sealed form (``{"b", "k", "g"}``); an unsigned seal if never signed."""
        return self.sealed or seal(self.encode(), None)

    @staticmethod
    def peek_id_untrusted(obj: dict[str, Any]) -> DeltaId:
        """``(doc, origin, first, seq)`` of an unpacked body, validated, so duplicates
        can be dropped before the state is decoded. Raises CRDTError."""
        if set(obj) != _FIELDS:
            raise CRDTError("delta does not have exactly the fields doc, o, f, s, vc, st")
        seq = valid_counter_untrusted(obj["s"])
        first = valid_counter_untrusted(obj["f"])
        if first not in (1, seq):
            raise CRDTError("a delta covers one operation or a checkpoint 1..s")
        return (
            doc_name_untrusted(obj["doc"]),
            valid_replica_id_untrusted(obj["o"]),
            first,
            seq,
        )

    @classmethod
    def from_wire_untrusted(cls, obj: object, sealed: bytes = b"") -> Delta:
        """Validate a decoded body. Raises CRDTError."""
        if not isinstance(obj, dict):
            raise CRDTError("delta is not a map")
        doc, origin, first, seq = cls.peek_id_untrusted(obj)
        clock = VectorClock.from_wire_untrusted(obj["vc"])
        if clock.get(origin) != seq:
            raise CRDTError("delta clock does not count the delta itself", origin=origin)
        state = DocState.from_wire_untrusted(obj["st"])
        return cls(doc, origin, seq, clock, state, first, sealed)

    @classmethod
    def decode_untrusted(cls, data: bytes) -> Delta:
        """Decode a body produced by :meth:`encode` (no signature). Raises CRDTError."""
        return cls.from_wire_untrusted(decode_map(data, DELTA_LIMITS, "delta"))


@dataclass(frozen=True, slots=True)
class Opened:
    """A peer's sealed delta, decoded far enough to read its ids (not yet verified)."""

    #: The sealed bytes as received (forwarded and stored unchanged).
    data: bytes
    sealed: Sealed
    body: dict[str, Any]
    id: DeltaId

    @classmethod
    def open_untrusted(cls, data: bytes) -> Opened:
        """Unseal and unpack; check the ids. Raises CRDTError."""
        sealed = Sealed.decode_untrusted(data)
        body = decode_map(sealed.body, DELTA_LIMITS, "delta")
        return cls(data, sealed, body, Delta.peek_id_untrusted(body))

    def verify(self) -> Delta:
        """The delta, once its origin's signature and authorship are checked.

        Raises ForgedDeltaError (not signed by its origin, or writing in another
        replica's name) or CRDTError (malformed state).
        """
        origin = self.id[1]
        self.sealed.verify(origin)
        delta = Delta.from_wire_untrusted(self.body, self.data)
        check_authorship(delta.state, origin)
        return delta

    def trusted(self) -> Delta:
        """The delta without checking the signature: only for this node's own store."""
        return Delta.from_wire_untrusted(self.body, self.data)


__all__ = ["DELTA_LIMITS", "Delta", "DeltaId", "Opened", "decode_map", "doc_name_untrusted"]
