"""Replicas: named documents, their delta logs, and what a peer is missing.

Theory of operation
-------------------
A :class:`Replica` holds named documents. Each document is a
:class:`~p2pnode.crdt.types.DocState` (CRDT state and causal context), the set
of operations ``(origin, seq)`` already applied (a
:class:`~p2pnode.crdt.dots.DotContext`; its contiguous prefix is the vector
clock the replica advertises), and a bounded log of the deltas it applied.

* A local operation gets the next sequence number of this replica for the
  document and becomes a :class:`Delta` tagged with origin, sequence and the
  replica's clock after the operation — never empty, since it counts the
  operation itself (R9.4, Property 27).
* A remote delta is joined unless its ``(origin, seq)`` was applied already;
  joins are idempotent, so a duplicate that slips through is harmless.
* Given a peer's vector clock, :meth:`Replica.missing_for` returns the logged
  deltas above it — or a :class:`FullState` when the log no longer holds
  everything the peer needs. The log keeps at most ``max_log`` deltas per
  document; evicting ``(o, s)`` raises the document's *floor* for ``o``: every
  applied op of ``o`` above the floor is in the log.
* Bytes that fail to decode raise a :class:`~p2pnode.crdt.clock.CRDTError`
  (code ``CRDT_DESERIALIZATION_FAILED``) inside
  :meth:`Replica.receive_delta_untrusted`, which logs it on the
  ``p2pnode.crdt`` logger with the source agent id, records it in
  :attr:`Replica.errors`, and returns ``None``: synchronisation goes on (R9.5).

The replica also journals what changed (:meth:`Replica.take_changes`) so a
store can persist exactly that before the caller acknowledges an update.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from p2pnode.crdt.clock import (
    MAX_CLOCK_ENTRIES,
    CRDTError,
    VectorClock,
    check_replica_id,
    valid_counter_untrusted,
    valid_replica_id_untrusted,
)
from p2pnode.crdt.dots import Dot, DotContext
from p2pnode.crdt.ops import Op
from p2pnode.crdt.types import MAX_KEY_LEN, DocState
from p2pnode.errors import ErrorCode, LocalError
from p2pnode.wire import WireError, WireLimits, pack, unpack_untrusted

logger = logging.getLogger("p2pnode.crdt")

#: Limits for one encoded delta or full state.
DELTA_LIMITS = WireLimits(max_size=1024 * 1024, max_depth=32)
FULL_STATE_LIMITS = WireLimits(max_size=4 * 1024 * 1024, max_depth=32)


def _check_doc_name(name: object) -> str:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_KEY_LEN:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"bad document name {name!r}")
    return name


def _doc_name_untrusted(name: object) -> str:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_KEY_LEN:
        raise CRDTError(f"bad document name {name!r:.80}")
    return name


def _decode(data: bytes, limits: WireLimits, what: str) -> dict[str, Any]:
    try:
        obj = unpack_untrusted(data, limits)
    except WireError as exc:
        raise CRDTError(f"undecodable {what}: {exc.message}") from exc
    if not isinstance(obj, dict):
        raise CRDTError(f"{what} is not a map")
    return obj


@dataclass(frozen=True, slots=True)
class Delta:
    """One operation's delta-state, as it travels between replicas.

    ``state`` must be treated as read-only once the delta exists.
    """

    #: Document name.
    doc: str
    #: Replica that performed the operation.
    origin: str
    #: The origin's operation number for this document (1, 2, ...).
    seq: int
    #: The origin's vector clock after the operation (``clock[origin] == seq``).
    clock: VectorClock
    #: The delta: a small document state to join.
    state: DocState

    def to_wire(self) -> dict[str, Any]:
        """Plain msgpack-ready data (see docs/protocol/gossip.md)."""
        return {
            "doc": self.doc,
            "o": self.origin,
            "s": self.seq,
            "vc": self.clock.to_wire(),
            "st": self.state.to_wire(),
        }

    def encode(self) -> bytes:
        """msgpack bytes of :meth:`to_wire`."""
        return pack(self.to_wire())

    @staticmethod
    def unpack_untrusted(data: bytes) -> dict[str, Any]:
        """msgpack-decode a delta frame (no semantic checks yet). Raises CRDTError."""
        return _decode(data, DELTA_LIMITS, "delta")

    @staticmethod
    def peek_id_untrusted(obj: dict[str, Any]) -> tuple[str, str, int]:
        """``(doc, origin, seq)`` of an unpacked delta, validated, so duplicates can be
        dropped before the state is decoded. Raises CRDTError."""
        if set(obj) != {"doc", "o", "s", "vc", "st"}:
            raise CRDTError("delta does not have exactly the fields doc, o, s, vc, st")
        return (
            _doc_name_untrusted(obj["doc"]),
            valid_replica_id_untrusted(obj["o"]),
            valid_counter_untrusted(obj["s"]),
        )

    @classmethod
    def from_wire_untrusted(cls, obj: object) -> Delta:
        """Validate decoded peer data. Raises CRDTError."""
        if not isinstance(obj, dict):
            raise CRDTError("delta is not a map")
        doc, origin, seq = cls.peek_id_untrusted(obj)
        clock = VectorClock.from_wire_untrusted(obj["vc"])
        if clock.get(origin) != seq:
            raise CRDTError("delta clock does not count the delta itself", origin=origin)
        return cls(doc, origin, seq, clock, _state(obj["st"]))

    @classmethod
    def decode_untrusted(cls, data: bytes) -> Delta:
        """Decode peer bytes produced by :meth:`encode`. Raises CRDTError."""
        return cls.from_wire_untrusted(cls.unpack_untrusted(data))


def _state(obj: object) -> DocState:
    return DocState.from_wire_untrusted(obj)


@dataclass(frozen=True, slots=True)
class FullState:
    """A whole document, sent when the peer's gap is no longer in the delta log."""

    doc: str
    #: The sender's replica id.
    sender: str
    #: Every operation the state includes (its prefix is the sender's clock).
    applied: DotContext
    state: DocState

    @property
    def clock(self) -> VectorClock:
        """The sender's vector clock for the document."""
        return self.applied.clock()

    def to_wire(self) -> dict[str, Any]:
        """Plain msgpack-ready data (see docs/protocol/gossip.md)."""
        return {
            "doc": self.doc,
            "from": self.sender,
            "ap": self.applied.to_wire(),
            "st": self.state.to_wire(),
        }

    def encode(self) -> bytes:
        """msgpack bytes of :meth:`to_wire`."""
        return pack(self.to_wire())

    @classmethod
    def from_wire_untrusted(cls, obj: object) -> FullState:
        """Validate decoded peer data. Raises CRDTError."""
        if not isinstance(obj, dict) or set(obj) != {"doc", "from", "ap", "st"}:
            raise CRDTError("full state does not have exactly the fields doc, from, ap, st")
        applied = DotContext.from_wire_untrusted(obj["ap"])
        if not applied.vv and not applied.cloud:
            raise CRDTError("full state with an empty clock")
        return cls(
            _doc_name_untrusted(obj["doc"]),
            valid_replica_id_untrusted(obj["from"]),
            applied,
            _state(obj["st"]),
        )

    @classmethod
    def decode_untrusted(cls, data: bytes) -> FullState:
        """Decode peer bytes produced by :meth:`encode`. Raises CRDTError."""
        return cls.from_wire_untrusted(_decode(data, FULL_STATE_LIMITS, "full state"))


@dataclass(slots=True)
class Changes:
    """What changed since the last :meth:`Replica.take_changes`, for a store."""

    #: Deltas appended to logs, in order.
    appended: list[Delta] = field(default_factory=list)
    #: ``(doc, origin, seq)`` of deltas evicted from logs.
    evicted: list[tuple[str, str, int]] = field(default_factory=list)
    #: Documents whose snapshot (state, applied set, floors) must be rewritten.
    snapshot: set[str] = field(default_factory=set)
    #: False for a replica without storage: nothing is recorded (no unbounded growth).
    enabled: bool = True

    def note_append(self, delta: Delta) -> None:
        """Record a delta appended to a log."""
        if self.enabled:
            self.appended.append(delta)

    def note_evict(self, doc: str, origin: str, seq: int) -> None:
        """Record a delta removed from a log."""
        if self.enabled:
            self.evicted.append((doc, origin, seq))

    def note_snapshot(self, doc: str) -> None:
        """Record that ``doc`` needs its snapshot rewritten."""
        if self.enabled:
            self.snapshot.add(doc)

    def __bool__(self) -> bool:
        return bool(self.appended or self.evicted or self.snapshot)


@dataclass(slots=True)
class Document:
    """One replicated document inside a replica (owned by the replica)."""

    state: DocState = field(default_factory=DocState)
    applied: DotContext = field(default_factory=DotContext)
    log: OrderedDict[Dot, Delta] = field(default_factory=OrderedDict)
    floor: dict[str, int] = field(default_factory=dict)

    def clock(self) -> VectorClock:
        """The contiguous prefix of applied operations."""
        return self.applied.clock()


class Replica:
    """A set of named documents replicated by delta-state CRDTs (see module docstring)."""

    def __init__(
        self,
        replica_id: str,
        *,
        max_log: int = 1024,
        max_errors: int = 64,
        journal: bool = False,
    ) -> None:
        """``journal=True`` records changes for a store (:meth:`take_changes`);
        :meth:`p2pnode.crdt.store.CRDTStore.load` sets it.

        Raises LocalError(INVALID_ARGUMENT) on a bad id or ``max_log < 1``.
        """
        self.replica_id = check_replica_id(replica_id)
        if max_log < 1:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "max_log must be >= 1")
        self.max_log = max_log
        self._docs: dict[str, Document] = {}
        #: The most recent remote errors (bounded), newest last.
        self.errors: deque[CRDTError] = deque(maxlen=max_errors)
        self.journal = journal
        self._changes = Changes(enabled=journal)

    # Reading --------------------------------------------------------------------------
    def documents(self) -> list[str]:
        """Names of the documents held, sorted."""
        return sorted(self._docs)

    def document(self, doc: str) -> Document:
        """The live document record (read-only for callers). Raises LocalError if unknown."""
        try:
            return self._docs[doc]
        except KeyError:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"no document {doc!r}") from None

    def value(self, doc: str) -> dict[str, Any]:
        """The document's value as plain data ({} if unknown)."""
        d = self._docs.get(doc)
        return d.state.value() if d else {}

    def has_applied(self, doc: str, origin: str, seq: int) -> bool:
        """Whether operation ``(origin, seq)`` of ``doc`` was applied here."""
        d = self._docs.get(doc)
        return d is not None and (origin, seq) in d.applied

    def clock(self, doc: str) -> VectorClock:
        """The replica's vector clock for ``doc`` (empty if unknown)."""
        d = self._docs.get(doc)
        return d.clock() if d else VectorClock()

    def _doc(self, name: str) -> Document:
        d = self._docs.get(name)
        if d is None:
            d = self._docs[name] = Document()
        return d

    # Writing --------------------------------------------------------------------------
    def update(self, doc: str, op: Op) -> Delta:
        """Apply a local operation and return its delta (to gossip).

        Raises LocalError(INVALID_ARGUMENT) on a bad document name or operation, or when the
        document is full (:func:`_fits_wire`).
        """
        _check_doc_name(doc)
        d = self._docs.get(doc) or Document()
        state = d.state.mutate(self.replica_id, op)
        rid = self.replica_id
        if not (_fits_wire(d.applied, (), rid) and _fits_wire(d.state.ctx, (state.ctx,), rid)):
            raise LocalError(
                ErrorCode.INVALID_ARGUMENT,
                f"document {doc!r} is full: its encoding would exceed the wire limits",
            )
        seq = d.applied.max_for(self.replica_id) + 1
        clock = d.clock().merge({self.replica_id: seq})
        delta = Delta(doc, self.replica_id, seq, clock, state)
        self._docs.setdefault(doc, d)
        self.apply_delta(delta)
        return delta

    def apply_delta(self, delta: Delta) -> bool:
        """Join a (validated) delta; False if its operation was applied before.

        Raises CRDTError when the document would then name more replicas, or hold
        more out-of-order operations, than its encoding carries (see :func:`_fits_wire`).
        """
        d = self._doc(delta.doc)
        key = (delta.origin, delta.seq)
        if key in d.applied:
            return False
        self._check_room(d, (d.applied, (), delta.origin), (d.state.ctx, (delta.state.ctx,), ""))
        d.state.join(delta.state)
        d.applied.add(key)
        if delta.seq <= d.floor.get(delta.origin, 0):
            # Below the floor a logged delta would never be served; persist via snapshot.
            self._changes.note_snapshot(delta.doc)
            return True
        d.log[key] = delta
        self._changes.note_append(delta)
        if len(d.log) > self.max_log:
            # Evict down to 3/4 so a store rewrites the snapshot once per max_log/4 deltas.
            # Eviction goes oldest first, so lower entries of an origin are rare; any left
            # below its floor are never served and age out in turn.
            while len(d.log) > self.max_log * 3 // 4:
                (o, s), _ = d.log.popitem(last=False)
                self._evicted(delta.doc, d, o, s)
            self._changes.note_snapshot(delta.doc)
        return True

    def _check_room(
        self, d: Document, *joins: tuple[DotContext, tuple[DotContext, ...], str]
    ) -> None:
        # Each join is (ours, theirs, one more replica named): ours must still encode after
        # it. (A full document is still read and synchronised; update() refuses to make it
        # name one replica more.)
        for ours, theirs, name in joins:
            if not _fits_wire(ours, theirs, name):
                raise CRDTError(
                    f"the update would make the document name more than {MAX_CLOCK_ENTRIES} "
                    f"replicas or hold more than {MAX_CLOUD} out-of-order operations"
                )

    def _evicted(self, name: str, d: Document, origin: str, seq: int) -> None:
        """Logged delta ``(origin, seq)`` left the log: the floor of ``origin`` rises to it."""
        if seq > d.floor.get(origin, 0):
            d.floor[origin] = seq
            self._changes.note_snapshot(name)
        self._changes.note_evict(name, origin, seq)

    def apply_full_state(self, full: FullState) -> bool:
        """Join a peer's whole document; False if it taught us nothing.

        Raises CRDTError like :meth:`apply_delta`.
        """
        d = self._doc(full.doc)
        new_ops = _new_maxima(d.applied, full.applied)
        if not new_ops:
            return False
        self._check_room(d, (d.applied, (full.applied,), ""), (d.state.ctx, (full.state.ctx,), ""))
        d.state.join(full.state)
        d.applied.join(full.applied)
        self._changes.note_snapshot(full.doc)
        floor = d.floor
        for origin, top in new_ops.items():
            # We now hold ops of `origin` up to `top` whose deltas we never logged.
            if top > floor.get(origin, 0):
                floor[origin] = top
        # Anything at or below its origin's floor is useless to a peer now. One pass over
        # the log for all origins: a state naming thousands of origins must not cost a
        # pass per origin (that was quadratic, seconds for one frame).
        stale = [k for k in d.log if k[0] in new_ops and k[1] <= floor[k[0]]]
        for key in stale:
            del d.log[key]
            self._changes.note_evict(full.doc, key[0], key[1])
        return True

    def receive_delta_untrusted(self, data: bytes, source: str) -> Delta | None:
        """Decode and apply a peer's encoded delta.

        Returns the delta if it was new, None if it was a duplicate or
        malformed. A malformed delta is logged (logger ``p2pnode.crdt``, with
        ``source``), appended to :attr:`errors` and skipped (R9.5); never raises.
        """
        try:
            delta = Delta.decode_untrusted(data)
            return delta if self.apply_delta(delta) else None
        except CRDTError as exc:
            self.record_error(exc, source)
            return None

    def receive_full_state_untrusted(self, data: bytes, source: str) -> FullState | None:
        """Like :meth:`receive_delta_untrusted` for an encoded :class:`FullState`."""
        try:
            full = FullState.decode_untrusted(data)
            return full if self.apply_full_state(full) else None
        except CRDTError as exc:
            self.record_error(exc, source)
            return None

    def record_error(self, exc: CRDTError, source: str) -> None:
        """Log and remember a remote CRDT error attributed to ``source``."""
        exc.details.setdefault("source", source)
        self.errors.append(exc)
        logger.warning(
            "skipping CRDT update from %s: %s",
            source,
            exc.message,
            extra={"source_agent": source, "code": str(exc.code)},
        )

    # Anti-entropy -----------------------------------------------------------------------
    def missing_for(
        self, doc: str, peer_clock: VectorClock, *, limit: int = 1024
    ) -> list[Delta] | FullState:
        """What a peer at ``peer_clock`` lacks of ``doc``: logged deltas (oldest
        first, at most ``limit``), or the full state when the log was compacted
        past the peer's clock. ``[]`` if nothing (or the document is unknown)."""
        d = self._docs.get(doc)
        if d is None:
            return []
        for origin, floor in d.floor.items():
            if peer_clock.get(origin) < floor:
                return self.full_state(doc)
        out: list[Delta] = []
        for (origin, seq), delta in d.log.items():
            if seq > peer_clock.get(origin):
                out.append(delta)
                if len(out) >= limit:
                    break
        return out

    def full_state(self, doc: str) -> FullState:
        """The whole document (copied). Raises LocalError if unknown."""
        d = self.document(doc)
        return FullState(doc, self.replica_id, d.applied.copy(), d.state.copy())

    # Persistence hooks ------------------------------------------------------------------
    def take_changes(self) -> Changes:
        """Return and reset the journal of changes since the last call."""
        changes, self._changes = self._changes, Changes(enabled=self.journal)
        return changes

    def restore(self, name: str, document: Document) -> None:
        """Install a document loaded from storage (replaces any in memory)."""
        self._docs[_check_doc_name(name)] = document


#: Most dots outside the contiguous prefixes a context may hold: the encoded cloud is one
#: msgpack array, and decoders take arrays of at most 65,536 items.
MAX_CLOUD = 65_536


def _fits_wire(ours: DotContext, theirs: Iterable[DotContext], *names: str) -> bool:
    """Whether ``ours`` joined with ``theirs`` (and naming ``names`` too) still encodes in
    a form peers decode: at most MAX_CLOCK_ENTRIES replicas in the vector (replica ids are
    not authenticated, so a peer could otherwise name thousands and make every clock,
    delta and full state of the document undecodable for everyone) and at most MAX_CLOUD
    dots in the cloud. Counts are exact only near a limit: a join never holds more than
    the union of its parts."""
    others = list(theirs)
    cloud = len(ours.cloud) + sum(len(c.cloud) for c in others)
    if cloud > MAX_CLOUD and len(ours.cloud.union(*(c.cloud for c in others))) > MAX_CLOUD:
        return False
    bound = len(ours.vv) + len(ours.cloud) + len(names)
    bound += sum(len(c.vv) + len(c.cloud) for c in others)
    if bound <= MAX_CLOCK_ENTRIES:
        return True  # the common case: no need to count distinct names
    seen = {n for n in names if n}
    for ctx in (ours, *others):
        seen.update(ctx.vv)
        seen.update(r for r, _ in ctx.cloud)
        if len(seen) > MAX_CLOCK_ENTRIES:
            return False
    return True


def _new_maxima(have: DotContext, incoming: DotContext) -> dict[str, int]:
    """For each origin, the highest op in ``incoming`` that ``have`` lacks."""
    out: dict[str, int] = {}
    for origin, top in incoming.vv.items():
        s = top
        base = have.vv.get(origin, 0)
        while s > base and (origin, s) in have.cloud:
            s -= 1
        if s > base:
            out[origin] = s
    for origin, s in incoming.cloud:
        if (origin, s) not in have and s > out.get(origin, 0):
            out[origin] = s
    return out
