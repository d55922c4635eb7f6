"""The owner's side of tools, resources and prompts: who is calling, and the audit trail.

A request to a local agent whose ``metadata.capability`` is an MCP method
(p2pnode.agent.tools) comes here from the agent's inbox task instead of going
straight to the agent: :class:`ToolAudit` serves those methods on the node
(:meth:`ToolAudit.serve_on`, a :class:`~p2pnode.node.service.MethodServer`).

* The caller is built from the sender's card in the registry. The node
  admitted that card and checked, before delivering, that the envelope came
  from the peer owning it; roles count only as endorsed by the swarm
  authority. Nothing the request claims about its sender is used.
* Each use (``tools/call``, ``resources/read``, ``prompts/get``), allowed or
  refused, becomes a ``tool-invocation`` event with the caller, the owner,
  what was used, a digest of the arguments, the outcome and the latency
  (R12.2), and a :class:`ToolInvocation` record in a bounded
  history (R13.4). A refusal by an access rule is also a security event.
  Listing is not audited: it shows a caller only what it may use.
  A use cancelled before it answered (its deadline passed, or its caller
  cancelled it: p2pnode.node.agents) is recorded as failed with ``TIMEOUT``.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio

from p2pnode.agent.definition import Agent, Reply
from p2pnode.agent.tools import MCP_METHODS, PROMPTS_GET, RESOURCES_READ, TOOLS_CALL, Caller
from p2pnode.core.card import AgentCard
from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.core.jsonutil import dumps, is_json_value, loads_untrusted
from p2pnode.core.registry import Registry
from p2pnode.core.wire import canonical_pack, pack
from p2pnode.node.service import EventSink, ServiceHost

#: Invocation records kept (the most recent).
HISTORY_SIZE = 256
#: Uses forwarded to attached processes and not yet answered, remembered for the audit.
MAX_FORWARDED = 1024
#: Arguments or results larger than this (msgpack bytes) are recorded as a digest.
RECORDED_VALUE_BYTES = 4096
#: Seconds a use may run unless its tool declares a deadline (NodeConfig.tool_deadline's
#: default; the composition root passes the node's).
TOOL_DEADLINE = 30.0
#: Largest JSON text of one invocation record :meth:`ToolInvocation.from_json_untrusted` reads.
MAX_RECORD_BYTES = 1024 * 1024
_USES = frozenset({TOOLS_CALL, RESOURCES_READ, PROMPTS_GET})


# -- the record of one use -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolInvocation:
    """What happened when a tool was called: the qualified tool, the calling agent, its
    arguments and result (or error code), how long it took and when it started. One per
    use in :meth:`ToolAudit.invocations` (seed R13.4-13.5, Property 34); its JSON form
    round-trips exactly."""

    tool: str
    agent_id: str
    arguments: Any
    result: Any
    error: str | None
    duration_ms: float
    started_at: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "tool": self.tool,
            "agentId": self.agent_id,
            "arguments": self.arguments,
            "result": self.result,
            "error": self.error,
            "durationMs": self.duration_ms,
            "startedAt": self.started_at,
        }

    def to_json(self) -> str:
        """JSON text. Raises LocalError(INVALID_ARGUMENT) for non-JSON arguments or results."""
        if not (is_json_value(self.arguments) and is_json_value(self.result)):
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "arguments and result must be JSON data")
        return dumps(self.to_dict())

    @classmethod
    def from_json_untrusted(cls, text: str | bytes) -> ToolInvocation:
        """Parse a record. Raises RemoteError(MALFORMED_MESSAGE)."""
        try:
            data = loads_untrusted(text, MAX_RECORD_BYTES)
            if not isinstance(data, dict):
                raise ValueError("a record is a JSON object")
            if set(data) != set(_RECORD_KEYS):
                raise ValueError("unexpected fields")
            record = cls(*(data[k] for k in _RECORD_KEYS))
            checks = (
                isinstance(record.tool, str),
                isinstance(record.agent_id, str),
                record.error is None or isinstance(record.error, str),
                _is_duration(record.duration_ms),
                isinstance(record.started_at, int) and not isinstance(record.started_at, bool),
                # What to_json() would refuse (NaN, infinities, integers past 64 bits) is
                # refused here, so an accepted record always encodes again.
                is_json_value(record.arguments),
                is_json_value(record.result),
            )
            if not all(checks):
                raise ValueError("wrongly typed field")
        except (KeyError, ValueError, TypeError) as exc:
            raise RemoteError(ErrorCode.MALFORMED_MESSAGE, f"bad tool invocation: {exc}") from None
        return record


_RECORD_KEYS = ("tool", "agentId", "arguments", "result", "error", "durationMs", "startedAt")


def _is_duration(value: object) -> bool:
    # A number JSON and msgpack both carry: finite, and an integer fits 64 bits.
    return isinstance(value, int | float) and not isinstance(value, bool) and is_json_value(value)


_SCALARS = (str, int, float, bool, type(None))
_MIN_INT, _MAX_INT = -(2**63), 2**64 - 1  # what msgpack packs


def _canonical_bytes(value: Any) -> bytes:
    if type(value) is dict and all(
        type(k) is str and isinstance(v, _SCALARS) for k, v in value.items()
    ):
        # The common case, a flat map of scalars, packed once: msgpack orders str keys
        # by (encoded length, bytes), which is canonical_pack's order for them.
        keys = sorted(value, key=lambda k: (len(k.encode()), k.encode()))
        return pack({k: value[k] for k in keys})
    return canonical_pack(value)


def arguments_digest(value: Any) -> str:
    """The first 16 hex digits of SHA-256 over the canonical msgpack of ``value``."""
    try:
        data = _canonical_bytes(value)
    except (TypeError, ValueError, OverflowError, P2PError):
        data = repr(value).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _recorded(value: Any) -> Any:
    """``value`` as an invocation record keeps it: itself, or when it packs past
    RECORDED_VALUE_BYTES a note of its size and digest."""
    kind = type(value)
    if kind is int or kind is float or kind is bool or value is None:
        return value
    if kind is dict and _small_flat_map(value):
        return value  # packs to well under RECORDED_VALUE_BYTES: no need to pack it
    if isinstance(value, _SCALARS):
        return (
            value
            if not isinstance(value, str) or len(value) <= RECORDED_VALUE_BYTES
            else {"omitted": f"{len(value)} characters", "sha256": arguments_digest(value)}
        )
    try:
        size = len(pack(value))
    except (TypeError, ValueError, OverflowError, P2PError):
        return {"omitted": "not msgpack data"}
    if size <= RECORDED_VALUE_BYTES:
        return value
    return {"omitted": f"{size} bytes", "sha256": arguments_digest(value)}


def _small_flat_map(value: dict[Any, Any]) -> bool:
    """At most 16 entries whose keys and strings have at most 24 characters and whose
    other values are scalars msgpack packs: at most 16 * 2 * (5 + 4 * 24) + 5 = 3,237
    bytes of msgpack, under RECORDED_VALUE_BYTES. (Most arguments and results: this
    runs twice a use, so it is :func:`~p2pnode.core.jsonutil.is_flat_json_map` inlined.)"""
    if len(value) > 16:
        return False
    for key, item in value.items():
        if type(key) is not str or len(key) > 24:
            return False
        kind = type(item)
        if kind is str:
            if len(item) > 24:
                return False
        elif kind is int:
            if not _MIN_INT <= item <= _MAX_INT:
                return False
        elif kind is not float and kind is not bool and item is not None:
            return False
    return True


def used_name(owner: str, method: str, params: Any) -> str:
    """What one use names in the audit: ``owner.tool``, ``resource:<uri>`` or
    ``prompt:owner.name``."""
    params = params if type(params) is dict else {}
    if method == TOOLS_CALL:
        name = params.get("name")
        if type(name) is str and len(name) <= 64:  # most uses: no formatting
            return owner + "." + name
    if method == RESOURCES_READ:
        return f"resource:{params.get('uri')!s:.256}"
    name = f"{owner}.{params.get('name')!s:.64}"
    return name if method == TOOLS_CALL else f"prompt:{name}"


class ToolAudit:
    """Serves MCP requests to local agents with an authenticated caller, and audits
    them (see the module docstring)."""

    def __init__(
        self,
        registry: Registry,
        events: EventSink,
        authority_key: Callable[[], bytes | None],
        history_size: int = HISTORY_SIZE,
        *,
        tool_deadline: float = TOOL_DEADLINE,
    ) -> None:
        self._registry = registry
        self._tool_deadline = tool_deadline
        self._events = events
        self._authority_key = authority_key
        # The fields of each ToolInvocation, built when read.
        self._history: deque[tuple[Any, ...]] = deque(maxlen=history_size)
        #: A caller per card object (cards are immutable), bounded.
        self._callers: dict[int, tuple[AgentCard, Caller]] = {}
        #: Uses handed to an attached agent process, until it answers (the oldest forgotten).
        self._forwarded: OrderedDict[str, _Started] = OrderedDict()

    def invocations(self) -> list[ToolInvocation]:
        """The most recent uses of this node's tools, resources and prompts, oldest first."""
        return [
            ToolInvocation(name, caller, arguments, result, error, round(duration, 3), started)
            for name, caller, arguments, result, error, duration, started in self._history
        ]

    def serve_on(self, host: ServiceHost) -> None:
        """Serve the MCP methods of ``host``'s local agents (a large answer may stream)."""
        host.serve_methods(MCP_METHODS, self, streamed=True)

    def deadline(self, agent: Agent, envelope: Envelope) -> float:
        """Seconds a use may run: its tool's declared deadline, else ``tool_deadline``."""
        declared = agent.tool_deadline(envelope)
        return declared if declared is not None else self._tool_deadline

    async def serve(
        self, agent: Agent, envelope: Envelope, method: str, sender: AgentCard
    ) -> Reply | None:
        """``agent``'s answer to the MCP request ``envelope`` (its ``method``), audited;
        None when the agent forwarded it to its process (audited by :meth:`answered`).
        The caller is ``sender``: of a contested id, the owner that sent it."""
        caller = self._caller_of_card(sender)
        if method not in _USES:
            return await agent.handle(envelope, caller)
        perf = time.perf_counter()
        try:
            reply = await agent.handle(envelope, caller)
        except trio.Cancelled:
            # Cut at its deadline, or its caller gave up (p2pnode.node.agents): audited
            # as a use that timed out, then the cancellation goes on.
            cut = {"code": str(ErrorCode.TIMEOUT), "message": "cancelled before it answered"}
            self._record(agent.id, envelope, method, MessageType.ERROR, cut, perf, sender)
            raise
        if reply is None:
            self._forwarded[envelope.id] = _Started(perf, sender)
            while len(self._forwarded) > MAX_FORWARDED:
                self._forwarded.popitem(last=False)
            return None
        self._record(agent.id, envelope, method, reply.type, reply.payload, perf, sender)
        return reply

    def caller_of(self, agent_id: str) -> Caller | None:
        """Agent ``agent_id`` as a caller, from its card in the registry (None: no card);
        what an attached agent process is told of who sent a request it is forwarded."""
        card = self._registry.find(agent_id)
        return self._caller_of_card(card) if card is not None else None

    def _caller_of_card(self, card: AgentCard) -> Caller:
        cached = self._callers.get(id(card))
        return cached[1] if cached is not None and cached[0] is card else self._caller(card)

    def _caller(self, card: AgentCard) -> Caller:
        """The caller ``card`` stands for, built and cached (:meth:`serve` reads the cache)."""
        if len(self._callers) >= MAX_FORWARDED:
            self._callers.clear()
        caller = Caller.from_card(card, self._authority_key())
        self._callers[id(card)] = (card, caller)
        return caller

    def answered(self, request: Envelope, type: MessageType, payload: Any) -> None:
        """An attached process answered the forwarded use ``request``."""
        started = self._forwarded.pop(request.id, None)
        meta = request.metadata
        if started is not None and meta is not None and meta.capability is not None:
            self._record(
                request.recipient,
                request,
                meta.capability,
                type,
                payload,
                started.perf,
                started.card,
            )

    def _record(
        self,
        owner: str,
        envelope: Envelope,
        method: str,
        answer_type: MessageType,
        payload: Any,
        started_perf: float,
        card: AgentCard | None,
    ) -> None:
        duration_ms = (time.perf_counter() - started_perf) * 1000
        params = envelope.payload
        is_map = type(params) is dict
        arguments = params.get("arguments") if is_map else None
        name = params.get("name") if is_map and method == TOOLS_CALL else None
        if type(name) is str and len(name) <= 64:  # most uses: no formatting
            name = owner + "." + name
        else:
            name = used_name(owner, method, params)
        if answer_type is MessageType.ERROR:
            code, detail = _failure(payload)
            result = None
        else:
            code, detail = None, ""
            if method == TOOLS_CALL and type(payload) is dict and "structuredContent" in payload:
                payload = payload["structuredContent"]  # a tool's value, not the whole answer
            kind = type(payload)
            result = payload if kind is int or kind is bool or kind is float else _recorded(payload)
        # Small flat arguments (most) are kept as they are without a call.
        kept = arguments if type(arguments) is dict and _small_flat_map(arguments) else None
        if kept is None:
            kept = _recorded(arguments)
        # The digest is computed when the event is read (most never are), from the
        # arguments the record keeps; arguments too large to keep were digested already.
        digest = (
            partial(arguments_digest, kept)
            if kept is arguments
            else kept.get("sha256") or arguments_digest(arguments)
        )
        if code is None:  # most uses: the outcome's defaults, fewer keywords to pass
            stamped = self._events.tool_invocation(
                name, envelope.sender, duration_ms, True, owner=owner, arguments_digest=digest
            )
            error = None
        else:
            stamped = self._failed(name, envelope, duration_ms, code, detail, owner, digest, card)
            error = str(code)
        # The event's clock read: the start is its end less the duration.
        started_ms = stamped - int(duration_ms)
        self._history.append((name, envelope.sender, kept, result, error, duration_ms, started_ms))

    def _failed(
        self,
        name: str,
        envelope: Envelope,
        duration_ms: float,
        code: ErrorCode,
        detail: str,
        owner: str,
        digest: str | Callable[[], str],
        card: AgentCard | None,
    ) -> int:
        """The events of a use that failed: the tool invocation, and a security event
        when an access rule refused it. Returns the invocation event's timestamp (ms)."""
        stamped = self._events.tool_invocation(
            name,
            envelope.sender,
            duration_ms,
            False,
            code=code,
            detail=detail,
            owner=owner,
            arguments_digest=digest,
        )
        if code is ErrorCode.PERMISSION_DENIED:
            peer = str(card.peer_id) if card is not None else None
            self._events.security(code, detail, peer, envelope)
        return stamped


def _failure(payload: Any) -> tuple[ErrorCode, str]:
    """The code and message of an ``error`` answer."""
    body = payload if isinstance(payload, dict) else {}
    raw = str(body.get("code"))
    code = ErrorCode(raw) if raw in ErrorCode.__members__ else ErrorCode.INTERNAL
    return code, str(body.get("message", ""))


@dataclass(frozen=True, slots=True)
class _Started:
    """A use handed to an attached process: when it started, and the caller's card."""

    perf: float
    card: AgentCard | None


__all__ = [
    "HISTORY_SIZE",
    "MAX_RECORD_BYTES",
    "ToolAudit",
    "ToolInvocation",
    "arguments_digest",
    "used_name",
]
