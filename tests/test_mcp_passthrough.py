"""The MCP bridge passes everything through (docs/protocol/mcp.md §2.4, §3.2): a
published server's content blocks and structured content reach an MCP client through
``mcp serve`` exactly as the server sent them, a swarm error is an error result the
official client reads as such, progress crosses both bridges, and a caller that gives up
reaches the published server as ``notifications/cancelled``. In memory, with the
official SDK on both sides: a server written here, mirrored into an agent of one node,
and the SDK's client on :class:`SwarmServer` as an agent of another."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import anyio
import mcp_types as types
import pytest
import trio
from mcp import ClientSession
from mcp.client._memory import InMemoryTransport
from mcp.server import Server
from mcp.server.context import ServerRequestContext
from mcp.shared.memory import create_client_server_memory_streams

from p2pnode import Agent
from p2pnode.bridges.mcp.mirror import mirror_agent
from p2pnode.bridges.mcp.serve import SwarmServer
from p2pnode.runtime import Node
from tests.sim import connect_all, open_swarm, wait_until
from tests.test_mcp_bridge import NodeTools

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n not really").decode()
WAV = base64.b64encode(b"RIFF....WAVEfmt ").decode()

#: One block of every content type MCP defines, with annotations and _meta on some.
EVERY_BLOCK: list[dict[str, Any]] = [
    {"type": "text", "text": "six files", "annotations": {"audience": ["user"], "priority": 0.5}},
    {"type": "image", "data": PNG, "mimeType": "image/png"},
    {"type": "audio", "data": WAV, "mimeType": "audio/wav", "_meta": {"x/len": 16}},
    {"type": "resource_link", "uri": "file:///srv/a.txt", "name": "a.txt",
     "mimeType": "text/plain", "size": 12},
    {"type": "resource", "resource": {"uri": "file:///srv/b.md", "mimeType": "text/markdown",
                                      "text": "# b"}},
    {"type": "resource", "resource": {"uri": "file:///srv/c.bin",
                                      "mimeType": "application/octet-stream", "blob": PNG}},
]  # fmt: skip
STRUCTURED = {"count": 6, "names": ["a.txt", "b.md"]}
OUTPUT_SCHEMA = {
    "type": "object",
    "properties": {"count": {"type": "integer"}, "names": {"type": "array"}},
    "required": ["count"],
}


class Seen:
    """What the published server saw."""

    def __init__(self) -> None:
        self.cancelled = 0
        self.started = 0


def files_server(seen: Seen) -> Server[Any]:
    """A low-level server: ``listing`` answers every content type and structured content,
    ``plain`` only blocks, ``slow`` reports progress every 5 s for ``seconds``."""

    async def list_tools(
        ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(
            tools=[
                types.Tool(name="listing", input_schema={"type": "object"},
                           output_schema=OUTPUT_SCHEMA),
                types.Tool(name="plain", input_schema={"type": "object"}),
                types.Tool(name="slow", input_schema={
                    "type": "object", "properties": {"seconds": {"type": "integer"}}}),
            ]
        )  # fmt: skip

    async def call_tool(
        ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        if params.name == "listing":
            return types.CallToolResult.model_validate(
                {"content": EVERY_BLOCK, "structuredContent": STRUCTURED}
            )
        if params.name == "plain":
            return types.CallToolResult.model_validate({"content": EVERY_BLOCK[:2]})
        seconds = int((params.arguments or {}).get("seconds", 0))
        seen.started += 1
        try:
            for done in range(5, seconds + 1, 5):
                await anyio.sleep(5)
                await ctx.session.report_progress(done, seconds, f"{done} s")
        except anyio.get_cancelled_exc_class():
            seen.cancelled += 1
            raise
        return types.CallToolResult(content=[types.TextContent(text=f"slept {seconds}")])

    return Server("files", on_list_tools=list_tools, on_call_tool=call_tool)


@asynccontextmanager
async def published(seen: Seen) -> AsyncIterator[tuple[ClientSession, SwarmServer, Node]]:
    """The files server mirrored as agent ``files`` on one node, and a SwarmServer acting
    as agent ``ide`` of another; yields a direct session to the server too."""
    async with open_swarm(2) as sw:
        owner, host = sw.nodes
        await host.add_agent(Agent("ide", tier=2))
        async with (
            InMemoryTransport(files_server(seen)) as (read, write),
            ClientSession(read, write) as direct,
        ):
            await direct.initialize()
            await owner.add_agent(await mirror_agent(direct, "files", tier=2))
            await connect_all([owner, host])
            await wait_until(lambda: host.registry.find("files") is not None)
            yield direct, SwarmServer(NodeTools(host, "ide"), poll_interval=60), owner


@asynccontextmanager
async def client_of(server: SwarmServer) -> AsyncIterator[ClientSession]:
    """The SDK's ClientSession on ``server`` in memory."""
    async with (
        create_client_server_memory_streams() as ((c_read, c_write), (s_read, s_write)),
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(server.run, s_read, s_write)
        async with ClientSession(c_read, c_write) as session:
            await session.initialize()
            yield session
        nursery.cancel_scope.cancel()


def wire(result: types.CallToolResult) -> dict[str, Any]:
    """A result as it goes on the wire (what a client of any language reads)."""
    return result.model_dump(by_alias=True, mode="json", exclude_none=True)


async def test_every_content_type_arrives_through_mcp_serve_as_the_server_sent_it() -> None:
    seen = Seen()
    with trio.fail_after(30):
        async with published(seen) as (direct, server, _), client_of(server) as session:
            for name in ("listing", "plain"):
                straight = await direct.call_tool(name, {})
                bridged = await session.call_tool(f"files.{name}", {})
                assert wire(bridged) == wire(straight)
            bridged = await session.call_tool("files.listing", {})
            assert [b.type for b in bridged.content] == [
                "text", "image", "audio", "resource_link", "resource", "resource"
            ]
            assert bridged.structured_content == STRUCTURED and not bridged.is_error
            assert wire(bridged)["content"] == EVERY_BLOCK


async def test_a_swarm_error_is_an_error_result_without_structured_content() -> None:
    seen = Seen()
    with trio.fail_after(30):
        async with published(seen) as (_, server, _owner), client_of(server) as session:
            # An argument the server's input schema refuses: checked by the owner's node.
            refused = await session.call_tool("files.slow", {"seconds": "x"})
            assert refused.is_error
            assert refused.structured_content is None
            [block] = refused.content
            assert isinstance(block, types.TextContent)
            assert block.text.startswith("INVALID_INPUT: ")
            error = (refused.meta or {})["p2pnode/error"]
            assert (error["code"], error["agentId"]) == ("INVALID_INPUT", "files")
            # The session goes on.
            ok = await session.call_tool("files.plain", {})
            assert not ok.is_error


async def test_progress_crosses_both_bridges_and_keeps_a_long_call_alive(
    autojump_clock: Any,
) -> None:
    """A 90 s call of the published server, past its 30 s timer and the owner's 30 s
    tool deadline, reporting every 5 s: the client sees each report and the result."""
    seen = Seen()
    reports: list[tuple[float, float | None, str | None]] = []

    async def progressed(progress: float, total: float | None, message: str | None) -> None:
        reports.append((progress, total, message))

    async with published(seen) as (_, server, _owner), client_of(server) as session:
        start = trio.current_time()
        result = await session.call_tool(
            "files.slow",
            {"seconds": 90},
            progress_callback=progressed,
            meta=cast(Any, {"p2pnode/timeout": 20}),  # the SDK's TypedDict takes extra keys
        )
        elapsed = trio.current_time() - start
    assert not result.is_error, result
    # In order; the last report may race the result and be dropped (it says nothing new).
    assert [p for p, _, _ in reports] == list(range(5, 5 * len(reports) + 1, 5))
    assert len(reports) >= 17
    assert reports[0] == (5, 90, "5 s")
    assert 90 <= elapsed < 92


async def test_a_caller_that_gives_up_reaches_the_published_server_as_cancelled(
    autojump_clock: Any,
) -> None:
    seen = Seen()
    async with published(seen) as (_, _server, owner):
        host_tools = _server.tools
        with trio.move_on_after(7):
            await host_tools.call_tool_result("files.slow", {"seconds": 60}, timeout=20)
        await wait_until(lambda: seen.cancelled == 1)
        assert seen.started == 1 and trio.current_time() < 20
        assert owner.tool_audit.invocations()[-1].error == "TIMEOUT"


@pytest.mark.parametrize("value", [0, -5, "10", 86_401, True, None])
def test_a_timeout_that_is_no_number_of_seconds_is_not_passed_on(value: Any) -> None:
    from p2pnode.bridges.mcp.serve import _timeout

    assert _timeout({"p2pnode/timeout": value}) is None
    assert _timeout({"p2pnode/timeout": 90}) == 90.0


async def test_an_mcp_clients_cancel_reaches_the_published_server(autojump_clock: Any) -> None:
    """The client gives up: the SDK sends mcp serve notifications/cancelled, the swarm's
    cancel reaches the owner, and the published server is sent notifications/cancelled."""
    seen = Seen()
    async with published(seen) as (_, server, _owner), client_of(server) as session:
        with trio.move_on_after(7):
            await session.call_tool("files.slow", {"seconds": 60})
        await wait_until(lambda: seen.cancelled == 1)
        assert seen.started == 1 and trio.current_time() < 20
