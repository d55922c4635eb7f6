"""Structured events, aggregate metrics and log output (seed R12, Properties 17, 31-33).

Theory of operation:

* Everything observable is an :class:`~p2pnode.node.events.Event`: one frozen record with a
  :class:`EventKind` and the fields that kind uses (the rest are None).
  Envelope events carry the envelope id, sender, recipient, message type and
  timestamp (R12.1); routing decisions add the path, latency and outcome
  (R4.6, R12.3, Property 17); tool invocations carry the tool, the invoking
  agent, the duration and success (R12.2); audit events record cross-tier
  traffic with both tiers and the message type (R11.4, Property 31);
  security events record a refused message or card with its code and peer
  (R10.2, the error table's "emit security event").
* :meth:`Observability.emit` does four things, in order: keeps the event in a
  bounded ring of recent events, folds it into the counters, writes it
  through stdlib :mod:`logging` with the event dict in ``extra={"event":
  ...}``, and calls listeners. Levels (:func:`log_level`): WARNING for
  ``error`` and ``security``; INFO for a routing decision that did not
  deliver and a failed tool call; DEBUG for every other per-message event
  (sent, received, delivered, audit, a tool call that worked), so a daemon
  at INFO logs its lifecycle, peers, refusals and errors, not one line per
  envelope.
  Counters are exact totals since the last :meth:`reset_metrics`; only the
  latency percentiles use a bounded window of recent samples, and averages
  use running sums so they stay exact without storing every sample.
* The per-message helpers (:meth:`~Observability.message_sent`,
  :meth:`~Observability.message_received`,
  :meth:`~Observability.routing_decision`) run on every envelope. When no
  listener is registered and the event logger is below their level they keep the
  event's fields as a plain tuple in the ring and count them; the
  :class:`Event` is built only when :meth:`~Observability.recent` reads it.
  The result is the same, without three dataclass constructions per message.
* A WARNING line (an error or security event) repeating one already logged, same
  kind, code and text, within :data:`LOG_REPEAT_MS`, is not logged again: it is
  counted, and the first like it after that time says how many were left out.
  A peer that dials a restarted device's old key, once a second, is one line a
  minute, not sixty. The event itself is kept, counted and announced as always.
* A listener that raises is logged and skipped: telemetry must never break
  the message path that emits it.
* Time comes from the injected ``clock_ms``; nothing here reads a clock.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_left
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from p2pnode.core.envelope import Envelope
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.node.events import Event, EventKind, Outcome, RoutingPath

DEFAULT_RECENT_SIZE = 1000
DEFAULT_LATENCY_WINDOW = 1024
#: Upper bounds (ms) of the routing latency histogram's buckets; one more bucket counts
#: what is above the last (a Prometheus histogram's ``+Inf``).
LATENCY_BUCKETS_MS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 1000.0)
EVENT_LOGGER = "p2pnode.events"
#: Distinct tool names counted apart in ``tool_invocations_by_tool``; calls of any further
#: name are counted under OTHER_TOOLS. The names come from callers (a call of a tool that
#: does not exist is counted too), so without a bound a peer calling made-up names grew
#: the counter, and the metrics page's label set, by one entry per name.
MAX_TOOL_NAMES = 256
OTHER_TOOLS = "(other)"
#: Characters of an event's ``detail`` kept (the rest is cut, marked with "..."): a
#: reason may quote what a peer sent, and the ring keeps DEFAULT_RECENT_SIZE events.
MAX_DETAIL = 1024


@dataclass(frozen=True, slots=True)
class Metrics:
    """A snapshot of the aggregate metrics (seed R12.4, R12.5; Properties 32, 33).

    Counts are exact since the last reset. ``routing_latency_avg_ms`` and
    ``tool_duration_avg_ms`` are exact averages over every sample;
    ``routing_latency_p50_ms`` / ``_p99_ms`` are nearest-rank percentiles over
    the most recent samples (the latency window). Averages and percentiles are
    0.0 when there is no sample.
    """

    messages_sent: int = 0
    messages_received: int = 0
    sent_by_type: Mapping[str, int] = field(default_factory=dict)
    received_by_type: Mapping[str, int] = field(default_factory=dict)
    routing_decisions: int = 0
    routing_by_path: Mapping[str, int] = field(default_factory=dict)
    routing_by_outcome: Mapping[str, int] = field(default_factory=dict)
    routing_latency_avg_ms: float = 0.0
    routing_latency_p50_ms: float = 0.0
    routing_latency_p99_ms: float = 0.0
    errors: int = 0
    errors_by_code: Mapping[str, int] = field(default_factory=dict)
    security_events: int = 0
    security_by_code: Mapping[str, int] = field(default_factory=dict)
    audit_events: int = 0
    tool_invocations: int = 0
    tool_invocations_by_tool: Mapping[str, int] = field(default_factory=dict)
    tool_duration_avg_ms: float = 0.0
    tool_errors: int = 0
    #: For histograms and summaries (``p2pnode run --metrics``): routing latency samples,
    #: their sum, and how many fell in each bucket of LATENCY_BUCKETS_MS (not cumulative;
    #: the last is above the last bound); tool durations measured and their sum.
    routing_latency_count: int = 0
    routing_latency_sum_ms: float = 0.0
    routing_latency_buckets: tuple[int, ...] = ()
    tool_duration_count: int = 0
    tool_duration_sum_ms: float = 0.0

    @property
    def messages_by_type(self) -> dict[str, int]:
        """Sent plus received, by message type."""
        return dict(Counter(self.sent_by_type) + Counter(self.received_by_type))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready plain form with camelCase keys."""
        return {
            "totalMessagesSent": self.messages_sent,
            "totalMessagesReceived": self.messages_received,
            "messagesByType": self.messages_by_type,
            "sentByType": dict(self.sent_by_type),
            "receivedByType": dict(self.received_by_type),
            "routingDecisions": self.routing_decisions,
            "routingByPath": dict(self.routing_by_path),
            "routingByOutcome": dict(self.routing_by_outcome),
            "averageRoutingLatencyMs": self.routing_latency_avg_ms,
            "p50RoutingLatencyMs": self.routing_latency_p50_ms,
            "p99RoutingLatencyMs": self.routing_latency_p99_ms,
            "errorCount": self.errors,
            "errorsByCode": dict(self.errors_by_code),
            "securityEvents": self.security_events,
            "securityByCode": dict(self.security_by_code),
            "auditEvents": self.audit_events,
            "totalToolInvocations": self.tool_invocations,
            "toolInvocationsByTool": dict(self.tool_invocations_by_tool),
            "averageToolDurationMs": self.tool_duration_avg_ms,
            "toolErrorCount": self.tool_errors,
        }


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0 < q <= 100) of ``samples``; 0.0 when empty."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


Listener = Callable[[Event], None]


class _Counters:
    """The mutable tallies behind :class:`Metrics`."""

    def __init__(self, latency_window: int) -> None:
        self.sent: Counter[str] = Counter()
        self.received: Counter[str] = Counter()
        self.by_path: Counter[str] = Counter()
        self.by_outcome: Counter[str] = Counter()
        self.decisions = 0
        self.latency_sum = 0.0
        self.latency_count = 0
        self.latencies: deque[float] = deque(maxlen=latency_window)
        self.latency_buckets = [0] * (len(LATENCY_BUCKETS_MS) + 1)
        self.errors: Counter[str] = Counter()
        self.error_count = 0
        self.security: Counter[str] = Counter()
        self.security_count = 0
        self.audit = 0
        self.tools: Counter[str] = Counter()
        self.tool_duration_sum = 0.0
        self.tool_duration_count = 0
        self.tool_errors = 0

    def add(self, e: Event) -> None:
        handler = _FOLD.get(e.kind)
        if handler is not None:
            handler(self, e)

    def _message_sent(self, e: Event) -> None:
        if e.message_type is not None:
            self.sent[e.message_type] += 1

    def _message_received(self, e: Event) -> None:
        if e.message_type is not None:
            self.received[e.message_type] += 1

    def _routing(self, e: Event) -> None:
        self.routing(e.path, e.outcome, e.latency_ms)

    def routing(
        self, path: RoutingPath | None, outcome: Outcome | None, latency_ms: float | None
    ) -> None:
        self.decisions += 1
        if path is not None:
            self.by_path[path] += 1
        if outcome is not None:
            self.by_outcome[outcome] += 1
        if latency_ms is not None:
            self.latency_sum += latency_ms
            self.latency_count += 1
            self.latencies.append(latency_ms)
            self.latency_buckets[bisect_left(LATENCY_BUCKETS_MS, latency_ms)] += 1

    def _tool(self, e: Event) -> None:
        self.tool(e.tool, e.duration_ms, e.success)

    def tool(self, name: str | None, duration_ms: float | None, success: bool | None) -> None:
        key = name or "?"
        tools = self.tools
        if key not in tools and len(tools) >= MAX_TOOL_NAMES:
            key = OTHER_TOOLS
        tools[key] += 1
        if duration_ms is not None:
            self.tool_duration_sum += duration_ms
            self.tool_duration_count += 1
        if success is False:
            self.tool_errors += 1

    def _error(self, e: Event) -> None:
        self.error_count += 1
        if e.code is not None:
            self.errors[str(e.code)] += 1

    def _security(self, e: Event) -> None:
        self.security_count += 1
        if e.code is not None:
            self.security[str(e.code)] += 1

    def _audit(self, e: Event) -> None:
        self.audit += 1

    def snapshot(self) -> Metrics:
        window = list(self.latencies)
        return Metrics(
            messages_sent=sum(self.sent.values()),
            messages_received=sum(self.received.values()),
            sent_by_type=_plain(self.sent),
            received_by_type=_plain(self.received),
            routing_decisions=self.decisions,
            routing_by_path=_plain(self.by_path),
            routing_by_outcome=_plain(self.by_outcome),
            routing_latency_avg_ms=_mean(self.latency_sum, self.latency_count),
            routing_latency_p50_ms=percentile(window, 50),
            routing_latency_p99_ms=percentile(window, 99),
            errors=self.error_count,
            errors_by_code=dict(self.errors),
            security_events=self.security_count,
            security_by_code=dict(self.security),
            audit_events=self.audit,
            tool_invocations=sum(self.tools.values()),
            tool_invocations_by_tool=dict(self.tools),
            tool_duration_avg_ms=_mean(self.tool_duration_sum, self.tool_duration_count),
            tool_errors=self.tool_errors,
            routing_latency_count=self.latency_count,
            routing_latency_sum_ms=self.latency_sum,
            routing_latency_buckets=tuple(self.latency_buckets),
            tool_duration_count=self.tool_duration_count,
            tool_duration_sum_ms=self.tool_duration_sum,
        )


_FOLD: dict[EventKind, Callable[[_Counters, Event], None]] = {
    EventKind.MESSAGE_SENT: _Counters._message_sent,
    EventKind.MESSAGE_RECEIVED: _Counters._message_received,
    EventKind.ROUTING_DECISION: _Counters._routing,
    EventKind.TOOL_INVOCATION: _Counters._tool,
    EventKind.ERROR: _Counters._error,
    EventKind.SECURITY: _Counters._security,
    EventKind.AUDIT: _Counters._audit,
}


def _plain(counter: Counter[str]) -> dict[str, int]:
    # Hot-path counters are keyed by StrEnum members; snapshots hold plain text.
    return {str(key): count for key, count in counter.items()}


def _mean(total: float, count: int) -> float:
    return total / count if count else 0.0


_WARNING_KINDS = frozenset({EventKind.ERROR, EventKind.SECURITY})


def log_level(event: Event) -> int:
    """The level ``event`` is logged at (see the module docstring)."""
    if event.kind in _WARNING_KINDS:
        return logging.WARNING
    if event.kind is EventKind.ROUTING_DECISION:
        return _routing_level(event.outcome)
    if event.kind is EventKind.TOOL_INVOCATION and event.success is False:
        return logging.INFO
    return logging.DEBUG


def _routing_level(outcome: Outcome | None) -> int:
    # A refusal or a failure is news to an operator; a delivery is one of thousands.
    return logging.DEBUG if outcome in (Outcome.DELIVERED, None) else logging.INFO


#: A WARNING log line like one logged less than this long ago is counted, not logged.
LOG_REPEAT_MS = 60_000
#: Distinct WARNING lines remembered for that (the oldest is forgotten first).
LOG_REPEAT_LINES = 256


class LogRepeats:
    """Which WARNING lines to log: the first of a kind, code and text, then the first
    one :data:`LOG_REPEAT_MS` or more after it (with the count left out between)."""

    def __init__(self) -> None:
        #: key -> (when it was last logged, how many like it were left out since).
        self._lines: dict[tuple[Any, ...], tuple[int, int]] = {}

    def admit(self, key: tuple[Any, ...], now_ms: int) -> int | None:
        """None: leave this line out; else log it, saying how many were left out."""
        seen = self._lines.pop(key, None)
        if seen is not None and now_ms - seen[0] < LOG_REPEAT_MS:
            self._lines[key] = (seen[0], seen[1] + 1)
            return None
        if len(self._lines) >= LOG_REPEAT_LINES:
            del self._lines[next(iter(self._lines))]
        self._lines[key] = (now_ms, 0)
        return 0 if seen is None else seen[1]


class Observability:
    """A node's event sink: recent events, metrics, logging and listeners.

    ``clock_ms`` stamps events; ``recent_size`` bounds the ring of recent
    events; ``latency_window`` bounds the samples behind the percentiles.
    Raises LocalError(INVALID_ARGUMENT) for a size below 1.
    """

    #: The routing latency histogram's upper bucket bounds (ms; the last bucket of
    #: ``Metrics.routing_latency_buckets`` is above them), for exporters.
    latency_bounds_ms: tuple[float, ...] = LATENCY_BUCKETS_MS

    def __init__(
        self,
        clock_ms: Callable[[], int],
        recent_size: int = DEFAULT_RECENT_SIZE,
        logger: logging.Logger | None = None,
        latency_window: int = DEFAULT_LATENCY_WINDOW,
    ) -> None:
        if recent_size < 1 or latency_window < 1:
            raise LocalError(
                ErrorCode.INVALID_ARGUMENT, "recent_size and latency_window must be at least 1"
            )
        self._clock_ms = clock_ms
        self._logger = logger if logger is not None else logging.getLogger(EVENT_LOGGER)
        # An Event, or the positional fields of one not built yet (see the module docstring).
        self._recent: deque[Event | tuple[Any, ...]] = deque(maxlen=recent_size)
        self._latency_window = latency_window
        self._counters = _Counters(latency_window)
        self._listeners: list[Listener] = []
        self._repeats = LogRepeats()

    # -- core -------------------------------------------------------------------------------

    def now_ms(self) -> int:
        """The injected clock, for callers building their own events."""
        return self._clock_ms()

    def emit(self, event: Event) -> Event:
        """Record, count, log and announce ``event`` (its detail cut to MAX_DETAIL
        characters); returns what was recorded."""
        if len(event.detail) > MAX_DETAIL:
            event = replace(event, detail=short_detail(event.detail))
        self._recent.append(event)
        self._counters.add(event)
        level = log_level(event)
        if self._logger.isEnabledFor(level):
            self._log(level, event)
        for listener in tuple(self._listeners):
            try:
                listener(event)
            except Exception:
                # A broken listener must not break the message path that emitted.
                self._logger.exception("event listener %r failed", listener)
        return event

    def _log(self, level: int, event: Event) -> None:
        text = event.summary()
        if level >= logging.WARNING:
            left_out = self._repeats.admit((event.kind, event.code, event.detail), event.at_ms)
            if left_out is None:
                return
            if left_out:
                text += f" ({left_out} more like it in the last {LOG_REPEAT_MS // 1000} s)"
        self._logger.log(level, text, extra={"event": event.to_dict()})

    def recent(self, limit: int | None = None, kind: EventKind | None = None) -> list[Event]:
        """Recent events, oldest first: the last ``limit`` (all when None) of ``kind``
        (any when None)."""
        events = [item if isinstance(item, Event) else _built(item) for item in self._recent]
        if kind is not None:
            events = [e for e in events if e.kind == kind]
        if limit is not None:
            events = events[-limit:] if limit > 0 else []
        return events

    def metrics(self) -> Metrics:
        """A snapshot of the aggregate metrics."""
        return self._counters.snapshot()

    def reset_metrics(self) -> None:
        """Zero every counter (recent events are kept)."""
        self._counters = _Counters(self._latency_window)

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener(event)`` after every emitted event."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        """Stop calling ``listener``. Raises LocalError(INVALID_ARGUMENT) if not added."""
        try:
            self._listeners.remove(listener)
        except ValueError:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "listener was not added") from None

    # -- helpers ----------------------------------------------------------------------------

    def message_sent(
        self, envelope: Envelope, path: RoutingPath | None = None, peer: str | None = None
    ) -> None:
        """An envelope left this node (R12.1)."""
        self._message_event(EventKind.MESSAGE_SENT, envelope, path, peer, self._counters.sent)

    def message_received(
        self, envelope: Envelope, peer: str | None = None, path: RoutingPath | None = None
    ) -> None:
        """An envelope arrived and passed checks (R12.1)."""
        self._message_event(
            EventKind.MESSAGE_RECEIVED, envelope, path, peer, self._counters.received
        )

    def routing_decision(
        self,
        envelope: Envelope,
        path: RoutingPath,
        outcome: Outcome,
        latency_ms: float,
        *,
        target: str | None = None,
        code: ErrorCode | None = None,
        peer: str | None = None,
        detail: str = "",
    ) -> None:
        """A routing decision (R4.6, R12.3, Property 17). ``target`` is the resolved
        agent when it differs from the envelope's recipient (capability routing)."""
        fields = (
            EventKind.ROUTING_DECISION,
            self._clock_ms(),
            envelope.id,
            envelope.sender,
            target if target is not None else envelope.recipient,
            envelope.type,
            path,
            latency_ms,
            outcome,
            code,
            peer,
        )
        if detail or not self._is_quiet(
            logging.DEBUG if outcome is Outcome.DELIVERED else _routing_level(outcome)
        ):
            self.emit(Event(*fields, detail=detail))
        else:
            self._recent.append(fields)
            self._counters.routing(path, outcome, latency_ms)

    def sent_and_delivered(
        self, envelope: Envelope, path: RoutingPath, peer: str, latency_ms: float, target: str
    ) -> None:
        """:meth:`message_sent` then a DELIVERED :meth:`routing_decision` to ``target``:
        what every routed envelope leaves, in one call (both are stored alike when quiet)."""
        if not self._is_quiet():
            self.message_sent(envelope, path, peer)
            self.routing_decision(envelope, path, Outcome.DELIVERED, latency_ms, target=target)
            return
        now, id, sender, type = self._clock_ms(), envelope.id, envelope.sender, envelope.type
        recent = self._recent
        recent.append(
            (EventKind.MESSAGE_SENT, now, id, sender, envelope.recipient, type, path,
             None, None, None, peer)
        )  # fmt: skip
        recent.append(
            (EventKind.ROUTING_DECISION, now, id, sender, target, type, path,
             latency_ms, Outcome.DELIVERED, None, None)
        )  # fmt: skip
        counters = self._counters
        counters.sent[type] += 1
        counters.routing(path, Outcome.DELIVERED, latency_ms)

    def _is_quiet(self, level: int = logging.DEBUG) -> bool:
        """True when nothing reads events of ``level`` as they happen (no listener, and
        the logger is above that level)."""
        return not self._listeners and not self._logger.isEnabledFor(level)

    def _message_event(
        self,
        kind: EventKind,
        env: Envelope,
        path: RoutingPath | None,
        peer: str | None,
        counter: Counter[str],
    ) -> None:
        fields = (
            kind, self._clock_ms(), env.id, env.sender, env.recipient, env.type, path,
            None, None, None, peer,
        )  # fmt: skip
        if self._is_quiet():
            self._recent.append(fields)
            counter[env.type] += 1
        else:
            self.emit(Event(*fields))

    def security(
        self,
        code: ErrorCode,
        reason: str,
        peer: str | None = None,
        envelope: Envelope | None = None,
        *,
        source_tier: int | None = None,
        target_tier: int | None = None,
    ) -> Event:
        """A refused message or card, a forged identity, a sandbox or tier breach (R10.2)."""
        return self.emit(
            _with_envelope(
                Event(
                    EventKind.SECURITY,
                    self.now_ms(),
                    code=code,
                    peer=peer,
                    source_tier=source_tier,
                    target_tier=target_tier,
                    detail=reason,
                ),
                envelope,
            )
        )

    def audit_cross_tier(
        self,
        envelope: Envelope,
        source_tier: int,
        target_tier: int,
        *,
        target: str | None = None,
        peer: str | None = None,
        outcome: Outcome | None = None,
    ) -> Event:
        """Audit record of a message between different tiers (R11.4, Property 31)."""
        return self.emit(
            Event(
                EventKind.AUDIT,
                self.now_ms(),
                envelope_id=envelope.id,
                sender=envelope.sender,
                recipient=target if target is not None else envelope.recipient,
                message_type=envelope.type,
                outcome=outcome,
                peer=peer,
                source_tier=source_tier,
                target_tier=target_tier,
            )
        )

    def error(
        self,
        code: ErrorCode,
        detail: str,
        peer: str | None = None,
        envelope: Envelope | None = None,
    ) -> Event:
        """A failure that is not a security matter (delivery failed, bad CRDT update...)."""
        return self.emit(
            _with_envelope(
                Event(EventKind.ERROR, self.now_ms(), code=code, peer=peer, detail=detail),
                envelope,
            )
        )

    def tool_invocation(
        self,
        tool: str,
        agent: str | None,
        duration_ms: float,
        success: bool,
        *,
        code: ErrorCode | None = None,
        detail: str = "",
        owner: str | None = None,
        arguments_digest: str | Callable[[], str] | None = None,
    ) -> int:
        """An MCP tool call by ``agent`` of ``owner``'s ``tool`` finished: the audit record
        of one invocation, allowed or refused (R12.2, Property 33). ``arguments_digest``
        may be a function that computes it: called only once the event is read. Returns
        the event's timestamp (ms), so the caller's own record needs no clock read."""
        now = self._clock_ms()
        if len(detail) > MAX_DETAIL:
            detail = short_detail(detail)
        fields = (
            EventKind.TOOL_INVOCATION, now, None, agent, owner, None, None, None,
            None, code, None, None, None, tool, duration_ms, success, arguments_digest, detail,
        )  # fmt: skip
        if self._is_quiet(logging.DEBUG if success else logging.INFO):
            self._recent.append(fields)
            self._counters.tool(tool, duration_ms, success)
        else:
            self.emit(_built(fields))
        return now


def short_detail(detail: str) -> str:
    """``detail`` cut to MAX_DETAIL characters, the cut marked."""
    return detail if len(detail) <= MAX_DETAIL else detail[: MAX_DETAIL - 3] + "..."


def _built(fields: tuple[Any, ...]) -> Event:
    """The event a stored tuple of fields stands for (a tool invocation's digest is
    computed now when it was left to compute: most are never read)."""
    if fields[0] is EventKind.TOOL_INVOCATION and callable(fields[16]):
        fields = (*fields[:16], fields[16](), *fields[17:])
    return Event(*fields)


def _with_envelope(event: Event, envelope: Envelope | None) -> Event:
    if envelope is None:
        return event
    return replace(
        event,
        envelope_id=envelope.id,
        sender=envelope.sender,
        recipient=envelope.recipient,
        message_type=envelope.type,
    )


__all__ = [
    "DEFAULT_LATENCY_WINDOW",
    "DEFAULT_RECENT_SIZE",
    "EVENT_LOGGER",
    "LATENCY_BUCKETS_MS",
    "MAX_DETAIL",
    "MAX_TOOL_NAMES",
    "OTHER_TOOLS",
    "Event",
    "EventKind",
    "Listener",
    "Metrics",
    "Observability",
    "Outcome",
    "RoutingPath",
    "log_level",
    "percentile",
    "short_detail",
]
