"""The MCP bridge (docs/protocol/mcp.md), with the official SDK on both sides.

Fast tests run the bridge in memory: the SDK's client against
:class:`SwarmServer` over a simulated swarm, and a FastMCP (``MCPServer``)
server mirrored into an agent of that swarm. The slow tests (test_mcp_cli.py)
run the commands as processes.
"""

from __future__ import annotations

import importlib.util
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import mcp_types as types
import pytest
import trio
from mcp import ClientSession
from mcp.client import Client
from mcp.client._memory import InMemoryTransport
from mcp.server.mcpserver import MCPServer
from mcp.shared.exceptions import MCPError
from mcp.shared.memory import create_client_server_memory_streams

from p2pnode import Agent
from p2pnode.agent.tools import Access, Caller
from p2pnode.bridges.mcp import MISSING_SDK, require_sdk
from p2pnode.bridges.mcp.mirror import mirror_agent
from p2pnode.bridges.mcp.names import NameMap, error_info, mcp_name, swarm_name
from p2pnode.bridges.mcp.serve import SwarmServer
from p2pnode.cli.mcp import access_rule, parse_server_option
from p2pnode.core.errors import ErrorCode, LocalError, P2PError
from p2pnode.node.service import ProgressCallback
from p2pnode.runtime import Node
from p2pnode.services.tools.client import Listing
from tests.sim import connect_all, open_swarm, wait_until


class NodeTools:
    """The SwarmTools of a node's ToolClient, as one of its agents (what AgentClient is
    for an attached process)."""

    def __init__(self, node: Node, caller: str) -> None:
        self.node = node
        self.caller = caller

    async def list_tools(self) -> Listing:
        return await self.node.tools.list_tools(self.caller)

    async def call_tool(self, name: str, arguments: dict[str, Any] | None = None) -> Any:
        return await self.node.tools.call_tool(name, arguments, caller=self.caller)

    async def call_tool_result(
        self,
        name: str,
        arguments: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (it travels to the owner)
        on_progress: ProgressCallback | None = None,
    ) -> Any:
        return await self.node.tools.call_tool_result(
            name, arguments, caller=self.caller, timeout=timeout, on_progress=on_progress
        )

    async def list_resources(self) -> Listing:
        return await self.node.tools.list_resources(self.caller)

    async def read_resource(self, uri: str, *, agent: str | None = None) -> dict[str, Any]:
        return await self.node.tools.read_resource(uri, caller=self.caller, agent=agent)

    async def list_prompts(self) -> Listing:
        return await self.node.tools.list_prompts(self.caller)

    async def get_prompt(
        self, name: str, arguments: dict[str, str] | None = None
    ) -> dict[str, Any]:
        return await self.node.tools.get_prompt(name, arguments, caller=self.caller)


def toolbox(agent_id: str = "toolbox") -> Agent:
    owner = Agent(agent_id, tier=2)

    @owner.tool()
    def add(a: int, b: int = 2) -> int:
        """Add two numbers."""
        return a + b

    @owner.tool()
    def plan(goal: str) -> dict[str, list[str]]:
        """Plan the steps towards a goal."""
        return {"steps": [f"understand {goal}", "do it"]}

    @owner.tool(access=Access(agents=["someone-else"]))
    def secret() -> str:
        return "no"

    @owner.tool()
    def whoami(caller: Caller) -> str:
        return caller.agent_id

    @owner.resource("memo://today", mime_type="application/json")
    def today() -> dict[str, int]:
        return {"tasks": 3}

    owner.add_prompt("greet", "Hello {name}", description="A greeting")
    return owner


@asynccontextmanager
async def bridged_swarm() -> AsyncIterator[tuple[Node, Node, SwarmServer]]:
    """Two connected nodes: ``owner`` hosting the toolbox, ``host`` hosting agent
    ``mcp-client`` that the SwarmServer uses the swarm as."""
    async with open_swarm(2) as sw:
        host, owner = sw.nodes
        await owner.add_agent(toolbox())
        await host.add_agent(Agent("mcp-client", tier=2))
        await connect_all([host, owner])
        await wait_until(lambda: host.registry.find("toolbox") is not None)
        yield host, owner, SwarmServer(NodeTools(host, "mcp-client"), poll_interval=0.05)


@asynccontextmanager
async def session_of(
    server: SwarmServer, messages: list[Any] | None = None
) -> AsyncIterator[ClientSession]:
    """The SDK's ClientSession (handshake era) connected to ``server`` in memory."""

    async def keep(message: Any) -> None:
        if messages is not None:
            messages.append(message)

    async with (
        create_client_server_memory_streams() as ((c_read, c_write), (s_read, s_write)),
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(server.run, s_read, s_write)
        async with ClientSession(c_read, c_write, message_handler=keep) as session:
            await session.initialize()
            yield session
        nursery.cancel_scope.cancel()


# -- names and errors ---------------------------------------------------------------------------


def test_swarm_names_become_mcp_names_and_back() -> None:
    assert mcp_name("toolbox.add") == "toolbox.add"
    assert mcp_name("node:eu/west.search") == "node_eu_west.search-fa87424c"  # mcp.md §2.3
    odd = mcp_name("node:eu/west.search")
    assert odd.startswith("node_eu_west.search-") and len(odd) == len("node_eu_west.search") + 9
    assert mcp_name("node:eu/west.search") == odd  # stable
    long = mcp_name("a" * 128 + ".tool")
    assert len(long) == 128
    names = NameMap()
    assert names.replace(["toolbox.add", "node:eu/west.search"]) == ["toolbox.add", odd]
    assert names.swarm(odd) == "node:eu/west.search"
    assert names.swarm("toolbox.add") == "toolbox.add"
    assert names.swarm("unknown.x") is None


def test_mcp_names_become_swarm_names() -> None:
    assert swarm_name("read_file") == "read_file"
    assert swarm_name("files.read") == "files_read"
    assert swarm_name("") is None
    long = swarm_name("x" * 80)
    assert long is not None and len(long) == 64 and long.startswith("x" * 55 + "-")


def test_a_swarm_error_crosses_with_code_owner_and_details() -> None:
    exc = LocalError(ErrorCode.PERMISSION_DENIED, "no", agentId="toolbox", caller="me")
    assert error_info(exc) == {
        "code": "PERMISSION_DENIED",
        "message": "no",
        "agentId": "toolbox",
        "details": {"agentId": "toolbox", "caller": "me"},
    }


def test_access_rules_and_server_options_from_the_command_line() -> None:
    rule = access_rule([("tier", "1"), ("tier", "2"), ("role", "ops")])
    assert rule is not None and rule.tiers == frozenset({1, 2})
    assert rule.roles == frozenset({"ops"})
    assert access_rule([]) is None
    with pytest.raises(LocalError) as info:
        access_rule([("colour", "red")])
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    with pytest.raises(LocalError):
        access_rule([("tier", "7")])
    assert parse_server_option("fs=npx -y server '/tmp/a b'") == (
        "fs",
        ("npx", "-y", "server", "/tmp/a b"),
    )
    with pytest.raises(LocalError):
        parse_server_option("fs")


def test_a_missing_sdk_is_an_error_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mcp" else real(name, *a)
    )
    with pytest.raises(LocalError) as info:
        require_sdk()
    assert info.value.code is ErrorCode.CONFIG_ERROR and info.value.message == MISSING_SDK


# -- serve: the swarm for an MCP client ---------------------------------------------------------


async def test_an_mcp_client_lists_and_calls_the_swarms_tools() -> None:
    with trio.fail_after(20):
        async with bridged_swarm() as (_, owner, server), session_of(server) as session:
            tools = {t.name: t for t in (await session.list_tools()).tools}
            assert sorted(tools) == ["toolbox.add", "toolbox.plan", "toolbox.whoami"]
            add = tools["toolbox.add"]
            assert add.description == "Add two numbers."
            assert add.input_schema["properties"]["a"]["type"] == "integer"
            # A non-object result is wrapped, as FastMCP does.
            assert add.output_schema is not None
            assert add.output_schema["properties"]["result"]["type"] == "integer"
            assert add.meta == {"p2pnode/agentId": "toolbox", "p2pnode/name": "toolbox.add"}
            result = await session.call_tool("toolbox.add", {"a": 40})
            assert not result.is_error and result.structured_content == {"result": 42}
            assert isinstance(result.content[0], types.TextContent)
            assert result.content[0].text == "42"
            plan = await session.call_tool("toolbox.plan", {"goal": "ship"})
            assert plan.structured_content == {"steps": ["understand ship", "do it"]}
            me = await session.call_tool("toolbox.whoami", {})
            assert me.structured_content == {"result": "mcp-client"}  # the owner's caller
            by_tool = owner.status()["metrics"]["toolInvocationsByTool"]
            assert by_tool["toolbox.add"] == 1


async def test_swarm_errors_are_mcp_error_results_with_code_and_source_agent() -> None:
    with trio.fail_after(20):
        async with bridged_swarm() as (_, _owner, server), session_of(server) as session:
            refused = await session.call_tool("toolbox.secret", {})
            assert refused.is_error
            assert isinstance(refused.content[0], types.TextContent)
            assert refused.content[0].text.startswith("PERMISSION_DENIED: mcp-client may not")
            # The error's fields go in _meta: a structured result must match the schema.
            assert refused.structured_content is None
            error = (refused.meta or {})["p2pnode/error"]
            assert error["code"] == "PERMISSION_DENIED" and error["agentId"] == "toolbox"
            bad = await session.call_tool("toolbox.add", {"a": "x"})
            assert bad.is_error and (bad.meta or {})["p2pnode/error"]["code"] == "INVALID_INPUT"
            missing = await session.call_tool("toolbox.nothing", {})
            assert (missing.meta or {})["p2pnode/error"]["code"] == "TOOL_NOT_FOUND"
            with pytest.raises(MCPError) as info:
                await session.read_resource("memo://nothing")
            assert info.value.code == -32002
            assert info.value.data["code"] == "RESOURCE_NOT_FOUND"
            with pytest.raises(MCPError) as info:
                await session.get_prompt("toolbox.greet", {})
            assert info.value.code == -32602 and info.value.data["agentId"] == "toolbox"


async def test_an_mcp_client_reads_resources_and_gets_prompts() -> None:
    with trio.fail_after(20):
        async with bridged_swarm() as (_, _owner, server), session_of(server) as session:
            [resource] = (await session.list_resources()).resources
            assert (resource.uri, resource.mime_type) == ("memo://today", "application/json")
            read = await session.read_resource("memo://today")
            [content] = read.contents
            assert isinstance(content, types.TextResourceContents)
            assert content.text == '{"tasks":3}'
            [prompt] = (await session.list_prompts()).prompts
            assert prompt.name == "toolbox.greet" and prompt.description == "A greeting"
            assert [a.name for a in prompt.arguments or ()] == ["name"]
            got = await session.get_prompt("toolbox.greet", {"name": "Ann"})
            [message] = got.messages
            assert isinstance(message.content, types.TextContent)
            assert (message.role, message.content.text) == ("user", "Hello Ann")


async def test_the_tool_list_follows_the_swarm() -> None:
    with trio.fail_after(20):
        messages: list[Any] = []
        async with bridged_swarm() as (_host, owner, server), session_of(server, messages):
            await trio.sleep(0.2)  # the watch has its first snapshot
            await owner.add_agent(toolbox("toolbox2"))

            def notified(kind: type[Any]) -> bool:
                return any(isinstance(m, kind) for m in messages)

            await wait_until(lambda: notified(types.ToolListChangedNotification))
            await wait_until(lambda: notified(types.PromptListChangedNotification))
            messages.clear()
            await owner.remove_agent("toolbox2")
            await wait_until(lambda: notified(types.ToolListChangedNotification))


async def test_a_modern_client_hears_of_changes_on_its_listen_stream() -> None:
    with trio.fail_after(20):
        async with bridged_swarm() as (_host, owner, server), trio.open_nursery() as nursery:
            nursery.start_soon(server.watch)
            async with Client(server.server, mode="2026-07-28") as client:
                tools = await client.list_tools()
                assert "toolbox.add" in [t.name for t in tools.tools]
                async with client.listen(tools_list_changed=True) as subscription:
                    await owner.add_agent(toolbox("toolbox2"))
                    async for _event in subscription:
                        break
                tools = await client.list_tools()
                assert "toolbox2.add" in [t.name for t in tools.tools]
            nursery.cancel_scope.cancel()


# -- publish: an MCP server for the swarm -------------------------------------------------------


def fastmcp_server() -> MCPServer:
    server = MCPServer("notes", instructions="Notes kept by a FastMCP server")

    @server.tool()
    def shout(text: str) -> str:
        """Say it louder."""
        return text.upper()

    @server.tool(name="notes.count")
    def count(words: list[str]) -> dict[str, int]:
        """Count words."""
        return {"words": len(words)}

    @server.tool()
    def fail() -> str:
        raise ValueError("it went wrong")

    @server.resource("notes://today", mime_type="text/markdown")
    def today() -> str:
        """Today's notes."""
        return "# today"

    @server.prompt()
    def review(topic: str, tone: str = "kind") -> str:
        """Ask for a review."""
        return f"Review {topic}, {tone}."

    return server


async def test_an_mcp_servers_tools_become_an_agents_with_their_schemas() -> None:
    with trio.fail_after(20):
        async with open_swarm(2) as sw:
            host, caller_node = sw.nodes
            await caller_node.add_agent(Agent("asker", tier=2))
            await caller_node.add_agent(Agent("stranger", tier=3))
            async with (
                InMemoryTransport(fastmcp_server()) as (read, write),
                ClientSession(read, write) as session,
            ):
                await session.initialize()
                agent = await mirror_agent(session, "notes", tier=2, access=Access(tiers=[2]))
                assert sorted(agent.catalog.tools) == ["fail", "notes_count", "shout"]
                assert agent.description == "Notes kept by a FastMCP server"
                await host.add_agent(agent)
                await connect_all([host, caller_node])
                await wait_until(lambda: caller_node.registry.find("notes") is not None)
                tools = caller_node.tools
                listing = await tools.list_tools(caller="asker")
                shout = next(t for t in listing.items if t["name"] == "notes.shout")
                assert shout["inputSchema"]["properties"]["text"]["type"] == "string"
                assert shout["outputSchema"]["properties"]["result"]["type"] == "string"
                said = await tools.call_tool("notes.shout", {"text": "hi"}, caller="asker")
                assert said == {"result": "HI"}
                counted = await tools.call_tool(
                    "notes.notes_count", {"words": ["a", "b"]}, caller="asker"
                )
                assert counted == {"words": 2}
                with pytest.raises(P2PError) as info:
                    await tools.call_tool("notes.shout", {"text": 3}, caller="asker")
                assert info.value.code is ErrorCode.INVALID_INPUT  # checked by the owner
                with pytest.raises(P2PError) as info:
                    await tools.call_tool("notes.fail", {}, caller="asker")
                assert info.value.code is ErrorCode.HANDLER_FAILED
                assert "Error executing tool fail" in info.value.message
                assert info.value.details["agentId"] == "notes"
                with pytest.raises(P2PError) as info:
                    await tools.call_tool("notes.shout", {"text": "hi"}, caller="stranger")
                assert info.value.code is ErrorCode.PERMISSION_DENIED  # before the server
                content = await tools.read_resource("notes://today", caller="asker")
                assert content["contents"] == [
                    {"uri": "notes://today", "mimeType": "text/markdown", "text": "# today"}
                ]
                got = await tools.get_prompt("notes.review", {"topic": "p2p"}, caller="asker")
                assert got["messages"][0]["content"]["text"] == "Review p2p, kind."
                records = host.tool_audit.invocations()
                assert [r.agent_id for r in records][:2] == ["asker", "asker"]
