"""Sans-IO epidemic broadcast tree of one document (Plumtree).

Theory of operation
-------------------
Leitao, Pereira and Rodrigues, "Epidemic Broadcast Trees" (SRDS 2007), over a
small symmetric overlay of *links* per document:

* **Links.** A node links to its ring successor (the next replica id after its
  own among the peers it knows, wrapping) and to random peers until it has
  ``fanout`` links, sending each a link request (a :class:`Graft` without ids);
  the receiver links back. Since every node links its successor, the links of
  nodes that know each other contain a ring, so the overlay is connected.
  A node keeps at most ``max_links`` links and refuses more with a Prune.
* **Eager push (§3.3).** Links start *eager*. A delta is pushed to every eager
  link but the one it came from (and its origin). The first copy of a delta
  makes its sender eager; a duplicate makes it *lazy* and is answered with a
  :class:`Prune`, which makes the link lazy on the other side too. After one
  delta has crossed the overlay the eager links form a spanning tree, and
  later deltas travel it with no duplicates.
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
missing deltas by ``max_missing`` (further ones are left to anti-entropy).
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field

from p2pnode.crdt.frames import MAX_IDS, DeltaId

#: Announcers remembered per missing delta.
MAX_ANNOUNCERS = 4


@dataclass(slots=True)
class _Missing:
    deadline: float
    announcers: list[str] = field(default_factory=list)


class Tree:
    """Eager and lazy links, pending announcements and missing deltas of one document."""

    def __init__(
        self,
        self_id: str,
        *,
        rng: random.Random,
        fanout: int,
        max_links: int,
        lazy_delay: float,
        graft_timeout: float,
        max_missing: int,
    ) -> None:
        self._self = self_id
        self._rng = rng
        self._fanout = fanout
        self._max_links = max_links
        self._lazy_delay = lazy_delay
        self._graft_timeout = graft_timeout
        self._max_missing = max_missing
        # Dicts, not sets: insertion order keeps a simulation a function of its seed.
        self.eager: dict[str, None] = {}
        self.lazy: dict[str, None] = {}
        self._pending: dict[str, list[DeltaId]] = {}
        self._flush_at: float | None = None
        self._missing: dict[DeltaId, _Missing] = {}
        # Deltas learnt from an anti-entropy batch, oldest first (at most max_missing):
        # a push of one arriving later is no sign of a redundant link.
        self._by_batch: dict[DeltaId, None] = {}

    # Links ----------------------------------------------------------------------------
    @property
    def links(self) -> int:
        return len(self.eager) + len(self.lazy)

    def linked(self, peer: str) -> bool:
        return peer in self.eager or peer in self.lazy

    def fill(self, sorted_peers: list[str]) -> list[str]:
        """Link the ring successor and random peers up to ``fanout`` links; returns
        the peers newly linked (each gets a link request)."""
        new: list[str] = []
        if not sorted_peers:
            return new
        i = bisect.bisect_right(sorted_peers, self._self)
        successor = sorted_peers[i % len(sorted_peers)]
        if self._link(successor):
            new.append(successor)
        want = self._fanout - self.links
        if want > 0:
            k = min(len(sorted_peers), want + self.links)
            for peer in self._rng.sample(sorted_peers, k):
                if self.links >= self._fanout:
                    break
                if self._link(peer):
                    new.append(peer)
        return new

    def _link(self, peer: str) -> bool:
        """A new eager link (a lazy one stays lazy); False if linked or full."""
        if self.linked(peer) or self.links >= self._max_links:
            return False
        self.eager[peer] = None
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
        for entry in self._missing.values():
            if peer in entry.announcers:
                entry.announcers.remove(peer)

    # Delivery -------------------------------------------------------------------------
    def delivered(self, did: DeltaId, sender: str | None, now: float) -> list[str]:
        """A new delta arrived from ``sender`` (None: made here). Returns the eager
        links to push it to; queues its announcement to the lazy links."""
        self._missing.pop(did, None)
        if sender is not None:
            self.make_eager(sender)
        origin = did[0]
        skip = (sender, origin)
        lazy = [p for p in self.lazy if p not in skip]
        if lazy:
            for peer in lazy:
                ids = self._pending.setdefault(peer, [])
                if len(ids) >= MAX_IDS:
                    del ids[0]  # oldest first: anti-entropy covers an announcement lost here
                ids.append(did)
            if self._flush_at is None:
                self._flush_at = now + self._lazy_delay
        return [p for p in self.eager if p not in skip]

    def learnt_by_batch(self, did: DeltaId) -> None:
        """A new delta came in an anti-entropy batch, ahead of its push."""
        if len(self._by_batch) >= self._max_missing:
            del self._by_batch[next(iter(self._by_batch))]
        self._by_batch[did] = None

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

    def announced(self, did: DeltaId, peer: str, now: float) -> None:
        """``peer`` announced a delta this replica lacks: wait for it, then graft."""
        self.add_lazy(peer)
        entry = self._missing.get(did)
        if entry is None:
            if len(self._missing) >= self._max_missing:
                return  # left to anti-entropy
            self._missing[did] = _Missing(now + self._graft_timeout, [peer])
        elif peer not in entry.announcers and len(entry.announcers) < MAX_ANNOUNCERS:
            entry.announcers.append(peer)

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
