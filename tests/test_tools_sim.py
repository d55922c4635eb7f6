"""Tools across a swarm of five nodes in the simulator, on trio's virtual clock: what a
listing shows each caller (its access and its sandbox), calls between nodes, refusals
and the security events they leave on the owner, an owner gone offline, validation
errors naming their path, the audit trail, and finding a tool's owner in the DHT."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

import pytest
import trio

from p2pnode.agent.definition import Agent
from p2pnode.agent.tools import Access, Caller
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.core.identity import Identity
from p2pnode.node.events import EventKind
from p2pnode.node.policy import PolicyConfig
from p2pnode.runtime import Node, NodeConfig
from p2pnode.services.tools.audit import arguments_digest
from tests.sim import FAST_NODE, Member, Swarm, met, open_swarm, wait_until

#: Members of a swarm have the identity ``bytes([index + 1]) * 32`` (tests.sim.nodes):
#: the user's node is the third.
USER_PEER = str(Identity(bytes([3]) * 32).peer_id)
#: The lab sandbox may talk to calc, and to nothing else.
CONFIG = dataclasses.replace(
    FAST_NODE, policy=PolicyConfig(sandbox_allow={"lab": frozenset({"calc"})})
)


def calc_agent() -> Agent:
    """An L2 agent with a tool for each kind of access rule."""
    calc = Agent("calc", tier=2)

    @calc.tool()
    def add(a: int, b: int = 2) -> int:
        """Add two numbers."""
        return a + b

    @calc.tool()
    def whoami(caller: Caller) -> dict[str, Any]:
        return {
            "agent": caller.agent_id,
            "peer": caller.peer_id,
            "tier": caller.tier,
            "sandbox": caller.sandbox,
        }

    @calc.tool(
        input_schema={
            "type": "object",
            "properties": {"items": {"type": "array", "items": {"type": "integer"}}},
            "required": ["items"],
        }
    )
    def pick(arguments: dict[str, Any]) -> int:
        return int(max(arguments["items"]))

    @calc.tool(access=Access(sandboxes=["lab"]))
    def lab_only() -> str:
        return "lab"

    @calc.tool(access=Access(tiers=[0, 1]))
    def chiefs() -> str:
        return "chiefs"

    @calc.tool(access=Access(agents=["user"]))
    def user_only() -> str:
        return "user"

    @calc.tool(access=Access(peers=[USER_PEER]))
    def user_node_only() -> str:
        return "user's node"

    calc.add_prompt("greet", "Hello {name}, about {topic}")

    @calc.resource("calc:readme", mime_type="text/markdown")
    def readme() -> str:
        return "# calc"

    return calc


def geo_agent() -> Agent:
    geo = Agent("geo")

    @geo.tool()
    def dist(a: int, b: int) -> int:
        return abs(a - b)

    return geo


class Five(NamedTuple):
    swarm: Swarm
    calc: Node
    geo: Node
    user: Node
    lab: Node
    chief: Node


async def mesh(nodes: list[Node]) -> None:
    """Connect every pair and wait until each knows every other's cards."""
    for i, node in enumerate(nodes):
        for other in nodes[i + 1 :]:
            await node.connect(other.listen_address)
    await wait_until(lambda: all(met(a, b) for a in nodes for b in nodes if a is not b))


@asynccontextmanager
async def five_nodes(config: NodeConfig = CONFIG) -> AsyncIterator[Five]:
    """calc (L2), geo (L3), user (L3), rat (L3 in sandbox lab) and chief (L0), each on
    its own node, all meshed."""
    async with open_swarm(5, config) as sw:
        five = Five(sw, *sw.nodes)
        assert str(five.user.peer_id) == USER_PEER
        await five.calc.add_agent(calc_agent())
        await five.geo.add_agent(geo_agent())
        await five.user.add_agent(Agent("user"))
        await five.lab.add_agent(Agent("rat", sandbox="lab"))
        await five.chief.add_agent(Agent("chief", tier=0))
        await mesh(sw.nodes)
        yield five


def names(items: list[dict[str, Any]]) -> set[str]:
    return {item["name"] for item in items}


EVERYONES = {"calc.add", "calc.whoami", "calc.pick"}


async def test_a_listing_shows_each_caller_every_reachable_tool_it_may_use(
    autojump_clock: Any,
) -> None:
    async with five_nodes() as five:
        expected = {
            five.user: EVERYONES | {"calc.user_only", "calc.user_node_only", "geo.dist"},
            # Sandboxed: geo is not even discoverable from the lab.
            five.lab: EVERYONES | {"calc.lab_only"},
            five.chief: EVERYONES | {"calc.chiefs", "geo.dist"},
        }
        for node, tools in expected.items():
            listing = await node.tools.list_tools()
            assert names(listing.items) == tools
            assert listing.unreachable == {} and listing.dropped == 0
            add = next(i for i in listing.items if i["name"] == "calc.add")
            assert add["agentId"] == "calc" and add["description"] == "Add two numbers."
            assert add["inputSchema"]["required"] == ["a"]
            assert add["outputSchema"] == {"type": "integer"}
        # The owner lists its own tools too; an owner its tier may not send to is not
        # asked (calc is L2, geo L3).
        own = await five.calc.tools.list_tools()
        assert names(own.items) == EVERYONES
        assert own.unreachable == {}
        assert five.geo.events.recent(kind=EventKind.SECURITY) == []
        prompts = await five.user.tools.list_prompts()
        assert names(prompts.items) == {"calc.greet"}
        resources = await five.lab.tools.list_resources()
        assert [(r["uri"], r["mimeType"]) for r in resources.items] == [
            ("calc:readme", "text/markdown")
        ]


async def test_calls_cross_nodes_and_run_as_the_authenticated_caller(autojump_clock: Any) -> None:
    async with five_nodes() as five:
        assert await five.user.tools.call_tool("calc.add", {"a": 1}) == 3
        assert await five.user.tools.call_tool("geo.dist", {"a": 1, "b": 5}) == 4
        assert await five.chief.tools.call_tool("geo.dist", {"a": 9, "b": 5}) == 4
        assert await five.chief.tools.call_tool("calc.chiefs") == "chiefs"
        assert await five.lab.tools.call_tool("calc.lab_only") == "lab"
        assert await five.user.tools.call_tool("calc.user_only") == "user"
        assert await five.user.tools.call_tool("calc.user_node_only") == "user's node"
        for node, agent, tier, sandbox in (
            (five.user, "user", 3, None),
            (five.lab, "rat", 3, "lab"),
            (five.chief, "chief", 0, None),
        ):
            assert await node.tools.call_tool("calc.whoami") == {
                "agent": agent,
                "peer": str(node.peer_id),
                "tier": tier,
                "sandbox": sandbox,
            }
        prompt = await five.chief.tools.get_prompt("calc.greet", {"name": "Ada", "topic": "maps"})
        assert prompt["messages"][0]["content"]["text"] == "Hello Ada, about maps"
        (readme,) = (await five.lab.tools.read_resource("calc:readme"))["contents"]
        assert readme == {"uri": "calc:readme", "mimeType": "text/markdown", "text": "# calc"}


def permission_denials(node: Node) -> list[Any]:
    return [
        e
        for e in node.events.recent(kind=EventKind.SECURITY)
        if e.code is ErrorCode.PERMISSION_DENIED
    ]


async def test_a_refused_call_is_permission_denied_and_a_security_event_on_the_owner(
    autojump_clock: Any,
) -> None:
    async with five_nodes() as five:
        refusals = [
            (five.user, "calc.lab_only", "sandbox None is not one of lab"),
            (five.lab, "calc.chiefs", "tier L3 is not one of L0, L1"),
            (five.chief, "calc.user_only", "agent 'chief' is not allowed"),
            (five.lab, "calc.user_node_only", f"peer {five.lab.peer_id} is not allowed"),
        ]
        for node, tool, reason in refusals:
            with pytest.raises(RemoteError) as info:
                await node.tools.call_tool(tool)
            assert info.value.code is ErrorCode.PERMISSION_DENIED
            assert info.value.message.endswith(reason)
            assert info.value.details["agentId"] == "calc"
        events = permission_denials(five.calc)
        assert [(e.sender, e.recipient, e.peer) for e in events] == [
            (caller, "calc", str(node.peer_id))
            for node, caller in ((five.user, "user"), (five.lab, "rat"), (five.chief, "chief"))
        ] + [("rat", "calc", str(five.lab.peer_id))]
        assert all(reason in e.detail for e, (_, _, reason) in zip(events, refusals, strict=True))
        assert five.calc.status()["metrics"]["securityByCode"]["PERMISSION_DENIED"] == 4
        # The sandbox refuses on the caller's own node: the request never leaves it.
        with pytest.raises(P2PError) as sandboxed:
            await five.lab.tools.call_tool("geo.dist", {"a": 1, "b": 2})
        assert sandboxed.value.code is ErrorCode.SANDBOX_VIOLATION
        assert five.geo.tool_audit.invocations() == []


async def test_an_owner_that_left_is_a_typed_error_and_no_longer_listed(
    autojump_clock: Any,
) -> None:
    async with five_nodes() as five:
        geo_member: Member = five.swarm.members[1]
        await five.swarm.stop(geo_member)  # a graceful stop withdraws geo
        gone = (ErrorCode.DELIVERY_FAILED, ErrorCode.AGENT_NOT_FOUND, ErrorCode.TIMEOUT)
        with trio.fail_after(CONFIG.request_timeout * 1.25 + 1):
            with pytest.raises(P2PError) as info:
                await five.user.tools.call_tool("geo.dist", {"a": 1, "b": 2})
            assert info.value.code in gone
            listing = await five.user.tools.list_tools()
        # It left: neither listed nor warned about as unreachable on every listing.
        assert listing.unreachable == {}
        assert names(listing.items) == EVERYONES | {"calc.user_only", "calc.user_node_only"}
        # The rest of the swarm serves on, and so does geo once it is back.
        assert await five.user.tools.call_tool("calc.add", {"a": 2}) == 4
        geo = await five.swarm.start(geo_member)
        await geo.add_agent(geo_agent())
        await geo.connect(five.user.listen_address)
        await wait_until(lambda: met(geo, five.user))
        assert await five.user.tools.call_tool("geo.dist", {"a": 1, "b": 2}) == 1


async def test_validation_errors_name_the_failing_path(autojump_clock: Any) -> None:
    async with five_nodes() as five:
        tools = five.user.tools
        cases = [
            (tools.call_tool("calc.add", {"a": "x"}), "arguments.a: "),
            (tools.call_tool("calc.add", {}), "arguments.a: Field required"),
            (tools.call_tool("calc.add", {"a": 1, "c": 2}), "arguments.c: "),
            (tools.call_tool("calc.pick", {"items": [1, "x"]}), "arguments.items[1]: "),
            (tools.call_tool("calc.pick", {"items": 3}), "arguments.items: "),
            (tools.get_prompt("calc.greet", {"name": "Ada"}), "arguments.topic: "),
            (tools.get_prompt("calc.greet", {"name": "A", "topic": "t", "x": ""}), "arguments.x: "),
        ]
        for call, prefix in cases:
            with pytest.raises(RemoteError) as info:
                await call
            assert info.value.code is ErrorCode.INVALID_INPUT
            assert info.value.message.startswith(prefix), info.value.message
            assert info.value.details["agentId"] == "calc"
        # Checked on the caller's side before anything is sent.
        with pytest.raises(LocalError) as unqualified:
            await tools.call_tool("add", {"a": 1})
        assert unqualified.value.code is ErrorCode.INVALID_ARGUMENT
        with pytest.raises(LocalError) as not_json:
            await tools.call_tool("calc.add", {"a": float("nan")})
        assert not_json.value.code is ErrorCode.INVALID_ARGUMENT


async def test_each_use_leaves_an_audit_event_and_a_record_on_the_owner(
    autojump_clock: Any,
) -> None:
    async with five_nodes() as five:
        await five.user.tools.list_tools()  # listing is not audited
        assert five.calc.events.recent(kind=EventKind.TOOL_INVOCATION) == []
        await five.user.tools.call_tool("calc.add", {"a": 1, "b": 5})
        with pytest.raises(RemoteError):
            await five.lab.tools.call_tool("calc.add", {"a": "one"})
        with pytest.raises(RemoteError):
            await five.user.tools.call_tool("calc.lab_only", {})
        await five.chief.tools.get_prompt("calc.greet", {"name": "Ada", "topic": "maps"})
        await five.user.tools.read_resource("calc:readme")
        events = five.calc.events.recent(kind=EventKind.TOOL_INVOCATION)
        assert [(e.sender, e.recipient, e.tool, e.success, e.code) for e in events] == [
            ("user", "calc", "calc.add", True, None),
            ("rat", "calc", "calc.add", False, ErrorCode.INVALID_INPUT),
            ("user", "calc", "calc.lab_only", False, ErrorCode.PERMISSION_DENIED),
            ("chief", "calc", "prompt:calc.greet", True, None),
            ("user", "calc", "resource:calc:readme", True, None),
        ]
        digests = [e.arguments_digest for e in events]
        assert digests[:3] == [
            arguments_digest({"a": 1, "b": 5}),
            arguments_digest({"a": "one"}),
            arguments_digest({}),
        ]
        assert digests[0] != digests[1] and all(len(d or "") == 16 for d in digests)
        assert all(e.duration_ms is not None and e.duration_ms >= 0 for e in events)
        plain = events[0].to_dict()
        for key in ("sender", "recipient", "tool", "argumentsDigest", "success", "durationMs"):
            assert key in plain
        # The caller's node audits nothing: the owner's node is where it happened.
        assert five.user.events.recent(kind=EventKind.TOOL_INVOCATION) == []
        records = five.calc.tool_audit.invocations()
        assert [(r.tool, r.agent_id, r.error) for r in records] == [
            (e.tool, e.sender, str(e.code) if e.code else None) for e in events
        ]
        assert records[0].arguments == {"a": 1, "b": 5}
        assert records[0].result == 6


async def test_the_dht_finds_the_owner_of_a_tool(autojump_clock: Any) -> None:
    async with open_swarm(6, FAST_NODE, seed=3, dht=True) as sw:
        nodes = sw.nodes
        await nodes[-1].add_agent(calc_agent())
        await nodes[1].add_agent(Agent("user"))
        for node in nodes:
            await node.join()
        await wait_until(lambda: all(met(nodes[0], node) for node in nodes[1:]))
        asker = nodes[1]
        assert asker.registry.find("calc") is None  # never met it
        (found,) = await asker.find("tool:add")
        assert found.id == "calc" and found.peer_id == nodes[-1].peer_id
        assert "add" in found.tools
        assert await asker.find("tool:no-such-tool") == []
        # Found is enough to call it: the card says where its owner is.
        assert await asker.tools.call_tool("calc.add", {"a": 40}) == 42
