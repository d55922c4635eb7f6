"""Names and errors across the MCP bridge (docs/protocol/mcp.md §2, §3). Pure: no SDK.

* **Swarm to MCP.** A swarm tool or prompt is named ``<agent id>.<name>``
  (docs/protocol/tools.md §1). MCP tool names are 1-128 characters of
  ``A-Z a-z 0-9 _ - .`` (SEP-986; the SDK's ``mcp.shared.tool_name_validation``),
  so a qualified name keeps its form when it fits; when the agent id holds
  ``:`` or ``/``, or the whole is too long, it becomes a stable name of the
  allowed characters ending in ``-`` and 8 hex digits of its SHA-256.
  :class:`NameMap` remembers the way back.
* **MCP to swarm.** A child server's tool or prompt name becomes a swarm name
  (``^[A-Za-z0-9_-]{1,64}$``, no dot) by :func:`swarm_name`; the mirror
  remembers the child's own name for the calls it forwards.
* **Errors.** A swarm error crosses as its code, message, owning agent and
  details (:func:`error_info`), and MCP protocol errors from a child come back
  as swarm codes (:func:`code_of_mcp_error`).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from p2pnode.core.card import NAME_PATTERN
from p2pnode.core.errors import ErrorCode, P2PError

#: MCP's tool name rule (SEP-986).
MCP_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
_MCP_NAME_MAX = 128
_NOT_MCP = re.compile(r"[^A-Za-z0-9._-]")
_NOT_SWARM = re.compile(r"[^A-Za-z0-9_-]")
_SWARM_NAME_MAX = 64

#: JSON-RPC error codes the bridge answers with (JSON-RPC 2.0 §5.1; MCP's resources).
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
METHOD_NOT_FOUND = -32601
RESOURCE_NOT_FOUND = -32002
CONNECTION_CLOSED = -32000
REQUEST_TIMEOUT = -32001

#: ``_meta`` keys the bridge adds to what it lists and to its error results.
META_AGENT = "p2pnode/agentId"
META_NAME = "p2pnode/name"
META_UNREACHABLE = "p2pnode/unreachable"
#: An error result's fields (code, message, agentId, details), in its ``_meta``.
META_ERROR = "p2pnode/error"
#: A ``tools/call`` request's own timeout in seconds, in its ``params._meta``.
META_TIMEOUT = "p2pnode/timeout"
#: Longest timeout a caller may ask for: a day (the envelope's ``deadlineMs`` bound).
MAX_TIMEOUT = 86_400


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:8]


def mcp_name(qualified: str) -> str:
    """The MCP name of swarm name ``qualified``: itself when it is a valid MCP tool name,
    else its allowed characters (others as ``_``), cut to fit, then ``-`` and 8 hex
    digits of its SHA-256 (the same every time, so clients may keep it)."""
    if MCP_NAME.fullmatch(qualified):
        return qualified
    safe = _NOT_MCP.sub("_", qualified)
    return f"{safe[: _MCP_NAME_MAX - 9]}-{_digest(qualified)}"


def swarm_name(name: str) -> str | None:
    """The swarm name of an MCP server's tool or prompt ``name``: itself when it matches
    the swarm's name rule, else its allowed characters (others, dots included, as ``_``)
    cut to fit with 8 hex digits of its SHA-256 when it had to be cut. None for an empty
    name."""
    if NAME_PATTERN.fullmatch(name):
        return name
    if not name:
        return None
    safe = _NOT_SWARM.sub("_", name)
    if len(safe) <= _SWARM_NAME_MAX:
        return safe
    return f"{safe[: _SWARM_NAME_MAX - 9]}-{_digest(name)}"


class NameMap:
    """The MCP names of one listing of swarm names, and the way back."""

    def __init__(self) -> None:
        self._swarm: dict[str, str] = {}

    def replace(self, qualified_names: list[str]) -> list[str]:
        """Remember the names of a new listing; their MCP names, in the same order."""
        names = [mcp_name(q) for q in qualified_names]
        self._swarm = dict(zip(names, qualified_names, strict=True))
        return names

    def swarm(self, name: str) -> str | None:
        """The swarm name of MCP name ``name`` from the last listing (None: not listed)."""
        return self._swarm.get(name)


def error_info(exc: P2PError) -> dict[str, Any]:
    """What crosses the bridge of a swarm error: ``{"code", "message", "agentId",
    "details"}`` (``agentId``: the agent that refused, when the error names one)."""
    details = {k: v for k, v in exc.details.items() if k not in ("code", "message")}
    agent = details.get("agentId")
    return {
        "code": str(exc.code),
        "message": exc.message,
        "agentId": agent if isinstance(agent, str) else None,
        "details": details,
    }


def error_text(exc: P2PError) -> str:
    """The one line an MCP client shows of a swarm error: ``CODE: message``."""
    return f"{exc.code}: {exc.message}"


def jsonrpc_code(exc: P2PError) -> int:
    """The JSON-RPC error code of a swarm error answering ``resources/read`` or
    ``prompts/get`` (MCP has no error result for those)."""
    if exc.code is ErrorCode.RESOURCE_NOT_FOUND:
        return RESOURCE_NOT_FOUND
    if exc.code in _CALLER_FAULTS:
        return INVALID_PARAMS
    return INTERNAL_ERROR


_CALLER_FAULTS = frozenset(
    {
        ErrorCode.INVALID_INPUT,
        ErrorCode.INVALID_ARGUMENT,
        ErrorCode.PROMPT_NOT_FOUND,
        ErrorCode.TOOL_NOT_FOUND,
    }
)


def code_of_mcp_error(code: int) -> ErrorCode:
    """The swarm code of a JSON-RPC error a child MCP server answered with."""
    if code == INVALID_PARAMS:
        return ErrorCode.INVALID_INPUT
    if code == RESOURCE_NOT_FOUND:
        return ErrorCode.RESOURCE_NOT_FOUND
    if code == METHOD_NOT_FOUND:
        return ErrorCode.CAPABILITY_NOT_FOUND
    if code == CONNECTION_CLOSED:
        return ErrorCode.AGENT_UNAVAILABLE
    if code == REQUEST_TIMEOUT:
        return ErrorCode.TIMEOUT
    return ErrorCode.HANDLER_FAILED


__all__ = [
    "CONNECTION_CLOSED",
    "INTERNAL_ERROR",
    "INVALID_PARAMS",
    "MAX_TIMEOUT",
    "MCP_NAME",
    "META_AGENT",
    "META_ERROR",
    "META_NAME",
    "META_TIMEOUT",
    "META_UNREACHABLE",
    "METHOD_NOT_FOUND",
    "REQUEST_TIMEOUT",
    "RESOURCE_NOT_FOUND",
    "NameMap",
    "code_of_mcp_error",
    "error_info",
    "error_text",
    "jsonrpc_code",
    "mcp_name",
    "swarm_name",
]
