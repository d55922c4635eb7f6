"""The agent protocol's core, sans-IO: one session of an agent process on ``agent.sock``.

Theory of operation (docs/protocol/agents.md is the specification):

* A process in any language connects to the node's ``agent.sock`` and speaks
  JSON lines: one object per line, at most :data:`MAX_LINE` bytes. Its first
  useful line is ``attach`` with a card template; the node then hosts the
  agent and streams each envelope addressed to it as an ``envelope`` event.
  The process answers requests with ``reply`` and may ``send``, ``request``,
  use shared documents (``doc.*``) and ``detach``.
* :class:`AgentSession` is the whole protocol state of one connection, with
  no I/O and no clock of its own, in the shape of h11: bytes in
  (:meth:`AgentSession.receive_data`), events out
  (:meth:`AgentSession.next_event`), bytes out
  (:meth:`AgentSession.data_to_send`), and ``now`` passed in for the only
  timer (forgetting requests the process never answered). A thin trio
  driver (:mod:`p2pnode.services.attach.service`) performs what the events ask.
* States are data (:class:`SessionState`, :data:`TRANSITIONS`); ops are
  parsed by a dispatch table; an op in a state that does not allow it is a
  typed error reply, never an exception of the driver.
* Bounds, so a slow or hostile process cannot make the node buffer without
  limit: envelopes waiting to be written (count and bytes), requests waiting
  for a reply, ops running at once, and the backlog of replies (past it the
  session asks the driver to stop reading: :data:`PAUSED`). A full envelope
  queue refuses the envelope (:class:`Delivery`): a request is answered
  ``BUSY`` by the driver, anything else is dropped and counted, and the
  process learns the count from an ``overflow`` event.
* Blame: a line the process got wrong is its error (an error reply; the
  connection is closed when the line cannot be read as a JSON object or is
  too long), the node's failures are the driver's to report.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from p2pnode.agent.task import Task, TaskError
from p2pnode.core.envelope import MAX_ID_LENGTH, Envelope, MessageType
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.services.attach.events import (
    Answer,
    Attach,
    Closed,
    Detach,
    DocOp,
    Event,
    FindOp,
    Request,
    Send,
    TaskOp,
    ToolOp,
)
from p2pnode.services.attach.wire import (
    MAX_LINE,
    MAX_TEXT,
    PROTOCOL_VERSION,
    TYPES,
    AttachError,
    LineBuffer,
    Ref,
    encode_line,
    error_line,
    flag,
    invalid,
    is_error_body,
    object_untrusted,
    ok_line,
    only_keys,
    optional_text,
    parse_card_template_untrusted,
    payload_untrusted,
    text,
)

#: Output of replies waiting to be written past which the session reads no further line.
MAX_REPLY_BACKLOG: Final = MAX_LINE
_COMMON = frozenset({"v", "op", "id"})


class SessionState(enum.Enum):
    """What a session waits on."""

    EXPECT_ATTACH = "expect-attach"  # connected: waits for ``attach``
    ATTACHING = "attaching"  # waits for the node to host the agent
    ATTACHED = "attached"  # serving the agent
    CLOSED = "closed"  # detached, disconnected or ended by a fatal error


TRANSITIONS: Final[dict[SessionState, frozenset[SessionState]]] = {
    SessionState.EXPECT_ATTACH: frozenset({SessionState.ATTACHING, SessionState.CLOSED}),
    SessionState.ATTACHING: frozenset(
        {SessionState.ATTACHED, SessionState.EXPECT_ATTACH, SessionState.CLOSED}
    ),
    SessionState.ATTACHED: frozenset({SessionState.CLOSED}),
    SessionState.CLOSED: frozenset(),
}


@dataclass(frozen=True, slots=True)
class AttachLimits:
    """Per-connection bounds (docs/protocol/agents.md "Limits")."""

    #: Envelopes waiting to be written to the process.
    queue_size: int = 256
    #: Bytes of envelope events waiting to be written to the process.
    queue_bytes: int = 8 * 1024 * 1024
    #: Requests written (or queued) to the process and not yet answered.
    max_pending: int = 1024
    #: ``send``, ``request`` and ``doc.*`` ops of one connection running at once.
    max_ops: int = 64
    #: Seconds after which an unanswered request is forgotten (its requester gave up).
    request_timeout: float = 30.0

    def __post_init__(self) -> None:
        if min(self.queue_size, self.queue_bytes, self.max_pending, self.max_ops) < 1:
            raise LocalError(ErrorCode.CONFIG_ERROR, "attach limits must be positive")
        if not self.request_timeout > 0:
            raise LocalError(ErrorCode.CONFIG_ERROR, "request_timeout must be positive")


class _Sentinel(enum.Enum):
    NEED_DATA = "need-data"
    PAUSED = "paused"


#: :meth:`AgentSession.next_event`: feed more bytes.
NEED_DATA: Final = _Sentinel.NEED_DATA
#: :meth:`AgentSession.next_event`: wait for the driver (an attach to finish, replies to be
#: written), then ask again.
PAUSED: Final = _Sentinel.PAUSED

#: Ops that run as the node's tasks, counted against ``max_ops``.
TOOL_OPS: Final = frozenset(
    {"tools.list", "tools.call", "resources.list", "resources.read", "prompts.list", "prompts.get"}
    | {"tools.cancel"}
)
#: Task ops (the task service's), counted against ``max_ops``.
TASK_OPS: Final = frozenset({"tasks.propose", "tasks.cancel"})
RUNNING_OPS: Final = (
    frozenset({"send", "request", "find", "doc.subscribe", "doc.update", "doc.read"})
    | TOOL_OPS
    | TASK_OPS
)
#: Targets one ``tasks.propose`` may name (the task service bounds them further).
MAX_TASK_TARGETS: Final = 64


class Delivery(enum.Enum):
    """What became of an envelope handed to :meth:`AgentSession.deliver`."""

    QUEUED = "queued"
    BUSY = "busy"  # the queue or the table of unanswered requests is full
    UNAVAILABLE = "unavailable"  # no agent attached (yet, or any more)
    NOT_JSON = "not-json"  # the payload has no JSON form (bytes, NaN)
    TOO_LARGE = "too-large"  # its event would exceed MAX_LINE


#: The error a refused request is answered with, by delivery outcome.
REFUSALS: Final[dict[Delivery, tuple[ErrorCode, str]]] = {
    Delivery.BUSY: (ErrorCode.BUSY, "the agent's process is not keeping up"),
    Delivery.UNAVAILABLE: (ErrorCode.AGENT_UNAVAILABLE, "the agent's process is gone"),
    Delivery.NOT_JSON: (ErrorCode.INVALID_INPUT, "the payload has no JSON form"),
    Delivery.TOO_LARGE: (ErrorCode.MESSAGE_TOO_LARGE, "the envelope exceeds 1 MiB as JSON"),
}


def _ref_untrusted(obj: dict[str, Any]) -> Ref:
    """The op (as given: it may be unknown) and id of a line, so that even an error reply
    names them. Raises AttachError(INVALID_ARGUMENT) for an id of the wrong kind."""
    op = obj.get("op")
    value = obj.get("id")
    if not (
        value is None
        or (type(value) is int and -(2**63) <= value < 2**63)
        or (isinstance(value, str) and 0 < len(value) <= MAX_ID_LENGTH)
    ):
        raise invalid(f"id: a 64-bit integer or a string of 1..{MAX_ID_LENGTH} characters")
    return Ref(op if isinstance(op, str) and len(op) <= MAX_ID_LENGTH else None, value)


class AgentSession:
    """The protocol state of one ``agent.sock`` connection (see the module docstring)."""

    def __init__(self, limits: AttachLimits | None = None) -> None:
        self.limits = limits if limits is not None else AttachLimits()
        self._state = SessionState.EXPECT_ATTACH
        self._lines = LineBuffer()
        self._eof = False
        #: Set by the session when it closed: why (``disconnected``, ``detached``, ``error``).
        self.close_reason: str | None = None
        self.agent_id: str | None = None
        # Output: replies and envelope events, in order; what data_to_send() handed out is
        # "in flight" until send_done().
        self._out: list[bytes] = []
        self._out_events = self._out_event_bytes = self._out_reply_bytes = 0
        self._flight_events = self._flight_event_bytes = self._flight_reply_bytes = 0
        # Requests forwarded and not answered: envelope id -> (envelope, forget at).
        self._pending: OrderedDict[str, tuple[Envelope, float]] = OrderedDict()
        self._running = 0
        self._attach_ref = Ref("attach")
        self.dropped = 0  # envelopes refused since the last ``overflow`` event
        self.dropped_total = 0

    # -- state ------------------------------------------------------------------------------

    @property
    def state(self) -> SessionState:
        return self._state

    def _transition(self, target: SessionState) -> None:
        if target not in TRANSITIONS[self._state]:
            raise LocalError(
                ErrorCode.ILLEGAL_TRANSITION,
                f"agent session: {self._state.value} -> {target.value}",
            )
        self._state = target

    def statistics(self) -> dict[str, int]:
        """Counters: envelopes queued, requests pending, ops running, envelopes dropped."""
        return {
            "queued": self._out_events + self._flight_events,
            "pending": len(self._pending),
            "running": self._running,
            "dropped": self.dropped_total,
        }

    # -- bytes in, events out ---------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Bytes read from the process; ``b""`` is the end of its stream."""
        if not data:
            self._eof = True
        elif self._state is not SessionState.CLOSED:
            self._lines.feed(data)

    def next_event(self) -> Event | _Sentinel:
        """The next thing to do, :data:`NEED_DATA` or :data:`PAUSED`.

        A line the process got wrong is answered here (an error reply in the output) and
        the next line is read; a fatal one closes the session (:class:`Closed`).
        """
        while True:  # each turn consumes one line of what was fed
            if self._state is SessionState.CLOSED:
                return Closed(self.close_reason or "closed")
            if self._state is SessionState.ATTACHING or self._reply_backlog > MAX_REPLY_BACKLOG:
                return PAUSED
            try:
                line = self._lines.next_line()
            except AttachError as exc:
                self._fatal(None, exc)
                continue
            if line is None:
                if self._eof:
                    self._close("disconnected")
                    continue
                return NEED_DATA
            if not line.strip():
                continue  # blank lines are allowed (keepalives, a trailing "\r\n")
            try:
                obj = object_untrusted(line)
            except AttachError as exc:
                self._fatal(None, exc)
                continue
            ref: Ref | None = None
            try:
                ref = _ref_untrusted(obj)
                event = self._dispatch_untrusted(obj, ref)
            except AttachError as exc:
                extra: dict[str, Any] = {}
                if ref is not None and ref.op == "reply" and isinstance(obj.get("to"), str):
                    extra["to"] = obj["to"]  # which request the failed reply was for
                self._reply(error_line(ref, exc, **extra))
                continue
            return event

    def _dispatch_untrusted(self, obj: dict[str, Any], ref: Ref) -> Event:
        if ref.op is None or ref.op not in _OPS:
            raise invalid(f"op: must be one of {sorted(_OPS)}")
        version = obj.get("v", PROTOCOL_VERSION if ref.op != "attach" else None)
        if version != PROTOCOL_VERSION or type(version) is not int:
            raise invalid(
                f"v: this node speaks version {PROTOCOL_VERSION} of the agent protocol",
                ErrorCode.PROTOCOL_VERSION_MISMATCH,
                supported=[PROTOCOL_VERSION],
            )
        parse, states = _OPS[ref.op]
        if self._state not in states:
            raise invalid(
                "attach first" if self.agent_id is None else f"attached as {self.agent_id!r}",
                ErrorCode.ILLEGAL_TRANSITION,
                state=self._state.value,
            )
        if ref.op in RUNNING_OPS and self._running >= self.limits.max_ops:
            raise invalid(f"{self.limits.max_ops} ops are running", ErrorCode.BUSY)
        return parse(self, obj, ref)

    # -- op parsers (a dispatch table below) ------------------------------------------------

    def _attach(self, obj: dict[str, Any], ref: Ref) -> Event:
        only_keys(obj, _COMMON | {"card"})
        card = parse_card_template_untrusted(obj.get("card"))
        self._transition(SessionState.ATTACHING)
        self._attach_ref = ref
        return Attach(ref, card)

    def _send(self, obj: dict[str, Any], ref: Ref) -> Event:
        only_keys(obj, _COMMON | {"to", "type", "payload", "capability", "correlationId"})
        type_text = obj.get("type", "notification")
        if not isinstance(type_text, str) or type_text not in TYPES:
            raise invalid(f"type: must be one of {sorted(TYPES)}")
        event = Send(
            ref,
            text(obj, "to", None, MAX_ID_LENGTH),
            TYPES[type_text],
            payload_untrusted(obj),
            flag(obj, "capability"),
            optional_text(obj, "correlationId"),
        )
        self._running += 1
        return event

    def _request(self, obj: dict[str, Any], ref: Ref) -> Event:
        only_keys(obj, _COMMON | {"to", "payload", "capability", "timeout"})
        timeout = obj.get("timeout")
        if timeout is not None and (type(timeout) not in (int, float) or not 0 < timeout <= 3600):
            raise invalid("timeout: seconds, more than 0 and at most 3600")
        event = Request(
            ref,
            text(obj, "to", None, MAX_ID_LENGTH),
            payload_untrusted(obj),
            flag(obj, "capability"),
            float(timeout) if timeout is not None else None,
        )
        self._running += 1
        return event

    def _reply_op(self, obj: dict[str, Any], ref: Ref) -> Event:
        only_keys(obj, _COMMON | {"to", "type", "payload"})
        to = text(obj, "to", None, MAX_ID_LENGTH)
        type_text = obj.get("type", "response")
        if type_text not in ("response", "error"):
            raise invalid('type: must be "response" or "error"')
        payload = payload_untrusted(obj)
        if type_text == "error" and not is_error_body(payload):
            raise invalid('payload: an error is {"code": str, "message": str, "details": object}')
        entry = self._pending.pop(to, None)
        if entry is None:
            raise invalid(f"no request {to!r} is waiting (unknown, answered or forgotten)")
        return Answer(ref, entry[0], MessageType(type_text), payload)

    def _doc(self, obj: dict[str, Any], ref: Ref) -> Event:
        allowed = _COMMON | {"doc", "update"} if ref.op == "doc.update" else _COMMON | {"doc"}
        only_keys(obj, allowed)
        doc = text(obj, "doc", None, MAX_ID_LENGTH)
        if ref.op == "doc.update" and not isinstance(obj.get("update"), dict):
            raise invalid("update: must be an operation object")
        self._running += 1
        return DocOp(ref, doc, obj.get("update"))

    def _tool(self, obj: dict[str, Any], ref: Ref) -> Event:
        keys = _TOOL_KEYS[ref.op or ""]
        only_keys(obj, _COMMON | keys)
        params: dict[str, Any] = {}
        for key in ("name", "uri", "agent"):
            if key in keys and (key != "agent" or obj.get(key) is not None):
                params[key] = text(obj, key, None, MAX_ID_LENGTH)
        if "arguments" in keys:
            arguments = obj.get("arguments", {})
            if not isinstance(arguments, dict):
                raise invalid("arguments: must be an object")
            params["arguments"] = arguments
        if "timeout" in keys and obj.get("timeout") is not None:  # the caller's own deadline
            timeout = obj["timeout"]
            if type(timeout) not in (int, float) or not 0 < timeout <= 86_400:
                raise invalid("timeout: seconds, more than 0 and at most 86400")
            params["timeout"] = float(timeout)
        if "content" in keys:  # the owner's whole answer (MCP content blocks included)
            params["content"] = obj.get("content") is True
            params["progress"] = obj.get("progress") is True  # progress events wanted
        if "callId" in keys:  # the id of a tools.call this process gave up
            call_id = obj.get("callId")
            if type(call_id) not in (int, str) or len(str(call_id)) > MAX_ID_LENGTH:
                raise invalid("callId: the id of a running tools.call")
            params["callId"] = call_id
        self._running += 1
        return ToolOp(ref, params)

    def _find(self, obj: dict[str, Any], ref: Ref) -> Event:
        only_keys(obj, _COMMON | {"capability"})
        event = FindOp(ref, text(obj, "capability", None, MAX_ID_LENGTH))
        self._running += 1
        return event

    def _task(self, obj: dict[str, Any], ref: Ref) -> Event:
        if ref.op == "tasks.cancel":
            only_keys(obj, _COMMON | {"taskId", "reason"})
            reason = obj.get("reason")
            params: dict[str, Any] = {
                "taskId": text(obj, "taskId", None, MAX_ID_LENGTH),
                "reason": "" if reason is None else text(obj, "reason", None),
            }
        else:
            params = _proposal_untrusted(obj)
        self._running += 1
        return TaskOp(ref, params)

    def _detach(self, obj: dict[str, Any], ref: Ref) -> Event:
        only_keys(obj, _COMMON)
        self._close("detached")
        return Detach(ref)

    # -- the driver reports -----------------------------------------------------------------

    def attach_succeeded(self, agent_id: str, result: Any) -> None:
        """The node hosts the agent: answer the ``attach`` with ``result``."""
        self._transition(SessionState.ATTACHED)
        self.agent_id = agent_id
        self._reply(ok_line(self._attach_ref, result))

    def attach_failed(self, error: P2PError) -> None:
        """The node refused the card: answer with ``error``; the process may attach again."""
        self._transition(SessionState.EXPECT_ATTACH)
        self._reply(error_line(self._attach_ref, error))

    def op_succeeded(self, ref: Ref, result: Any) -> None:
        """An op the driver ran succeeded (see :data:`RUNNING_OPS`; also ``detach``)."""
        self._op_done(ref)
        try:
            line = ok_line(ref, result)
        except (TypeError, ValueError):
            self._reply(error_line(ref, LocalError(ErrorCode.INTERNAL, "unencodable result")))
            return
        self._reply(line)

    def op_failed(self, ref: Ref, error: P2PError, **extra: Any) -> None:
        """An op failed (``extra``: keys added to the error reply, e.g. a reply's ``to``).
        A RemoteError (a responder's or a peer's) is marked ``remote`` in the reply."""
        self._op_done(ref)
        remote = isinstance(error, RemoteError)
        self._reply(error_line(ref, error, remote=remote, **extra))

    def notify(self, event: dict[str, Any]) -> None:
        """Queue an event line that is no envelope (a ``task`` event): it counts as a reply
        (against the reply backlog). An event without a JSON form, or past ``MAX_LINE``,
        goes without its ``result`` and with an ``error`` (INVALID_INPUT, MESSAGE_TOO_LARGE)."""
        if self._state is not SessionState.ATTACHED:
            return
        try:
            line = encode_line(event)
            problem = None if len(line) <= MAX_LINE + 1 else ErrorCode.MESSAGE_TOO_LARGE
        except (TypeError, ValueError):
            problem = ErrorCode.INVALID_INPUT
        if problem is not None:
            kept = {k: v for k, v in event.items() if k not in ("result", "error")}
            error = {"code": str(problem), "message": "the value has no JSON line", "details": {}}
            line = encode_line({**kept, "error": error})
        self._reply(line)

    def _op_done(self, ref: Ref) -> None:
        if ref.op in RUNNING_OPS:
            self._running = max(0, self._running - 1)

    def abort(self, error: P2PError) -> None:
        """End the session on the node's side (an attach timeout, the node closing): the
        process gets ``error`` as a fatal reply."""
        if self._state is not SessionState.CLOSED:
            self._fatal(None, error)

    def _fatal(self, ref: Ref | None, error: P2PError) -> None:
        self._reply(error_line(ref, error, fatal=True))
        self._close("error")

    def close(self, reason: str = "disconnected") -> None:
        """End the session without a reply (the connection is gone, the node is closing)."""
        self._close(reason)

    def _close(self, reason: str) -> None:
        if self._state is not SessionState.CLOSED:
            self._transition(SessionState.CLOSED)
            self.close_reason = reason

    def take_pending(self) -> list[Envelope]:
        """Once CLOSED: the requests the process will never answer (the driver answers them
        ``AGENT_UNAVAILABLE``); the table is emptied."""
        if self._state is not SessionState.CLOSED:
            raise LocalError(ErrorCode.ILLEGAL_TRANSITION, "the session is still open")
        pending = [envelope for envelope, _ in self._pending.values()]
        self._pending.clear()
        return pending

    # -- envelopes to the process -----------------------------------------------------------

    def deliver(
        self, envelope: Envelope, now: float, caller: dict[str, Any] | None = None
    ) -> Delivery:
        """Queue ``envelope`` (addressed to the agent) as an ``envelope`` event; ``caller``
        (a request's authenticated caller) goes with it."""
        if self._state is not SessionState.ATTACHED:
            return Delivery.UNAVAILABLE
        is_request = envelope.type is MessageType.REQUEST
        limits = self.limits
        if (
            self._out_events + self._flight_events >= limits.queue_size
            or self._out_event_bytes + self._flight_event_bytes >= limits.queue_bytes
            or (is_request and len(self._pending) >= limits.max_pending)
        ):
            return self._drop(Delivery.BUSY)
        try:
            event = {"event": "envelope", "envelope": envelope.to_dict()}
            if caller is not None:
                event["caller"] = caller
            line = encode_line(event)
        except (TypeError, ValueError):
            return self._drop(Delivery.NOT_JSON)
        if len(line) > MAX_LINE + 1:
            return self._drop(Delivery.TOO_LARGE)
        if self.dropped:
            self._out.append(encode_line({"event": "overflow", "dropped": self.dropped}))
            self.dropped = 0
        if is_request:
            self._pending[envelope.id] = (envelope, now + limits.request_timeout)
        self._out.append(line)
        self._out_events += 1
        self._out_event_bytes += len(line)
        return Delivery.QUEUED

    def _drop(self, outcome: Delivery) -> Delivery:
        self.dropped += 1
        self.dropped_total += 1
        return outcome

    # -- timers -----------------------------------------------------------------------------

    def next_deadline(self) -> float:
        """When the oldest unanswered request is to be forgotten (inf: none is)."""
        for _, forget_at in self._pending.values():
            return forget_at  # insertion order is deadline order: one timeout for all
        return float("inf")

    def handle_timer(self, now: float) -> int:
        """Forget requests whose time is up; returns how many."""
        forgotten = 0
        while self._pending:  # bounded by the table's size
            key, (_, forget_at) = next(iter(self._pending.items()))
            if forget_at > now:
                break
            del self._pending[key]
            forgotten += 1
        return forgotten

    # -- bytes out --------------------------------------------------------------------------

    def _reply(self, line: bytes) -> None:
        self._out.append(line)
        self._out_reply_bytes += len(line)

    @property
    def _reply_backlog(self) -> int:
        return self._out_reply_bytes + self._flight_reply_bytes

    def has_output(self) -> bool:
        return bool(self._out)

    def data_to_send(self) -> bytes:
        """Everything to write, in order; it counts as queued until :meth:`send_done`."""
        data = b"".join(self._out)
        self._out.clear()
        self._flight_events += self._out_events
        self._flight_event_bytes += self._out_event_bytes
        self._flight_reply_bytes += self._out_reply_bytes
        self._out_events = self._out_event_bytes = self._out_reply_bytes = 0
        return data

    def send_done(self) -> None:
        """What :meth:`data_to_send` returned was written."""
        self._flight_events = self._flight_event_bytes = self._flight_reply_bytes = 0


_Parser = Callable[[AgentSession, dict[str, Any], Ref], Event]
#: The keys each tool op takes besides the common ones.
_TOOL_KEYS: Final[dict[str, frozenset[str]]] = {
    "tools.list": frozenset(),
    "resources.list": frozenset(),
    "prompts.list": frozenset(),
    "tools.call": frozenset({"name", "arguments", "timeout", "content", "progress"}),
    "tools.cancel": frozenset({"callId"}),
    "prompts.get": frozenset({"name", "arguments"}),
    "resources.read": frozenset({"uri", "agent"}),
}
_ATTACHED = frozenset({SessionState.ATTACHED})
_PROPOSAL_KEYS = frozenset({"to", "task", "capability", "deadline", "justification"})


def _proposal_untrusted(obj: dict[str, Any]) -> dict[str, Any]:
    """The checked keys of a ``tasks.propose``. Raises AttachError(INVALID_ARGUMENT)."""
    only_keys(obj, _COMMON | _PROPOSAL_KEYS)
    to = obj.get("to")
    if isinstance(to, list):
        if not 0 < len(to) <= MAX_TASK_TARGETS or not all(
            isinstance(t, str) and 0 < len(t) <= MAX_ID_LENGTH for t in to
        ):
            raise invalid(f"to: 1..{MAX_TASK_TARGETS} agent ids")
        target: str | tuple[str, ...] = tuple(to)
    else:
        target = text(obj, "to", None, MAX_ID_LENGTH)
    try:
        task = Task.from_dict_untrusted(obj.get("task"))
    except (TaskError, LocalError) as exc:
        raise invalid(exc.message) from None
    deadline = obj.get("deadline")
    if deadline is not None and (type(deadline) not in (int, float) or not 0 < deadline <= 3600):
        raise invalid("deadline: seconds, more than 0 and at most 3600")
    return {
        "to": target,
        "task": task,
        "capability": flag(obj, "capability"),
        "deadline": float(deadline) if deadline is not None else None,
        "justification": optional_text(obj, "justification", MAX_TEXT),
    }
#: op -> (parser, states that allow it)
_OPS: Final[dict[str, tuple[_Parser, frozenset[SessionState]]]] = {
    "attach": (AgentSession._attach, frozenset({SessionState.EXPECT_ATTACH})),
    "detach": (AgentSession._detach, _ATTACHED),
    "send": (AgentSession._send, _ATTACHED),
    "request": (AgentSession._request, _ATTACHED),
    "reply": (AgentSession._reply_op, _ATTACHED),
    "doc.subscribe": (AgentSession._doc, _ATTACHED),
    "doc.update": (AgentSession._doc, _ATTACHED),
    "doc.read": (AgentSession._doc, _ATTACHED),
    **dict.fromkeys(TOOL_OPS, (AgentSession._tool, _ATTACHED)),
    "find": (AgentSession._find, _ATTACHED),
    **dict.fromkeys(TASK_OPS, (AgentSession._task, _ATTACHED)),
}

__all__ = [
    "MAX_REPLY_BACKLOG",
    "NEED_DATA",
    "PAUSED",
    "REFUSALS",
    "RUNNING_OPS",
    "TASK_OPS",
    "TOOL_OPS",
    "TRANSITIONS",
    "AgentSession",
    "Answer",
    "Attach",
    "AttachLimits",
    "Closed",
    "Delivery",
    "Detach",
    "DocOp",
    "Event",
    "FindOp",
    "Request",
    "Send",
    "SessionState",
    "TaskOp",
    "ToolOp",
]
