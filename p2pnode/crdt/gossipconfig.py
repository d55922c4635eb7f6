"""Configuration, per-frame results and counters of the gossip core
(:mod:`p2pnode.crdt.gossip`, which re-exports them); docs/protocol/gossip.md gives
the defaults' rationale."""

from __future__ import annotations

from dataclasses import dataclass, field

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.crdt.clock import CRDTError
from p2pnode.crdt.frames import MAX_BATCH


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


__all__ = ["GossipConfig", "GossipStats", "Received"]
