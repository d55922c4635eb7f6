"""One log line for many dropped datagrams (sans-IO): counters in, a summary line out.

Theory of operation: a node under a flood drops datagrams by the thousand;
one log line each buries the log (and costs more than dropping). The driver
counts every drop in its :class:`~p2pnode.dht.config.DhtStatistics` (which
``status`` shows) and asks :meth:`LogSummary.due` after each datagram and at
each timer wake-up: the first change after a quiet spell is reported at
once, later ones at most once per ``interval``, as the increase of each
watched counter since the last line. Asking costs one comparison until a
line may be due. No clock reads: ``now`` is a parameter.
"""

from __future__ import annotations

import math

from p2pnode.dht.config import DhtStatistics

#: The counters a summary reports, in its order.
WATCHED = (
    "datagrams_dropped",
    "dropped_malformed",
    "dropped_requests",
    "dropped_replies",
    "records_rejected",
    "stores_rate_limited",
    "inputs_failed",
)


class LogSummary:
    """When to log a summary of the watched counters, and its text."""

    __slots__ = ("_armed", "_last", "_next", "interval", "poll")

    def __init__(self, interval: float = 60.0, *, poll: float = 1.0) -> None:
        """``interval``: least time between two lines; ``poll``: how often a quiet node
        looks at its counters again (the first drop after quiet waits at most this)."""
        self.interval = interval
        self.poll = poll
        self._last = dict.fromkeys(WATCHED, 0)
        self._next = -math.inf
        # A line went out less than an interval ago: more may follow when it ends.
        self._armed = False

    def next_deadline(self) -> float:
        """When the driver should call :meth:`due` even if nothing arrives (inf: never)."""
        return self._next if self._armed else math.inf

    def due(self, now: float, stats: DhtStatistics) -> str | None:
        """The line to log now, or None."""
        if now < self._next:
            return None
        counts = {name: getattr(stats, name) for name in WATCHED}
        last = self._last
        changed = [f"{n}=+{counts[n] - last[n]}" for n in WATCHED if counts[n] != last[n]]
        if not changed:
            self._armed = False
            self._next = now + self.poll
            return None
        self._last = counts
        self._armed = True
        self._next = now + self.interval
        return "dht.summary " + " ".join(changed)


__all__ = ["WATCHED", "LogSummary"]
