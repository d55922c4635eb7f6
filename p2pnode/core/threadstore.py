"""Correlation threads: the envelopes of each conversation, grouped by correlation id,
bounded by count, by bytes per owner and in all, and by age once finished."""

from __future__ import annotations

import bisect
import math
import time
from collections import OrderedDict
from collections.abc import Callable

from p2pnode.core.envelope import Envelope, MessageType, envelope_size

#: Bytes of envelopes the thread store keeps in all, and per owner (the peer that sent
#: them, or the node itself), by default.
DEFAULT_THREAD_BYTES = 64 * 1024 * 1024
DEFAULT_THREAD_BYTES_PER_OWNER = 8 * 1024 * 1024
#: Bytes charged for each kept envelope beside its wire size: what holding it costs in
#: memory (the Envelope object, its fields, the entry and the owner's index), measured
#: at about 930 bytes for a request of 273 wire bytes. Without it a flood of small
#: envelopes held three times the byte budget.
ENTRY_OVERHEAD = 640
#: Seconds a finished thread (its last envelope a final answer) is kept, by default.
DEFAULT_FINISHED_TTL = 60.0
#: Envelope types that end a request's thread: after one, the thread is finished.
FINAL_TYPES = frozenset(
    {MessageType.RESPONSE, MessageType.ERROR, MessageType.STREAM_END, MessageType.TASK_REJECT}
)


class _Owned:
    """What one owner has filed: its entries, oldest first (seq -> thread key), and
    their bytes."""

    __slots__ = ("bytes", "entries")

    def __init__(self) -> None:
        self.entries: OrderedDict[int, str] = OrderedDict()
        self.bytes = 0


class ThreadStore:
    """Envelopes grouped by correlation id, each thread in timestamp order.

    Bounded by count: at most ``max_threads`` threads (the least recently
    touched is evicted) of at most ``max_per_thread`` envelopes (the oldest is
    dropped). Bounded by bytes (:func:`envelope_size` plus ``entry_overhead``, what
    holding an envelope costs beside its wire bytes): each envelope is charged
    to its *owner* (the peer it came from; ``""`` for the node's own), and an
    owner over ``max_bytes_per_owner`` loses its own oldest envelopes first, so
    a peer flooding large envelopes with fresh correlation ids evicts only its
    own; over ``max_bytes`` in all, the least recently touched threads go. An
    envelope larger than an owner's budget is not kept. :meth:`forget` drops
    what an owner left, when it leaves.

    Bounded by age: a *finished* thread, one whose last envelope is a final
    answer (:data:`FINAL_TYPES`), is dropped ``finished_ttl`` seconds later
    (on ``clock``, injected; read once per :meth:`add`) unless another
    envelope touched it meanwhile. Request and answer threads are most of the
    traffic and nobody reads them after the answer, so under steady load the
    store holds a minute of them instead of filling to its count and byte
    bounds over many minutes: memory levels off early, and a node's RSS says
    whether something else grows.
    """

    def __init__(
        self,
        max_threads: int = 10_000,
        max_per_thread: int = 1_000,
        *,
        max_bytes: int = DEFAULT_THREAD_BYTES,
        max_bytes_per_owner: int = DEFAULT_THREAD_BYTES_PER_OWNER,
        finished_ttl: float = DEFAULT_FINISHED_TTL,
        clock: Callable[[], float] = time.monotonic,
        entry_overhead: int = ENTRY_OVERHEAD,
    ) -> None:
        # Entries: (timestamp, seq, envelope, owner, size); seq is unique, so tuples
        # never compare the envelopes themselves.
        self._threads: OrderedDict[str, list[tuple[int, int, Envelope, str, int]]] = OrderedDict()
        #: Finished threads: key -> when it finished (on ``clock``), oldest first.
        self._finished: OrderedDict[str, float] = OrderedDict()
        self._finished_ttl = finished_ttl
        #: When the oldest finished thread is due (or earlier): no expiry pass before it.
        self._expire_at = math.inf
        self._clock = clock
        #: What each owner has filed.
        self._owners: dict[str, _Owned] = {}
        self._max_threads = max_threads
        self._max_per_thread = max_per_thread
        self._max_bytes = max_bytes
        self._max_per_owner = max_bytes_per_owner
        self._overhead = entry_overhead
        self._seq = 0
        #: Bytes held in all.
        self.bytes = 0

    def add(self, envelope: Envelope, owner: str = "", size: int | None = None) -> None:
        """File ``envelope`` (from ``owner``) under its correlation id (envelopes without
        one are ignored). ``size`` is its :func:`envelope_size` when the caller has it;
        the entry overhead is charged beside it."""
        key = envelope.correlation_id
        if key is None:
            return
        now = self._clock()
        if now >= self._expire_at:
            self._expire(now)
        if size is None:
            size = envelope_size(envelope)
        size += self._overhead
        if size > self._max_per_owner:
            return
        seq = self._seq = self._seq + 1
        entry = (envelope.timestamp, seq, envelope, owner, size)
        threads, finished = self._threads, self._finished
        thread = threads.get(key)
        if thread is None:  # most envelopes: a reply opens and ends its thread
            thread = threads[key] = [entry]
            if len(threads) > self._max_threads:
                self._drop_thread(next(iter(threads)))
        else:
            threads.move_to_end(key)
            finished.pop(key, None)  # the thread goes on, or finishes (again) now
            if thread[-1][0] <= entry[0]:
                thread.append(entry)  # in order already: seq is the largest yet
            else:
                bisect.insort(thread, entry)
        if envelope.type in FINAL_TYPES:
            if not finished:
                self._expire_at = now + self._finished_ttl
            finished[key] = now
        held = self._owners.get(owner)
        if held is None:
            held = self._owners[owner] = _Owned()
        held.entries[seq] = key
        held.bytes += size
        self.bytes += size
        if len(thread) > self._max_per_thread:
            self._remove(key, thread[0][1])
        if held.bytes > self._max_per_owner:
            entries = held.entries
            while entries and held.bytes > self._max_per_owner:
                oldest_seq, oldest = entries.popitem(last=False)
                self._remove(oldest, oldest_seq)
        while self.bytes > self._max_bytes and threads:
            self._drop_thread(next(iter(threads)))

    def _expire(self, now: float) -> None:
        """Drop the threads that finished ``finished_ttl`` or more before ``now``."""
        finished = self._finished
        limit = now - self._finished_ttl
        # Each step drops one thread: bounded by the threads held.
        while finished:
            key, when = next(iter(finished.items()))
            if when > limit:
                self._expire_at = when + self._finished_ttl
                return
            self._drop_thread(key)  # takes it out of _finished too
        self._expire_at = math.inf

    def forget(self, owner: str) -> int:
        """Drop every envelope ``owner`` left; returns the bytes released."""
        before = self.bytes
        held = self._owners.get(owner)
        if held is not None:
            for seq, key in list(held.entries.items()):
                self._remove(key, seq)
        return before - self.bytes

    def owners(self) -> list[str]:
        """Owners with envelopes held."""
        return list(self._owners)

    def bytes_of(self, owner: str) -> int:
        """Bytes held of ``owner``'s envelopes."""
        held = self._owners.get(owner)
        return 0 if held is None else held.bytes

    def _remove(self, key: str, seq: int) -> None:
        thread = self._threads.get(key)
        if thread is None:
            return
        for index, entry in enumerate(thread):
            if entry[1] == seq:
                del thread[index]
                self._uncharge(entry[3], seq, entry[4])
                break
        if not thread:
            del self._threads[key]
            self._finished.pop(key, None)

    def _drop_thread(self, key: str) -> None:
        self._finished.pop(key, None)
        for entry in self._threads.pop(key, []):
            self._uncharge(entry[3], entry[1], entry[4])

    def _uncharge(self, owner: str, seq: int, size: int) -> None:
        self.bytes -= size
        held = self._owners.get(owner)
        if held is not None:
            held.entries.pop(seq, None)
            held.bytes -= size
            if not held.entries:
                del self._owners[owner]

    def thread(self, correlation_id: str) -> list[Envelope]:
        """Every stored envelope of ``correlation_id``, oldest first (ties in arrival order)."""
        if self._finished:
            self._expire(self._clock())
        return [entry[2] for entry in self._threads.get(correlation_id, [])]

    def __len__(self) -> int:
        return len(self._threads)


__all__ = [
    "DEFAULT_FINISHED_TTL",
    "DEFAULT_THREAD_BYTES",
    "DEFAULT_THREAD_BYTES_PER_OWNER",
    "ENTRY_OVERHEAD",
    "FINAL_TYPES",
    "ThreadStore",
]
