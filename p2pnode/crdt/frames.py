"""Gossip frames: the messages of docs/protocol/gossip.md §4, encoded and decoded.

Every frame is a msgpack map ``{"v": 3, "t": type, ...fields}``. Deltas travel
as opaque sealed bytes (:mod:`p2pnode.crdt.signing`) so a node forwards them
without re-encoding. :func:`decode_untrusted` checks the version, the type, the
exact key set and every field's type and limit, and raises only
:class:`GossipError`. Types 1-3 carry deltas and clocks (push, anti-entropy);
types 5-7 are the epidemic broadcast tree's control frames (Leitao, Pereira,
Rodrigues, "Epidemic Broadcast Trees", SRDS 2007: IHAVE, GRAFT, PRUNE), which
name deltas by their clear-text ids ``(origin, first, seq)`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from p2pnode.core.errors import ErrorCode, RemoteError
from p2pnode.core.wire import WireError, WireLimits, pack, unpack_untrusted
from p2pnode.crdt.clock import CRDTError, VectorClock
from p2pnode.crdt.delta import Delta
from p2pnode.crdt.types import MAX_KEY_LEN

#: Protocol version carried in every frame (2: deltas sealed by their origin;
#: 3: the broadcast tree's IHave, Graft and Prune frames).
GOSSIP_VERSION = 3
#: Limits for one gossip frame (a full state can be the largest).
FRAME_LIMITS = WireLimits(max_size=4 * 1024 * 1024 + 1024, max_depth=4)
#: Most deltas one batch frame may carry.
MAX_BATCH = 1024
#: Most delta ids one IHave or Graft frame may carry.
MAX_IDS = 256
#: Hop counts saturate here (informational only).
MAX_HOPS = 255

#: A delta's clear-text id within a document: ``(origin, first, seq)``.
DeltaId = tuple[str, int, int]


class GossipError(RemoteError):
    """A peer sent a gossip frame that is malformed or out of protocol."""


def _fail(message: str) -> GossipError:
    return GossipError(ErrorCode.MALFORMED_MESSAGE, message)


@dataclass(frozen=True, slots=True)
class GossipMessage:
    """Base of the gossip frames."""

    TYPE: ClassVar[int] = 0

    def _fields(self) -> dict[str, Any]:
        raise NotImplementedError

    def encode(self) -> bytes:
        """msgpack bytes of the frame ``{"v": 3, "t": type, ...fields}``."""
        return pack({"v": GOSSIP_VERSION, "t": self.TYPE, **self._fields()})

    @staticmethod
    def decode_untrusted(data: bytes) -> GossipMessage:
        """Decode one frame from a peer (see :func:`decode_untrusted`). Raises GossipError."""
        return decode_untrusted(data)


@dataclass(frozen=True, slots=True)
class DeltaPush(GossipMessage):
    """Eager push: one sealed :class:`~p2pnode.crdt.delta.Delta` (or checkpoint),
    forwarded once by new receivers along the broadcast tree."""

    TYPE: ClassVar[int] = 1
    #: Document, origin, first and last operation of the delta, in clear so a receiver
    #: drops duplicates without decoding the payload (checked against it when new).
    doc: str
    origin: str
    first: int
    seq: int
    #: The sealed delta (``Delta.sealed_bytes()``).
    delta: bytes
    #: Hops travelled from the origin (0 when pushed by the origin); informational.
    hops: int = 0

    @classmethod
    def of(cls, delta: Delta, hops: int = 0) -> DeltaPush:
        """The push frame for ``delta``."""
        return cls(delta.doc, delta.origin, delta.first, delta.seq, delta.sealed_bytes(), hops)

    @property
    def id(self) -> DeltaId:
        """The delta's id within its document."""
        return (self.origin, self.first, self.seq)

    def _fields(self) -> dict[str, Any]:
        return {
            "doc": self.doc,
            "o": self.origin,
            "f": self.first,
            "s": self.seq,
            "d": self.delta,
            "h": self.hops,
        }


@dataclass(frozen=True, slots=True)
class Digest(GossipMessage):
    """Anti-entropy request: "this is my clock for ``doc``; send what I lack"."""

    TYPE: ClassVar[int] = 2
    doc: str
    clock: VectorClock
    #: True when sent in answer to a digest (must not be answered with a digest).
    reply: bool = False

    def _fields(self) -> dict[str, Any]:
        return {"doc": self.doc, "vc": self.clock.to_wire(), "r": self.reply}


@dataclass(frozen=True, slots=True)
class DeltaBatch(GossipMessage):
    """Anti-entropy answer: sealed deltas and checkpoints the digest's sender lacks
    (not forwarded)."""

    TYPE: ClassVar[int] = 3
    deltas: tuple[bytes, ...]

    def _fields(self) -> dict[str, Any]:
        return {"ds": list(self.deltas)}


@dataclass(frozen=True, slots=True)
class IHave(GossipMessage):
    """Lazy push: "I have these deltas of ``doc``" (1..MAX_IDS ids, oldest first)."""

    TYPE: ClassVar[int] = 5
    doc: str
    ids: tuple[DeltaId, ...]

    def _fields(self) -> dict[str, Any]:
        return {"doc": self.doc, "ids": [list(i) for i in self.ids]}


@dataclass(frozen=True, slots=True)
class Graft(GossipMessage):
    """ "Push ``doc`` to me eagerly from now on, and send me these deltas" (0..MAX_IDS
    ids; none: only the link)."""

    TYPE: ClassVar[int] = 6
    doc: str
    ids: tuple[DeltaId, ...] = ()

    def _fields(self) -> dict[str, Any]:
        return {"doc": self.doc, "ids": [list(i) for i in self.ids]}


@dataclass(frozen=True, slots=True)
class Prune(GossipMessage):
    """ "Stop pushing ``doc`` to me eagerly; announce it lazily instead"."""

    TYPE: ClassVar[int] = 7
    doc: str

    def _fields(self) -> dict[str, Any]:
        return {"doc": self.doc}


def _bytes(obj: object, what: str) -> bytes:
    if not isinstance(obj, bytes):
        raise _fail(f"{what} is not bin")
    return obj


def _doc(obj: object) -> str:
    if not isinstance(obj, str) or not 0 < len(obj) <= MAX_KEY_LEN:
        raise _fail("bad document name")
    return obj


def _push(f: dict[str, Any]) -> GossipMessage:
    hops = f.get("h")
    if type(hops) is not int or not 0 <= hops <= MAX_HOPS:
        raise _fail("bad hop count")
    try:
        ids = {"doc": f["doc"], "o": f["o"], "f": f["f"], "s": f["s"], "vc": None, "st": None}
        doc, origin, first, seq = Delta.peek_id_untrusted(ids)
    except CRDTError as exc:
        raise _fail(f"bad push id: {exc.message}") from exc
    return DeltaPush(doc, origin, first, seq, _bytes(f.get("d"), "delta"), hops)


def _digest(f: dict[str, Any]) -> GossipMessage:
    doc, reply = _doc(f.get("doc")), f.get("r")
    if type(reply) is not bool:
        raise _fail("bad digest")
    try:
        clock = VectorClock.from_wire_untrusted(f.get("vc"))
    except CRDTError as exc:
        raise _fail(f"bad digest clock: {exc.message}") from exc
    return Digest(doc, clock, reply)


def _batch(f: dict[str, Any]) -> GossipMessage:
    ds = f.get("ds")
    if not isinstance(ds, list) or len(ds) > MAX_BATCH:
        raise _fail("bad delta batch")
    return DeltaBatch(tuple(_bytes(d, "delta") for d in ds))


def _ids(doc: str, obj: object, least: int) -> tuple[DeltaId, ...]:
    """Delta ids ``[[o, f, s], ...]``, validated as a push frame's ids are."""
    if not isinstance(obj, list) or not least <= len(obj) <= MAX_IDS:
        raise _fail("bad id list")
    out: list[DeltaId] = []
    for item in obj:
        if not isinstance(item, list) or len(item) != 3:
            raise _fail("bad delta id")
        fields = {"doc": doc, "o": item[0], "f": item[1], "s": item[2], "vc": None, "st": None}
        try:
            _, origin, first, seq = Delta.peek_id_untrusted(fields)
        except CRDTError as exc:
            raise _fail(f"bad delta id: {exc.message}") from exc
        out.append((origin, first, seq))
    return tuple(out)


def _ihave(f: dict[str, Any]) -> GossipMessage:
    doc = _doc(f.get("doc"))
    return IHave(doc, _ids(doc, f.get("ids"), 1))


def _graft(f: dict[str, Any]) -> GossipMessage:
    doc = _doc(f.get("doc"))
    return Graft(doc, _ids(doc, f.get("ids"), 0))


def _prune(f: dict[str, Any]) -> GossipMessage:
    return Prune(_doc(f.get("doc")))


# Type 4 (StatePush, an unsigned full state in version 1) is retired and never reused.
_DECODERS = {
    1: (_push, {"doc", "o", "f", "s", "d", "h"}),
    2: (_digest, {"doc", "vc", "r"}),
    3: (_batch, {"ds"}),
    5: (_ihave, {"doc", "ids"}),
    6: (_graft, {"doc", "ids"}),
    7: (_prune, {"doc"}),
}


def decode_untrusted(data: bytes) -> GossipMessage:
    """Decode one gossip frame from a peer. Raises GossipError (MALFORMED_MESSAGE,
    MESSAGE_TOO_LARGE, or PROTOCOL_VERSION_MISMATCH)."""
    try:
        obj = unpack_untrusted(data, FRAME_LIMITS)
    except WireError as exc:
        raise GossipError(exc.code, exc.message) from exc
    if not isinstance(obj, dict):
        raise _fail("frame is not a map")
    version, kind = obj.get("v"), obj.get("t")
    if type(version) is not int or version != GOSSIP_VERSION:
        raise GossipError(ErrorCode.PROTOCOL_VERSION_MISMATCH, f"gossip version {version!r:.20}")
    # The type is checked before the table lookup: a peer's list or map is unhashable.
    entry = _DECODERS.get(kind) if type(kind) is int else None
    if entry is None:
        raise _fail(f"unknown frame type {kind!r:.20}")
    decoder, names = entry
    if set(obj) != names | {"v", "t"}:
        raise _fail("frame fields do not match its type")
    return decoder(obj)


__all__ = [
    "FRAME_LIMITS",
    "GOSSIP_VERSION",
    "MAX_BATCH",
    "MAX_HOPS",
    "MAX_IDS",
    "DeltaBatch",
    "DeltaId",
    "DeltaPush",
    "Digest",
    "GossipError",
    "GossipMessage",
    "Graft",
    "IHave",
    "Prune",
    "decode_untrusted",
]
