"""An MCP server's tools, resources and prompts as one agent of the swarm.

:func:`mirror_agent` takes an SDK ``ClientSession`` connected to an MCP server
(any off-the-shelf one) and builds a :class:`~p2pnode.agent.definition.Agent` whose
catalog mirrors what the server lists (docs/protocol/mcp.md §4):

* each **tool** with the server's own input and output schemas (checked by
  the owner's node before and after the call, as for any tool), its call
  forwarded with ``tools/call``; the answer is the server's content blocks
  and ``structuredContent`` as it sent them (a ToolContent); the server's
  progress goes on to the swarm caller, and a call the caller gave up is
  abandoned, which sends the server ``notifications/cancelled``;
* each **resource** (not templates) with its name, description and MIME
  type, its content read with ``resources/read``;
* each **prompt** with its arguments, rendered with ``prompts/get`` into the
  server's messages.

Every entry carries the same :class:`~p2pnode.agent.tools.Access` rule, so the
owner's node checks who may use the server's tools against the caller's
signed card before anything reaches the server (least privilege: the server
itself sees no caller). Names the swarm cannot carry are renamed
(:func:`~p2pnode.bridges.mcp.names.swarm_name`); what does not fit a card
(more than 64 tools, 16 resources, 16 prompts) or has a schema the swarm
refuses is left out and logged. The agent is a snapshot: when the server's
lists change, build it again (:mod:`p2pnode.bridges.mcp.supervise` does).

A server error comes back as a typed error: a tool result with ``isError``
as ``HANDLER_FAILED`` with the server's text, a JSON-RPC error by its code
(:func:`~p2pnode.bridges.mcp.names.code_of_mcp_error`), the server gone as
``AGENT_UNAVAILABLE``, a call silent for ``call_timeout`` (no answer, no
progress) as ``TIMEOUT``.
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import mcp_types as types
from mcp import ClientSession
from mcp.shared.exceptions import MCPError
from pydantic import BaseModel

from p2pnode.agent.definition import Agent
from p2pnode.agent.tools import Access, PromptArgument, ToolContent
from p2pnode.bridges.mcp.names import code_of_mcp_error, swarm_name
from p2pnode.core.card import MAX_PROMPTS, MAX_RESOURCES, MAX_TEXT, MAX_TOOLS, URI_PATTERN
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.node.service import current_progress

logger = logging.getLogger("p2pnode.mcp")

#: Seconds a forwarded call may take before it is answered TIMEOUT (the owner's node
#: gives a tool call 30 s too: docs/protocol/node.md "Requests to an agent").
CALL_TIMEOUT = 30.0
#: Pages of one listing read at most (the card limits are far below).
MAX_PAGES = 16

P = TypeVar("P", bound=BaseModel)


async def mirror_agent(
    session: ClientSession,
    agent_id: str,
    *,
    tier: int = 3,
    sandbox: str | None = None,
    access: Access | None = None,
    description: str | None = None,
    call_timeout: float = CALL_TIMEOUT,
) -> Agent:
    """The agent ``agent_id`` offering what the server behind ``session`` (initialized)
    lists, each entry with rule ``access`` (see the module docstring).

    Raises LocalError(HANDLER_FAILED) when the server does not answer a listing.
    """
    init = session.initialize_result
    info = init.server_info if init is not None else None
    capabilities = session.server_capabilities or types.ServerCapabilities()
    server = info.name if info is not None and info.name else "an MCP server"
    instructions = init.instructions if init is not None else None
    agent = Agent(
        agent_id,
        name=(info.title or info.name or None) if info is not None else None,
        description=(description or instructions or f"MCP server {server}")[:MAX_TEXT],
        tier=tier,
        sandbox=sandbox,
        version=info.version if info is not None and info.version else "1.0.0",
    )
    forward = _Forwarder(session, call_timeout)
    if capabilities.tools is not None:
        tools = await _pages(session.list_tools, "tools")
        _mirror_tools(agent, forward, tools, access)
    if capabilities.resources is not None:
        resources = await _pages(session.list_resources, "resources")
        _mirror_resources(agent, forward, resources, access)
    if capabilities.prompts is not None:
        prompts = await _pages(session.list_prompts, "prompts")
        _mirror_prompts(agent, forward, prompts, access)
    return agent


async def _pages(list_page: Callable[..., Awaitable[Any]], key: str) -> list[Any]:
    items: list[Any] = []
    cursor: str | None = None
    for _ in range(MAX_PAGES):
        params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
        try:
            page = await list_page(params=params)
        except MCPError as exc:
            raise LocalError(
                ErrorCode.HANDLER_FAILED, f"the MCP server did not list its {key}: {exc.message}"
            ) from None
        items.extend(getattr(page, key))
        cursor = page.next_cursor
        if not cursor:
            break
    return items


def _mirror_tools(
    agent: Agent, forward: _Forwarder, tools: list[types.Tool], access: Access | None
) -> None:
    for tool in tools:
        name = swarm_name(tool.name)
        if name is None or name in agent.catalog.tools:
            logger.warning(
                "%s: tool %r has no swarm name of its own; left out", agent.id, tool.name
            )
            continue
        if len(agent.catalog.tools) >= MAX_TOOLS:
            logger.warning("%s: more than %d tools; %r left out", agent.id, MAX_TOOLS, tool.name)
            continue
        try:
            agent.catalog.add_tool(
                forward.tool(tool.name),
                name=name,
                description=tool.description or "",
                input_schema=tool.input_schema,
                output_schema=tool.output_schema,
                access=access,
            )
        except P2PError as exc:
            logger.warning("%s: tool %r left out: %s", agent.id, tool.name, exc.message)


def _mirror_resources(
    agent: Agent, forward: _Forwarder, resources: list[types.Resource], access: Access | None
) -> None:
    for resource in resources:
        uri = str(resource.uri)
        if not URI_PATTERN.fullmatch(uri) or len(agent.catalog.resources) >= MAX_RESOURCES:
            logger.warning("%s: resource %s left out (URI or count)", agent.id, uri)
            continue
        try:
            agent.catalog.add_resource(
                forward.resource(uri),
                uri,
                name=resource.name,
                description=resource.description or "",
                mime_type=resource.mime_type or "text/plain",
                access=access,
            )
        except P2PError as exc:
            logger.warning("%s: resource %s left out: %s", agent.id, uri, exc.message)


def _mirror_prompts(
    agent: Agent, forward: _Forwarder, prompts: list[types.Prompt], access: Access | None
) -> None:
    for prompt in prompts:
        name = swarm_name(prompt.name)
        if name is None or name in agent.catalog.prompts:
            logger.warning("%s: prompt %r has no swarm name; left out", agent.id, prompt.name)
            continue
        if len(agent.catalog.prompts) >= MAX_PROMPTS:
            logger.warning("%s: more than %d prompts; %r left out", agent.id, MAX_PROMPTS, name)
            continue
        arguments = [
            PromptArgument(a.name, a.description or "", bool(a.required))
            for a in prompt.arguments or ()
        ]
        try:
            agent.catalog.add_prompt(
                forward.prompt(prompt.name, arguments),
                name=name,
                description=prompt.description or "",
                arguments=arguments,
                access=access,
            )
        except P2PError as exc:
            logger.warning("%s: prompt %r left out: %s", agent.id, prompt.name, exc.message)


class _Forwarder:
    """The functions of the mirrored entries: each forwards to the server and translates
    what comes back."""

    def __init__(self, session: ClientSession, timeout: float) -> None:
        self.session = session
        self.timeout = timeout

    def tool(self, name: str) -> Callable[[dict[str, Any]], Awaitable[Any]]:
        async def call(arguments: dict[str, Any]) -> Any:
            result = await self._call(name, arguments)
            if result.is_error:
                text = _text(result.content) or f"tool {name} failed"
                raise RemoteError(ErrorCode.HANDLER_FAILED, text[:MAX_TEXT], tool=name)
            # The server's own blocks and structured content, as it sent them (mcp.md §3.2).
            blocks = tuple(_plain(block) for block in result.content)
            return ToolContent(blocks, result.structured_content)

        return call

    async def _call(self, name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        """``tools/call`` on the server. Its timer is idle: each progress the server reports
        starts it again and goes on to the swarm caller (p2pnode.node.progress). A call
        cancelled here (the swarm caller gave up) is abandoned by the SDK, which sends the
        server ``notifications/cancelled``."""
        reporter = current_progress()
        with anyio.CancelScope(deadline=anyio.current_time() + self.timeout) as timer:

            async def progressed(progress: float, total: float | None, message: str | None) -> None:
                timer.deadline = anyio.current_time() + self.timeout
                if reporter is not None:
                    await reporter.report(progress, total, message)

            return await self._ask(
                lambda: self.session.call_tool(name, arguments, progress_callback=progressed),
                timed=False,  # the idle timer above instead
            )
        raise RemoteError(
            ErrorCode.TIMEOUT, f"the MCP server did not answer within {self.timeout:g} s"
        )

    def resource(self, uri: str) -> Callable[[], Awaitable[Any]]:
        async def load() -> Any:
            result = await self._ask(lambda: self.session.read_resource(uri))
            contents = result.contents
            if len(contents) == 1:
                [content] = contents
                if isinstance(content, types.BlobResourceContents):
                    try:
                        return base64.b64decode(content.blob, validate=True)
                    except (binascii.Error, ValueError):
                        raise RemoteError(
                            ErrorCode.INVALID_OUTPUT, f"{uri}: the blob is not base64", uri=uri
                        ) from None
                return content.text
            return [_plain(content) for content in contents]

        return load

    def prompt(self, name: str, declared: list[PromptArgument]) -> Callable[..., Awaitable[Any]]:
        optional = {a.name for a in declared if not a.required}

        async def render(**values: str) -> Any:
            # The catalog passes "" for an optional argument not given: not passed on.
            given = {k: v for k, v in values.items() if v or k not in optional}
            result = await self._ask(lambda: self.session.get_prompt(name, given))
            return [_plain(message) for message in result.messages]

        return render

    async def _ask(self, request: Callable[[], Awaitable[P]], *, timed: bool = True) -> P:
        try:
            with anyio.fail_after(self.timeout if timed else None):
                return await request()
        except TimeoutError:
            raise RemoteError(
                ErrorCode.TIMEOUT, f"the MCP server did not answer within {self.timeout:g} s"
            ) from None
        except MCPError as exc:
            raise RemoteError(code_of_mcp_error(exc.code), exc.message[:MAX_TEXT]) from None
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise RemoteError(ErrorCode.AGENT_UNAVAILABLE, "the MCP server is gone") from None
        except RuntimeError as exc:  # the SDK's own check of a result (its output schema)
            raise RemoteError(ErrorCode.INVALID_OUTPUT, str(exc)[:MAX_TEXT]) from None


def _plain(model: BaseModel) -> Any:
    return model.model_dump(by_alias=True, mode="json", exclude_none=True)


def _text(blocks: list[types.ContentBlock]) -> str:
    return " ".join(b.text for b in blocks if isinstance(b, types.TextContent))


__all__ = ["CALL_TIMEOUT", "mirror_agent"]
