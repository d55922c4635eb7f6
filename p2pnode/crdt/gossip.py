"""Sans-IO epidemic gossip of CRDT deltas with anti-entropy (R9.1-9.5).

Theory of operation
-------------------
Two complementary mechanisms (Demers et al., "Epidemic Algorithms for
Replicated Database Maintenance", PODC 1987):

* **Rumor mongering (push).** A local update is pushed to ``fanout`` peers
  chosen uniformly at random (the RNG is injected). A node that receives a
  delta it had not applied forwards it once to ``fanout`` random peers other
  than the sender and the origin ("infect and die", §3 of the paper). A delta
  already applied — same ``(origin, seq)`` — is a duplicate: counted, not
  forwarded. With fanout *f* each node receives about *f* copies, so the
  redundancy per node is bounded by the fanout, and the update reaches all but
  about ``N·e^-f`` nodes in ``O(log N)`` hops.
* **Anti-entropy (push-pull).** Every ``interval`` (jittered ±50 %), for each
  subscribed document the node sends a :class:`Digest` — its vector clock — to
  one random peer. The receiver answers with the deltas the sender lacks
  (:class:`DeltaBatch`, oldest first, at most ``max_reply_deltas`` so the
  sender's contiguous clock always advances), preceded by an origin's
  checkpoint where its log was compacted past the sender's clock. If the digest
  shows the sender knows something the receiver lacks, the receiver also
  returns its own digest (``reply=True``, which is never answered with another
  digest). This repairs everything rumor mongering lost: message drops,
  partitions, overflowing outboxes, restarts.

The core reads no clock and touches no socket: the driver passes ``now`` in,
calls :meth:`GossipNode.handle_timer` at :meth:`GossipNode.next_deadline`, and
drains bounded per-peer outboxes (:meth:`GossipNode.take_outgoing`), which drop
their oldest message when full (anti-entropy repairs the loss). Messages are
small frozen dataclasses with msgpack ``encode`` / ``decode_untrusted``; the
wire format is in docs/protocol/gossip.md. Deltas travel as opaque sealed
bytes inside a frame (:mod:`p2pnode.crdt.signing`), so a node forwards them
without re-encoding. A delta that is news is verified — signed by its
origin, written only in its origin's name — before it is applied or
forwarded; duplicates are dropped on their clear-text ids before any
signature is checked. A malformed or forged delta is skipped on its own
(logged with the source peer, R9.5, and returned in :attr:`Received.rejected`
so the driver can report a forgery) while the rest of the frame is processed.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from p2pnode.crdt.clock import CRDTError, VectorClock
from p2pnode.crdt.delta import Delta, Opened
from p2pnode.crdt.ops import Op
from p2pnode.crdt.replica import Replica
from p2pnode.crdt.signing import ForgedDeltaError
from p2pnode.crdt.types import MAX_KEY_LEN
from p2pnode.errors import ErrorCode, LocalError, RemoteError
from p2pnode.wire import WireError, WireLimits, pack, unpack_untrusted

#: Protocol version carried in every frame (2: deltas are sealed by their origin).
GOSSIP_VERSION = 2
#: Limits for one gossip frame (a full state can be the largest).
FRAME_LIMITS = WireLimits(max_size=4 * 1024 * 1024 + 1024, max_depth=4)
#: Most deltas one batch frame may carry.
MAX_BATCH = 1024
#: Hop counts saturate here (informational only).
MAX_HOPS = 255


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
        """msgpack bytes of the frame ``{"v": 1, "t": type, ...fields}``."""
        return pack({"v": GOSSIP_VERSION, "t": self.TYPE, **self._fields()})

    @staticmethod
    def decode_untrusted(data: bytes) -> GossipMessage:
        """Decode one frame from a peer (see :func:`decode_untrusted`). Raises GossipError."""
        return decode_untrusted(data)


@dataclass(frozen=True, slots=True)
class DeltaPush(GossipMessage):
    """Rumor: one sealed :class:`~p2pnode.crdt.delta.Delta` (or checkpoint), forwarded
    once by new receivers."""

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


def _bytes(obj: object, what: str) -> bytes:
    if not isinstance(obj, bytes):
        raise _fail(f"{what} is not bin")
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
    doc, reply = f.get("doc"), f.get("r")
    if not isinstance(doc, str) or not 0 < len(doc) <= MAX_KEY_LEN or type(reply) is not bool:
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


# Type 4 (StatePush, an unsigned full state in version 1) is retired: unknown in version 2.
_DECODERS = {
    1: (_push, {"doc", "o", "f", "s", "d", "h"}),
    2: (_digest, {"doc", "vc", "r"}),
    3: (_batch, {"ds"}),
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


@dataclass(frozen=True, slots=True)
class GossipConfig:
    """Tuning knobs (see docs/protocol/gossip.md for the defaults' rationale)."""

    fanout: int = 4
    #: Mean anti-entropy period, seconds (each wait is jittered to 0.5x-1.5x).
    interval: float = 1.0
    #: Messages queued per peer before the oldest is dropped.
    max_outbox: int = 256
    #: Most deltas returned for one digest.
    max_reply_deltas: int = 128
    #: Forward new deltas received by push (False: push-only at the origin).
    forward: bool = True
    #: Run anti-entropy at all (False only for measurements).
    anti_entropy: bool = True

    def __post_init__(self) -> None:
        if self.fanout < 1 or self.interval <= 0 or self.max_outbox < 1:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "fanout, interval, max_outbox must be > 0")
        if not 1 <= self.max_reply_deltas <= min(MAX_BATCH, self.max_outbox * 64):
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "bad max_reply_deltas")


@dataclass(frozen=True, slots=True)
class Received:
    """What :meth:`GossipNode.receive` did with one frame."""

    #: Deltas (or checkpoints) that taught this replica something.
    new: int
    #: Duplicates or useless answers.
    duplicate: int
    #: Peers the new delta was forwarded to.
    forwarded_to: tuple[str, ...] = ()
    #: Deltas skipped as malformed or forged (already logged and recorded in
    #: ``Replica.errors``); a :class:`~p2pnode.crdt.signing.ForgedDeltaError` means the
    #: sending peer passed on a delta its claimed origin did not sign.
    rejected: tuple[CRDTError, ...] = ()


@dataclass(slots=True)
class GossipStats:
    """Counters since creation (``statistics()``)."""

    pushed: int = 0
    forwarded: int = 0
    new_deltas: int = 0
    duplicates: int = 0
    digests_sent: int = 0
    deltas_served: int = 0
    checkpoints_served: int = 0
    dropped: int = 0
    errors: int = 0
    #: Deltas rejected because their origin did not sign them (a subset of ``errors``).
    forged: int = 0
    received_by_type: dict[str, int] = field(default_factory=dict)


class GossipNode:
    """One node's gossip core over a :class:`~p2pnode.crdt.replica.Replica`."""

    def __init__(
        self,
        replica: Replica,
        *,
        peers: Iterable[str] = (),
        docs: Iterable[str] = (),
        rng: random.Random,
        now: float,
        config: GossipConfig | None = None,
    ) -> None:
        self.replica = replica
        self.config = config or GossipConfig()
        self._rng = rng
        self._peers: list[str] = []
        self._peer_set: set[str] = set()
        self._docs: set[str] = set()
        self._outbox: dict[str, deque[GossipMessage]] = {}
        self._stats = GossipStats()
        self._rejected: list[CRDTError] = []
        self._seen: dict[str, VectorClock] = {}  # doc -> the join of the digests received
        for p in peers:
            self.add_peer(p)
        for d in docs:
            self.subscribe(d)
        self._deadline = now + self._jitter()

    # Membership -----------------------------------------------------------------------
    def add_peer(self, peer: str) -> None:
        """Start gossiping with ``peer`` (ignored if it is this replica)."""
        if peer != self.replica.replica_id and peer not in self._peer_set:
            self._peer_set.add(peer)
            self._peers.append(peer)

    def remove_peer(self, peer: str) -> None:
        """Stop gossiping with ``peer`` and discard its outbox."""
        if peer in self._peer_set:
            self._peer_set.discard(peer)
            self._peers.remove(peer)
            self._outbox.pop(peer, None)

    @property
    def peers(self) -> tuple[str, ...]:
        """Known peers, in insertion order."""
        return tuple(self._peers)

    def subscribe(self, doc: str) -> None:
        """Replicate ``doc``: accept its deltas and run anti-entropy for it."""
        self._docs.add(doc)

    def unsubscribe(self, doc: str) -> None:
        """Stop replicating ``doc`` (its data stays in the replica)."""
        self._docs.discard(doc)
        self._seen.pop(doc, None)

    # Helpers --------------------------------------------------------------------------
    def _jitter(self) -> float:
        return self.config.interval * (0.5 + self._rng.random())

    def _choose(self, k: int, exclude: Iterable[str] = ()) -> list[str]:
        ex = set(exclude)
        if len(ex) == 0:
            return self._rng.sample(self._peers, min(k, len(self._peers)))
        pool = self._peers
        picked = self._rng.sample(pool, min(k + len(ex), len(pool)))
        return [p for p in picked if p not in ex][:k]

    def _send(self, peer: str, msg: GossipMessage) -> None:
        box = self._outbox.get(peer)
        if box is None:
            box = self._outbox[peer] = deque(maxlen=self.config.max_outbox)
        if len(box) == box.maxlen:
            self._stats.dropped += 1  # deque drops the oldest; anti-entropy repairs it
        box.append(msg)

    # Events ---------------------------------------------------------------------------
    def publish(self, delta: Delta) -> tuple[str, ...]:
        """Push a delta this replica produced (already applied and, if durable
        storage is used, committed) to ``fanout`` random peers; returns them. The
        checkpoint the replica made with it, if any, goes to the same peers.

        Raises LocalError(INVALID_ARGUMENT) when not subscribed to the document or
        the replica does not sign its deltas (peers would refuse them).
        """
        if delta.doc not in self._docs:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"not subscribed to {delta.doc!r}")
        if not self.replica.signed:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "the replica has no signer")
        targets = self._choose(self.config.fanout)
        msgs = [DeltaPush.of(delta)]
        cp = self.replica.checkpoint(delta.doc, delta.origin)
        if cp is not None and cp.seq == delta.seq and cp.is_checkpoint:
            msgs.append(DeltaPush.of(cp))
        for p in targets:
            for msg in msgs:
                self._send(p, msg)
        self._stats.pushed += 1
        return tuple(targets)

    def local_update(self, doc: str, op: Op) -> tuple[Delta, tuple[str, ...]]:
        """Apply a local operation (in memory only) and push its delta; returns the
        delta and the peers it goes to. Use :meth:`publish` after a durable commit
        instead when updates must survive a crash."""
        if doc not in self._docs:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"not subscribed to {doc!r}")
        delta = self.replica.update(doc, op)
        return delta, self.publish(delta)

    def receive_untrusted(self, peer: str, data: bytes) -> Received:
        """Decode and handle one frame from ``peer``. Raises GossipError on a bad frame;
        bad deltas inside a good frame are logged, recorded and skipped (R9.5)."""
        return self.receive(peer, decode_untrusted(data))

    def receive(self, peer: str, msg: GossipMessage) -> Received:
        """Handle one decoded frame from ``peer``."""
        name = type(msg).__name__
        self._stats.received_by_type[name] = self._stats.received_by_type.get(name, 0) + 1
        handler = self._HANDLERS[type(msg)]
        result: Received = handler(self, peer, msg)
        self._stats.new_deltas += result.new
        self._stats.duplicates += result.duplicate
        if self._rejected:
            rejected, self._rejected = tuple(self._rejected), []
            return Received(result.new, result.duplicate, result.forwarded_to, rejected)
        return result

    def _apply_encoded(
        self, peer: str, data: bytes, expect: tuple[str, str, int, int] | None = None
    ) -> Delta | bool | None:
        """The new delta, None for a duplicate / unsubscribed document, False if
        malformed or forged (then recorded and kept for :attr:`Received.rejected`)."""
        try:
            opened = Opened.open_untrusted(data)
            if expect is not None and expect != opened.id:
                raise CRDTError("push frame id does not match its delta", frame=expect)
            # Duplicates are dropped on their ids, before any signature or state is checked.
            if opened.id[0] not in self._docs or not self.replica.is_news(*opened.id):
                return None
            delta = opened.verify()  # signed by its origin, written only in its name
            applied = self.replica.apply_delta(delta)  # may refuse it: see apply_delta
        except CRDTError as exc:
            self.replica.record_error(exc, peer)
            self._stats.errors += 1
            if isinstance(exc, ForgedDeltaError):
                self._stats.forged += 1
            self._rejected.append(exc)
            return False
        return delta if applied else None

    def _on_push(self, peer: str, msg: DeltaPush) -> Received:
        if msg.doc not in self._docs:
            return Received(0, 0)
        if not self.replica.is_news(msg.doc, msg.origin, msg.first, msg.seq):
            return Received(0, 1)
        ids = (msg.doc, msg.origin, msg.first, msg.seq)
        got = self._apply_encoded(peer, msg.delta, ids)
        if got is False:
            return Received(0, 0)
        if got is None:
            return Received(0, 1)
        assert isinstance(got, Delta)
        targets: list[str] = []
        if self.config.forward:
            targets = self._choose(self.config.fanout, exclude=(peer, got.origin))
            fwd = DeltaPush(*ids, msg.delta, min(msg.hops + 1, MAX_HOPS))
            for p in targets:
                self._send(p, fwd)
            self._stats.forwarded += 1
        return Received(1, 0, tuple(targets))

    def _on_digest(self, peer: str, msg: Digest) -> Received:
        if msg.doc not in self._docs:
            return Received(0, 0)
        seen = self._seen.get(msg.doc)
        self._seen[msg.doc] = msg.clock if seen is None else seen.merge(msg.clock)
        missing = self.replica.missing_for(msg.doc, msg.clock, limit=self.config.max_reply_deltas)
        if missing:
            self._send(peer, DeltaBatch(tuple(d.sealed_bytes() for d in missing)))
            checkpoints = sum(1 for d in missing if d.is_checkpoint)
            self._stats.checkpoints_served += checkpoints
            self._stats.deltas_served += len(missing) - checkpoints
        mine = self.replica.clock(msg.doc)
        if not msg.reply and not mine.dominates(msg.clock):
            self._send(peer, Digest(msg.doc, mine, reply=True))
            self._stats.digests_sent += 1
        return Received(0, 0)

    def _on_batch(self, peer: str, msg: DeltaBatch) -> Received:
        new = dup = 0
        for data in msg.deltas:
            got = self._apply_encoded(peer, data)
            if isinstance(got, Delta):
                new += 1
            elif got is None:
                dup += 1
        return Received(new, dup)

    _HANDLERS: ClassVar[dict[type[GossipMessage], Any]] = {
        DeltaPush: _on_push,
        Digest: _on_digest,
        DeltaBatch: _on_batch,
    }

    # Timers ---------------------------------------------------------------------------
    def next_deadline(self) -> float:
        """When :meth:`handle_timer` should next run (``inf`` without anti-entropy)."""
        return self._deadline if self.config.anti_entropy else float("inf")

    def handle_timer(self, now: float) -> list[tuple[str, str]]:
        """Run anti-entropy if due: one digest per subscribed document to a random
        peer. Returns ``(doc, peer)`` pairs; ``[]`` if not yet due."""
        if now < self._deadline or not self.config.anti_entropy:
            return []
        self._deadline = now + self._jitter()
        sent: list[tuple[str, str]] = []
        for doc in sorted(self._docs):
            target = self._choose(1)
            if target:
                self._send(target[0], Digest(doc, self.replica.clock(doc)))
                self._stats.digests_sent += 1
                sent.append((doc, target[0]))
        return sent

    # Output ---------------------------------------------------------------------------
    def pop_outgoing(self, peer: str, max_messages: int | None = None) -> list[GossipMessage]:
        """Dequeue up to ``max_messages`` frames for ``peer`` (oldest first)."""
        box = self._outbox.get(peer)
        if not box:
            return []
        n = len(box) if max_messages is None else min(max_messages, len(box))
        return [box.popleft() for _ in range(n)]

    def take_outgoing(self) -> list[tuple[str, GossipMessage]]:
        """Dequeue every queued frame as ``(peer, message)`` pairs."""
        out = [(p, m) for p, box in self._outbox.items() for m in box]
        self._outbox.clear()
        return out

    def lag(self, doc: str) -> int:
        """How many operations of ``doc`` the digests received so far show and this
        replica has not applied (contiguously): how far behind its peers it is."""
        seen = self._seen.get(doc)
        if seen is None:
            return 0
        mine = self.replica.clock(doc)
        return sum(max(0, n - mine.get(origin)) for origin, n in seen.items())

    def statistics(self) -> GossipStats:
        """A copy of the counters."""
        s = self._stats
        return GossipStats(
            s.pushed,
            s.forwarded,
            s.new_deltas,
            s.duplicates,
            s.digests_sent,
            s.deltas_served,
            s.checkpoints_served,
            s.dropped,
            s.errors,
            s.forged,
            dict(s.received_by_type),
        )
