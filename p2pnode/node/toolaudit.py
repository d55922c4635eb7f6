"""The owner's side of tools, resources and prompts: who is calling, and the audit trail.

A request to a local agent whose ``metadata.capability`` is an MCP method
(p2pnode.tools) comes here from the agent's inbox task instead of going
straight to the agent:

* The caller is built from the sender's card in the registry. The node
  admitted that card and checked, before delivering, that the envelope came
  from the peer owning it; roles count only as endorsed by the swarm
  authority. Nothing the request claims about its sender is used.
* Each use (``tools/call``, ``resources/read``, ``prompts/get``), allowed or
  refused, becomes a ``tool-invocation`` event with the caller, the owner,
  what was used, a digest of the arguments, the outcome and the latency
  (R12.2), and a :class:`~p2pnode.tools.ToolInvocation` record in a bounded
  history (R13.4). A refusal by an access rule is also a security event.
  Listing is not audited: it shows a caller only what it may use.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from p2pnode.agent import Agent, Reply
from p2pnode.envelope import Envelope, MessageType
from p2pnode.errors import ErrorCode
from p2pnode.node.observability import Observability
from p2pnode.registry import Registry
from p2pnode.toolrecord import ToolInvocation
from p2pnode.tools import PROMPTS_GET, RESOURCES_READ, TOOLS_CALL, Caller
from p2pnode.wire import canonical_pack, pack

#: Invocation records kept (the most recent).
HISTORY_SIZE = 256
#: Arguments or results larger than this (msgpack bytes) are recorded as a digest.
RECORDED_VALUE_BYTES = 4096
_USES = frozenset({TOOLS_CALL, RESOURCES_READ, PROMPTS_GET})


def arguments_digest(value: Any) -> str:
    """The first 16 hex digits of SHA-256 over the canonical msgpack of ``value``."""
    try:
        data = canonical_pack(value)
    except (TypeError, ValueError, OverflowError):
        data = repr(value).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def _recorded(value: Any) -> Any:
    try:
        size = len(pack(value))
    except (TypeError, ValueError, OverflowError):
        return {"omitted": "not msgpack data"}
    if size <= RECORDED_VALUE_BYTES:
        return value
    return {"omitted": f"{size} bytes", "sha256": arguments_digest(value)}


def used_name(owner: str, method: str, params: Any) -> str:
    """What one use names in the audit: ``owner.tool``, ``resource:<uri>`` or
    ``prompt:owner.name``."""
    params = params if isinstance(params, dict) else {}
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
        events: Observability,
        authority_key: Callable[[], bytes | None],
        history_size: int = HISTORY_SIZE,
    ) -> None:
        self._registry = registry
        self._events = events
        self._authority_key = authority_key
        self._history: deque[ToolInvocation] = deque(maxlen=history_size)

    def invocations(self) -> list[ToolInvocation]:
        """The most recent uses of this node's tools, resources and prompts, oldest first."""
        return list(self._history)

    async def serve(self, agent: Agent, envelope: Envelope, method: str) -> Reply:
        """``agent``'s answer to the MCP request ``envelope`` (its ``method``), audited."""
        card = self._registry.find(envelope.sender)
        caller = Caller.from_card(card, self._authority_key()) if card is not None else None
        if method not in _USES:
            reply = await agent.handle(envelope, caller)
            assert reply is not None  # a request always gets a reply
            return reply
        started_at = self._events.now_ms()
        start = time.perf_counter()
        reply = await agent.handle(envelope, caller)
        assert reply is not None
        duration_ms = (time.perf_counter() - start) * 1000
        params = envelope.payload
        name = used_name(agent.id, method, params)
        arguments = params.get("arguments") if isinstance(params, dict) else None
        digest = arguments_digest(arguments)
        code: ErrorCode | None = None
        detail = ""
        if reply.type is MessageType.ERROR:
            body = reply.payload if isinstance(reply.payload, dict) else {}
            raw = str(body.get("code"))
            code = ErrorCode(raw) if raw in ErrorCode.__members__ else ErrorCode.INTERNAL
            detail = str(body.get("message", ""))
        self._events.tool_invocation(
            name,
            envelope.sender,
            duration_ms,
            code is None,
            code=code,
            detail=detail,
            owner=agent.id,
            arguments_digest=digest,
        )
        if code is ErrorCode.PERMISSION_DENIED:
            peer = str(card.peer_id) if card is not None else None
            self._events.security(code, detail, peer, envelope)
        self._history.append(
            ToolInvocation(
                tool=name,
                agent_id=envelope.sender,
                arguments=_recorded(arguments),
                result=_recorded(reply.payload) if code is None else None,
                error=None if code is None else str(code),
                duration_ms=round(duration_ms, 3),
                started_at=started_at,
            )
        )
        return reply


__all__ = ["HISTORY_SIZE", "ToolAudit", "arguments_digest", "used_name"]
