"""Resource limits against peers that flood a node (sans-IO: time is a parameter).

Theory of operation. Each limit is a small counter that the trio layer
(node/links.py, node/channels.py) asks before it spends memory, a task or a
connection on someone it does not yet trust, or on a peer that sends faster
than anyone honest does. Nothing here blocks: a refusal is a False, the
caller drops the input and counts it, and reports it at most once per
``REPORT_INTERVAL`` per source (:class:`ReportGate`), so a flood costs one
log line a minute, not one per input.

* :class:`HandshakeSlots`: connections not yet through the Noise handshake,
  at most ``total`` at once and ``per_host`` per source host (an IPv4
  address or an IPv6 /64; loopback uncounted unless ``limit_loopback``, as
  the DHT's admission does, dht.md §5.1). When full the newest connection is
  refused: it is closed at once, before any byte of it is read. Older
  pending handshakes keep their slot until they finish or hit the handshake
  timeout (10 s), so a flood delays honest newcomers by at most that long
  and never costs more than ``total`` connections' worth of memory.
* :class:`DialBudget`: outgoing connection attempts per peer, at most
  ``per_window`` per ``window`` seconds, so the addresses a peer announces
  (its HELLO, its card) cannot turn this node into an amplifier that
  connects to them over and over. An attempt that reaches the expected peer
  is given back: only failed attempts use the budget.
* :class:`TokenBucket`: a peer's envelope rate after the handshake,
  ``rate`` per second with bursts of ``burst``.
"""

from __future__ import annotations

import math
from collections import deque

from p2pnode.dht.routing import host_key
from p2pnode.errors import ErrorCode, LocalError

__all__ = ["REPORT_INTERVAL", "DialBudget", "HandshakeSlots", "ReportGate", "TokenBucket"]

#: Seconds between two reports of the same kind of refusal from the same source.
REPORT_INTERVAL = 60.0


class HandshakeSlots:
    """Slots for unauthenticated connections: ``total`` in all, ``per_host`` per host."""

    __slots__ = ("_by_host", "_limit_loopback", "in_use", "per_host", "refused", "total")

    def __init__(self, total: int, per_host: int, *, limit_loopback: bool = False) -> None:
        """Raises LocalError(CONFIG_ERROR) unless both limits are positive."""
        if total < 1 or per_host < 1:
            raise LocalError(ErrorCode.CONFIG_ERROR, "handshake limits must be positive")
        self.total = total
        self.per_host = per_host
        self._limit_loopback = limit_loopback
        self._by_host: dict[str, int] = {}
        #: Slots held now.
        self.in_use = 0
        #: Connections refused since the start.
        self.refused = 0

    def key(self, host: str | None) -> str | None:
        """The group ``host`` is counted in (None: not counted per host)."""
        if host is None:
            return None
        return host_key(host, limit_loopback=self._limit_loopback)

    def acquire(self, host: str | None) -> bool:
        """Take a slot for a connection from ``host``; False (and counted) when full."""
        key = self.key(host)
        if self.in_use >= self.total or (
            key is not None and self._by_host.get(key, 0) >= self.per_host
        ):
            self.refused += 1
            return False
        self.in_use += 1
        if key is not None:
            self._by_host[key] = self._by_host.get(key, 0) + 1
        return True

    def release(self, host: str | None) -> None:
        """Give back the slot :meth:`acquire` granted for ``host``."""
        self.in_use -= 1
        key = self.key(host)
        if key is not None:
            left = self._by_host[key] - 1
            if left:
                self._by_host[key] = left
            else:
                del self._by_host[key]


class DialBudget:
    """At most ``per_window`` connection attempts per peer in any ``window`` seconds."""

    __slots__ = ("_attempts", "max_peers", "per_window", "refused", "window")

    def __init__(self, per_window: int, window: float = 60.0, *, max_peers: int = 4096) -> None:
        """Raises LocalError(CONFIG_ERROR) unless the limits are positive."""
        if per_window < 1 or window <= 0 or max_peers < 1:
            raise LocalError(ErrorCode.CONFIG_ERROR, "dial budget limits must be positive")
        self.per_window = per_window
        self.window = window
        self.max_peers = max_peers
        self._attempts: dict[bytes, deque[float]] = {}
        #: Attempts refused since the start.
        self.refused = 0

    def allow(self, peer: bytes, now: float) -> bool:
        """Spend one attempt on ``peer`` at ``now``; False (and counted) when spent out."""
        times = self._attempts.get(peer)
        if times is None:
            if len(self._attempts) >= self.max_peers:
                self._forget(now)
            times = self._attempts[peer] = deque()
        while times and times[0] <= now - self.window:
            times.popleft()
        if len(times) >= self.per_window:
            self.refused += 1
            return False
        times.append(now)
        return True

    def refund(self, peer: bytes) -> None:
        """Give back ``peer``'s latest attempt: it reached the peer it was meant for.

        A handshake that proves the expected peer id shows the address is the
        peer's own, so it amplifies nothing; only attempts that fail count, and
        a live peer can be reconnected to as often as its links need.
        """
        times = self._attempts.get(peer)
        if times:
            times.pop()

    def _forget(self, now: float) -> None:
        # Peers whose attempts are all older than the window hold no budget.
        for peer in [p for p, t in self._attempts.items() if not t or t[-1] <= now - self.window]:
            del self._attempts[peer]
        if len(self._attempts) >= self.max_peers:  # still full: forget the oldest entry
            del self._attempts[next(iter(self._attempts))]


class TokenBucket:
    """``rate`` tokens a second, at most ``burst`` saved up (starts full)."""

    __slots__ = ("_at", "_tokens", "burst", "rate")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        """Raises LocalError(CONFIG_ERROR) unless rate and burst are positive."""
        if not rate > 0 or not burst >= 1 or math.isinf(rate):
            raise LocalError(ErrorCode.CONFIG_ERROR, "a rate limit needs rate > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._at = now

    def take(self, count: float, now: float) -> bool:
        """Spend ``count`` tokens; False (spending none) when there are not enough."""
        if now > self._at:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
            self._at = now
        if count > self._tokens:
            return False
        self._tokens -= count
        return True


class ReportGate:
    """Whether a refusal from a source is reported now: once per ``interval`` per source.

    Holds at most ``max_sources`` sources (the oldest are forgotten first).
    """

    __slots__ = ("_last", "interval", "max_sources")

    def __init__(self, interval: float = REPORT_INTERVAL, *, max_sources: int = 1024) -> None:
        self.interval = interval
        self.max_sources = max_sources
        self._last: dict[str, float] = {}

    def due(self, source: str, now: float) -> bool:
        """True when ``source`` was not reported within the interval (and notes ``now``)."""
        last = self._last.get(source)
        if last is not None and now - last < self.interval:
            return False
        self._last.pop(source, None)
        if len(self._last) >= self.max_sources:
            del self._last[next(iter(self._last))]
        self._last[source] = now
        return True
