"""Tools agents expose to each other (MCP-style), and invocation records.

Tools are named ``<agent id>.<tool name>`` so two agents may both offer a
``search`` tool (seed R5.6). Registering a fully qualified name twice raises
``DUPLICATE_TOOL``. Each invocation leaves a :class:`ToolInvocation` record
whose JSON form round-trips exactly (seed R13.4-13.5, Property 34).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from p2pnode.errors import ErrorCode, LocalError, RemoteError
from p2pnode.jsonutil import dumps, is_json_value, loads_untrusted

MAX_RECORD_BYTES = 1024 * 1024
ToolHandler = Callable[[Mapping[str, Any]], Awaitable[Any]]


@dataclass(frozen=True, slots=True)
class Tool:
    """A tool: its qualified name, description and JSON Schemas."""

    agent_id: str
    name: str
    description: str = ""
    input_schema: Any = None
    output_schema: Any = None

    @property
    def qualified_name(self) -> str:
        return f"{self.agent_id}.{self.name}"


@dataclass(frozen=True, slots=True)
class ToolInvocation:
    """What happened when a tool was called."""

    tool: str
    agent_id: str
    arguments: Any
    result: Any
    error: str | None
    duration_ms: float
    started_at: int

    def to_json(self) -> str:
        """JSON text. Raises LocalError(INVALID_ARGUMENT) for non-JSON arguments or results."""
        if not (is_json_value(self.arguments) and is_json_value(self.result)):
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "arguments and result must be JSON data")
        return dumps(
            {
                "tool": self.tool,
                "agentId": self.agent_id,
                "arguments": self.arguments,
                "result": self.result,
                "error": self.error,
                "durationMs": self.duration_ms,
                "startedAt": self.started_at,
            }
        )

    @classmethod
    def from_json_untrusted(cls, text: str | bytes) -> ToolInvocation:
        """Parse a record. Raises RemoteError(MALFORMED_MESSAGE)."""
        try:
            data = loads_untrusted(text, MAX_RECORD_BYTES)
            if not isinstance(data, dict):
                raise ValueError("a record is a JSON object")
            record = cls(
                tool=data["tool"],
                agent_id=data["agentId"],
                arguments=data["arguments"],
                result=data["result"],
                error=data["error"],
                duration_ms=data["durationMs"],
                started_at=data["startedAt"],
            )
            if set(data) != {"tool", "agentId", "arguments", "result", "error"} | {
                "durationMs",
                "startedAt",
            }:
                raise ValueError("unexpected fields")
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


def _is_duration(value: object) -> bool:
    # A number JSON and msgpack both carry: finite, and an integer fits 64 bits.
    return isinstance(value, int | float) and not isinstance(value, bool) and is_json_value(value)


class ToolRegistry:
    """Tools by qualified name, with their handlers."""

    def __init__(self) -> None:
        self._tools: dict[str, tuple[Tool, ToolHandler]] = {}

    def register(self, tool: Tool, handler: ToolHandler) -> None:
        """Add a tool. Raises LocalError(DUPLICATE_TOOL) if its qualified name is taken."""
        if tool.qualified_name in self._tools:
            raise LocalError(
                ErrorCode.DUPLICATE_TOOL,
                f"tool {tool.qualified_name!r} is already registered",
                tool=tool.qualified_name,
            )
        self._tools[tool.qualified_name] = (tool, handler)

    def unregister_agent(self, agent_id: str) -> None:
        for name in [n for n, (t, _) in self._tools.items() if t.agent_id == agent_id]:
            del self._tools[name]

    def list(self) -> list[Tool]:
        return [
            tool for tool, _ in sorted(self._tools.values(), key=lambda th: th[0].qualified_name)
        ]

    def handler(self, qualified_name: str) -> ToolHandler:
        """The handler of a tool. Raises LocalError(CAPABILITY_NOT_FOUND)."""
        entry = self._tools.get(qualified_name)
        if entry is None:
            raise LocalError(ErrorCode.CAPABILITY_NOT_FOUND, f"no tool {qualified_name!r}")
        return entry[1]
