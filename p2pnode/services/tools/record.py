"""Tool invocation records (seed R13.4-13.5, Property 34).

Each use of a tool, resource or prompt leaves one :class:`ToolInvocation` on
the owner's node (p2pnode.services.tools.audit); its JSON form round-trips exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.jsonutil import dumps, is_json_value, loads_untrusted

MAX_RECORD_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class ToolInvocation:
    """What happened when a tool was called: the qualified tool, the calling agent, its
    arguments and result (or error code), how long it took and when it started."""

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


__all__ = ["MAX_RECORD_BYTES", "ToolInvocation"]
