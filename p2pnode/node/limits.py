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
  is given back: only failed attempts use the budget. Once the budget is
  spent one *probe* still passes per ``probe_interval`` (no attempt of any
  kind in the last ``probe_interval`` seconds), so a peer that comes back is
  reached within about that long of its return; in any span of T <= window
  seconds a peer thus costs at most ``per_window + T / probe_interval``
  attempts. A peer that shows it is back (an inbound channel, a HELLO, a
  fresh card) is :meth:`~DialBudget.reset`: its next attempt always passes.
* :class:`FailureSummary`: repeated failures of one kind per source, logged
  as one line per ``REPORT_INTERVAL`` with a count instead of one per failure.
* :class:`TokenBucket`: a peer's envelope rate after the handshake,
  ``rate`` per second with bursts of ``burst``.
* :class:`PeerQuota`: work held for a peer (task proposals its agents made to
  this node's agents, p2pnode.services.tasks.executor): a rate, a count and bytes per
  peer; a refusal says when to retry.
"""

from __future__ import annotations

import math
from collections import deque

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.dht.routing import host_key

__all__ = [
    "REPORT_INTERVAL",
    "DialBudget",
    "FailureSummary",
    "HandshakeSlots",
    "PeerQuota",
    "ReportGate",
    "TokenBucket",
]

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
    """At most ``per_window`` connection attempts per peer in any ``window`` seconds,
    plus one probe per ``probe_interval`` once those are spent (see the module docstring)."""

    __slots__ = ("_attempts", "max_peers", "per_window", "probe_interval", "refused", "window")

    def __init__(
        self,
        per_window: int,
        window: float = 60.0,
        *,
        probe_interval: float | None = None,
        max_peers: int = 4096,
    ) -> None:
        """``probe_interval`` None: no probes. Raises LocalError(CONFIG_ERROR) unless the
        limits are positive."""
        if per_window < 1 or not window > 0 or max_peers < 1:
            raise LocalError(ErrorCode.CONFIG_ERROR, "dial budget limits must be positive")
        if probe_interval is not None and not 0 < probe_interval <= window:
            raise LocalError(ErrorCode.CONFIG_ERROR, "dial probe interval must be in (0, window]")
        self.per_window = per_window
        self.window = window
        self.probe_interval = probe_interval
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
        if len(times) >= self.per_window and not self._probe_due(times, now):
            self.refused += 1
            return False
        times.append(now)
        return True

    def _probe_due(self, times: deque[float], now: float) -> bool:
        # Spent out, but nothing tried for a probe interval: one attempt more. It is
        # kept in the window like any other, so probes never add to the regular ones.
        interval = self.probe_interval
        return interval is not None and now - times[-1] >= interval

    def next_allowed(self, peer: bytes, now: float) -> float:
        """The earliest time (>= ``now``) at which :meth:`allow` would pass for ``peer``."""
        times = self._attempts.get(peer)
        if not times:
            return now
        live = [t for t in times if t > now - self.window]
        if len(live) < self.per_window:
            return now
        later = live[len(live) - self.per_window] + self.window  # the window frees a slot
        if self.probe_interval is not None:
            later = min(later, live[-1] + self.probe_interval)
        return max(now, later)

    def refund(self, peer: bytes) -> None:
        """Give back ``peer``'s latest attempt: it reached the peer it was meant for.

        A handshake that proves the expected peer id shows the address is the
        peer's own, so it amplifies nothing; only attempts that fail count, and
        a live peer can be reconnected to as often as its links need.
        """
        times = self._attempts.get(peer)
        if times:
            times.pop()

    def reset(self, peer: bytes) -> None:
        """Forget ``peer``'s attempts: it showed it is back, so the next attempt passes."""
        self._attempts.pop(peer, None)

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
        self.mark(source, now)
        return True

    def mark(self, source: str, now: float) -> None:
        """Note that ``source`` was reported at ``now``."""
        self._last.pop(source, None)
        if len(self._last) >= self.max_sources:
            del self._last[next(iter(self._last))]
        self._last[source] = now


class FailureSummary:
    """Failures of one kind per source, reported as one line per ``interval`` with a count.

    :meth:`note` counts a failure and says when a report is due: the first failure
    of a source at once (count 1), later ones when ``interval`` has passed since
    the last report, with how many failed since then. :meth:`hold` marks a source
    as just reported (another line said it all), so its next report comes an
    interval later. At most ``max_sources`` sources (the oldest forgotten first).
    """

    __slots__ = ("_counts", "_gate")

    def __init__(self, interval: float = REPORT_INTERVAL, *, max_sources: int = 1024) -> None:
        self._gate = ReportGate(interval, max_sources=max_sources)
        self._counts: dict[str, int] = {}

    def note(self, source: str, now: float) -> int:
        """Count one failure of ``source``; the failures to report now (0: none due)."""
        count = self._counts.pop(source, 0) + 1
        if self._gate.due(source, now):
            return count
        if len(self._counts) >= self._gate.max_sources:
            del self._counts[next(iter(self._counts))]
        self._counts[source] = count
        return 0

    def hold(self, source: str, now: float) -> int:
        """Mark ``source`` as reported at ``now``; returns the failures it had counted."""
        self._gate.mark(source, now)
        return self._counts.pop(source, 0)


# -- held work per peer (the task service's proposals) ------------------------------------------


class PeerQuota:
    """Work a node holds on behalf of peers: a rate, a count held and bytes held, per peer.

    ``admit(peer, size, now)`` takes one item of ``size`` bytes for ``peer``, or
    refuses it with the seconds after which a retry may pass: when the peer's
    token bucket (``rate`` a second, bursts of ``burst``) is empty, the time
    until it holds a token again; when the peer already holds ``max_held``
    items or ``max_bytes`` bytes (or all peers ``max_total_bytes``),
    ``busy_retry``. :meth:`release` gives an item back once the work ends. At
    most ``max_peers`` peers are tracked: peers holding nothing are forgotten
    first (their bucket starts full again), and a new peer is refused while
    every tracked peer holds work. Sans-IO: ``now`` is the caller's clock.
    """

    __slots__ = (
        "_peers",
        "burst",
        "busy_retry",
        "max_bytes",
        "max_held",
        "max_peers",
        "max_total_bytes",
        "rate",
        "refused",
        "total_bytes",
    )

    def __init__(
        self,
        rate: float,
        burst: int,
        max_held: int,
        max_bytes: int,
        *,
        max_total_bytes: int,
        max_peers: int = 4096,
        busy_retry: float = 1.0,
    ) -> None:
        """Raises LocalError(CONFIG_ERROR) unless every limit is positive."""
        if not rate > 0 or math.isinf(rate) or min(burst, max_held, max_bytes, max_peers) < 1:
            raise LocalError(ErrorCode.CONFIG_ERROR, "peer quota limits must be positive")
        if max_total_bytes < max_bytes or not busy_retry > 0:
            raise LocalError(ErrorCode.CONFIG_ERROR, "peer quota: total bytes below a peer's")
        self.rate = rate
        self.burst = burst
        self.max_held = max_held
        self.max_bytes = max_bytes
        self.max_total_bytes = max_total_bytes
        self.max_peers = max_peers
        self.busy_retry = busy_retry
        #: peer -> [tokens, at, items held, bytes held]
        self._peers: dict[str, list[float]] = {}
        #: Bytes held for all peers.
        self.total_bytes = 0
        #: Items refused since the start.
        self.refused = 0

    def admit(self, peer: str, size: int, now: float) -> float | None:
        """Take one item of ``size`` bytes for ``peer``: None when taken, else the
        seconds after which to retry (counted in :attr:`refused`)."""
        entry = self._peers.get(peer)
        if entry is None:
            if len(self._peers) >= self.max_peers and not self._forget_idle():
                self.refused += 1
                return self.busy_retry
            entry = self._peers[peer] = [float(self.burst), now, 0.0, 0.0]
        tokens = min(float(self.burst), entry[0] + max(0.0, now - entry[1]) * self.rate)
        entry[0], entry[1] = tokens, max(now, entry[1])
        if tokens < 1:
            self.refused += 1
            return (1 - tokens) / self.rate
        if (
            entry[2] >= self.max_held
            or entry[3] + size > self.max_bytes
            or self.total_bytes + size > self.max_total_bytes
        ):
            self.refused += 1
            return self.busy_retry
        entry[0] -= 1
        entry[2] += 1
        entry[3] += size
        self.total_bytes += size
        return None

    def release(self, peer: str, size: int) -> None:
        """Give back one item of ``size`` bytes that :meth:`admit` took for ``peer``."""
        entry = self._peers.get(peer)
        if entry is None:
            return
        entry[2] -= 1
        entry[3] -= size
        self.total_bytes -= size

    def held(self, peer: str) -> tuple[int, int]:
        """Items and bytes held for ``peer``."""
        entry = self._peers.get(peer)
        return (0, 0) if entry is None else (int(entry[2]), int(entry[3]))

    def __len__(self) -> int:
        """Peers tracked."""
        return len(self._peers)

    def _forget_idle(self) -> bool:
        idle = [p for p, e in self._peers.items() if e[2] <= 0]
        for peer in idle:
            del self._peers[peer]
        return bool(idle)
