"""The DHT node's tunables and counters (plain data, shared by the core and the driver),
and the log line that summarises the counters.

Log summary: a node under a flood drops datagrams by the thousand;
one log line each buries the log (and costs more than dropping). The driver
counts every drop in its :class:`DhtStatistics` (which
``status`` shows) and asks :meth:`LogSummary.due` after each datagram and at
each timer wake-up: the first change after a quiet spell is reported at
once, later ones at most once per ``interval``, as the increase of each
watched counter since the last line. Asking costs one comparison until a
line may be due. No clock reads: ``now`` is a parameter.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class DhtMode(enum.Enum):
    """Whether the node answers requests (docs/protocol/dht.md §5.3)."""

    #: Answers every request: it can be proven, admitted and routed through.
    SERVER = "server"
    #: Answers no request (a node others cannot reach): it is never admitted to a
    #: routing table, so no lookup routes through it; it still looks up and stores.
    CLIENT = "client"


@dataclass(frozen=True, slots=True)
class DhtConfig:
    """Tunables; defaults follow Kademlia §2.3-§4 and the stock package (dht.md §7)."""

    k: int = 20
    alpha: int = 3
    rto_initial: float = 1.0
    rto_floor: float = 0.05
    rto_ceiling: float = 2.0
    rpc_hard_timeout: float = 5.0
    refresh_interval: float = 3600.0
    republish_interval: float = 1800.0
    maintenance_interval: float = 60.0
    record_ttl_ms: int = 2 * 3600 * 1000
    value_quorum: int = 3
    replacement_size: int = 8
    card_quorum: int = 1
    max_pending: int = 1024
    #: Admission (dht.md §5.1): distinct ids one host may hold in the table (an
    #: IPv4 address, an IPv6 /64), and whether loopback hosts count (every node
    #: of a one-machine swarm shares 127.0.0.1).
    max_ids_per_host: int = 2
    limit_loopback: bool = False
    #: Checks of unproven senders: slots in all and per host, how long a check
    #: holds its slot, pings per check (an unanswered one is tried again, after
    #: the RPC hard timeout), and how long a checked address is not checked again
    #: (remembering ``check_memory`` addresses).
    max_checks: int = 32
    max_checks_per_host: int = 2
    check_slot_time: float = 1.0
    check_attempts: int = 3
    check_retry_after: float = 60.0
    check_memory: int = 4096
    #: A sender that would not be one of the k contacts nearest our id is checked
    #: only while its bucket holds fewer contacts than this (dht.md §5.1).
    check_fill: int = 4
    #: Joining again with an empty table (dht.md §5.2): the first attempt this long
    #: after the table emptied, each later one twice as long after the last, at most
    #: ``rejoin_max_delay`` (each ±25%).
    rejoin_delay: float = 2.0
    rejoin_max_delay: float = 300.0
    #: Least time between two summary lines of dropped input in the log.
    log_summary_interval: float = 60.0


@dataclass(slots=True)
class DhtStatistics:
    """Counters for benchmarks and tests."""

    rpcs_sent: int = 0
    rpcs_answered: int = 0
    rpcs_timed_out: int = 0
    requests_handled: int = 0
    datagrams_dropped: int = 0
    records_rejected: int = 0
    stores_rate_limited: int = 0
    #: Datagrams and looked-up values whose processing raised (contained, dropped).
    inputs_failed: int = 0
    #: Of ``datagrams_dropped``: not a Kademlia message; a request with bad
    #: arguments; a reply nobody waits for (unknown id, late, from another
    #: address) or one that does not parse.
    dropped_malformed: int = 0
    dropped_requests: int = 0
    dropped_replies: int = 0
    #: Admission (dht.md §5.1): contacts that entered the table; pings sent to
    #: check unproven senders, those unanswered, and checks tried again after an
    #: unanswered ping; senders not checked (a check out already, a request of
    #: ours out, too many out, checked recently, host full, bucket full, far and
    #: enough held there); proven
    #: contacts the table refused (address held by another id, host full).
    contacts_admitted: int = 0
    checks_sent: int = 0
    checks_failed: int = 0
    checks_retried: int = 0
    checks_skipped: int = 0
    admissions_refused: int = 0
    #: Attempts to join again from the bootstrap and snapshot addresses (dht.md §5.2).
    rejoins: int = 0
    #: Requests left unanswered because the node runs in client mode (dht.md §5.3).
    requests_ignored: int = 0



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


__all__ = ["WATCHED", "DhtConfig", "DhtStatistics", "LogSummary"]
