"""Periodic upkeep of a DHT node: expire records, refresh stale buckets, republish.

Theory of operation (Kademlia §2.3 and §2.5; docs/protocol/dht.md §5 and §7):

* :class:`MaintenanceSchedule` is the sans-IO timer: the first pass comes at a
  random point between half and one and a half ``maintenance_interval`` after
  start (so a thousand nodes started together do not refresh in step), later
  ones every interval. A pass still running when the next one is due is not
  doubled: the due pass is skipped (state table ``_TRANSITIONS``).
* :func:`maintenance_pass` is one pass: drop expired records, look up a
  random id in the range of every bucket no lookup touched for
  ``refresh_interval`` (§2.3), then let the publisher republish the owner's
  records when ``republish_interval`` has passed. Most passes find no stale
  bucket and no republish due: :func:`quiet_pass` tells so after expiring
  records, and the driver then starts no task for the pass.

The driver (:class:`p2pnode.dht.peer.DhtPeer`) asks :meth:`MaintenanceSchedule.next_deadline`
when to wake and runs each pass in a short-lived task of its own nursery.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Awaitable, Callable

import trio

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.dht.publish import Publisher
from p2pnode.dht.records import RecordStore
from p2pnode.dht.routing import RoutingTable, random_id_in_range


class MaintenanceState(enum.Enum):
    """What the schedule waits for."""

    WAITING = "waiting"  # for the next pass to be due
    RUNNING = "running"  # for the pass in progress to finish


_TRANSITIONS: dict[MaintenanceState, frozenset[MaintenanceState]] = {
    MaintenanceState.WAITING: frozenset({MaintenanceState.RUNNING}),
    MaintenanceState.RUNNING: frozenset({MaintenanceState.WAITING}),
}


class MaintenanceSchedule:
    """When maintenance passes run (sans-IO: every method that needs the time takes it)."""

    __slots__ = ("_interval", "_next", "_rng", "_state")

    def __init__(self, interval: float, rng: random.Random) -> None:
        """Raises LocalError(INVALID_ARGUMENT) for a non-positive interval."""
        if interval <= 0:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "maintenance interval must be > 0")
        self._interval = interval
        self._rng = rng
        self._next = float("inf")
        self._state = MaintenanceState.WAITING

    @property
    def state(self) -> MaintenanceState:
        return self._state

    def start(self, now: float) -> None:
        """The node started at ``now``: schedule the first pass, jittered."""
        self._next = now + self._interval * (0.5 + self._rng.random())

    def next_deadline(self) -> float:
        """When :meth:`handle_timer` has work (infinity before :meth:`start`)."""
        return self._next

    def handle_timer(self, now: float) -> bool:
        """True if a pass should start now (the state is then RUNNING until :meth:`finished`)."""
        if now < self._next:
            return False
        self._next = now + self._interval
        if self._state is MaintenanceState.RUNNING:
            return False
        self._move(MaintenanceState.RUNNING)
        return True

    def finished(self) -> None:
        """The pass started by :meth:`handle_timer` ended (normally or not)."""
        self._move(MaintenanceState.WAITING)

    def _move(self, new: MaintenanceState) -> None:
        if new not in _TRANSITIONS[self._state]:
            raise LocalError(ErrorCode.ILLEGAL_TRANSITION, f"maintenance {self._state} -> {new}")
        self._state = new


def mark_fresh(table: RoutingTable, now: float) -> None:
    """Every bucket counts as refreshed at ``now`` (the table was built before the clock ran)."""
    for lo, _ in table.stale_buckets(now, 0.0):
        table.touch_range(lo.to_bytes(20, "big"), now)


def quiet_pass(
    *,
    table: RoutingTable,
    records: RecordStore,
    publisher: Publisher,
    now: float,
    now_ms: int,
    refresh_interval: float,
) -> bool:
    """The part of a pass at ``now`` that needs no I/O: drop expired records. True when
    that is the whole pass (no bucket is stale, no republish is due), so the driver
    need not start a task for it; else :func:`maintenance_pass` is still to run."""
    records.expire(now_ms)
    if len(table) and table.stale_buckets(now, refresh_interval):
        return False
    return not publisher.republish_due(now)


async def maintenance_pass(
    *,
    table: RoutingTable,
    records: RecordStore,
    publisher: Publisher,
    find_node: Callable[[bytes], Awaitable[object]],
    rng: random.Random,
    now: float,
    now_ms: int,
    refresh_interval: float,
) -> None:
    """One pass at ``now`` (``now_ms`` on the wall clock): expire, refresh, republish."""
    records.expire(now_ms)
    if len(table):
        stale = table.stale_buckets(now, refresh_interval)
        async with trio.open_nursery() as nursery:
            for lo, hi in stale:
                nursery.start_soon(find_node, random_id_in_range(lo, hi, rng))
    await publisher.republish_if_due(now)


__all__ = [
    "MaintenanceSchedule",
    "MaintenanceState",
    "maintenance_pass",
    "mark_fresh",
    "quiet_pass",
]
