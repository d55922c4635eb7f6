"""Timers and datagrams in flight for :meth:`p2pnode.simnet.SimNetwork.drive`, kept by due time.

Theory of operation: a simulation of many thousands of nodes holds a timer or
more per node and tens of thousands of datagrams in flight. Kept in one heap
each (trio's deadline heap, a heap of datagrams) every push and pop walks
``log2`` of that many entries, scattered in memory. Here both are kept in
buckets instead:

* :class:`BucketQueue` (datagrams in flight): one first-in-first-out list per
  distinct due time and a heap of the times alone. Under a delivery tick
  thousands of datagrams share each due time, so a push is a dict look-up and
  an append, and the driver takes a whole bucket at once, in the order sent
  (as a heap of ``(due, sequence)`` would give them).
* :class:`TimerWheel` (node timers): a bucket per granule of time (a
  millisecond), and the earliest granule as a small heap, so timers still
  fire at their exact deadlines, in deadline order (equal deadlines in an
  order the operations fix). A :class:`SimTimer` is a cancel scope whose
  deadline lives in the wheel while the driver runs. Moving it sooner files
  a new entry and leaves the old one stale (dropped when its granule comes
  up, or when stale entries outnumber live timers twice, as trio prunes its
  heap); moving it later files nothing: its entry, when it comes up, is
  filed again at the deadline then set. A node's timer is pulled in by each
  call it makes and pushed out when the last is answered, so most moves are
  of the second kind, and most entries are never stale.

A due :class:`SimTimer` either calls its ``on_due(now)`` from the driver's task
(its owner's task does not wake at all) or, without ``on_due``, cancels its
scope as a trio deadline would.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from types import TracebackType
from typing import Generic, Self, TypeVar

import trio

T = TypeVar("T")


class BucketQueue(Generic[T]):
    """Items by due time; items due at one time leave in the order they came."""

    __slots__ = ("_buckets", "_times")

    def __init__(self) -> None:
        self._buckets: dict[float, list[T]] = {}
        self._times: list[float] = []  # a heap of the buckets' due times

    def __bool__(self) -> bool:
        return bool(self._times)

    def push(self, due: float, item: T) -> bool:
        """Queue ``item`` at ``due``; True if nothing was due sooner."""
        bucket = self._buckets.get(due)
        if bucket is not None:
            bucket.append(item)
            return self._times[0] == due
        self._buckets[due] = [item]
        heapq.heappush(self._times, due)
        return self._times[0] == due

    def first(self) -> float:
        """The earliest due time (infinity when empty)."""
        return self._times[0] if self._times else math.inf

    def pop_due(self, now: float) -> tuple[float, list[T]] | None:
        """The earliest bucket, if due by ``now``: its time and items, oldest first."""
        times = self._times
        if not times or times[0] > now:
            return None
        due = heapq.heappop(times)
        return due, self._buckets.pop(due)

    def clear(self) -> list[tuple[float, T]]:
        """Empty the queue: what it held, in order."""
        out: list[tuple[float, T]] = []
        while self._times:
            due = heapq.heappop(self._times)
            out.extend((due, item) for item in self._buckets.pop(due))
        return out


# One filed deadline of a timer: (deadline, sequence, timer); live while the timer's
# ``_entry`` is that sequence number.
_Entry = tuple[float, int, "SimTimer"]


class TimerWheel:
    """The deadlines of the :class:`SimTimer` objects of one driver (module docstring)."""

    __slots__ = (
        "_buckets",
        "_entries",
        "_front",
        "_front_index",
        "_granule",
        "_indices",
        "_per_granule",
        "_prune_slack",
        "_seq",
        "idle",
        "timers",
    )

    def __init__(self, granule: float = 0.001, prune_slack: int = 1000) -> None:
        """``granule``: seconds per bucket; ``prune_slack``: stale entries tolerated
        beyond twice the live timers before they are pruned. ValueError for a
        granule <= 0."""
        if granule <= 0:
            raise ValueError("granule must be > 0")
        self._granule = granule
        self._per_granule = 1.0 / granule
        self._prune_slack = prune_slack
        # Entries by granule (int(deadline / granule)), but for the earliest one held
        # (``_front_index``), whose entries form the heap ``_front``.
        self._buckets: dict[int, list[_Entry]] = {}
        self._indices: list[int] = []  # a heap of the keys of _buckets
        self._front: list[_Entry] = []
        self._front_index: float = -math.inf
        self._seq = 0
        self._entries = 0
        #: The timers filing here (a dict for a fixed order), until the driver stops.
        self.timers: dict[SimTimer, None] = {}
        #: Called when a timer is filed (the driver, waiting with nothing timed, wakes).
        self.idle: Callable[[], object] | None = None

    def file(self, timer: SimTimer, deadline: float) -> None:
        """File ``timer`` at ``deadline`` (finite, not after its own); any other
        filing of it goes stale."""
        self._seq = seq = self._seq + 1
        timer._entry = seq
        timer._filed = deadline
        self._put((deadline, seq, timer))
        self._entries += 1
        if self._entries > 2 * len(self.timers) + self._prune_slack:
            self._prune()
        if self.idle is not None:
            self.idle()

    def _put(self, entry: _Entry) -> None:
        index = int(entry[0] * self._per_granule)
        front_index = self._front_index
        if index == front_index:
            heapq.heappush(self._front, entry)
            return
        if index < front_index:
            # Sooner than the earliest granule held: it goes back among the buckets
            # (a heap is a valid bucket) and the front is chosen again when asked.
            self._buckets[int(front_index)] = self._front
            heapq.heappush(self._indices, int(front_index))
            self._front = []
            self._front_index = -math.inf
        bucket = self._buckets.get(index)
        if bucket is None:
            self._buckets[index] = [entry]
            heapq.heappush(self._indices, index)
        else:
            bucket.append(entry)

    def first(self) -> float:
        """The earliest deadline of a live timer (infinity: none)."""
        front = self._front
        while True:
            while front:
                filed, seq, timer = front[0]
                if timer._entry == seq:
                    deadline = timer._deadline
                    if deadline == filed:
                        return filed
                    # Moved later since it was filed: filed again where it is due now.
                    timer._entry = -1
                    timer._filed = math.inf
                    heapq.heappop(front)
                    self._entries -= 1
                    if deadline != math.inf:
                        self.file(timer, deadline)
                        front = self._front  # (a prune may have built a new one)
                    continue
                heapq.heappop(front)
                self._entries -= 1
            if not self._indices:
                return math.inf
            index = heapq.heappop(self._indices)
            front = self._front = self._buckets.pop(index)
            heapq.heapify(front)
            self._front_index = index

    def fire_due(self, now: float) -> None:
        """Fire, in order, every timer due by ``now`` (and any that firing makes due)."""
        while self.first() <= now:
            _, _, timer = heapq.heappop(self._front)
            self._entries -= 1
            timer._entry = -1
            timer._filed = timer._deadline = math.inf
            timer._fire(now)

    def __len__(self) -> int:
        """Entries held, live and stale (what pruning bounds)."""
        return self._entries

    def stop(self) -> None:
        """The driver stops: every timer's deadline goes to its trio scope."""
        timers, self.timers = self.timers, {}
        for timer in timers:
            timer._wheel = None
            deadline, timer._deadline, timer._entry = timer._deadline, math.inf, -1
            timer._filed = math.inf
            timer._scope.deadline = deadline
        self._buckets.clear()
        self._indices.clear()
        self._front = []
        self._front_index = -math.inf
        self._entries = 0

    def _prune(self) -> None:
        live = [
            e
            for bucket in (self._front, *self._buckets.values())
            for e in bucket
            if e[2]._entry == e[1]
        ]
        self._buckets.clear()
        self._indices.clear()
        self._front = []
        self._front_index = -math.inf
        for entry in live:
            self._put(entry)
        self._entries = len(live)


class SimTimer:
    """A cancel scope (use ``with``) whose deadline a :class:`TimerWheel` keeps while
    the driver runs, then its trio scope. When the deadline passes, ``on_due(now)``
    is called from the driver's task (the deadline is then infinite until set again);
    without ``on_due`` the scope is cancelled.

    An exception from ``on_due`` cancels the scope and is raised where it exits,
    in the task that owns it.
    """

    __slots__ = (
        "_deadline",
        "_entry",
        "_failure",
        "_filed",
        "_on_due",
        "_scope",
        "_wheel",
    )

    def __init__(
        self, wheel: TimerWheel, deadline: float, on_due: Callable[[float], None] | None
    ) -> None:
        self._scope = trio.CancelScope()
        self._wheel: TimerWheel | None = wheel
        self._on_due = on_due
        self._deadline = math.inf
        # The live entry in the wheel: its sequence number (-1: none) and its time,
        # which the deadline may have moved past since.
        self._entry = -1
        self._filed = math.inf
        self._failure: Exception | None = None
        wheel.timers[self] = None
        self.deadline = deadline

    @property
    def deadline(self) -> float:
        """When the timer is due (settable, as a cancel scope's)."""
        return self._deadline if self._wheel is not None else self._scope.deadline

    @deadline.setter
    def deadline(self, value: float) -> None:
        wheel = self._wheel
        if wheel is None:
            self._scope.deadline = value
            return
        self._deadline = value
        if value < self._filed:
            wheel.file(self, value)

    def cancel(self) -> None:
        """Cancel the scope now."""
        self._scope.cancel()

    @property
    def cancelled_caught(self) -> bool:
        """True if the scope caught its own cancellation (as a cancel scope's)."""
        return self._scope.cancelled_caught

    def _fire(self, now: float) -> None:
        on_due = self._on_due
        if on_due is None:
            self._scope.cancel()
            return
        try:
            on_due(now)
        except Exception as exc:  # the owner's failure: raised in its task, at exit
            self._failure = exc
            self._scope.cancel()

    def __enter__(self) -> Self:
        self._scope.__enter__()
        return self

    def __exit__(
        self,
        etype: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self.deadline = math.inf
        wheel = self._wheel
        if wheel is not None:
            wheel.timers.pop(self, None)
            self._entry = -1  # its entry goes stale
            self._filed = math.inf
        suppress = self._scope.__exit__(etype, exc, tb)
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        return suppress


__all__ = ["BucketQueue", "SimTimer", "TimerWheel"]
