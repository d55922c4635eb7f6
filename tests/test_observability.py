"""Events, metrics (Properties 17, 31-33), the recent-event ring, listeners and log output."""

from __future__ import annotations

import io
import json
import logging
import math
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.node.logs import JsonLinesFormatter, configure_logging
from p2pnode.node.observability import (
    LOG_REPEAT_LINES,
    LOG_REPEAT_MS,
    Event,
    EventKind,
    LogRepeats,
    Observability,
    Outcome,
    RoutingPath,
    percentile,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1_000

    def __call__(self) -> int:
        self.now += 1
        return self.now


def envelope(type: MessageType = MessageType.REQUEST, n: int = 1) -> Envelope:
    return Envelope(f"env-{n}", "venus", "mars", type, 1_700_000_000_000)


def quiet_logger() -> logging.Logger:
    logger = logging.getLogger("tests.observability.quiet")
    logger.propagate = False
    logger.setLevel(logging.CRITICAL + 1)
    return logger


# -- metrics equal independently derived counts (Properties 32, 33) ----------------------------

TOOLS = ["search", "summarize", "fetch"]
CODES = [ErrorCode.DELIVERY_FAILED, ErrorCode.TIER_VIOLATION, ErrorCode.SANDBOX_VIOLATION]

actions = st.one_of(
    st.tuples(st.just("sent"), st.sampled_from(list(MessageType))),
    st.tuples(st.just("received"), st.sampled_from(list(MessageType))),
    st.tuples(
        st.just("route"),
        st.sampled_from(list(RoutingPath)),
        st.sampled_from(list(Outcome)),
        st.integers(0, 10_000).map(lambda ms: ms / 10),
    ),
    st.tuples(st.just("tool"), st.sampled_from(TOOLS), st.integers(0, 5_000), st.booleans()),
    st.tuples(st.just("error"), st.sampled_from(CODES)),
    st.tuples(st.just("security"), st.sampled_from(CODES)),
    st.tuples(st.just("audit"), st.integers(0, 3), st.integers(0, 3)),
)

WINDOW = 8


def replay(obs: Observability, seq: list[tuple[Any, ...]]) -> None:
    for i, action in enumerate(seq):
        match action:
            case ("sent", mtype):
                obs.message_sent(envelope(mtype, i), RoutingPath.REMOTE, "peer")
            case ("received", mtype):
                obs.message_received(envelope(mtype, i), "peer")
            case ("route", path, outcome, latency):
                obs.routing_decision(envelope(n=i), path, outcome, latency)
            case ("tool", tool, duration, ok):
                obs.tool_invocation(tool, "venus", duration, ok)
            case ("error", code):
                obs.error(code, "failed")
            case ("security", code):
                obs.security(code, "refused", "peer", envelope(n=i))
            case ("audit", s, t):
                obs.audit_cross_tier(envelope(n=i), s, t)


@settings(max_examples=200)
@given(st.lists(actions, max_size=60))
def test_metrics_match_the_event_sequence(seq: list[tuple[Any, ...]]) -> None:
    obs = Observability(Clock(), recent_size=10_000, logger=quiet_logger(), latency_window=WINDOW)
    replay(obs, seq)
    m = obs.metrics()
    sent = [a[1] for a in seq if a[0] == "sent"]
    received = [a[1] for a in seq if a[0] == "received"]
    routes = [a for a in seq if a[0] == "route"]
    tools = [a for a in seq if a[0] == "tool"]
    assert m.messages_sent == len(sent)
    assert m.messages_received == len(received)
    for mtype in MessageType:
        assert m.sent_by_type.get(mtype, 0) == sent.count(mtype)
        assert m.received_by_type.get(mtype, 0) == received.count(mtype)
        assert m.messages_by_type.get(mtype, 0) == sent.count(mtype) + received.count(mtype)
    assert m.routing_decisions == len(routes)
    for path in RoutingPath:
        assert m.routing_by_path.get(path, 0) == sum(1 for r in routes if r[1] == path)
    for outcome in Outcome:
        assert m.routing_by_outcome.get(outcome, 0) == sum(1 for r in routes if r[2] == outcome)
    latencies = [r[3] for r in routes]
    if latencies:
        assert math.isclose(m.routing_latency_avg_ms, sum(latencies) / len(latencies))
        window = sorted(latencies[-WINDOW:])
        assert m.routing_latency_p50_ms == window[math.ceil(len(window) * 0.5) - 1]
        assert m.routing_latency_p99_ms == window[math.ceil(len(window) * 0.99) - 1]
    else:
        assert m.routing_latency_avg_ms == m.routing_latency_p50_ms == 0.0
    assert m.errors == sum(1 for a in seq if a[0] == "error")
    assert m.security_events == sum(1 for a in seq if a[0] == "security")
    for code in CODES:
        assert m.errors_by_code.get(code, 0) == seq.count(("error", code))
        assert m.security_by_code.get(code, 0) == seq.count(("security", code))
    assert m.audit_events == sum(1 for a in seq if a[0] == "audit")
    assert m.tool_invocations == len(tools)
    for tool in TOOLS:
        assert m.tool_invocations_by_tool.get(tool, 0) == sum(1 for a in tools if a[1] == tool)
    assert m.tool_errors == sum(1 for a in tools if not a[3])
    if tools:
        assert math.isclose(m.tool_duration_avg_ms, sum(a[2] for a in tools) / len(tools))
    assert len(obs.recent()) == len(seq)
    # The plain form is JSON data.
    assert json.loads(json.dumps(m.to_dict()))["totalMessagesSent"] == len(sent)


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=50), st.sampled_from([1, 50, 90, 99, 100]))
def test_percentile_is_nearest_rank(samples: list[float], q: int) -> None:
    p = percentile(samples, q)
    assert p in samples
    need = math.ceil(q / 100 * len(samples))
    assert sum(1 for x in samples if x <= p) >= need
    assert sum(1 for x in samples if x < p) < need


def test_tool_invocation_returns_the_timestamp_it_stamped() -> None:
    # The tool audit's history takes its start from this instead of a clock read of its own.
    for listening in (False, True):
        obs = Observability(Clock(), logger=quiet_logger())
        if listening:
            obs.add_listener(lambda event: None)
        stamped = obs.tool_invocation("search", "venus", 3, True)
        assert [e.at_ms for e in obs.recent()] == [stamped]


def test_reset_metrics_keeps_recent_events() -> None:
    obs = Observability(Clock(), logger=quiet_logger())
    obs.message_sent(envelope())
    obs.tool_invocation("search", "venus", 3, False)
    obs.reset_metrics()
    m = obs.metrics()
    assert (m.messages_sent, m.tool_invocations, m.tool_errors) == (0, 0, 0)
    assert len(obs.recent()) == 2


@settings(max_examples=200)
@given(st.lists(actions, max_size=60), st.integers(1, 20))
def test_unobserved_events_read_back_as_observed_ones(
    seq: list[tuple[Any, ...]], recent_size: int
) -> None:
    # With nobody listening, per-message events are stored unbuilt; reading them back
    # must give exactly what a listener would have been handed.
    heard: list[Event] = []
    observed = Observability(Clock(), recent_size, logger=quiet_logger(), latency_window=WINDOW)
    observed.add_listener(heard.append)
    unobserved = Observability(Clock(), recent_size, logger=quiet_logger(), latency_window=WINDOW)
    replay(observed, seq)
    replay(unobserved, seq)
    assert unobserved.recent() == observed.recent() == heard[-recent_size:]
    assert unobserved.metrics() == observed.metrics()
    assert unobserved.recent(kind=EventKind.ROUTING_DECISION, limit=3) == observed.recent(
        kind=EventKind.ROUTING_DECISION, limit=3
    )


# -- events ------------------------------------------------------------------------------------


def test_routing_event_carries_property_17_fields() -> None:
    obs = Observability(Clock(), logger=quiet_logger())
    env = envelope(MessageType.TASK_PROPOSAL)
    obs.routing_decision(env, RoutingPath.LOCAL, Outcome.DELIVERED, 1.5, target="mars-2", peer="p1")
    [e] = obs.recent()
    assert e.to_dict() == {
        "kind": "routing-decision",
        "timestamp": 1_001,
        "envelopeId": "env-1",
        "sender": "venus",
        "recipient": "mars-2",
        "messageType": "task-proposal",
        "path": "local",
        "latencyMs": 1.5,
        "outcome": "delivered",
        "peer": "p1",
    }


def test_audit_and_security_events() -> None:
    obs = Observability(Clock(), logger=quiet_logger())
    audit = obs.audit_cross_tier(envelope(MessageType.NOTIFICATION), 0, 3)
    assert audit.to_dict() | {"timestamp": 0} == {
        "kind": "audit",
        "timestamp": 0,
        "envelopeId": "env-1",
        "sender": "venus",
        "recipient": "mars",
        "messageType": "notification",
        "sourceTier": 0,
        "targetTier": 3,
    }
    sec = obs.security(ErrorCode.SANDBOX_VIOLATION, "no", peer="p9")
    assert sec.to_dict()["code"] == "SANDBOX_VIOLATION" and sec.envelope_id is None
    assert obs.recent(kind=EventKind.AUDIT) == [audit]


def test_recent_is_bounded_and_ordered() -> None:
    obs = Observability(Clock(), recent_size=5, logger=quiet_logger())
    for i in range(12):
        obs.message_sent(envelope(n=i))
    events = [Event(EventKind.MESSAGE_SENT, 1_001 + i, f"env-{i}", "venus", "mars",
                    MessageType.REQUEST) for i in range(12)]  # fmt: skip
    assert obs.recent() == events[-5:]
    assert obs.recent(limit=2) == events[-2:]
    assert obs.recent(limit=0) == []
    assert obs.recent(kind=EventKind.ERROR) == []
    # Counters are exact totals even though the ring forgot events.
    assert obs.metrics().messages_sent == 12


def test_sizes_are_validated() -> None:
    with pytest.raises(LocalError):
        Observability(Clock(), recent_size=0)
    with pytest.raises(LocalError):
        Observability(Clock(), latency_window=0)


# -- listeners ---------------------------------------------------------------------------------


def test_listeners_are_called_and_removed(caplog: pytest.LogCaptureFixture) -> None:
    obs = Observability(Clock())
    seen: list[Event] = []
    obs.add_listener(seen.append)
    obs.message_received(envelope())
    [first] = obs.recent()
    assert seen == [first]

    def broken(event: Event) -> None:
        raise RuntimeError("listener bug")

    obs.add_listener(broken)
    later: list[Event] = []
    obs.add_listener(later.append)
    with caplog.at_level(logging.ERROR, logger="p2pnode.events"):
        second = obs.error(ErrorCode.DELIVERY_FAILED, "gone")
    # The broken listener is logged and does not stop the others.
    assert seen == [first, second] and later == [second]
    assert any("listener" in r.getMessage() and r.exc_info for r in caplog.records)
    obs.remove_listener(seen.append)
    obs.remove_listener(broken)
    obs.message_sent(envelope())
    assert len(seen) == 2 and len(later) == 2
    with pytest.raises(LocalError):
        obs.remove_listener(broken)


# -- logging -----------------------------------------------------------------------------------


def test_events_are_logged_with_levels_and_extra(caplog: pytest.LogCaptureFixture) -> None:
    obs = Observability(Clock())
    with caplog.at_level(logging.DEBUG, logger="p2pnode.events"):
        obs.message_sent(envelope(), RoutingPath.REMOTE, "peer-1")
        [sent] = obs.recent()
        sec = obs.security(ErrorCode.TIER_VIOLATION, "L1 to L3", "peer-2")
        err = obs.error(ErrorCode.DELIVERY_FAILED, "retries exhausted")
    records = [r for r in caplog.records if r.name == "p2pnode.events"]
    assert [r.levelno for r in records] == [logging.DEBUG, logging.WARNING, logging.WARNING]
    assert [getattr(r, "event", None) for r in records] == [
        sent.to_dict(),
        sec.to_dict(),
        err.to_dict(),
    ]
    assert "id=env-1" in records[0].getMessage() and "peer=peer-1" in records[0].getMessage()


def test_info_logs_refusals_and_errors_not_every_message(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A daemon logs at INFO: one line per envelope would drown what an operator needs.
    obs = Observability(Clock())
    env = envelope()
    with caplog.at_level(logging.INFO, logger="p2pnode.events"):
        obs.message_sent(env, RoutingPath.REMOTE, "peer-1")
        obs.message_received(env, "peer-1")
        obs.routing_decision(env, RoutingPath.REMOTE, Outcome.DELIVERED, 1.0)
        obs.audit_cross_tier(env, 0, 3)
        obs.tool_invocation("search", "venus", 3, True)
        obs.routing_decision(env, RoutingPath.REMOTE, Outcome.REJECTED, 1.0,
                             code=ErrorCode.TIER_VIOLATION)  # fmt: skip
        obs.tool_invocation("search", "venus", 3, False)
        obs.security(ErrorCode.TIER_VIOLATION, "L1 to L3", "peer-2")
        obs.error(ErrorCode.DELIVERY_FAILED, "retries exhausted")
    records = [r for r in caplog.records if r.name == "p2pnode.events"]
    assert [(r.levelno, r.event["kind"]) for r in records] == [  # type: ignore[attr-defined]
        (logging.INFO, "routing-decision"),
        (logging.INFO, "tool-invocation"),
        (logging.WARNING, "security"),
        (logging.WARNING, "error"),
    ]
    # Everything is still kept and counted.
    assert len(obs.recent()) == 9
    assert obs.metrics().messages_sent == 1


@pytest.fixture
def p2p_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("p2pnode")
    handlers, level = list(logger.handlers), logger.level
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)


def test_a_repeated_warning_is_logged_once_a_minute_with_the_count_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    obs = Observability(clock)
    reason = "inbound handshake failed: message authentication failed"
    with caplog.at_level(logging.INFO, logger="p2pnode.events"):
        for _ in range(100):  # one a second for 100 s, and another line in between
            obs.security(ErrorCode.HANDSHAKE_FAILED, reason)
            clock.now += 999
        obs.security(ErrorCode.INVALID_CARD, "another problem")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert reason in lines[0] and "more like it" not in lines[0]
    assert lines[1].endswith("(59 more like it in the last 60 s)")
    assert "another problem" in lines[2]
    # Only the log lines are summarised: every event is kept and counted.
    assert len(obs.recent(kind=EventKind.SECURITY)) == 101
    assert obs.metrics().security_by_code["HANDSHAKE_FAILED"] == 100


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5_000)), max_size=200))
def test_log_repeats_logs_a_line_at_most_once_a_window_and_loses_no_count(
    steps: list[tuple[int, int]],
) -> None:
    repeats, now = LogRepeats(), 0
    logged: dict[int, list[int]] = {}
    total: dict[int, int] = {}
    reported: dict[int, int] = {}
    for key, gap in steps:
        now += gap
        total[key] = total.get(key, 0) + 1
        left_out = repeats.admit((key,), now)
        if left_out is not None:
            times = logged.setdefault(key, [])
            assert not times or now - times[-1] >= LOG_REPEAT_MS
            times.append(now)
            reported[key] = reported.get(key, 0) + 1 + left_out
    for key, count in total.items():
        # The first of each key is logged; the lines logged plus the repeats they
        # reported never exceed what happened, and fall short only by the tail not
        # reported yet (repeats after the last logged line).
        assert logged[key][0] <= now and 0 < reported[key] <= count
    assert LOG_REPEAT_LINES >= 4


def test_json_lines_output_parses_and_carries_the_event(p2p_logger: logging.Logger) -> None:
    out = io.StringIO()
    configure_logging("debug", json_lines=True, stream=out)
    obs = Observability(Clock())
    obs.message_sent(envelope(MessageType.STREAM_DATA), RoutingPath.BROADCAST)
    [sent] = obs.recent()
    obs.tool_invocation("search\nnewline", "venus", 12.5, True)
    tool = obs.recent()[-1]
    logging.getLogger("p2pnode.other").log(5, "not shown at DEBUG")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["event"] == sent.to_dict() and first["level"] == "DEBUG"
    assert first["logger"] == "p2pnode.events" and "message-sent" in first["message"]
    assert first["time"].endswith("+00:00")
    assert second["event"] == tool.to_dict() and second["event"]["tool"] == "search\nnewline"


def test_json_formatter_plain_record_and_exception() -> None:
    record = logging.LogRecord("p2pnode.x", logging.ERROR, __file__, 1, "boom %d", (7,), None)
    plain = json.loads(JsonLinesFormatter().format(record))
    assert datetime.fromisoformat(plain.pop("time")).utcoffset() == timedelta(0)
    assert plain == {"level": "ERROR", "logger": "p2pnode.x", "message": "boom 7"}
    try:
        raise ValueError("bad")
    except ValueError:
        record.exc_info = sys.exc_info()
    line = JsonLinesFormatter().format(record)
    assert "\n" not in line and "ValueError: bad" in json.loads(line)["exc"]


def test_configure_logging_replaces_its_handler(p2p_logger: logging.Logger) -> None:
    out = io.StringIO()
    configure_logging("DEBUG", stream=io.StringIO())
    handler = configure_logging("WARNING", stream=out)
    ours = [h for h in p2p_logger.handlers if getattr(h, "_p2pnode_configured", False)]
    assert ours == [handler] and p2p_logger.level == logging.WARNING
    logging.getLogger("p2pnode.events").warning("careful")
    assert out.getvalue().rstrip().endswith("WARNING p2pnode.events: careful")
    with pytest.raises(LocalError) as info:
        configure_logging("LOUD")
    assert info.value.code == ErrorCode.CONFIG_ERROR
