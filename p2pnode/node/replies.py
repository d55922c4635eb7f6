"""Replies leave per requester, so no requester can hold an agent hostage.

An agent's task (p2pnode.node.agents) runs its handler for one envelope at a
time. If it also waited for each reply to be written, a requester that asked
many times and then vanished (or never reads) would make the agent spend a
redial and a write timeout on every one of those replies before it could look
at anyone else's request. So the agent's task only *queues* a reply, in
:class:`ReplyQueues`: one FIFO per requesting peer, written by one task per
peer that has replies queued (started on demand, ended when its queue has
stayed empty for :data:`LINGER` seconds, so a peer asking one request after
another reuses one task instead of starting one per reply). Each peer's queue
has its own bounds (replies and bytes), and each reply its own timeout; a
reply that cannot be delivered (the peer is unreachable, or the write timed
out) drops what is still queued for that peer, since it would fail the same
way. What does not fit is dropped and counted: the requester times out, as
it would had the reply been lost.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from p2pnode.core.errors import ErrorCode
from p2pnode.core.lifetime import TaskOwner

logger = logging.getLogger("p2pnode.node")

#: Replies queued for one requesting peer at most.
DEFAULT_REPLIES_PER_PEER = 64
#: Bytes of replies queued for one requesting peer at most.
DEFAULT_REPLY_BYTES_PER_PEER = 16 * 1024 * 1024
#: Requesting peers with replies queued at most.
DEFAULT_REPLY_PEERS = 1024

#: Seconds a peer's reply task waits for the next reply before it ends.
LINGER = 1.0

#: What a reply job returns: None when delivered, else the code of why not.
ReplyJob = Callable[[], Awaitable[ErrorCode | None]]
#: Codes that mean the peer cannot be reached now: its other queued replies are dropped.
UNREACHABLE = frozenset({ErrorCode.DELIVERY_FAILED, ErrorCode.CHANNEL_CLOSED, ErrorCode.TIMEOUT})


@dataclass(frozen=True, slots=True)
class ReplyLimits:
    """Bounds of :class:`ReplyQueues`; ``timeout`` is seconds per reply."""

    timeout: float = 10.0
    max_per_peer: int = DEFAULT_REPLIES_PER_PEER
    max_bytes_per_peer: int = DEFAULT_REPLY_BYTES_PER_PEER
    max_peers: int = DEFAULT_REPLY_PEERS


class ReplyQueues:
    """Per-peer reply queues (see the module docstring); their tasks run in ``owner``'s
    nursery."""

    def __init__(self, owner: TaskOwner, limits: ReplyLimits) -> None:
        self._owner = owner
        self._limits = limits
        self._queues: dict[str, deque[tuple[ReplyJob, int, Callable[[], None]]]] = {}
        self._bytes: dict[str, int] = {}
        #: Set to wake a peer's task waiting, with its queue empty, for the next reply.
        self._wake: dict[str, trio.Event] = {}
        #: Replies sent, dropped for want of room, and dropped as their peer was unreachable.
        self.sent = 0
        self.refused = 0
        self.abandoned = 0

    def put(
        self, peer: str, job: ReplyJob, size: int, done: Callable[[], None] = lambda: None
    ) -> bool:
        """Queue ``job`` (a reply of about ``size`` bytes) for ``peer``; False when it
        does not fit (it is dropped and counted). ``done`` is called once the queued job
        leaves the queue, sent or not."""
        limits = self._limits
        queue = self._queues.get(peer)
        if queue is None:
            if not self._owner.is_open:
                return self._refuse(peer, "the node is closing")
            if len(self._queues) >= limits.max_peers:
                return self._refuse(peer, "too many peers have replies queued")
            queue = self._queues[peer] = deque()
            self._bytes[peer] = 0
            self._owner.nursery.start_soon(self._drain, peer, queue)
        if len(queue) >= limits.max_per_peer:
            return self._refuse(peer, f"{len(queue)} replies are queued for it")
        if queue and self._bytes[peer] + size > limits.max_bytes_per_peer:
            return self._refuse(peer, f"{self._bytes[peer]} bytes of replies are queued for it")
        queue.append((job, size, done))
        self._bytes[peer] += size
        wake = self._wake.pop(peer, None)
        if wake is not None:
            wake.set()
        return True

    def note(self, peer: str, code: ErrorCode | None) -> None:
        """Count a reply to ``peer`` written without the queue: sent (``code`` None) or
        abandoned."""
        if code is None:
            self.sent += 1
        else:
            self.abandoned += 1
            logger.info("reply to %s dropped: %s", peer, code)

    def _refuse(self, peer: str, why: str) -> bool:
        # A counter (statistics()), not a line per reply: a flood of requests would
        # bury the log.
        self.refused += 1
        logger.debug("reply to %s dropped: %s", peer, why)
        return False

    def queued(self, peer: str) -> int:
        """Replies queued for ``peer`` (the one being written included)."""
        queue = self._queues.get(peer)
        return 0 if queue is None else len(queue)

    def statistics(self) -> dict[str, int]:
        return {
            "peers": len(self._queues),
            "queued": sum(len(q) for q in self._queues.values()),
            "bytes": sum(self._bytes.values()),
            "sent": self.sent,
            "refused": self.refused,
            "abandoned": self.abandoned,
        }

    async def _drain(
        self, peer: str, queue: deque[tuple[ReplyJob, int, Callable[[], None]]]
    ) -> None:
        try:
            while True:
                if not queue:
                    wake = self._wake[peer] = trio.Event()
                    with trio.move_on_after(LINGER):
                        await wake.wait()
                    if not queue:
                        return
                job, size, done = queue[0]
                code: ErrorCode | None = ErrorCode.TIMEOUT
                with trio.move_on_after(self._limits.timeout):
                    code = await job()
                queue.popleft()
                done()
                self._bytes[peer] -= size
                if code is None:
                    self.sent += 1
                elif code in UNREACHABLE:
                    self.abandoned += 1 + len(queue)
                    if queue:
                        logger.info("%d replies to %s dropped: %s", len(queue), peer, code)
                    while queue:
                        queue.popleft()[2]()
        finally:
            while queue:  # cancelled: the node is closing
                queue.popleft()[2]()
            # No await between the last check of the queue and this: a put() after it
            # starts a new task.
            del self._queues[peer]
            del self._bytes[peer]
            self._wake.pop(peer, None)


__all__ = [
    "DEFAULT_REPLIES_PER_PEER",
    "DEFAULT_REPLY_BYTES_PER_PEER",
    "DEFAULT_REPLY_PEERS",
    "LINGER",
    "UNREACHABLE",
    "ReplyJob",
    "ReplyLimits",
    "ReplyQueues",
]
