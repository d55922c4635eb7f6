"""The events a node emits: one frozen record per thing observed (seed R12).

:class:`Event` has a :class:`EventKind` and the fields that kind uses (the
rest are None); :mod:`p2pnode.node.observability` emits, counts and logs them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from p2pnode.core.envelope import MessageType
from p2pnode.core.errors import ErrorCode


class EventKind(enum.StrEnum):
    """What an event reports."""

    MESSAGE_SENT = "message-sent"
    MESSAGE_RECEIVED = "message-received"
    ROUTING_DECISION = "routing-decision"
    TOOL_INVOCATION = "tool-invocation"
    ERROR = "error"
    SECURITY = "security"
    AUDIT = "audit"


class RoutingPath(enum.StrEnum):
    """How a message was routed (seed R4.6)."""

    LOCAL = "local"
    REMOTE = "remote"
    BROADCAST = "broadcast"


class Outcome(enum.StrEnum):
    """What became of a routed message."""

    DELIVERED = "delivered"
    REJECTED = "rejected"  # refused by policy, here or at the peer
    FAILED = "failed"  # no route, channel closed, retries exhausted
    DROPPED = "dropped"  # malformed or over a limit, discarded without a reply


_EVENT_KEYS = tuple(
    (attr, "".join(w.capitalize() if i else w for i, w in enumerate(attr.split("_"))))
    for attr in (
        "envelope_id", "sender", "recipient", "message_type", "path", "latency_ms", "outcome",
        "code", "peer", "source_tier", "target_tier", "tool", "duration_ms", "success",
        "arguments_digest",
    )
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Event:
    """One observable occurrence. Fields a kind does not use are None.

    at_ms: when (the Observability clock, milliseconds).
    envelope_id, sender, recipient, message_type: the envelope concerned.
    path, latency_ms, outcome: a routing decision.
    code: the error code of a failure, rejection or security event.
    peer: the remote peer id (text) involved, if any.
    source_tier, target_tier: the tiers of sender and recipient (audit).
    tool, duration_ms, success: a tool invocation (sender is the invoking agent,
    recipient the owner, arguments_digest a SHA-256 prefix of the arguments).
    detail: free text for humans.
    """

    kind: EventKind
    at_ms: int
    envelope_id: str | None = None
    sender: str | None = None
    recipient: str | None = None
    message_type: MessageType | None = None
    path: RoutingPath | None = None
    latency_ms: float | None = None
    outcome: Outcome | None = None
    code: ErrorCode | None = None
    peer: str | None = None
    source_tier: int | None = None
    target_tier: int | None = None
    tool: str | None = None
    duration_ms: float | None = None
    success: bool | None = None
    arguments_digest: str | None = None
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready plain form with camelCase keys; None fields and empty detail omitted."""
        out: dict[str, Any] = {"kind": str(self.kind), "timestamp": self.at_ms}
        for attr, key in _EVENT_KEYS:
            value = getattr(self, attr)
            if value is not None:
                out[key] = str(value) if isinstance(value, enum.Enum) else value
        if self.detail:
            out["detail"] = self.detail
        return out

    def summary(self) -> str:
        """A one-line human message for the log."""
        parts = [str(self.kind)]
        if self.envelope_id is not None:
            parts.append(f"id={self.envelope_id}")
        if self.sender is not None or self.recipient is not None:
            parts.append(f"{self.sender or '?'}->{self.recipient or '?'}")
        labelled = (self.message_type, self.path, self.outcome, self.code, self.peer, self.tool)
        names = ("type", "path", "outcome", "code", "peer", "tool")
        parts += [f"{k}={v}" for k, v in zip(names, labelled, strict=True) if v is not None]
        if self.source_tier is not None and self.target_tier is not None:
            parts.append(f"L{self.source_tier}->L{self.target_tier}")
        if self.latency_ms is not None:
            parts.append(f"latency={self.latency_ms:g}ms")
        if self.duration_ms is not None:
            parts.append(f"duration={self.duration_ms:g}ms success={self.success}")
        if self.detail:
            parts.append(f"- {self.detail}")
        return " ".join(parts)
