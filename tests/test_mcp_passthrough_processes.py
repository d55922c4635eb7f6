"""The same pass-through as processes (docs/protocol/mcp.md §2.4, §3.2): an MCP server
written here, hosted by one daemon (``p2pnode run --mcp-server``), called by the official
client directly and through ``p2pnode mcp serve`` on another daemon's node, gives the
same result for every content type; a refusal is an error result the client reads as
such; a timeout in ``_meta`` crosses the agent socket to the owner, progress comes back
through it, a client's cancel reaches the server, and a call in flight fails within 2 s
of the owner's node being killed (SIGKILL)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, cast

import mcp_types as types
import pytest
import trio
from mcp import ClientSession, StdioServerParameters, stdio_client

from p2pnode.core.errors import ErrorCode, P2PError
from tests.sim import wait_until
from tests.test_mcp_passthrough import EVERY_BLOCK, STRUCTURED, wire
from tests.test_mcp_processes import SEEN_TIMEOUT, call_until, env_for, two_nodes

FILES_SERVER = '''
import anyio
import mcp_types as types
from mcp.server import Server
from mcp.server.stdio import stdio_server

BLOCKS = {blocks!r}
STRUCTURED = {structured!r}


async def list_tools(ctx, params):
    return types.ListToolsResult(tools=[
        types.Tool(name="listing", input_schema={{"type": "object"}}),
        types.Tool(name="nap", input_schema={{"type": "object"}}),
        types.Tool(name="hang", input_schema={{"type": "object"}}),
        types.Tool(name="steps", input_schema={{"type": "object"}}),
    ])


async def call_tool(ctx, params):
    if params.name == "steps":
        for step in range(1, 7):
            await anyio.sleep(1)
            await ctx.session.report_progress(step, 6, f"step {{step}}")
        return types.CallToolResult(content=[types.TextContent(text="walked")])
    if params.name == "hang":
        with open({started!r}, "a") as started:  # one character per call begun
            started.write("+")
        try:
            await anyio.sleep(600)
        except anyio.get_cancelled_exc_class():
            open({marker!r}, "w").close()  # it heard notifications/cancelled
            raise
    if params.name == "nap":
        await anyio.sleep(5)
        return types.CallToolResult(content=[types.TextContent(text="rested")])
    return types.CallToolResult.model_validate(
        {{"content": BLOCKS, "structuredContent": STRUCTURED}}
    )


async def main():
    server = Server("files", on_list_tools=list_tools, on_call_tool=call_tool)
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


anyio.run(main)
'''


def stdio(command: list[str], env: dict[str, str]) -> StdioServerParameters:
    return StdioServerParameters(command=command[0], args=command[1:], env=env)


@pytest.mark.slow
async def test_every_content_type_is_the_same_directly_and_through_mcp_serve(
    tmp_path: Path,
) -> None:
    server = tmp_path / "files_server.py"
    marker = tmp_path / "cancelled"
    started = tmp_path / "started"
    server.write_text(
        FILES_SERVER.format(
            blocks=EVERY_BLOCK, structured=STRUCTURED, marker=str(marker), started=str(started)
        )
    )
    env = env_for(tmp_path)
    owner_args = ["--mcp-server", f"files={sys.executable} {server}"]
    with trio.fail_after(120):
        async with (
            stdio_client(stdio([sys.executable, str(server)], env)) as (read, write),
            ClientSession(read, write) as direct,
        ):
            await direct.initialize()
            straight = await direct.call_tool("listing", {})
        async with two_nodes(tmp_path, owner_args) as (owner, caller):
            await call_until(caller, "files.listing", {})  # the caller's node knows it
            serve = [sys.executable, "-m", "p2pnode", "--data-dir", str(caller.data_dir),
                     "mcp", "serve", "--agent-id", "ide"]  # fmt: skip
            async with (
                stdio_client(stdio(serve, env)) as (read, write),
                ClientSession(read, write) as session,
            ):
                await session.initialize()
                with trio.fail_after(SEEN_TIMEOUT):  # until mcp serve's node lists it
                    while True:
                        listed = [t.name for t in (await session.list_tools()).tools]
                        if "files.listing" in listed:
                            break
                        await trio.sleep(0.1)
                bridged = await session.call_tool("files.listing", {})
                assert wire(bridged) == wire(straight)
                assert wire(bridged)["content"] == EVERY_BLOCK
                # The caller's own deadline crosses the agent socket to the owner: 1 s.
                short = await session.call_tool(
                    "files.nap", {}, meta=cast(Any, {"p2pnode/timeout": 1})
                )
                assert short.is_error
                [block] = short.content
                assert isinstance(block, types.TextContent)
                assert block.text.startswith("TIMEOUT: ")
                assert short.structured_content is None
                rested = await session.call_tool(
                    "files.nap", {}, meta=cast(Any, {"p2pnode/timeout": 20})
                )
                assert not rested.is_error
                # Progress crosses the agent socket: a 6 s call reporting every second
                # outlives the caller's 3 s timeout, and the client hears each step.
                steps: list[float] = []

                async def heard(progress: float, total: float | None, message: str | None) -> None:
                    steps.append(progress)

                walked = await session.call_tool(
                    "files.steps", {}, progress_callback=heard,
                    meta=cast(Any, {"p2pnode/timeout": 3}),
                )  # fmt: skip
                assert not walked.is_error, walked
                assert steps == sorted(steps) and len(steps) >= 5
                # The client gives up a call: its cancel crosses mcp serve, the agent
                # socket, the swarm and the owner's bridge to the server.
                with trio.move_on_after(3):
                    await session.call_tool(
                        "files.hang", {}, meta=cast(Any, {"p2pnode/timeout": 600})
                    )
                await wait_until(marker.exists, SEEN_TIMEOUT)
            # The owner's node dies (SIGKILL) during a call that may run 600 s: the
            # caller's node fails it within 2 s, naming the owner, not at its deadline.
            failure: list[P2PError] = []

            async def hang() -> None:
                try:
                    await caller.call({"op": "tools.call", "name": "files.hang",
                                       "arguments": {}, "timeout": 600})  # fmt: skip
                except P2PError as exc:
                    failure.append(exc)

            async with trio.open_nursery() as calls:
                calls.start_soon(hang)
                await wait_until(lambda: started.read_text() == "++", SEEN_TIMEOUT)
                await owner.kill()
                killed = trio.current_time()
            failed_after = trio.current_time() - killed
            [error] = failure
            assert failed_after < 2.0, failed_after
            assert error.code is ErrorCode.DELIVERY_FAILED, error
            assert re.search(r"peer \w+ left: channel closed .*redials failed", error.message)
            assert "None" not in error.message
