"""Joining again once every contact is gone (sans-IO; docs/protocol/dht.md §5.2).

Theory of operation: Kademlia learns contacts from traffic (paper §2.2), and
a contact leaves the table only when requests to it fail. A node whose every
contact failed (its network was down, or the whole swarm restarted) has an
empty table, and nobody it knows of to ask: unless someone happens to send it
a request, it never joins again. :class:`Rejoin` remembers where the node
joined from, the addresses given to ``bootstrap`` (the configured bootstrap
peers, and any peer joined through later) and those of a restored snapshot,
at most ``max_seeds`` of them, and while the table is empty it has them
tried again:

* the driver reports the table's size after anything that may have emptied
  it (:meth:`Rejoin.observe`; contacts leave only when calls time out, which
  the driver handles on its timer);
* the first attempt is due ``first_delay`` after the table emptied, each
  later one twice as long after the previous one ended, at most
  ``max_delay``, every delay jittered by ±25% so that nodes that lost their
  contacts together do not retry in step (state table ``_TRANSITIONS``);
* an attempt (the driver's) pings every seed and looks up the node's own id
  through those that answer; once the table holds a contact again the
  delays start over, and :meth:`Rejoin.observe` / :meth:`Rejoin.finished`
  say so (True), for the driver to republish what it put while alone.

The same schedule paces a node that joined no bootstrap peer at all
(:class:`p2pnode.node.joining.Joining`). No clock reads: every method that
needs the time takes ``now``.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Iterable

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.dht.rpc import Address

#: Addresses kept to join again from, bootstrap addresses first.
MAX_SEEDS = 32


class RejoinState(enum.Enum):
    """What the rejoin schedule waits for."""

    JOINED = "joined"  # for the table to empty (it holds contacts, or nothing to join from)
    WAITING = "waiting"  # for the next attempt to be due (the table is empty)
    RUNNING = "running"  # for the attempt in progress to end


_TRANSITIONS: dict[RejoinState, frozenset[RejoinState]] = {
    RejoinState.JOINED: frozenset({RejoinState.WAITING}),
    RejoinState.WAITING: frozenset({RejoinState.JOINED, RejoinState.RUNNING}),
    RejoinState.RUNNING: frozenset({RejoinState.JOINED, RejoinState.WAITING}),
}


class Rejoin:
    """When a node with an empty routing table tries its seeds again."""

    __slots__ = (
        "_bootstrap",
        "_delay",
        "_next",
        "_rng",
        "_snapshot",
        "_state",
        "first_delay",
        "max_delay",
        "max_seeds",
    )

    def __init__(
        self,
        rng: random.Random,
        *,
        first_delay: float = 2.0,
        max_delay: float = 300.0,
        max_seeds: int = MAX_SEEDS,
    ) -> None:
        """Raises LocalError(INVALID_ARGUMENT) for a delay not above 0, a ``max_delay``
        below ``first_delay`` or ``max_seeds`` below 1."""
        if first_delay <= 0 or max_delay < first_delay or max_seeds < 1:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "rejoin delays and seeds must be > 0")
        self.first_delay = first_delay
        self.max_delay = max_delay
        self.max_seeds = max_seeds
        self._rng = rng
        self._bootstrap: list[Address] = []
        self._snapshot: list[Address] = []
        self._delay = first_delay
        self._next = float("inf")
        self._state = RejoinState.JOINED

    @property
    def state(self) -> RejoinState:
        return self._state

    @property
    def seeds(self) -> list[Address]:
        """Where an attempt starts: bootstrap addresses first, then the snapshot's."""
        seen: dict[Address, None] = dict.fromkeys(self._bootstrap)
        for address in self._snapshot:
            if len(seen) >= self.max_seeds:
                break
            seen.setdefault(address, None)
        return list(seen)[: self.max_seeds]

    def remember_bootstrap(self, addresses: Iterable[Address]) -> None:
        """``addresses`` were given to ``bootstrap``: they join the earlier ones (a node
        bootstrapped through one more peer, as ``Kernel.connect`` does, still knows the
        configured ones), the newest kept when there are more than ``max_seeds``."""
        fresh = list(dict.fromkeys(addresses))
        kept = [a for a in self._bootstrap if a not in fresh]
        self._bootstrap = [*kept, *fresh][-self.max_seeds :]

    def remember_snapshot(self, addresses: Iterable[Address]) -> None:
        """A snapshot was restored with contacts at ``addresses``."""
        self._snapshot = list(dict.fromkeys(addresses))[: self.max_seeds]

    def observe(self, contacts: int, now: float) -> bool:
        """The table holds ``contacts`` at ``now``: an empty one (with seeds to try)
        schedules an attempt, a filled one ends the waiting and resets the delays.
        True when the table holds contacts again after it was empty (the driver then
        republishes what it put meanwhile: that reached nobody)."""
        if contacts:
            self._delay = self.first_delay
            if self._state is RejoinState.WAITING:
                self._next = float("inf")
                self._move(RejoinState.JOINED)
                return True
        elif self._state is RejoinState.JOINED and (self._bootstrap or self._snapshot):
            self._next = now + self._jittered(self._delay)
            self._move(RejoinState.WAITING)
        return False

    def next_deadline(self) -> float:
        """When :meth:`handle_timer` has work (infinity unless WAITING)."""
        return self._next

    def handle_timer(self, now: float) -> bool:
        """True if an attempt should start now (the state is then RUNNING until
        :meth:`finished`)."""
        if self._state is not RejoinState.WAITING or now < self._next:
            return False
        self._next = float("inf")
        self._move(RejoinState.RUNNING)
        return True

    def finished(self, contacts: int, now: float) -> bool:
        """The attempt ended at ``now`` with ``contacts`` in the table; without any,
        the next one is due after twice the delay (at most ``max_delay``). True when
        it joined (as :meth:`observe`). Raises LocalError(ILLEGAL_TRANSITION) when no
        attempt runs."""
        if self._state is not RejoinState.RUNNING:
            raise LocalError(ErrorCode.ILLEGAL_TRANSITION, f"rejoin {self._state}: nothing runs")
        if contacts:
            self._delay = self.first_delay
            self._move(RejoinState.JOINED)
            return True
        self._delay = min(self._delay * 2, self.max_delay)
        self._next = now + self._jittered(self._delay)
        self._move(RejoinState.WAITING)
        return False

    def _jittered(self, delay: float) -> float:
        return delay * (0.75 + 0.5 * self._rng.random())

    def _move(self, new: RejoinState) -> None:
        if new not in _TRANSITIONS[self._state]:
            raise LocalError(ErrorCode.ILLEGAL_TRANSITION, f"rejoin {self._state} -> {new}")
        self._state = new


__all__ = ["MAX_SEEDS", "Rejoin", "RejoinState"]
