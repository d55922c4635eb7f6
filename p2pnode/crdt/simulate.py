"""A deterministic discrete-event simulator for the gossip core (tests and benchmarks).

Theory of operation: N :class:`~p2pnode.crdt.gossip.GossipNode` cores, each
over its own :class:`~p2pnode.crdt.replica.Replica`, exchange encoded frames
through a virtual network with a seeded RNG: per-message latency drawn
uniformly from ``latency``, independent loss with probability ``loss``, and
partitions (frames between different groups are dropped). A heap of events
(frame deliveries and anti-entropy timers) is processed in virtual-time order
(ties broken by insertion order), so a run is a pure function of its seed.
Frames are really encoded and decoded (``decode_untrusted``), so byte counts
are the wire's, and deltas are really signed and verified: node ``i`` has an
Ed25519 identity drawn from the seeded RNG and its replica id is that
identity's peer id text (:attr:`GossipSimulation.ids`).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

from p2pnode.core.identity import Identity
from p2pnode.crdt.delta import Delta
from p2pnode.crdt.gossip import DeltaPush, GossipConfig, GossipNode, decode_untrusted
from p2pnode.crdt.ops import Op
from p2pnode.crdt.replica import Replica

_DELIVER = 0
_TIMER = 1


@dataclass(frozen=True, slots=True)
class NetConfig:
    """The virtual network."""

    #: One-way latency bounds, seconds.
    latency: tuple[float, float] = (0.01, 0.03)
    #: Probability that a frame is lost.
    loss: float = 0.0


@dataclass(slots=True)
class NodeCounters:
    """Per-node traffic counters."""

    frames_sent: int = 0
    bytes_sent: int = 0
    frames_received: int = 0
    first_hops: dict[tuple[str, int], int] = field(default_factory=dict)


class GossipSimulation:
    """N gossip nodes on a seeded virtual network; node ``i`` has replica id ``ids[i]``."""

    def __init__(
        self,
        n: int,
        *,
        seed: int,
        gossip: GossipConfig | None = None,
        net: NetConfig | None = None,
        docs: Iterable[str] = ("doc",),
        max_log: int = 1024,
    ) -> None:
        self.rng = random.Random(seed)
        self.net = net or NetConfig()
        self.now = 0.0
        self.docs = tuple(docs)
        identities = [Identity(self.rng.randbytes(32)) for _ in range(n)]
        #: Replica id of each node (its identity's peer id text).
        self.ids = ids = [str(identity.peer_id) for identity in identities]
        self.nodes = [
            GossipNode(
                Replica(rid, signer=identity, max_log=max_log),
                peers=ids,
                docs=self.docs,
                rng=random.Random(self.rng.getrandbits(64)),
                now=0.0,
                config=gossip,
            )
            for rid, identity in zip(ids, identities, strict=True)
        ]
        self._index = {rid: i for i, rid in enumerate(ids)}
        self.counters = [NodeCounters() for _ in ids]
        self._events: list[tuple[float, int, int, int, int, bytes]] = []
        self._seq = 0
        self._group: list[int] | None = None
        self.lost = 0
        self.tracked: set[tuple[str, int]] = set()
        self._timer_at = [float("inf")] * n  # the earliest timer event queued per node
        for i in range(n):
            self._schedule_timer(i)

    # Scheduling -----------------------------------------------------------------------
    def _push(self, t: float, kind: int, a: int, b: int = 0, data: bytes = b"") -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, a, b, data))

    def _schedule_timer(self, i: int) -> None:
        """Queue a timer event for node ``i``'s deadline unless one is queued earlier
        (a frame can move the deadline earlier: an announcement, an awaited delta)."""
        deadline = self.nodes[i].next_deadline()
        if deadline < self._timer_at[i] or self._timer_at[i] < self.now:
            self._timer_at[i] = deadline
            if deadline != float("inf"):
                self._push(deadline, _TIMER, i)

    def _flush(self, i: int) -> None:
        """Put node ``i``'s queued frames on the wire."""
        lo, hi = self.net.latency
        c = self.counters[i]
        encoded: dict[int, bytes] = {}  # one frame fanned out to many peers is encoded once
        for peer, msg in self.nodes[i].take_outgoing():
            data = encoded.get(id(msg))
            if data is None:
                data = encoded[id(msg)] = msg.encode()
            c.frames_sent += 1
            c.bytes_sent += len(data)
            j = self._index[peer]
            if self.rng.random() < self.net.loss or (
                self._group is not None and self._group[i] != self._group[j]
            ):
                self.lost += 1
                continue
            self._push(self.now + self.rng.uniform(lo, hi), _DELIVER, i, j, data)

    # Control --------------------------------------------------------------------------
    def update(self, i: int, doc: str, op: Op) -> Delta:
        """Node ``i`` performs a local operation now and pushes it."""
        delta, _ = self.nodes[i].local_update(doc, op, self.now)
        self.counters[i].first_hops[(delta.origin, delta.seq)] = 0
        self._flush(i)
        self._schedule_timer(i)
        return delta

    def partition(self, groups: Iterable[Iterable[int]]) -> None:
        """Drop every frame between nodes of different groups (nodes not listed: group -1)."""
        group = [-1] * len(self.nodes)
        for g, members in enumerate(groups):
            for i in members:
                group[i] = g
        self._group = group

    def heal(self) -> None:
        """End the partition."""
        self._group = None

    def step(self) -> bool:
        """Process one event; False when none is left."""
        if not self._events:
            return False
        t, _, kind, a, b, data = heapq.heappop(self._events)
        self.now = max(self.now, t)
        if kind == _TIMER:
            node = self.nodes[a]
            if t >= self._timer_at[a]:
                self._timer_at[a] = float("inf")
            if self.now >= node.next_deadline():
                node.handle_timer(self.now)
                self._flush(a)
            self._schedule_timer(a)
            return True
        node = self.nodes[b]
        self.counters[b].frames_received += 1
        msg = decode_untrusted(data)
        node.receive(self.nodes[a].replica.replica_id, msg, self.now)
        if self.tracked:
            # Hops of the copy that first taught node b a tracked op (-1: via anti-entropy).
            hops = msg.hops + 1 if isinstance(msg, DeltaPush) else -1
            first = self.counters[b].first_hops
            for key in self.tracked:
                if key not in first and self.has(b, key):
                    first[key] = hops
        self._flush(b)
        self._schedule_timer(b)
        return True

    def track(self, op: tuple[str, int]) -> None:
        """Record per node how operation ``(origin, seq)`` of the first document arrived."""
        self.tracked.add(op)

    def has(self, i: int, op: tuple[str, int], doc: str | None = None) -> bool:
        """Whether node ``i`` applied operation ``(origin, seq)`` of ``doc``."""
        name = doc or self.docs[0]
        replica = self.nodes[i].replica
        return name in replica.documents() and op in replica.document(name).applied

    def run_until(self, t: float) -> None:
        """Process events up to virtual time ``t``."""
        while self._events and self._events[0][0] <= t:
            self.step()
        self.now = max(self.now, t)

    def run_until_all_have(
        self, op: tuple[str, int], deadline: float, doc: str | None = None
    ) -> float | None:
        """Run until every node applied ``op``; the virtual time, or None at ``deadline``."""
        missing = {i for i in range(len(self.nodes)) if not self.has(i, op, doc)}
        while missing:
            if not self._events or self._events[0][0] > deadline:
                return None
            _, _, kind, _, b, _ = self._events[0]
            self.step()
            if kind == _DELIVER and b in missing and self.has(b, op, doc):
                missing.discard(b)
        return self.now

    def converged(self) -> bool:
        """Every node holds identical state and clocks for every document."""
        first = self.nodes[0].replica
        for node in self.nodes[1:]:
            r = node.replica
            for doc in self.docs:
                if r.clock(doc) != first.clock(doc) or r.value(doc) != first.value(doc):
                    return False
                if doc in first.documents() and (
                    r.document(doc).state != first.document(doc).state
                ):
                    return False
        return True
