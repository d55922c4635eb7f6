"""An agent process attached over agent.sock uses the swarm's tools, resources and prompts
(the ``tools.*``, ``resources.*`` and ``prompts.*`` ops), as itself: the owner checks its
access rules against the attached agent's card."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from p2pnode import Agent
from p2pnode.agent.tools import Access, Caller
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.hosting.client import AgentClient
from p2pnode.services.attach.service import AgentSocket
from p2pnode.services.attach.wire import AGENT_SOCKET_NAME
from tests.sim import connect_all, open_swarm, wait_until


def toolbox() -> Agent:
    owner = Agent("toolbox", tier=2)

    @owner.tool()
    def add(a: int, b: int = 2) -> int:
        """Add two numbers."""
        return a + b

    @owner.tool(access=Access(agents=["someone-else"]))
    def secret() -> str:
        return "no"

    @owner.resource("memo://today", mime_type="application/json")
    def today() -> dict[str, int]:
        return {"tasks": 3}

    owner.add_prompt("greet", "Hello {name}")
    return owner


async def _raw_lines(path: Path, lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    stream = await trio.open_unix_socket(str(path))
    async with stream:
        await stream.send_all(b"".join(json.dumps(line).encode() + b"\n" for line in lines))
        received = b""
        while received.count(b"\n") < len(lines):
            chunk = await stream.receive_some(65536)
            assert chunk, "the node closed the connection"
            received += chunk
    return [json.loads(line) for line in received.splitlines()]


@pytest.mark.slow
async def test_an_attached_process_lists_and_uses_the_swarms_tools(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with open_swarm(2) as sw:
            host, owner_node = sw.nodes
            await owner_node.add_agent(toolbox())
            await connect_all([host, owner_node])
            path = tmp_path / AGENT_SOCKET_NAME
            await host.start_service(AgentSocket(host, path, tools=host.tools))
            async with AgentClient(Agent("proc", tier=2), path=path) as client:
                await wait_until(lambda: host.registry.find("toolbox") is not None)
                listing = await client.tools.list_tools()
                assert [t["name"] for t in listing.items] == ["toolbox.add"]
                assert listing.items[0]["agentId"] == "toolbox"
                assert await client.tools.call_tool("toolbox.add", {"a": 40}) == 42
                with pytest.raises(RemoteError) as info:  # the owner's refusal, as in-process
                    await client.tools.call_tool("toolbox.secret")
                assert info.value.code is ErrorCode.PERMISSION_DENIED
                assert info.value.details["caller"] == "proc"  # checked as the attached agent
                with pytest.raises(RemoteError) as info:
                    await client.tools.call_tool("toolbox.add", {"a": "x"})
                assert info.value.code is ErrorCode.INVALID_INPUT
                assert info.value.message.startswith("arguments.a:")
                read = await client.tools.read_resource("memo://today")
                assert read["contents"][0]["text"] == '{"tasks":3}'
                with pytest.raises(LocalError) as unknown:  # no owner known: the caller's side
                    await client.tools.read_resource("memo://nothing")
                assert unknown.value.code is ErrorCode.RESOURCE_NOT_FOUND
                prompt = await client.tools.get_prompt("toolbox.greet", {"name": "Ann"})
                assert prompt["messages"][0]["content"]["text"] == "Hello Ann"
                assert (await client.tools.list_prompts()).items[0]["name"] == "toolbox.greet"
                assert (await client.tools.list_resources()).items[0]["uri"] == "memo://today"
            by_tool = owner_node.status()["metrics"]["toolInvocationsByTool"]
            assert by_tool["toolbox.add"] == 2 and by_tool["toolbox.secret"] == 1


@pytest.mark.slow
async def test_tool_ops_check_their_keys_and_need_the_node_to_offer_them(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with open_swarm(1) as sw:
            [host] = sw.nodes
            with_tools, without = tmp_path / "a.sock", tmp_path / "b.sock"
            await host.start_service(AgentSocket(host, with_tools, tools=host.tools))
            await host.start_service(AgentSocket(host, without))
            attach: dict[str, Any] = {"op": "attach", "v": 1, "card": {"id": "raw"}}
            bad = [
                {"op": "tools.call", "id": 1, "name": "a.b", "arguments": [1]},
                {"op": "tools.call", "id": 2},
                {"op": "resources.read", "id": 3, "uri": "memo://x", "extra": 1},
                {"op": "tools.list", "id": 4, "name": "x"},
            ]
            replies = await _raw_lines(with_tools, [attach, *bad])
            assert replies[0]["ok"] is True
            for reply in replies[1:]:
                assert reply["ok"] is False and reply["error"]["code"] == "INVALID_ARGUMENT"
            attach["card"] = {"id": "raw2"}
            replies = await _raw_lines(without, [attach, {"op": "tools.list", "id": 1}])
            assert replies[1]["error"]["code"] == "INVALID_ARGUMENT"
            assert "no tool ops" in replies[1]["error"]["message"]


@pytest.mark.slow
async def test_an_attached_process_offers_tools_checked_and_audited_by_its_node(
    tmp_path: Path,
) -> None:
    with trio.fail_after(30):
        async with open_swarm(2) as sw:
            host, caller_node = sw.nodes
            await caller_node.add_agent(Agent("asker", tier=2))
            await caller_node.add_agent(Agent("stranger", tier=3))
            await connect_all([host, caller_node])
            path = tmp_path / AGENT_SOCKET_NAME
            await host.start_service(
                AgentSocket(host, path, tools=host.tools, audit=host.tool_audit)
            )
            proc = toolbox()
            proc.catalog.tools.pop("secret")

            @proc.tool(access=Access(tiers=[2]))
            def whoami(caller: Caller) -> str:
                return f"{caller.agent_id}@{caller.peer_id}"

            async with AgentClient(proc, path=path):
                await wait_until(
                    lambda: (
                        (c := caller_node.registry.find("toolbox")) is not None
                        and "whoami" in c.tools
                    )
                )
                card = caller_node.registry.find("toolbox")
                assert card is not None and card.resources == ("memo://today",)
                tools = caller_node.tools
                assert await tools.call_tool("toolbox.add", {"a": 1}, caller="asker") == 3
                me = await tools.call_tool("toolbox.whoami", caller="asker")
                assert me == f"asker@{caller_node.peer_id}"  # the node's authentication
                with pytest.raises(P2PError) as info:
                    await tools.call_tool("toolbox.whoami", caller="stranger")
                assert info.value.code is ErrorCode.PERMISSION_DENIED
                listing = await tools.list_tools(caller="stranger")
                assert [t["name"] for t in listing.items] == ["toolbox.add"]
                read = await tools.read_resource("memo://today", caller="asker")
                assert read["contents"][0]["mimeType"] == "application/json"
            records = host.tool_audit.invocations()
            assert [(r.tool, r.agent_id, r.error) for r in records] == [
                ("toolbox.add", "asker", None),
                ("toolbox.whoami", "asker", None),
                ("toolbox.whoami", "stranger", "PERMISSION_DENIED"),
                ("resource:memo://today", "asker", None),
            ]
            security = host.status()["metrics"]["securityByCode"]
            assert security.get("PERMISSION_DENIED") == 1
