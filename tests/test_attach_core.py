"""The agent protocol's sans-IO session core (p2pnode/services/attach/session.py): lines
in, events and lines out, bounded queues, and a state machine driven by hypothesis with
hostile input."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from p2pnode.core.envelope import Envelope, EnvelopeFactory, MessageType
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.services.attach.session import (
    MAX_REPLY_BACKLOG,
    NEED_DATA,
    PAUSED,
    TRANSITIONS,
    AgentSession,
    Answer,
    Attach,
    AttachLimits,
    Closed,
    Delivery,
    Detach,
    DocOp,
    FindOp,
    Request,
    Send,
    SessionState,
    TaskOp,
)
from p2pnode.services.attach.wire import MAX_LINE, AttachError, LineBuffer

factory = EnvelopeFactory(lambda: 1_700_000_000_000)
ATTACH = {"v": 1, "op": "attach", "card": {"id": "bot", "capabilities": [{"id": "add"}]}}


TASK = {"description": "sum", "capabilities": [], "complexity": 1, "input": [1, 2]}


def line(obj: Any) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def output(session: AgentSession) -> list[dict[str, Any]]:
    """The lines the session wants written, parsed; marks them written."""
    data = session.data_to_send()
    session.send_done()
    return [json.loads(x) for x in data.splitlines()]


def attached(limits: AttachLimits | None = None) -> AgentSession:
    session = AgentSession(limits)
    session.receive_data(line(ATTACH))
    event = session.next_event()
    assert isinstance(event, Attach) and event.card.id == "bot"
    assert session.state is SessionState.ATTACHING
    assert session.next_event() is PAUSED  # nothing is read while the node attaches
    session.attach_succeeded("bot", {"agent": "bot"})
    assert output(session) == [{"op": "attach", "ok": True, "result": {"agent": "bot"}}]
    return session


def request(payload: Any = 1, sender: str = "caller") -> Envelope:
    return factory.create(sender, "bot", MessageType.REQUEST, payload)


# -- the happy path ---------------------------------------------------------------------------


def test_attach_forward_reply() -> None:
    session = attached()
    asked = request({"a": 1})
    assert session.deliver(asked, now=0.0) is Delivery.QUEUED
    assert output(session) == [{"event": "envelope", "envelope": asked.to_dict()}]
    assert session.statistics()["pending"] == 1
    session.receive_data(line({"op": "reply", "to": asked.id, "payload": {"sum": 2}}))
    answer = session.next_event()
    assert isinstance(answer, Answer)
    assert (answer.request, answer.type, answer.payload) == (
        asked,
        MessageType.RESPONSE,
        {"sum": 2},
    )
    assert session.next_event() is NEED_DATA
    assert session.data_to_send() == b""  # a reply that went well is not acknowledged
    # The same request cannot be answered twice.
    session.receive_data(line({"op": "reply", "to": asked.id, "payload": 3, "id": "r2"}))
    assert session.next_event() is NEED_DATA
    [error] = output(session)
    assert error["ok"] is False and error["id"] == "r2" and error["to"] == asked.id
    assert error["error"]["code"] == "INVALID_ARGUMENT"


def test_ops_become_events_and_their_results_replies() -> None:
    session = attached()
    session.receive_data(
        line({"op": "send", "id": 1, "to": "x", "payload": [1], "type": "stream-data"})
        + line({"op": "request", "id": 2, "to": "plan", "capability": True, "timeout": 2})
        + line({"op": "doc.update", "id": 3, "doc": "d", "update": {"op": "counter.add"}})
    )
    send, req, doc = session.next_event(), session.next_event(), session.next_event()
    assert isinstance(send, Send) and send.type is MessageType.STREAM_DATA and send.to == "x"
    assert isinstance(req, Request) and req.capability and req.timeout == 2.0
    assert isinstance(doc, DocOp) and doc.ref.op == "doc.update" and doc.update["op"]
    assert session.statistics()["running"] == 3
    session.op_succeeded(send.ref, {"path": "local"})
    session.op_failed(req.ref, LocalError(ErrorCode.TIMEOUT, "slow"))
    assert output(session) == [
        {"op": "send", "ok": True, "id": 1, "result": {"path": "local"}},
        {"op": "request", "ok": False, "id": 2,
         "error": {"code": "TIMEOUT", "message": "slow", "details": {}}},
    ]  # fmt: skip
    assert session.statistics()["running"] == 1


def test_detach_closes_and_hands_back_unanswered_requests() -> None:
    session = attached()
    first, second = request(1), request(2)
    session.deliver(first, now=0.0)
    session.deliver(second, now=0.0)
    session.receive_data(line({"op": "reply", "to": first.id, "payload": None}))
    session.receive_data(line({"op": "detach", "id": 9}))
    assert isinstance(session.next_event(), Answer)
    detach = session.next_event()
    assert isinstance(detach, Detach) and detach.ref.id == 9
    assert session.state is SessionState.CLOSED
    assert session.take_pending() == [second]
    assert session.deliver(request(), now=0.0) is Delivery.UNAVAILABLE
    assert session.next_event() == Closed("detached")


def test_a_refused_card_may_be_corrected() -> None:
    session = AgentSession()
    session.receive_data(line({"v": 1, "op": "attach", "card": {"id": "bot", "tier": 9}}))
    assert session.next_event() is NEED_DATA  # the template's own problems: answered here
    [error] = output(session)
    assert error["error"]["code"] == "INVALID_CARD" and "card.tier" in error["error"]["message"]
    session.receive_data(line(ATTACH))
    assert isinstance(session.next_event(), Attach)
    session.attach_failed(LocalError(ErrorCode.INVALID_CARD, "taken"))  # the node's refusal
    assert session.state is SessionState.EXPECT_ATTACH
    assert output(session)[0]["error"]["message"] == "taken"


# -- lines the process got wrong --------------------------------------------------------------

NON_FATAL = [
    (line({"op": "send", "to": "x"}), "ILLEGAL_TRANSITION", False),  # before attach
    (line({"op": "nope"}), "INVALID_ARGUMENT", False),
    (line({"v": 2, "op": "attach", "card": {"id": "bot"}}), "PROTOCOL_VERSION_MISMATCH", False),
    (line({"op": "attach", "card": {"id": "bot"}}), "PROTOCOL_VERSION_MISMATCH", False),
    (line({"v": 1, "op": "attach", "id": [1], "card": {}}), "INVALID_ARGUMENT", False),
    (line({"v": 1, "op": "attach", "card": {"id": "b"}, "x": 1}), "INVALID_ARGUMENT", False),
    (line({"v": 1, "op": "attach", "card": []}), "INVALID_CARD", False),
    (b"   \r\n" + line({"op": 5}), "INVALID_ARGUMENT", False),  # a blank line is skipped
]
FATAL = [
    (b"{not json\n", "MALFORMED_MESSAGE", True),
    (b"[1, 2]\n", "MALFORMED_MESSAGE", True),
    (b'"text"\n', "MALFORMED_MESSAGE", True),
    (b"\xff\xfe\n", "MALFORMED_MESSAGE", True),
    (b"[" * 100 + b"]" * 100 + b"\n", "MALFORMED_MESSAGE", True),
    (b"x" * (MAX_LINE + 1), "MESSAGE_TOO_LARGE", True),  # no newline needed to know
    (b" " * MAX_LINE + b"{}\n", "MESSAGE_TOO_LARGE", True),
]


@pytest.mark.parametrize(("data", "code", "fatal"), NON_FATAL + FATAL)
def test_bad_lines_get_typed_errors(data: bytes, code: str, fatal: bool) -> None:
    session = AgentSession()
    session.receive_data(data)
    event = session.next_event()
    [error] = output(session)
    assert error["ok"] is False and error["error"]["code"] == code
    if fatal:
        assert event == Closed("error") and error["fatal"] is True
        assert session.state is SessionState.CLOSED
        session.receive_data(line(ATTACH))  # nothing after a fatal line is read
        assert session.next_event() == Closed("error")
    else:
        assert event is NEED_DATA and "fatal" not in error
        session.receive_data(line(ATTACH))  # the session goes on
        assert isinstance(session.next_event(), Attach)


@pytest.mark.parametrize(
    "op",
    [
        {"op": "send", "payload": 1},  # no "to"
        {"op": "send", "to": "x", "type": "gossip"},
        {"op": "send", "to": "x", "capability": "yes"},
        {"op": "request", "to": "x", "timeout": 0},
        {"op": "request", "to": "x", "payload": 2**64},
        {"op": "reply", "to": "unknown", "payload": 1},
        {"op": "reply", "to": "x", "type": "error", "payload": "oops"},
        {"op": "reply", "to": "x", "type": "notification"},
        {"op": "doc.update", "doc": "d", "update": [1]},
        {"op": "doc.read"},
        {"op": "attach", "v": 1, "card": {"id": "again"}},  # attached already
        {"op": "find"},
        {"op": "find", "capability": "x", "viewer": "y"},
        {"op": "tasks.propose", "to": "w"},  # no task
        {"op": "tasks.propose", "to": "w", "task": {"description": 1}},
        {"op": "tasks.propose", "to": [], "task": TASK},
        {"op": "tasks.propose", "to": ["w"] * 65, "task": TASK},
        {"op": "tasks.propose", "to": "w", "task": TASK, "deadline": 3601},
        {"op": "tasks.propose", "to": "w", "task": TASK, "selection": "best"},
        {"op": "tasks.cancel"},
        {"op": "tasks.cancel", "taskId": "t", "reason": ""},
    ],
)
def test_bad_ops_of_an_attached_agent_are_answered_and_the_session_goes_on(
    op: dict[str, Any],
) -> None:
    session = attached()
    session.receive_data(line({**op, "id": "x1"}))
    assert session.next_event() is NEED_DATA
    [error] = output(session)
    assert error["id"] == "x1" and error["op"] == op["op"] and error["ok"] is False
    assert error["error"]["code"] in {"INVALID_ARGUMENT", "ILLEGAL_TRANSITION"}
    assert session.state is SessionState.ATTACHED
    assert session.statistics()["running"] == 0


def test_find_and_task_ops_become_events_and_task_events_are_replies() -> None:
    session = attached()
    ops = [
        {"op": "find", "id": 1, "capability": "plan"},
        {"op": "tasks.propose", "id": 2, "to": ["a", "b"], "task": TASK, "deadline": 5},
        {"op": "tasks.cancel", "id": 3, "taskId": "t1"},
    ]
    session.receive_data(b"".join(line(op) for op in ops))
    find, propose, cancel = (session.next_event() for _ in ops)
    assert isinstance(find, FindOp) and find.capability == "plan"
    assert isinstance(propose, TaskOp) and propose.params["to"] == ("a", "b")
    assert propose.params["task"].input == [1, 2] and propose.params["deadline"] == 5.0
    assert isinstance(cancel, TaskOp) and cancel.params == {"taskId": "t1", "reason": ""}
    assert session.statistics()["running"] == 3
    session.op_failed(propose.ref, RemoteError(ErrorCode.TASK_REJECTED, "no"))
    session.notify({"event": "task", "taskId": "t1", "state": "completed", "result": b"x"})
    rejected, event = output(session)
    assert rejected["error"]["remote"] is True and rejected["error"]["code"] == "TASK_REJECTED"
    assert "result" not in event and event["error"]["code"] == "INVALID_INPUT"
    session.op_failed(find.ref, LocalError(ErrorCode.INVALID_ARGUMENT, "no"))
    assert "remote" not in output(session)[0]["error"]


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["to", "task", "capability", "deadline", "taskId",
                                        "reason", "justification", "capability"]),
                       st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                                    lambda inner: st.lists(inner, max_size=3)
                                    | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                                    max_leaves=8)),
       st.sampled_from(["find", "tasks.propose", "tasks.cancel"]))  # fmt: skip
def test_any_find_or_task_op_is_an_event_or_an_error_reply(
    fields: dict[str, Any], op: str
) -> None:
    session = attached()
    session.receive_data(line({**fields, "op": op, "id": 9}))
    event = session.next_event()
    if event is NEED_DATA:
        [error] = output(session)
        assert error["ok"] is False and error["error"]["code"] == "INVALID_ARGUMENT"
    else:
        assert isinstance(event, FindOp | TaskOp)
    assert session.state is SessionState.ATTACHED


def test_line_buffer_finds_lines_across_chunks() -> None:
    lines = LineBuffer(max_line=8)
    for chunk in (b"ab", b"c\nde", b"f\n\n", b"12345678"):
        lines.feed(chunk)
    assert [lines.next_line(), lines.next_line(), lines.next_line()] == [b"abc", b"def", b""]
    assert lines.next_line() is None  # 8 bytes without a newline: still allowed
    lines.feed(b"9")
    with pytest.raises(AttachError) as info:
        lines.next_line()
    assert info.value.code is ErrorCode.MESSAGE_TOO_LARGE


# -- bounds -----------------------------------------------------------------------------------


def test_a_full_queue_refuses_and_the_process_learns_how_many() -> None:
    session = attached(AttachLimits(queue_size=2))
    note = factory.create("caller", "bot", MessageType.NOTIFICATION, "n")
    assert session.deliver(note, 0.0) is Delivery.QUEUED
    assert session.deliver(request(), 0.0) is Delivery.QUEUED
    assert session.deliver(request(), 0.0) is Delivery.BUSY
    assert session.deliver(note, 0.0) is Delivery.BUSY
    written = session.data_to_send()
    assert session.deliver(note, 0.0) is Delivery.BUSY  # taken, not yet written: still queued
    session.send_done()
    assert len(written.splitlines()) == 2
    assert session.deliver(note, 0.0) is Delivery.QUEUED
    overflow, event = output(session)
    assert overflow == {"event": "overflow", "dropped": 3}
    assert event["envelope"]["payload"] == "n"
    assert session.statistics() == {"queued": 0, "pending": 1, "running": 0, "dropped": 3}


def test_unanswered_requests_are_bounded_and_forgotten() -> None:
    session = attached(AttachLimits(max_pending=2, request_timeout=10.0))
    assert session.next_deadline() == float("inf")
    first, second = request(1), request(2)
    assert session.deliver(first, now=1.0) is Delivery.QUEUED
    assert session.deliver(second, now=2.0) is Delivery.QUEUED
    assert session.deliver(request(3), now=2.0) is Delivery.BUSY
    output(session)
    assert session.next_deadline() == 11.0
    assert session.handle_timer(10.9) == 0
    assert session.handle_timer(11.0) == 1
    assert session.next_deadline() == 12.0
    session.receive_data(line({"op": "reply", "to": first.id}))
    assert session.next_event() is NEED_DATA  # forgotten: the requester gave up
    assert output(session)[0]["error"]["code"] == "INVALID_ARGUMENT"
    assert session.deliver(request(4), now=3.0) is Delivery.QUEUED


def test_payloads_without_a_json_form_and_oversized_events_are_refused() -> None:
    session = attached()
    assert session.deliver(request(b"\x00bytes"), 0.0) is Delivery.NOT_JSON
    assert session.deliver(request(float("nan")), 0.0) is Delivery.NOT_JSON
    assert session.deliver(request("x" * MAX_LINE), 0.0) is Delivery.TOO_LARGE
    assert session.statistics()["pending"] == 0 and session.data_to_send() == b""


def test_running_ops_are_bounded() -> None:
    session = attached(AttachLimits(max_ops=1))
    session.receive_data(line({"op": "doc.read", "doc": "a", "id": 1}) * 2)
    first = session.next_event()
    assert isinstance(first, DocOp)
    assert session.next_event() is NEED_DATA
    assert output(session)[0]["error"]["code"] == "BUSY"
    session.op_succeeded(first.ref, {})
    session.receive_data(line({"op": "doc.read", "doc": "a", "id": 3}))
    assert isinstance(session.next_event(), DocOp)


def test_reading_pauses_while_replies_back_up() -> None:
    session = attached()
    count = MAX_REPLY_BACKLOG // 150 + 10  # each answer is longer than 150 bytes
    session.receive_data(line({"op": "nope", "id": "x" * 100}) * count)
    assert session.next_event() is PAUSED
    assert session.next_event() is PAUSED  # still: nothing was written
    taken = session.data_to_send()
    assert len(taken) > MAX_REPLY_BACKLOG
    assert session.next_event() is PAUSED  # taken is not yet written
    session.send_done()
    answers = len(taken.splitlines())
    for _ in range(count):
        event = session.next_event()
        answers += len(output(session))
        if event is NEED_DATA:
            break
    assert answers == count  # every line got its answer, a backlog at a time


def test_limits_are_validated() -> None:
    with pytest.raises(LocalError) as info:
        AttachLimits(queue_size=0)
    assert info.value.code is ErrorCode.CONFIG_ERROR


# -- a state machine with hostile input -------------------------------------------------------

ops = st.sampled_from(
    [
        ATTACH,
        {"op": "detach"},
        {"op": "send", "to": "x", "payload": {"k": [1, "v"]}},
        {"op": "request", "to": "x"},
        {"op": "doc.read", "doc": "d"},
        {"op": "doc.subscribe", "doc": "d", "id": 7},
        {"op": "reply", "to": "?", "payload": 1},
        {"op": "nope"},
        {"v": 3, "op": "attach", "card": {"id": "b"}},
    ]
)
junk = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"{", b"}\n", b"\n", b"[]\n", b"null\n", b'{"op":', b"\xc3\x28\n"]),
)


class SessionMachine(RuleBasedStateMachine):
    """Any mix of lines, junk, deliveries, op results, writes and timers: the session never
    raises, keeps its bounds, follows its transition table and writes only JSON lines."""

    def __init__(self) -> None:
        super().__init__()
        self.limits = AttachLimits(queue_size=3, max_pending=2, max_ops=2, request_timeout=5.0)
        self.session = AgentSession(self.limits)
        self.now = 0.0
        self.running: list[Any] = []
        self.forwarded: list[Envelope] = []
        self.previous = self.session.state

    def _drain_events(self) -> None:
        for _ in range(200):  # bounded: each event consumes a line of what was fed
            before = self.session.state
            event = self.session.next_event()
            assert self.session.state is before or self.session.state in TRANSITIONS[before]
            if event is NEED_DATA or event is PAUSED or isinstance(event, Closed):
                return
            if isinstance(event, Attach):
                self.session.attach_succeeded(event.card.id, {"agent": event.card.id})
            elif isinstance(event, Send | Request | DocOp):
                self.running.append(event.ref)
            elif isinstance(event, Answer):
                assert event.request in self.forwarded
        raise AssertionError("next_event did not stop")

    @rule(op=ops, reply_to_forwarded=st.booleans())
    def feed_op(self, op: dict[str, Any], reply_to_forwarded: bool) -> None:
        if op["op"] == "reply" and reply_to_forwarded and self.forwarded:
            op = {**op, "to": self.forwarded[-1].id}
        self.session.receive_data(line(op))
        self._drain_events()

    @rule(data=junk)
    def feed_junk(self, data: bytes) -> None:
        self.session.receive_data(data)
        self._drain_events()

    @rule(is_request=st.booleans())
    def deliver(self, is_request: bool) -> None:
        type_ = MessageType.REQUEST if is_request else MessageType.NOTIFICATION
        envelope = factory.create("caller", "bot", type_, {"n": len(self.forwarded)})
        outcome = self.session.deliver(envelope, self.now)
        if self.session.state is not SessionState.ATTACHED:
            assert outcome is Delivery.UNAVAILABLE
        if outcome is Delivery.QUEUED and is_request:
            self.forwarded.append(envelope)

    @precondition(lambda self: self.running)
    @rule(ok=st.booleans())
    def finish_op(self, ok: bool) -> None:
        ref = self.running.pop(0)
        if ok:
            self.session.op_succeeded(ref, {"done": True})
        else:
            self.session.op_failed(ref, LocalError(ErrorCode.TIMEOUT, "slow"))

    @rule()
    def write(self) -> None:
        data = self.session.data_to_send()
        self.session.send_done()
        for text in data.splitlines():
            obj = json.loads(text)
            assert isinstance(obj, dict) and ("event" in obj or "ok" in obj)

    @rule(seconds=st.floats(0, 8))
    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.session.handle_timer(self.now)
        assert self.session.next_deadline() > self.now

    @rule()
    def end_of_stream(self) -> None:
        self.session.receive_data(b"")
        self._drain_events()
        assert self.session.state is SessionState.CLOSED or self.session.next_event() is PAUSED

    @invariant()
    def bounded(self) -> None:
        stats = self.session.statistics()
        assert stats["queued"] <= self.limits.queue_size
        assert stats["pending"] <= self.limits.max_pending
        assert stats["running"] <= self.limits.max_ops
        if self.session.state is SessionState.CLOSED:
            assert isinstance(self.session.next_event(), Closed)
            self.session.take_pending()
            assert self.session.statistics()["pending"] == 0


SessionMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40)
test_session_state_machine = SessionMachine.TestCase


def test_illegal_transitions_raise_and_leave_the_state() -> None:
    session = AgentSession()
    with pytest.raises(LocalError) as info:
        session.attach_succeeded("bot", {})  # no attach was asked for
    assert info.value.code is ErrorCode.ILLEGAL_TRANSITION
    assert session.state is SessionState.EXPECT_ATTACH
    with pytest.raises(LocalError):
        session.take_pending()  # still open


@pytest.mark.slow
def test_the_core_and_the_client_load_no_trio() -> None:
    code = (
        "import sys, p2pnode.services.attach.session, p2pnode.hosting.client; "
        "print(sorted(m for m in ('trio', 'sqlite3') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
