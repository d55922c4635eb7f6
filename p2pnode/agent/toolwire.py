"""The wire side of tools, resources and prompts: the MCP method names a request's
``metadata.capability`` carries, and the checks of a peer's ``params``
(docs/protocol/tools.md §3). Every check raises RemoteError(INVALID_INPUT)
naming the failing key.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from p2pnode.core.card import NAME_PATTERN
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError

#: The MCP methods a request's ``metadata.capability`` may name (docs/protocol/tools.md).
TOOLS_LIST = "tools/list"
TOOLS_CALL = "tools/call"
RESOURCES_LIST = "resources/list"
RESOURCES_READ = "resources/read"
PROMPTS_LIST = "prompts/list"
PROMPTS_GET = "prompts/get"
MCP_METHODS = frozenset(
    {TOOLS_LIST, TOOLS_CALL, RESOURCES_LIST, RESOURCES_READ, PROMPTS_LIST, PROMPTS_GET}
)


def _params(params: Any) -> Mapping[str, Any]:
    if type(params) is dict:  # what the wire decodes: no ABC check
        return params
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise RemoteError(ErrorCode.INVALID_INPUT, "params: must be an object")
    return params


def text_param(params: Any, key: str, limit: int) -> str:
    value = _params(params).get(key)
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        raise RemoteError(
            ErrorCode.INVALID_INPUT, f"params.{key}: a string of 1-{limit} characters is required"
        )
    return value


def call_params(params: Any, key: str) -> tuple[str, Any]:
    if type(params) is dict:  # the common case at a glance; anything else as below
        name, arguments = params.get(key), params.get("arguments")
        if (
            type(name) is str
            and 0 < len(name) <= 64
            and (arguments is None or type(arguments) is dict)
        ):
            return name, arguments
    name = text_param(params, key, 64)
    arguments = _params(params).get("arguments")
    if arguments is not None and type(arguments) is not dict and not isinstance(arguments, Mapping):
        raise RemoteError(ErrorCode.INVALID_INPUT, "params.arguments: must be an object")
    return name, arguments


#: The key of ``tools/call`` params by which a caller takes a result that is not a map
#: as the response payload itself (docs/protocol/tools.md §3.2).
PLAIN_RESULT = "plainResult"


def string_map(arguments: Any) -> dict[str, str]:
    if arguments is None:
        return {}
    out: dict[str, str] = {}
    for key, value in arguments.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise RemoteError(
                ErrorCode.INVALID_INPUT, f"arguments.{key}: prompt arguments are strings"
            )
        out[key] = value
    return out


@functools.lru_cache(maxsize=1024)  # a caller names the same few tools again and again
def split_qualified(name: str) -> tuple[str, str]:
    """``agent.tool`` as ``(agent id, tool name)`` (agent ids may hold dots; names may not).

    Raises LocalError(INVALID_ARGUMENT) when ``name`` is not qualified.
    """
    agent_id, dot, tool = name.rpartition(".")
    if not dot or not agent_id or not NAME_PATTERN.fullmatch(tool):
        raise LocalError(
            ErrorCode.INVALID_ARGUMENT, f"{name!r} is not AGENT.NAME (an agent id, a dot, a name)"
        )
    return agent_id, tool


__all__ = [
    "MCP_METHODS",
    "PLAIN_RESULT",
    "PROMPTS_GET",
    "PROMPTS_LIST",
    "RESOURCES_LIST",
    "RESOURCES_READ",
    "TOOLS_CALL",
    "TOOLS_LIST",
    "call_params",
    "split_qualified",
    "string_map",
    "text_param",
]
