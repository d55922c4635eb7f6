"""``p2pnode mcp serve``: the swarm's tools, resources and prompts as one MCP server.

An MCP client (a desktop assistant, an IDE, an agent framework) launches
``p2pnode mcp serve`` and talks MCP to it over stdio (or streamable HTTP on
the loopback, :mod:`p2pnode.bridges.mcp.http`). The process attaches to the
local node over ``agent.sock`` as one agent (:class:`~p2pnode.hosting.client.AgentClient`)
and answers each MCP request by using the swarm as that agent, so every
owner checks its access rules against that agent's signed card.

Theory of operation (docs/protocol/mcp.md §2):

* :class:`SwarmServer` is the SDK's low-level ``Server`` with one handler per
  MCP method: ``tools/list`` lists the swarm's tools as the agent may use
  them, with their schemas (MCP names by :mod:`p2pnode.bridges.mcp.names`);
  ``tools/call`` calls one; ``resources/*`` and ``prompts/*`` likewise. A
  listing is fresh for each request: the swarm, not this process, knows
  what exists.
* A call's result passes through: an owner's MCP content blocks and
  structured content (a published server's) reach the client as sent;
  another tool's result is one JSON text block and its structured content.
  ``_meta["p2pnode/timeout"]`` is the caller's deadline in the swarm, and
  with a ``progressToken`` the swarm's progress reaches the client.
* A swarm error on ``tools/call`` is a result with ``isError`` true, its text
  ``CODE: message``, no structured content (it must match the tool's output
  schema) and ``_meta["p2pnode/error"]`` the code, the message, the agent
  that refused and its details; on ``resources/read`` and ``prompts/get``
  (which have no error result) a JSON-RPC error carrying the same in
  ``data``.
* **The list follows the swarm.** :meth:`SwarmServer.watch` lists the swarm
  every ``poll_interval`` seconds and, when what a kind lists changed, sends
  ``notifications/{tools,resources,prompts}/list_changed``: to each
  handshake-era session (captured at its ``notifications/initialized``) and
  on the ``subscriptions/listen`` bus of 2026-07-28 sessions.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import anyio
import mcp_types as types
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel.server import NotificationOptions, Server
from mcp.server.models import InitializationOptions
from mcp.server.session import ServerSession
from mcp.server.subscriptions import (
    InMemorySubscriptionBus,
    ListenHandler,
    PromptsListChanged,
    ResourcesListChanged,
    ServerEvent,
    ToolsListChanged,
)
from mcp.shared._stream_protocols import ReadStream, WriteStream
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage
from pydantic import ValidationError

from p2pnode import __version__
from p2pnode.agent.surface import Listing
from p2pnode.bridges.mcp.names import (
    MAX_TIMEOUT,
    META_AGENT,
    META_ERROR,
    META_NAME,
    META_TIMEOUT,
    META_UNREACHABLE,
    NameMap,
    error_info,
    error_text,
    jsonrpc_code,
)
from p2pnode.bridges.mcp.stdio import pipe_stdio
from p2pnode.core.errors import ErrorCode, P2PError, RemoteError
from p2pnode.node.service import Progress, ProgressCallback

logger = logging.getLogger("p2pnode.mcp")

#: Seconds between two listings of the swarm that look for changes.
POLL_INTERVAL = 5.0
#: Handshake-era sessions kept for list-changed notifications (the oldest go first).
MAX_SESSIONS = 1024
_KINDS = ("tools", "resources", "prompts")
#: Progress reports of one call queued for a client that reads slower than they come.
PROGRESS_QUEUE = 16


class SwarmTools(Protocol):
    """What the server uses of the swarm: :class:`~p2pnode.hosting.client.AgentClient`'s
    ``client.tools`` (docs/protocol/agents.md, ``tools.*``)."""

    async def list_tools(self) -> Listing: ...
    async def call_tool_result(
        self,
        name: str,
        arguments: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (it travels to the owner)
        on_progress: ProgressCallback | None = None,
    ) -> Any: ...
    async def list_resources(self) -> Listing: ...
    async def read_resource(self, uri: str, *, agent: str | None = None) -> dict[str, Any]: ...
    async def list_prompts(self) -> Listing: ...
    async def get_prompt(
        self, name: str, arguments: dict[str, str] | None = None
    ) -> dict[str, Any]: ...


Context = ServerRequestContext[Any]


class _ListsChange(Server[Any]):
    """The SDK's low-level server announcing ``listChanged`` for tools, resources and
    prompts on every transport (the streamable HTTP session manager asks for the
    options with no arguments)."""

    def create_initialization_options(
        self,
        notification_options: NotificationOptions | None = None,
        experimental_capabilities: dict[str, dict[str, Any]] | None = None,
        extensions: dict[str, dict[str, Any]] | None = None,
    ) -> InitializationOptions:
        changes = notification_options or NotificationOptions(
            prompts_changed=True, resources_changed=True, tools_changed=True
        )
        return super().create_initialization_options(changes, experimental_capabilities, extensions)


class SwarmServer:
    """One MCP server over the swarm's tools, resources and prompts, as the agent that
    ``tools`` uses them as (see the module docstring)."""

    def __init__(
        self,
        tools: SwarmTools,
        *,
        name: str = "p2pnode",
        poll_interval: float = POLL_INTERVAL,
    ) -> None:
        self.tools = tools
        self.poll_interval = poll_interval
        self._tool_names = NameMap()
        self._prompt_names = NameMap()
        #: MCP names of the tools whose result is wrapped as ``{"result": value}``.
        self._wrapped: set[str] = set()
        self._bus = InMemorySubscriptionBus()
        self._sessions: dict[int, ServerSession] = {}
        self.server: Server[Any] = _ListsChange(
            name,
            version=__version__,
            description="The tools, resources and prompts of a p2pnode swarm",
            on_list_tools=self._list_tools,
            on_call_tool=self._call_tool,
            on_list_resources=self._list_resources,
            on_read_resource=self._read_resource,
            on_list_prompts=self._list_prompts,
            on_get_prompt=self._get_prompt,
            on_subscriptions_listen=ListenHandler(self._bus),
        )
        self.server.add_notification_handler(
            "notifications/initialized", types.NotificationParams, self._on_initialized
        )

    def initialization_options(self) -> InitializationOptions:
        """What the server announces: every list may change."""
        return self.server.create_initialization_options()

    async def run(
        self,
        read_stream: ReadStream[SessionMessage | Exception],
        write_stream: WriteStream[SessionMessage],
    ) -> None:
        """Serve one connection (stdio) until the client closes it, watching the swarm."""
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self.watch)
            await self.server.run(read_stream, write_stream, self.initialization_options())
            tasks.cancel_scope.cancel()

    # -- tools ------------------------------------------------------------------------------

    async def _list_tools(
        self, ctx: Context, params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        listing = await self._listing(self.tools.list_tools)
        items = [i for i in listing["items"] if isinstance(i.get("name"), str)]
        names = self._tool_names.replace([i["name"] for i in items])
        tools: list[types.Tool] = []
        wrapped: set[str] = set()
        for name, item in zip(names, items, strict=True):
            tool = _tool(name, item)
            if tool is None:
                logger.warning("%s: not a tool MCP can describe; not listed", item["name"])
                continue
            if item.get("outputSchema") is not None and not _is_object_schema(item["outputSchema"]):
                wrapped.add(name)
            tools.append(tool)
        self._wrapped = wrapped
        return types.ListToolsResult(tools=tools, _meta=_unreachable(listing))

    async def _call_tool(
        self, ctx: Context, params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        qualified = self._tool_names.swarm(params.name)
        if qualified is None:  # not listed yet (or renamed): list, then look again
            await self._list_tools(ctx, None)
            qualified = self._tool_names.swarm(params.name) or params.name
        raw_meta = (ctx.params or {}).get("_meta")
        meta = raw_meta if isinstance(raw_meta, dict) else {}
        arguments, timeout = params.arguments or {}, _timeout(meta)
        token: Any = meta.get("progressToken")

        def call(on_progress: ProgressCallback | None) -> Awaitable[Any]:
            return self.tools.call_tool_result(
                qualified, arguments, timeout=timeout, on_progress=on_progress
            )

        try:
            if type(token) in (str, int):
                answer = await _with_progress(ctx, token, call)
            else:
                answer = await call(None)
            return self._result(params.name, answer)
        except P2PError as exc:
            return _error_result(exc)

    def _result(self, name: str, answer: Any) -> types.CallToolResult:
        """The MCP result of a swarm tool's answer (mcp.md §2.4): a bridged server's blocks
        and structured content as they are, else the result as one JSON text block."""
        if isinstance(answer, dict) and isinstance(answer.get("content"), list):
            try:
                return types.CallToolResult.model_validate(
                    {k: answer[k] for k in ("content", "structuredContent") if k in answer}
                )
            except ValidationError as exc:
                raise RemoteError(
                    ErrorCode.INVALID_OUTPUT, f"{name}: content MCP cannot carry: {exc}"[:512]
                ) from None
        value = answer.get("structuredContent") if isinstance(answer, dict) else answer
        wrap = name in self._wrapped or not isinstance(value, dict)
        text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        return types.CallToolResult(
            content=[types.TextContent(text=text)],
            structured_content={"result": value} if wrap else value,
        )

    # -- resources --------------------------------------------------------------------------

    async def _list_resources(
        self, ctx: Context, params: types.PaginatedRequestParams | None
    ) -> types.ListResourcesResult:
        listing = await self._listing(self.tools.list_resources)
        resources = []
        for item in listing["items"]:
            wire = {
                "uri": item.get("uri"),
                "name": item.get("name") or item.get("uri"),
                "description": item.get("description") or None,
                "mimeType": item.get("mimeType"),
                "_meta": {META_AGENT: item.get("agentId")},
            }
            try:
                resources.append(types.Resource.model_validate(wire))
            except ValidationError:
                logger.warning("%s: not a resource MCP can describe", item.get("uri"))
        return types.ListResourcesResult(resources=resources, _meta=_unreachable(listing))

    async def _read_resource(
        self, ctx: Context, params: types.ReadResourceRequestParams
    ) -> types.ReadResourceResult:
        try:
            answer = await self.tools.read_resource(str(params.uri))
        except P2PError as exc:
            raise MCPError(jsonrpc_code(exc), error_text(exc), error_info(exc)) from None
        return types.ReadResourceResult.model_validate({"contents": answer.get("contents", [])})

    # -- prompts ----------------------------------------------------------------------------

    async def _list_prompts(
        self, ctx: Context, params: types.PaginatedRequestParams | None
    ) -> types.ListPromptsResult:
        listing = await self._listing(self.tools.list_prompts)
        items = [i for i in listing["items"] if isinstance(i.get("name"), str)]
        names = self._prompt_names.replace([i["name"] for i in items])
        prompts = []
        for name, item in zip(names, items, strict=True):
            wire = {
                "name": name,
                "description": item.get("description") or None,
                "arguments": item.get("arguments") or [],
                "_meta": {META_AGENT: item.get("agentId"), META_NAME: item["name"]},
            }
            try:
                prompts.append(types.Prompt.model_validate(wire))
            except ValidationError:
                logger.warning("%s: not a prompt MCP can describe; not listed", item["name"])
        return types.ListPromptsResult(prompts=prompts, _meta=_unreachable(listing))

    async def _get_prompt(
        self, ctx: Context, params: types.GetPromptRequestParams
    ) -> types.GetPromptResult:
        qualified = self._prompt_names.swarm(params.name)
        if qualified is None:
            await self._list_prompts(ctx, None)
            qualified = self._prompt_names.swarm(params.name) or params.name
        try:
            answer = await self.tools.get_prompt(qualified, params.arguments or {})
        except P2PError as exc:
            raise MCPError(jsonrpc_code(exc), error_text(exc), error_info(exc)) from None
        return types.GetPromptResult.model_validate(
            {"description": answer.get("description") or None, "messages": answer["messages"]}
        )

    async def _listing(self, list_kind: Callable[[], Any]) -> dict[str, Any]:
        try:
            listing: Listing = await list_kind()
        except P2PError as exc:
            raise MCPError(jsonrpc_code(exc), error_text(exc), error_info(exc)) from None
        return listing.to_dict()

    # -- the list follows the swarm ---------------------------------------------------------

    async def _on_initialized(self, ctx: Context, params: types.NotificationParams) -> None:
        """A handshake-era session: kept to notify it of list changes."""
        self._sessions[id(ctx.session)] = ctx.session
        while len(self._sessions) > MAX_SESSIONS:
            del self._sessions[next(iter(self._sessions))]

    async def watch(self) -> None:
        """List the swarm every ``poll_interval`` seconds; notify clients of each kind
        whose list changed. Runs until cancelled."""
        previous = await self._snapshot()
        while True:
            await anyio.sleep(self.poll_interval)
            current = await self._snapshot()
            for kind in _KINDS:
                if kind in current and kind in previous and current[kind] != previous[kind]:
                    logger.info("the swarm's %s changed", kind)
                    await self.notify_changed(kind)
            previous.update(current)

    async def _snapshot(self) -> dict[str, str]:
        """What each kind lists now, as comparable text (a kind that could not be listed
        is left out, so a failed listing is never a change)."""
        listers = {
            "tools": self.tools.list_tools,
            "resources": self.tools.list_resources,
            "prompts": self.tools.list_prompts,
        }
        out = {}
        for kind, list_kind in listers.items():
            try:
                listing = await list_kind()
            except P2PError as exc:
                logger.info("listing the swarm's %s failed: %s", kind, exc)
                continue
            out[kind] = json.dumps(listing.items, sort_keys=True)
        return out

    async def notify_changed(self, kind: str) -> None:
        """Tell every client the list of ``kind`` (tools, resources, prompts) changed."""
        events: dict[str, ServerEvent] = {
            "tools": ToolsListChanged(),
            "resources": ResourcesListChanged(),
            "prompts": PromptsListChanged(),
        }
        event = events[kind]
        await self._bus.publish(event)
        for key, session in list(self._sessions.items()):
            send = {
                "tools": session.send_tool_list_changed,
                "resources": session.send_resource_list_changed,
                "prompts": session.send_prompt_list_changed,
            }[kind]
            try:
                await send()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                del self._sessions[key]  # that client is gone


def _error_result(exc: P2PError) -> types.CallToolResult:
    """A swarm error as a tool's error result: ``CODE: message`` as text, the error's
    fields in ``_meta`` (a structured result must match the tool's output schema, and an
    error does not)."""
    return types.CallToolResult(
        content=[types.TextContent(text=error_text(exc))],
        is_error=True,
        _meta={META_ERROR: error_info(exc)},
    )


def _timeout(meta: dict[str, Any]) -> float | None:
    """The caller's timeout in ``_meta["p2pnode/timeout"]`` (seconds), when it is one."""
    value: Any = meta.get(META_TIMEOUT)
    if type(value) in (int, float) and 0 < value <= MAX_TIMEOUT:
        return float(value)
    return None


async def _with_progress(
    ctx: Context, token: str | int, call: Callable[[ProgressCallback], Awaitable[Any]]
) -> Any:
    """Run ``call`` with a progress callback that passes the swarm's progress on to the
    client as ``notifications/progress`` with its ``token``, in order; when the client
    reads slower than progress comes, the reports that do not fit the queue are dropped
    (each one supersedes the previous)."""
    send, receive = anyio.create_memory_object_stream[Progress](PROGRESS_QUEUE)
    related = None if ctx.request_id is None else str(ctx.request_id)

    def on_progress(update: Progress) -> None:
        with contextlib.suppress(anyio.WouldBlock):
            send.send_nowait(update)

    async def forward() -> None:
        async for update in receive:
            await ctx.session.send_progress_notification(
                token, update.progress, update.total, update.message, related_request_id=related
            )

    outcome: Any = None
    with send, receive:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(forward)
            try:
                outcome = await call(on_progress)
            except P2PError as exc:  # raised below, outside the task group's exception group
                outcome = exc
            finally:
                tasks.cancel_scope.cancel()
    if isinstance(outcome, P2PError):
        raise outcome
    return outcome


def _unreachable(listing: dict[str, Any]) -> dict[str, Any] | None:
    unreachable = listing.get("unreachable")
    return {META_UNREACHABLE: unreachable} if unreachable else None


def _is_object_schema(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "object"


def _object_schema(schema: Any) -> dict[str, Any] | None:
    """``schema`` as MCP wants a tool's input schema: ``type: object`` at the root (added
    when absent; the arguments are an object anyway). None when it cannot be."""
    if schema is None or schema is True or schema == {}:
        return {"type": "object"}
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        return None
    properties = schema.get("properties", {})
    required = schema.get("required", [])
    if not isinstance(properties, dict) or not all(
        isinstance(v, dict | bool) for v in properties.values()
    ):
        return None
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return None
    return {"type": "object", **schema}


def _wrapped_schema(schema: Any) -> dict[str, Any]:
    """The output schema of a tool whose result is not an object: ``{"result": value}``
    (what FastMCP does), with the inner schema's definitions moved to the root so its
    ``$ref``s still resolve."""
    inner = dict(schema) if isinstance(schema, dict) else schema
    wrapper: dict[str, Any] = {
        "type": "object",
        "properties": {"result": inner},
        "required": ["result"],
    }
    if isinstance(inner, dict):
        for key in ("$defs", "definitions"):
            if key in inner:
                wrapper[key] = inner.pop(key)
    return wrapper


def _tool(name: str, item: dict[str, Any]) -> types.Tool | None:
    """The MCP descriptor of one listed swarm tool (None when MCP cannot describe it)."""
    input_schema = _object_schema(item.get("inputSchema"))
    if input_schema is None:
        return None
    wire: dict[str, Any] = {
        "name": name,
        "description": item.get("description") or None,
        "inputSchema": input_schema,
        "_meta": {META_AGENT: item.get("agentId"), META_NAME: item["name"]},
    }
    output = item.get("outputSchema")
    if output is not None:
        wire["outputSchema"] = (
            _object_schema(output) if _is_object_schema(output) else _wrapped_schema(output)
        )
        if wire["outputSchema"] is None:
            return None
    try:
        return types.Tool.model_validate(wire)
    except ValidationError:
        return None


async def serve_stdio(server: SwarmServer) -> None:
    """Serve MCP on this process's stdin and stdout until the client closes stdin (on
    trio, without a thread per line when they are pipes: :mod:`p2pnode.bridges.mcp.stdio`)."""
    async with pipe_stdio() as (read_stream, write_stream):
        await server.run(read_stream, write_stream)


__all__ = ["MAX_SESSIONS", "POLL_INTERVAL", "SwarmServer", "SwarmTools", "serve_stdio"]
