"""Sans-IO epidemic broadcast tree of one document (Plumtree).

Theory of operation
-------------------
Leitao, Pereira and Rodrigues, "Epidemic Broadcast Trees" (SRDS 2007), over a
small overlay of *links* per document:

* **Links.** A node links to its ring successor (the peer whose replica id
  comes next after its own, wrapping; the caller picks it, since it knows the
  peers' replica ids) and to random peers until it has ``fanout`` links. New
  links start *lazy* on its side; it asks ``eager_fanout`` of them (the
  successor first) to push to it, with a link request (a :class:`Graft`
  without ids), and the receiver makes the link eager on its side (or,
  holding ``max_links`` links, refuses with a Prune). Every node is thus
  pushed to by ``eager_fanout`` peers before the first delta, and the asked
  successors alone form a ring through every node.
* **Eager push (§3.3).** A delta is pushed to every eager link but the one it
  came from (and its origin). The first copy of a delta makes its sender eager
  and *cancels* the other asks still open: each gets a :class:`Prune` at once,
  so most of them never push a copy (pruning before the duplicate, not after)
  — except a peer that asked this node too, which may lack the delta: it is
  pushed to, so no ask that the ring relies on is dropped unanswered.
  A node that no peer asked to be pushed from yet, making a delta or getting
  it over a link it did not ask for, pushes it to the peers it asked instead:
  a delta made before the link requests landed still leaves by push.
  A duplicate makes its sender lazy and is answered with a Prune, which makes
  the link lazy on the other side too. So the first delta costs each node
  at most ``eager_fanout - 1`` redundant copies once the requests landed,
  after it the eager links form a spanning tree, and later deltas travel it
  with no duplicates. (Links that all start eager would cost each node about
  its number of links, which is twice ``fanout`` once requests are counted
  both ways.)
* **Catching up a late request.** A link request may land after a delta
  passed its receiver (on a node the request waits for its channel to open).
  The receiver announces to the requester, at once, the deltas it applied in
  the last ``catch_up`` seconds; a node announced a delta it lacks by a peer
  it asked to push grafts it at once (that peer will not push it), from one
  such peer per delta.
* **Lazy push (§3.4).** The ids of a new delta are announced in a batched
  :class:`IHave` to the lazy links ``lazy_delay`` seconds later. An announced
  delta still missing ``graft_timeout`` seconds after its first announcement
  is asked for with a :class:`Graft` naming it, which also makes the link
  eager again (tree repair); each further announcer is tried
  ``graft_timeout`` later. Anti-entropy stays the safety net for what the tree
  and the announcements both miss.

This class holds the tables and applies the rules; the gossip core
(:class:`~p2pnode.crdt.gossip.GossipNode`) sends what it returns. Every table
is bounded: links by ``max_links``, announcements by :data:`MAX_IDS` per link,
missing deltas by ``max_missing`` (further ones are left to anti-entropy), the
deltas remembered for late requests by :data:`MAX_IDS`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from p2pnode.crdt.frames import MAX_IDS, DeltaId

#: Announcers remembered per missing delta.
MAX_ANNOUNCERS = 4


@dataclass(slots=True)
class _Missing:
    deadline: float
    announcers: list[str] = field(default_factory=list)
    #: Grafted at once from a peer asked to push here (which announced it instead).
    hurried: bool = False


class Tree:
    """Eager and lazy links, pending announcements and missing deltas of one document."""

    def __init__(
        self,
        *,
        rng: random.Random,
        fanout: int,
        eager_fanout: int,
        max_links: int,
        lazy_delay: float,
        graft_timeout: float,
        max_missing: int,
        catch_up: float,
    ) -> None:
        self._rng = rng
        self._fanout = fanout
        self._eager_fanout = eager_fanout
        self._asked = 0  # link requests sent: peers asked to push here eagerly
        self._requested: dict[str, None] = {}  # the peers they went to (still peers)
        self._max_links = max_links
        self._lazy_delay = lazy_delay
        self._graft_timeout = graft_timeout
        self._max_missing = max_missing
        self._catch_up = catch_up
        # Dicts, not sets: insertion order keeps a simulation a function of its seed.
        self.eager: dict[str, None] = {}
        self.lazy: dict[str, None] = {}
        self._pending: dict[str, list[DeltaId]] = {}
        self._flush_at: float | None = None
        self._missing: dict[DeltaId, _Missing] = {}
        # Peers asked to push here whose push has not come yet.
        self._asking: dict[str, None] = {}
        #: Peers asked whose pushes are no longer wanted: the caller sends each a Prune.
        self.cancelled: list[str] = []
        # Deltas learnt from an anti-entropy batch, oldest first (at most max_missing):
        # a push of one arriving later is no sign of a redundant link.
        self._by_batch: dict[DeltaId, None] = {}
        # Deltas applied here, oldest first (at most MAX_IDS): when and from whom (None:
        # made here). A peer whose link request lands later may have missed them.
        self._recent: dict[DeltaId, tuple[float, str | None]] = {}

    # Links ----------------------------------------------------------------------------
    @property
    def links(self) -> int:
        return len(self.eager) + len(self.lazy)

    def linked(self, peer: str) -> bool:
        return peer in self.eager or peer in self.lazy

    def fill(self, successor: str, peers: list[str]) -> list[str]:
        """Link the ring ``successor`` and random ``peers`` (in a fixed order, so a
        simulation is a function of its seed) until there are ``fanout`` links and
        ``eager_fanout`` of them were asked to push here; returns the peers to ask
        (each gets a link request). New links start lazy on this side."""
        ask: list[str] = []
        # The successor is asked even when already linked (it asked here first, or
        # announced something): the ring of requests must not miss this node.
        if successor not in self._requested and (self._link(successor) or self.linked(successor)):
            ask.append(successor)
        wanted = max(self._fanout - self.links, self._eager_fanout - self._asked - len(ask))
        if wanted > 0:
            k = min(len(peers), wanted + self.links)
            for peer in self._rng.sample(peers, k):
                more_asks = self._asked + len(ask) < self._eager_fanout
                if self.links >= self._fanout and not more_asks:
                    break
                if self._link(peer) and more_asks:
                    ask.append(peer)
        self._asked += len(ask)
        self._requested.update(dict.fromkeys(ask))
        self._asking.update(dict.fromkeys(ask))
        return ask

    def _link(self, peer: str) -> bool:
        """A new lazy link; False if linked already or full."""
        if self.linked(peer) or self.links >= self._max_links:
            return False
        self.lazy[peer] = None
        return True

    def make_eager(self, peer: str) -> bool:
        """Make ``peer`` an eager link; False if it already was a link or no room
        is left (then nothing changes)."""
        if peer in self.eager:
            return False
        if peer in self.lazy:
            del self.lazy[peer]
            self.eager[peer] = None
            return False
        if self.links >= self._max_links:
            return False
        self.eager[peer] = None
        return True

    def make_lazy(self, peer: str) -> bool:
        """Move an eager link to lazy; True if it was eager."""
        self._asking.pop(peer, None)
        if peer not in self.eager:
            return False
        del self.eager[peer]
        self.lazy[peer] = None
        return True

    def add_lazy(self, peer: str) -> None:
        """Remember an announcing peer as a lazy link, if there is room."""
        if not self.linked(peer) and self.links < self._max_links:
            self.lazy[peer] = None

    def full(self) -> bool:
        return self.links >= self._max_links

    def remove(self, peer: str) -> None:
        """Forget ``peer`` (it left): its link, its announcements, its offers."""
        self.eager.pop(peer, None)
        self.lazy.pop(peer, None)
        self._pending.pop(peer, None)
        self._asking.pop(peer, None)
        self._requested.pop(peer, None)
        for entry in self._missing.values():
            if peer in entry.announcers:
                entry.announcers.remove(peer)

    # Delivery -------------------------------------------------------------------------
    def delivered(self, did: DeltaId, sender: str | None, now: float) -> list[str]:
        """A new delta arrived from ``sender`` (None: made here). Returns the eager
        links to push it to; queues its announcement to the lazy links. Open asks
        are settled: pushed to when no one asked to be pushed from here and the delta
        did not come from a peer asked (the tree is new), else cancelled
        (:attr:`cancelled`) once a push came, but for peers that asked this node
        too: those are pushed to."""
        self._missing.pop(did, None)
        self._remember(did, sender, now)
        # A push over a link this node did not ask for, or none (made here): the tree
        # may not reach it yet from any side.
        unasked = sender is None or sender not in self._asking
        if sender is not None:
            self._asking.pop(sender, None)
            self.make_eager(sender)
        skip = (sender, did[0])  # and the origin
        targets = [p for p in self.eager if p not in skip]
        if self._asking and not targets and unasked:
            for peer in self._asking:
                self.make_eager(peer)
            targets = [p for p in self._asking if p not in skip]
            self._asking.clear()
        elif self._asking and sender is not None:
            # A peer that asked this node too gets the delta pushed instead of a Prune: it
            # may lack it, and the ring of requests through it must not break.
            self.cancelled.extend(p for p in self._asking if p not in self.eager)
            self._asking.clear()
        lazy = [p for p in self.lazy if p not in skip]
        for peer in lazy:
            ids = self._pending.setdefault(peer, [])
            if len(ids) >= MAX_IDS:
                del ids[0]  # oldest first: anti-entropy covers an announcement lost here
            ids.append(did)
        if lazy and self._flush_at is None:
            self._flush_at = now + self._lazy_delay
        return targets

    def learnt_by_batch(self, did: DeltaId, sender: str, now: float) -> None:
        """A new delta came from ``sender`` in an anti-entropy batch, ahead of its push."""
        if len(self._by_batch) >= self._max_missing:
            del self._by_batch[next(iter(self._by_batch))]
        self._by_batch[did] = None
        self._remember(did, sender, now)

    def _remember(self, did: DeltaId, sender: str | None, now: float) -> None:
        self._recent.pop(did, None)
        if len(self._recent) >= MAX_IDS:
            del self._recent[next(iter(self._recent))]
        self._recent[did] = (now, sender)

    def catch_up(self, peer: str, now: float) -> list[DeltaId]:
        """The deltas applied here in the last ``catch_up`` seconds that ``peer`` neither
        made nor sent, oldest first: what to announce to it when its link request lands,
        since it may have missed them while the request was on its way."""
        since = now - self._catch_up
        while self._recent and next(iter(self._recent.values()))[0] < since:
            del self._recent[next(iter(self._recent))]
        return [did for did, (_, sender) in self._recent.items() if peer not in (did[0], sender)]

    def duplicate(self, did: DeltaId, peer: str) -> bool | None:
        """A pushed duplicate came from ``peer``. True: make the link lazy and send
        ``peer`` a Prune (§3.3). None: the first copy came by anti-entropy, so this push
        is the tree's delivery: forward it as if it were new (:meth:`delivered`),
        else this node's subtree would miss it."""
        if self._by_batch.pop(did, 0) is None:
            return None
        # The Prune goes even when the link is lazy here already: the sender pushed, so
        # its side is eager (a link request or a delivery crossed our Prune).
        if not self.make_lazy(peer):
            self.add_lazy(peer)
        return True

    def announced(self, did: DeltaId, peer: str, now: float) -> bool:
        """``peer`` announced a delta this replica lacks: wait for it, then graft. True:
        graft it from ``peer`` at once (the caller sends the Graft): this node asked
        ``peer`` to push and no push came, so ``peer`` had the delta before the request
        landed and will not push it. One such graft per delta; further announcers wait
        their turn."""
        self.add_lazy(peer)
        entry = self._missing.get(did)
        if entry is None:
            if len(self._missing) >= self._max_missing:
                return False  # left to anti-entropy
            entry = self._missing[did] = _Missing(now + self._graft_timeout)
        if peer in self._asking and not entry.hurried:
            entry.hurried = True
            entry.deadline = now + self._graft_timeout  # then the other announcers in turn
            return True
        if peer not in entry.announcers and len(entry.announcers) < MAX_ANNOUNCERS:
            entry.announcers.append(peer)
        return False

    # Timers ---------------------------------------------------------------------------
    def next_deadline(self) -> float:
        """The earliest announcement flush or graft due (``inf``: none)."""
        soonest = self._flush_at if self._flush_at is not None else float("inf")
        for entry in self._missing.values():
            soonest = min(soonest, entry.deadline)
        return soonest

    def take_announcements(self, now: float) -> dict[str, list[DeltaId]]:
        """The announcements due, per lazy link (at most MAX_IDS each)."""
        if self._flush_at is None or now < self._flush_at:
            return {}
        due, self._pending, self._flush_at = self._pending, {}, None
        return {p: ids for p, ids in due.items() if p in self.lazy or p in self.eager}

    def take_grafts(self, now: float, is_news: dict[DeltaId, bool]) -> dict[str, list[DeltaId]]:
        """Deltas still missing past their timeout, per announcer to graft; the
        announcer becomes eager. ``is_news`` says which ids are still missing (the
        others are forgotten); it covers every id of :meth:`missing_ids`."""
        out: dict[str, list[DeltaId]] = {}
        for did in list(self._missing):
            entry = self._missing[did]
            if not is_news.get(did, False):
                del self._missing[did]
                continue
            if entry.deadline > now:
                continue
            if not entry.announcers:
                del self._missing[did]  # every announcer tried: left to anti-entropy
                continue
            peer = entry.announcers.pop(0)
            ids = out.setdefault(peer, [])
            if len(ids) < MAX_IDS:
                ids.append(did)
            self.make_eager(peer)
            entry.deadline = now + self._graft_timeout
        return out

    def missing_ids(self) -> list[DeltaId]:
        return list(self._missing)

    def statistics(self) -> tuple[int, int, int]:
        """``(eager links, lazy links, deltas awaited)``."""
        return len(self.eager), len(self.lazy), len(self._missing)


__all__ = ["MAX_ANNOUNCERS", "Tree"]
