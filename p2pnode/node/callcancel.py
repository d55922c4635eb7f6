"""Cancelling a request at its owner: the notification a caller sends when it gives up.

A requester that stops waiting for an answer (its timeout passed, or its own
caller was cancelled) tells the agent it asked, so the owner's node cancels
the handler instead of running it to its deadline for nobody
(docs/protocol/node.md "Requests to an agent"). The message is MCP's
``notifications/cancelled`` carried the way tools carry MCP methods: a
``notification`` envelope from the requesting agent to the agent asked, with
``metadata.capability`` set to the method, ``correlationId`` set to the
request's thread (its correlation id, else its id) and the payload
``{"requestId": <the request envelope's id>, "reason"?: str}``.

The owner takes it on delivery, before any inbox or handler: it cancels the
running call of that request id from that same sender and peer (so only the
requester can cancel its request) and ignores one that names no running call
or is malformed. It never reaches the agent's handler and is never answered.
"""

from __future__ import annotations

from typing import Any

from p2pnode.core.envelope import MAX_DEADLINE_MS, Envelope, MessageType
from p2pnode.core.errors import ErrorCode, LocalError

#: ``metadata.capability`` of the cancel notification (MCP's method name).
CANCELLED = "notifications/cancelled"
#: Longest request id the owner looks up (the envelope id rule, data-model.md).
MAX_REQUEST_ID = 128


def is_cancel(envelope: Envelope) -> bool:
    """True for a cancel notification (whatever its payload holds)."""
    meta = envelope.metadata
    return (
        envelope.type is MessageType.NOTIFICATION
        and meta is not None
        and meta.capability == CANCELLED
    )


def cancelled_request_untrusted(payload: Any) -> str | None:
    """The request id a cancel notification's ``payload`` names; None when it is not
    ``{"requestId": str of 1-128 characters, ...}`` (such a cancel is ignored)."""
    if type(payload) is not dict:
        return None
    request_id = payload.get("requestId")
    if type(request_id) is not str or not 0 < len(request_id) <= MAX_REQUEST_ID:
        return None
    return request_id


def requested_wait(timeout: float) -> float:
    """``timeout`` checked as a requester's own deadline (seconds, more than 0, at most a
    day: what ``metadata.deadlineMs`` carries). Raises LocalError(INVALID_ARGUMENT)."""
    if not (type(timeout) in (int, float) and 0 < timeout <= MAX_DEADLINE_MS / 1000):
        raise LocalError(
            ErrorCode.INVALID_ARGUMENT,
            f"timeout must be more than 0 and at most {MAX_DEADLINE_MS // 1000} seconds",
            timeout=repr(timeout),
        )
    return float(timeout)


def owner_limit(limit: float, envelope: Envelope) -> float:
    """The deadline of request ``envelope``'s handler: the owner's own ``limit``, or the
    requester's ``metadata.deadlineMs`` when that is shorter."""
    meta = envelope.metadata
    requested = meta.deadline_ms if meta is not None else None
    return limit if requested is None else min(limit, requested / 1000)


def cancel_payload(request: Envelope, reason: str) -> dict[str, Any]:
    """The payload of the notification cancelling ``request``."""
    return {"requestId": request.id, "reason": reason[:256]}


__all__ = [
    "CANCELLED",
    "MAX_REQUEST_ID",
    "cancel_payload",
    "cancelled_request_untrusted",
    "is_cancel",
    "owner_limit",
    "requested_wait",
]
