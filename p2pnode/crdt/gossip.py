"""Sans-IO gossip of CRDT deltas: a broadcast tree with anti-entropy (R9.1-9.5).

Theory of operation
-------------------
Three complementary mechanisms:

* **Eager push along a broadcast tree** (Leitao, Pereira, Rodrigues,
  "Epidemic Broadcast Trees", SRDS 2007; :mod:`p2pnode.crdt.plumtree`). Per
  document a node links to its ring successor (by replica id: a driver that
  names peers otherwise gives their replica ids to :meth:`GossipNode.add_peer`)
  and random peers (``fanout`` links, at most ``max_links``) and asks
  ``eager_fanout`` of them to push to it; a new delta is pushed to every eager
  link but its sender and origin. The first push prunes the other asked links,
  duplicates prune links to lazy, so the eager links become a spanning tree and
  each node receives each delta about once. A link request that lands after a
  delta passed is answered with an announcement of it, grafted at once.
* **Lazy push.** New deltas are announced by id (:class:`IHave`, batched,
  ``lazy_delay``) to the lazy links; one still missing ``graft_timeout`` later
  is asked for with a :class:`Graft`, which repairs the tree. With
  ``tree=False`` the core instead pushes to ``fanout`` random peers and new
  receivers forward once ("infect and die", Demers et al., PODC 1987, §3).
* **Anti-entropy (push-pull).** Every ``interval`` (jittered ±50 %), for each
  subscribed document the node sends a :class:`Digest` — its vector clock — to
  one random peer. The receiver answers with the deltas the sender lacks
  (:class:`DeltaBatch`, oldest first, at most ``max_reply_deltas`` so the
  sender's contiguous clock always advances), preceded by an origin's
  checkpoint where its log was compacted past the sender's clock. If the digest
  shows the sender knows something the receiver lacks, the receiver also
  returns its own digest (``reply=True``, which is never answered with another
  digest). This repairs everything the pushes lost: message drops,
  partitions, overflowing outboxes, restarts.

The core reads no clock and touches no socket: the driver passes ``now`` in,
calls :meth:`GossipNode.handle_timer` at :meth:`GossipNode.next_deadline`
(which moves earlier when a frame queues an announcement or awaits a delta),
and drains bounded per-peer outboxes (:meth:`GossipNode.take_outgoing`), which
drop their oldest message when full (anti-entropy repairs the loss). Frames
are in :mod:`p2pnode.crdt.frames`; the wire format is in
docs/protocol/gossip.md. A delta that is news is verified — signed by its
origin, written only in its origin's name — before it is applied or
forwarded; duplicates are dropped on their clear-text ids before any
signature is checked. A malformed or forged delta is skipped on its own
(logged with the source peer, R9.5, and returned in :attr:`Received.rejected`
so the driver can report a forgery) while the rest of the frame is processed.
"""

from __future__ import annotations

import bisect
import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.crdt.clock import CRDTError, VectorClock
from p2pnode.crdt.delta import Delta, Opened
from p2pnode.crdt.frames import (
    FRAME_LIMITS,
    GOSSIP_VERSION,
    MAX_BATCH,
    MAX_HOPS,
    MAX_IDS,
    DeltaBatch,
    DeltaId,
    DeltaPush,
    Digest,
    GossipError,
    GossipMessage,
    Graft,
    IHave,
    Prune,
    decode_untrusted,
)
from p2pnode.crdt.ops import Op
from p2pnode.crdt.plumtree import Tree
from p2pnode.crdt.replica import Replica
from p2pnode.crdt.signing import ForgedDeltaError


@dataclass(frozen=True, slots=True)
class GossipConfig:
    """Tuning knobs (see docs/protocol/gossip.md for the defaults' rationale)."""

    #: Links per document (tree) or random push targets (``tree=False``).
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
    #: Disseminate along a broadcast tree (False: push to ``fanout`` random peers).
    tree: bool = True
    #: Links asked to push here (link requests: the ring successor first; at most
    #: ``fanout``); the other links start lazy. It bounds the copies of the first
    #: delta a node receives while the tree is built (docs/protocol/gossip.md §5).
    eager_fanout: int = 3
    #: Most links per document (link requests beyond it are refused with a Prune).
    max_links: int = 16
    #: Seconds a new delta's announcement to lazy links waits, to batch them.
    lazy_delay: float = 0.2
    #: Seconds an announced delta may stay missing before it is grafted.
    graft_timeout: float = 0.5
    #: Announced deltas awaited per document (more are left to anti-entropy).
    max_missing: int = 1024
    #: Seconds back a node announces the deltas it applied to a peer whose link request
    #: it accepts: the peer may have missed them while its request was on its way.
    catch_up: float = 1.0

    def __post_init__(self) -> None:
        if self.fanout < 1 or self.interval <= 0 or self.max_outbox < 1:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "fanout, interval, max_outbox must be > 0")
        if not 1 <= self.max_reply_deltas <= min(MAX_BATCH, self.max_outbox * 64):
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "bad max_reply_deltas")
        if self.max_links <= self.fanout or self.max_missing < 1 or self.eager_fanout < 1:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "need max_links > fanout, max_missing > 0")
        if self.lazy_delay < 0 or self.graft_timeout <= 0 or self.catch_up < 0:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "bad lazy_delay, graft_timeout, catch_up")


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
    #: New deltas learnt from an anti-entropy batch (the rest came by push).
    new_by_batch: int = 0
    #: Pushes of a delta first learnt from a batch: the tree delivered it too.
    pushes_after_batch: int = 0
    #: Tree control frames sent.
    ihaves_sent: int = 0
    grafts_sent: int = 0
    prunes_sent: int = 0


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
        self._now = now
        self._peers: list[str] = []
        self._peer_set: set[str] = set()
        self._keys: dict[str, str] = {}  # peer -> its replica id (the ring's order)
        self._ring: list[str] | None = []  # peers by ring key; None: to sort again
        self._docs: set[str] = set()
        self._trees: dict[str, Tree] = {}
        self._filled: set[str] = set()  # documents whose links match the peer list
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
    def add_peer(self, peer: str, replica_id: str | None = None) -> None:
        """Start gossiping with ``peer`` (ignored if it is this replica), whose replica
        id is ``replica_id`` (default: ``peer``; a driver naming peers otherwise gives
        it, since the ring of link requests is ordered by replica id)."""
        key = peer if replica_id is None else replica_id
        if key != self.replica.replica_id and peer not in self._peer_set:
            self._peer_set.add(peer)
            self._peers.append(peer)
            self._keys[peer] = key
            self._ring = None
            self._filled.clear()

    def remove_peer(self, peer: str) -> None:
        """Stop gossiping with ``peer`` and discard its outbox and links."""
        if peer in self._peer_set:
            self._peer_set.discard(peer)
            self._peers.remove(peer)
            del self._keys[peer]
            self._outbox.pop(peer, None)
            self._ring = None
            self._filled.clear()
            for tree in self._trees.values():
                tree.remove(peer)

    @property
    def peers(self) -> tuple[str, ...]:
        """Known peers, in insertion order."""
        return tuple(self._peers)

    def subscribe(self, doc: str) -> None:
        """Replicate ``doc``: accept its deltas and run anti-entropy for it."""
        self._docs.add(doc)
        if doc not in self._trees:
            c = self.config
            self._trees[doc] = Tree(
                rng=self._rng,
                fanout=c.fanout,
                eager_fanout=min(c.eager_fanout, c.fanout),
                max_links=c.max_links,
                lazy_delay=c.lazy_delay,
                graft_timeout=c.graft_timeout,
                max_missing=c.max_missing,
                catch_up=c.catch_up,
            )

    def unsubscribe(self, doc: str) -> None:
        """Stop replicating ``doc`` (its data stays in the replica)."""
        self._docs.discard(doc)
        self._seen.pop(doc, None)
        self._trees.pop(doc, None)
        self._filled.discard(doc)

    def links(self, doc: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The eager and the lazy links of ``doc`` (both empty when not subscribed)."""
        tree = self._trees.get(doc)
        return ((), ()) if tree is None else (tuple(tree.eager), tuple(tree.lazy))

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

    def _tree(self, doc: str) -> Tree:
        """The document's tree, its links completed first (a link request to each new one)."""
        tree = self._trees[doc]
        if doc not in self._filled:
            if self._peers:
                for peer in tree.fill(self._successor(), self._sorted_ring()):
                    self._send(peer, Graft(doc))
                    self._stats.grafts_sent += 1
            self._filled.add(doc)
        return tree

    def _sorted_ring(self) -> list[str]:
        if self._ring is None:
            self._ring = sorted(self._peers, key=lambda p: (self._keys[p], p))
        return self._ring

    def _successor(self) -> str:
        """The peer whose replica id comes next after this replica's, wrapping."""
        ring = self._sorted_ring()
        keys = [self._keys[p] for p in ring]
        return ring[bisect.bisect_right(keys, self.replica.replica_id) % len(ring)]

    def _targets(self, doc: str, did: DeltaId, sender: str | None) -> list[str]:
        """Where a new delta goes: the tree's eager links, or random peers."""
        if self.config.tree:
            if sender is None or sender in self._peer_set:
                tree = self._tree(doc)
                targets = tree.delivered(did, sender, self._now)
                for peer in tree.cancelled:
                    self._send(peer, Prune(doc))
                    self._stats.prunes_sent += 1
                tree.cancelled.clear()
                return targets
            # A sender the driver did not make a peer (policy) is never linked.
            return [p for p in self._tree(doc).delivered(did, None, self._now) if p != sender]
        return self._choose(self.config.fanout, exclude=(sender or "", did[0]))

    def _clock(self, now: float | None) -> None:
        if now is not None and now > self._now:
            self._now = now

    # Events ---------------------------------------------------------------------------
    def publish(self, delta: Delta, now: float | None = None) -> tuple[str, ...]:
        """Push a delta this replica produced (already applied and, if durable
        storage is used, committed) to its eager links (or ``fanout`` random peers);
        returns them. The checkpoint the replica made with it, if any, goes to the
        same peers. ``now`` (default: the latest time the core was given) dates the
        announcements.

        Raises LocalError(INVALID_ARGUMENT) when not subscribed to the document or
        the replica does not sign its deltas (peers would refuse them).
        """
        if delta.doc not in self._docs:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"not subscribed to {delta.doc!r}")
        if not self.replica.signed:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "the replica has no signer")
        self._clock(now)
        msgs = [DeltaPush.of(delta)]
        cp = self.replica.checkpoint(delta.doc, delta.origin)
        if cp is not None and cp.seq == delta.seq and cp.is_checkpoint:
            msgs.append(DeltaPush.of(cp))
        targets = self._targets(delta.doc, msgs[0].id, None)
        if len(msgs) > 1 and self.config.tree:
            self._tree(delta.doc).delivered(msgs[1].id, None, self._now)
        for p in targets:
            for msg in msgs:
                self._send(p, msg)
        self._stats.pushed += 1
        return tuple(targets)

    def local_update(
        self, doc: str, op: Op, now: float | None = None
    ) -> tuple[Delta, tuple[str, ...]]:
        """Apply a local operation (in memory only) and push its delta; returns the
        delta and the peers it goes to. Use :meth:`publish` after a durable commit
        instead when updates must survive a crash."""
        if doc not in self._docs:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"not subscribed to {doc!r}")
        delta = self.replica.update(doc, op)
        return delta, self.publish(delta, now)

    def receive_untrusted(self, peer: str, data: bytes, now: float | None = None) -> Received:
        """Decode and handle one frame from ``peer``. Raises GossipError on a bad frame;
        bad deltas inside a good frame are logged, recorded and skipped (R9.5)."""
        return self.receive(peer, decode_untrusted(data), now)

    def receive(self, peer: str, msg: GossipMessage, now: float | None = None) -> Received:
        """Handle one decoded frame from ``peer`` at ``now`` (default: the latest time
        the core was given)."""
        self._clock(now)
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
            return self._on_duplicate(peer, msg)
        ids = (msg.doc, msg.origin, msg.first, msg.seq)
        got = self._apply_encoded(peer, msg.delta, ids)
        if got is False:
            return Received(0, 0)
        if got is None:
            return Received(0, 1)
        assert isinstance(got, Delta)
        return Received(1, 0, self._forward(peer, msg))

    def _forward(self, peer: str, msg: DeltaPush) -> tuple[str, ...]:
        if not self.config.forward:
            return ()
        targets = self._targets(msg.doc, msg.id, peer)
        fwd = DeltaPush(msg.doc, *msg.id, msg.delta, min(msg.hops + 1, MAX_HOPS))
        for p in targets:
            self._send(p, fwd)
        self._stats.forwarded += 1
        return tuple(targets)

    def _on_duplicate(self, peer: str, msg: DeltaPush) -> Received:
        if not self.config.tree or peer not in self._peer_set:
            return Received(0, 1)
        verdict = self._trees[msg.doc].duplicate(msg.id, peer)
        if verdict is None:  # learnt by anti-entropy first: the tree's delivery goes on
            self._stats.pushes_after_batch += 1
            return Received(0, 1, self._forward(peer, msg))
        self._send(peer, Prune(msg.doc))
        self._stats.prunes_sent += 1
        return Received(0, 1)

    def _on_ihave(self, peer: str, msg: IHave) -> Received:
        if msg.doc not in self._docs or not self.config.tree or peer not in self._peer_set:
            return Received(0, 0)
        tree = self._tree(msg.doc)
        now = [
            did
            for did in msg.ids
            if self.replica.is_news(msg.doc, *did) and tree.announced(did, peer, self._now)
        ]
        if now:  # a peer this node asked to push announced instead: graft them at once
            self._send(peer, Graft(msg.doc, tuple(now)))
            self._stats.grafts_sent += 1
        return Received(0, 0)

    def _on_graft(self, peer: str, msg: Graft) -> Received:
        if msg.doc not in self._docs or peer not in self._peer_set:
            return Received(0, 0)
        if self.config.tree:
            tree = self._tree(msg.doc)
            if tree.linked(peer) or not tree.full():
                tree.make_eager(peer)
                recent = [] if msg.ids else tree.catch_up(peer, self._now)
                if recent:  # a link request: what it may have missed while on its way
                    self._send(peer, IHave(msg.doc, tuple(recent)))
                    self._stats.ihaves_sent += 1
            else:
                self._send(peer, Prune(msg.doc))  # no room for another link
                self._stats.prunes_sent += 1
        for did in msg.ids:  # at most MAX_IDS, each answered at most once
            delta = self._logged(msg.doc, did)
            if delta is not None:
                self._send(peer, DeltaPush.of(delta))
        return Received(0, 0)

    def _logged(self, doc: str, did: DeltaId) -> Delta | None:
        """The delta or checkpoint ``did`` if this replica still holds it."""
        origin, first, seq = did
        if doc not in self.replica.documents():
            return None
        if first == seq:
            return self.replica.document(doc).log.get((origin, seq))
        cp = self.replica.checkpoint(doc, origin)
        return cp if cp is not None and cp.seq == seq else None

    def _on_prune(self, peer: str, msg: Prune) -> Received:
        if msg.doc in self._docs:
            self._trees[msg.doc].make_lazy(peer)
        return Received(0, 0)

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
        new: list[Delta] = []
        dup = 0
        for data in msg.deltas:
            got = self._apply_encoded(peer, data)
            if isinstance(got, Delta):
                new.append(got)
            elif got is None:
                dup += 1
        self._stats.new_by_batch += len(new)
        if self.config.tree:
            for delta in new:  # its push, when it comes, is forwarded (Tree.duplicate)
                did = (delta.origin, delta.first, delta.seq)
                self._trees[delta.doc].learnt_by_batch(did, peer, self._now)
        return Received(len(new), dup)

    _HANDLERS: ClassVar[dict[type[GossipMessage], Any]] = {
        DeltaPush: _on_push,
        Digest: _on_digest,
        DeltaBatch: _on_batch,
        IHave: _on_ihave,
        Graft: _on_graft,
        Prune: _on_prune,
    }

    # Timers ---------------------------------------------------------------------------
    def next_deadline(self) -> float:
        """When :meth:`handle_timer` should next run (``inf``: nothing is due). It moves
        earlier when a frame queues an announcement or announces a missing delta, and is
        now when links are to be made (the peer set or the subscriptions changed)."""
        if self.config.tree and self._peers and len(self._filled) < len(self._trees):
            return self._now  # link requests build the tree before the first delta
        soonest = self._deadline if self.config.anti_entropy else float("inf")
        for tree in self._trees.values():
            soonest = min(soonest, tree.next_deadline())
        return soonest

    def handle_timer(self, now: float) -> list[tuple[str, str]]:
        """Send the announcements and grafts due, and run anti-entropy if due: one
        digest per subscribed document to a random peer. Returns the ``(doc, peer)``
        pairs digests went to (``[]`` if anti-entropy was not due)."""
        self._clock(now)
        for doc in sorted(self._trees):
            self._tree_timers(doc, now)
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

    def _tree_timers(self, doc: str, now: float) -> None:
        tree = self._tree(doc) if self.config.tree else self._trees[doc]
        for peer, ids in tree.take_announcements(now).items():
            for i in range(0, len(ids), MAX_IDS):
                self._send(peer, IHave(doc, tuple(ids[i : i + MAX_IDS])))
                self._stats.ihaves_sent += 1
        awaited = {did: self.replica.is_news(doc, *did) for did in tree.missing_ids()}
        for peer, ids in tree.take_grafts(now, awaited).items():
            self._send(peer, Graft(doc, tuple(ids)))
            self._stats.grafts_sent += 1

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
        copy = replace(self._stats)
        copy.received_by_type = dict(self._stats.received_by_type)
        return copy


__all__ = [
    "FRAME_LIMITS",
    "GOSSIP_VERSION",
    "MAX_BATCH",
    "MAX_HOPS",
    "MAX_IDS",
    "DeltaBatch",
    "DeltaPush",
    "Digest",
    "GossipConfig",
    "GossipError",
    "GossipMessage",
    "GossipNode",
    "GossipStats",
    "Graft",
    "IHave",
    "Prune",
    "Received",
    "decode_untrusted",
]
