"""The asyncio node's ``tools`` group, as the README's asyncio section promises it: the
trio node's tool operations under the same names, awaited from asyncio."""

from __future__ import annotations

import asyncio

import pytest

from p2pnode import Agent, Identity, NodeConfig, RemoteError, TrioNetwork, aio
from p2pnode.core.errors import ErrorCode

#: Every wait in these tests gives up after this long.
LIMIT = 10.0

toolbox = Agent("toolbox", tier=2)


@toolbox.tool()
def estimate(tasks: int, parallel: int = 1) -> dict[str, float]:
    """Estimate the hours a plan of tasks takes."""
    return {"hours": tasks * 1.5 / parallel}


@toolbox.resource("memo://checklist", mime_type="application/json")
def checklist() -> dict[str, list[str]]:
    """The steps every plan goes through."""
    return {"steps": ["scope", "estimate"]}


async def _use_tools() -> None:
    async with aio.open_node(Identity.generate(), TrioNetwork(), NodeConfig()) as node:
        await node.add_agent(toolbox)
        await node.add_agent(Agent("lead"))
        listing = await node.tools.list_tools(caller="lead")
        assert [tool["name"] for tool in listing.items] == ["toolbox.estimate"]
        assert listing.unreachable == {}
        result = await node.tools.call_tool("toolbox.estimate", {"tasks": 4}, caller="lead")
        assert result == {"hours": 6.0}
        # Held to the schema with no coercion, as on the trio node.
        with pytest.raises(RemoteError) as info:
            await node.tools.call_tool("toolbox.estimate", {"tasks": "4"}, caller="lead")
        assert info.value.code is ErrorCode.INVALID_INPUT
        assert info.value.message.startswith("arguments.tasks: '4' is not of type 'integer'")
        read = await node.tools.read_resource("memo://checklist", caller="lead")
        assert read["contents"][0]["uri"] == "memo://checklist"
        resources = await node.tools.list_resources(caller="lead")
        assert [r["uri"] for r in resources.items] == ["memo://checklist"]


@pytest.mark.slow
def test_the_asyncio_node_lists_and_calls_tools() -> None:
    async def main() -> None:
        await asyncio.wait_for(_use_tools(), LIMIT)

    asyncio.run(main())
