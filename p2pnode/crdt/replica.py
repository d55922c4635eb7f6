"""Replicas: named documents, their delta logs and checkpoints, and what a peer is missing.

Theory of operation
-------------------
A :class:`Replica` holds named documents. Each document is a
:class:`~p2pnode.crdt.types.DocState` (CRDT state and causal context), the set
of operations ``(origin, seq)`` already applied (a
:class:`~p2pnode.crdt.dots.DotContext`; its contiguous prefix is the vector
clock the replica advertises), a bounded log of the deltas it applied, and
the latest **checkpoint** of each origin it holds (:mod:`p2pnode.crdt.delta`).

* A local operation gets the next sequence number of this replica for the
  document and becomes a :class:`~p2pnode.crdt.delta.Delta` tagged with
  origin, sequence and the replica's clock after the operation — never empty,
  since it counts the operation itself (R9.4, Property 27) — sealed with the
  replica's signer (:mod:`p2pnode.crdt.signing`). Every ``checkpoint_every``
  operations it also signs a checkpoint ``1..seq``: its previous checkpoint
  joined with its own deltas since, all still in the log (nothing evicts a
  delta no checkpoint covers). Those deltas are joined with each other first
  and the small result into a copy of the previous checkpoint, so a
  checkpoint costs one pass over the replica's own part of the document, not
  one per operation.
* A remote delta is joined unless its ``(origin, seq)`` was applied already;
  joins are idempotent, so a duplicate that slips through is harmless. A
  remote checkpoint is joined when it covers an operation not applied yet,
  and kept when it is the origin's latest.
* Given a peer's vector clock, :meth:`Replica.missing_for` returns the logged
  deltas above it, preceded by an origin's checkpoint when the log no longer
  holds that origin's operations the peer lacks. Everything served is signed
  by its origin, so peers verify it whoever serves it: there is no unsigned
  full-state transfer. The log keeps about ``max_log`` deltas per document;
  past that, the oldest deltas *covered by a checkpoint held* are evicted
  (down to 3/4), and evicting ``(o, s)`` raises the document's *floor* for
  ``o``. Invariant: every applied op of ``o`` above ``floor[o]`` is in the
  log, and ``floor[o]`` is at most the seq of the checkpoint of ``o`` held.
  A delta no checkpoint covers (its origin has not made one since) stays, so
  the log exceeds ``max_log`` by at most ``checkpoint_every`` deltas per
  origin (twice that if the origin's latest checkpoint push was lost).
* Bytes that fail to decode or verify raise a
  :class:`~p2pnode.crdt.clock.CRDTError` inside
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

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.crdt.clock import MAX_CLOCK_ENTRIES, CRDTError, VectorClock, check_replica_id
from p2pnode.crdt.delta import DELTA_LIMITS, Delta, Opened
from p2pnode.crdt.dots import Dot, DotContext
from p2pnode.crdt.ops import Op
from p2pnode.crdt.signing import Signer, replica_id_of
from p2pnode.crdt.types import MAX_KEY_LEN, DocState

logger = logging.getLogger("p2pnode.crdt")


def _check_doc_name(name: object) -> str:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_KEY_LEN:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"bad document name {name!r}")
    return name


@dataclass(slots=True)
class Changes:
    """What changed since the last :meth:`Replica.take_changes`, for a store."""

    #: Deltas appended to logs, in order.
    appended: list[Delta] = field(default_factory=list)
    #: ``(doc, origin, seq)`` of deltas evicted from logs.
    evicted: list[tuple[str, str, int]] = field(default_factory=list)
    #: Documents whose snapshot (state, applied set, floors) must be rewritten.
    snapshot: set[str] = field(default_factory=set)
    #: Checkpoints kept (each replaces the origin's previous one).
    checkpoints: list[Delta] = field(default_factory=list)
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

    def note_checkpoint(self, checkpoint: Delta) -> None:
        """Record a checkpoint kept."""
        if self.enabled:
            self.checkpoints.append(checkpoint)

    def __bool__(self) -> bool:
        return bool(self.appended or self.evicted or self.snapshot or self.checkpoints)


@dataclass(slots=True)
class Document:
    """One replicated document inside a replica (owned by the replica)."""

    state: DocState = field(default_factory=DocState)
    applied: DotContext = field(default_factory=DotContext)
    log: OrderedDict[Dot, Delta] = field(default_factory=OrderedDict)
    floor: dict[str, int] = field(default_factory=dict)
    #: The latest checkpoint held per origin.
    checkpoints: dict[str, Delta] = field(default_factory=dict)
    #: Log length from which compaction is tried again (the last try left the log long).
    compact_at: int = 0

    def clock(self) -> VectorClock:
        """The contiguous prefix of applied operations."""
        return self.applied.clock()


class Replica:
    """A set of named documents replicated by delta-state CRDTs (see module docstring)."""

    def __init__(
        self,
        replica_id: str,
        *,
        signer: Signer | None = None,
        max_log: int = 1024,
        checkpoint_every: int | None = None,
        max_errors: int = 64,
        journal: bool = False,
    ) -> None:
        """``signer`` signs this replica's deltas; its key must be the one ``replica_id``
        names (:func:`~p2pnode.crdt.signing.replica_id_of`). Without one, deltas are
        sealed unsigned: fine locally, refused by every peer. ``checkpoint_every``:
        own operations between checkpoints (default ``max_log // 4``, at least 1).
        ``journal=True`` records changes for a store (:meth:`take_changes`);
        :meth:`p2pnode.crdt.store.CRDTStore.load` sets it.

        Raises LocalError(INVALID_ARGUMENT) on a bad id, a signer whose key does not
        name ``replica_id``, ``max_log < 1`` or ``checkpoint_every < 1``.
        """
        self.replica_id = check_replica_id(replica_id)
        if signer is not None and replica_id_of(signer.public_key) != replica_id:
            raise LocalError(
                ErrorCode.INVALID_ARGUMENT, f"replica id {replica_id!r} is not the signer's"
            )
        if max_log < 1:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "max_log must be >= 1")
        every = max(1, max_log // 4) if checkpoint_every is None else checkpoint_every
        if every < 1:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "checkpoint_every must be >= 1")
        self._signer = signer
        self.max_log = max_log
        self.checkpoint_every = every
        self._docs: dict[str, Document] = {}
        #: The most recent remote errors (bounded), newest last.
        self.errors: deque[CRDTError] = deque(maxlen=max_errors)
        self.journal = journal
        self._changes = Changes(enabled=journal)

    @property
    def signed(self) -> bool:
        """Whether this replica signs its deltas (peers accept only signed ones)."""
        return self._signer is not None

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

    def is_news(self, doc: str, origin: str, first: int, seq: int) -> bool:
        """Whether a delta covering ``(origin, first..seq)`` would change anything here:
        an operation not applied yet, or (a checkpoint) a later one than the one held."""
        d = self._docs.get(doc)
        if d is None:
            return True
        if first == seq:
            return (origin, seq) not in d.applied
        held = d.checkpoints.get(origin)
        return d.applied.vv.get(origin, 0) < seq or held is None or seq > held.seq

    def checkpoint(self, doc: str, origin: str) -> Delta | None:
        """The latest checkpoint of ``origin`` held for ``doc``, if any."""
        d = self._docs.get(doc)
        return d.checkpoints.get(origin) if d is not None else None

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
        """Apply a local operation and return its sealed delta (to gossip). Every
        ``checkpoint_every`` operations a checkpoint is made too (:meth:`checkpoint`).

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
        delta = Delta(doc, self.replica_id, seq, clock, state).sign(self._signer)
        self._docs.setdefault(doc, d)
        self.apply_delta(delta)
        held = d.checkpoints.get(rid)
        if seq > 1 and seq - (held.seq if held is not None else 0) >= self.checkpoint_every:
            checkpoint = self._make_checkpoint(doc, d, held, seq, clock)
            self._keep_checkpoint(doc, d, checkpoint.sign(self._signer))
        return delta

    def _make_checkpoint(
        self, name: str, d: Document, held: Delta | None, seq: int, clock: VectorClock
    ) -> Delta:
        """Our operations 1..seq as one signed delta (module docstring)."""
        since = []
        for n in range((held.seq if held is not None else 0) + 1, seq + 1):
            own = d.log.get((self.replica_id, n))
            if own is not None:  # absent only below a floor a peer's checkpoint of ours set
                since.append(own.state)
        state = held.state.copy() if held is not None else DocState()
        state.join(_join_all(since))
        return Delta(name, self.replica_id, seq, clock, state, first=1)

    def apply_delta(self, delta: Delta) -> bool:
        """Join a (validated) delta or checkpoint; False if it changes nothing here.

        Raises CRDTError when the document would then name more replicas, or hold
        more out-of-order operations, than its encoding carries (see :func:`_fits_wire`).
        """
        d = self._doc(delta.doc)
        if delta.is_checkpoint:
            return self._apply_checkpoint(delta.doc, d, delta)
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
        if len(d.log) > self.max_log and len(d.log) >= d.compact_at:
            self._compact(delta.doc, d)
        return True

    def _apply_checkpoint(self, name: str, d: Document, cp: Delta) -> bool:
        origin, seq = cp.origin, cp.seq
        # The prefix is contiguous: below seq, it lacks at least (origin, prefix + 1).
        teaches = d.applied.vv.get(origin, 0) < seq
        held = d.checkpoints.get(origin)
        if not teaches and held is not None and held.seq >= seq:
            return False
        if teaches:  # then no checkpoint held reaches seq: it is kept below
            covered = DotContext({origin: seq})
            self._check_room(d, (d.applied, (covered,), origin), (d.state.ctx, (cp.state.ctx,), ""))
            d.state.join(cp.state)
            d.applied.join(covered)
            # Its operations are in the state without their deltas in the log.
            if seq > d.floor.get(origin, 0):
                d.floor[origin] = seq
                self._changes.note_snapshot(name)
        self._keep_checkpoint(name, d, cp)
        return True

    def _keep_checkpoint(self, name: str, d: Document, cp: Delta) -> None:
        held = d.checkpoints.get(cp.origin)
        if held is not None and held.seq >= cp.seq:
            return
        d.checkpoints[cp.origin] = cp
        self._changes.note_checkpoint(cp)
        d.compact_at = 0  # deltas it covers may go now
        if len(d.log) > self.max_log:
            self._compact(name, d)

    def _compact(self, name: str, d: Document) -> None:
        """Evict the oldest deltas a held checkpoint covers, down to 3/4 of max_log."""
        target = self.max_log * 3 // 4
        checkpoints = d.checkpoints
        for key in list(d.log):  # oldest first
            if len(d.log) <= target:
                break
            cp = checkpoints.get(key[0])
            if cp is not None and key[1] <= cp.seq:
                del d.log[key]
                self._evicted(name, d, key[0], key[1])
        # Nothing more is evictable until a checkpoint arrives or the log grows a quarter.
        d.compact_at = len(d.log) + max(1, self.max_log // 4)

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

    def receive_delta_untrusted(self, data: bytes, source: str) -> Delta | None:
        """Verify and apply a peer's sealed delta (or checkpoint).

        Returns the delta if it was news, None if it was a duplicate or rejected. A
        malformed or forged delta (see :mod:`p2pnode.crdt.signing`) is logged (logger
        ``p2pnode.crdt``, with ``source``), appended to :attr:`errors` and skipped
        (R9.5); never raises.
        """
        try:
            opened = Opened.open_untrusted(data)
            if not self.is_news(*opened.id):
                return None
            delta = opened.verify()
            return delta if self.apply_delta(delta) else None
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
    def missing_for(self, doc: str, peer_clock: VectorClock, *, limit: int = 1024) -> list[Delta]:
        """What a peer at ``peer_clock`` lacks of ``doc``, oldest first, at most ``limit``:
        for each origin whose operations the peer lacks below our floor, that origin's
        checkpoint, then the logged deltas above the peer's clock (and above a checkpoint
        sent). ``[]`` if nothing (or the document is unknown)."""
        d = self._docs.get(doc)
        if d is None:
            return []
        out: list[Delta] = []
        sent: dict[str, int] = {}
        for origin, floor in d.floor.items():
            cp = d.checkpoints.get(origin)
            if peer_clock.get(origin) < floor and cp is not None:
                out.append(cp)
                sent[origin] = cp.seq
                if len(out) >= limit:
                    return out
        for (origin, seq), delta in d.log.items():
            if seq > peer_clock.get(origin) and seq > sent.get(origin, 0):
                out.append(delta)
                if len(out) >= limit:
                    break
        return out

    # Persistence hooks ------------------------------------------------------------------
    def take_changes(self) -> Changes:
        """Return and reset the journal of changes since the last call."""
        changes, self._changes = self._changes, Changes(enabled=self.journal)
        return changes

    def restore(self, name: str, document: Document) -> None:
        """Install a document loaded from storage (replaces any in memory)."""
        self._docs[_check_doc_name(name)] = document


def _join_all(states: list[DocState]) -> DocState:
    """The join of ``states`` (left unchanged), neighbours paired level by level: a join
    costs about the size of the state joined into (a set join visits every element), so
    joining each delta into one growing group would cost the group's size per delta."""
    # The first level copies only the left state of each pair: the deltas stay as they are.
    level = [_joined(states[i].copy(), states[i + 1 : i + 2]) for i in range(0, len(states), 2)]
    while len(level) > 1:
        paired = []
        for i in range(0, len(level) - 1, 2):
            level[i].join(level[i + 1])
            paired.append(level[i])
        if len(level) % 2:
            paired.append(level[-1])
        level = paired
    return level[0] if level else DocState()


def _joined(state: DocState, others: list[DocState]) -> DocState:
    for other in others:
        state.join(other)
    return state


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


__all__ = ["DELTA_LIMITS", "MAX_CLOUD", "Changes", "Delta", "Document", "Replica"]
