"""Tools: access rules and endorsed roles, how a tool takes its arguments and the caller,
and what it returns or raises (split from tests/test_tools.py)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.agent.definition import Agent
from p2pnode.agent.tools import (
    PROMPTS_GET,
    PROMPTS_LIST,
    RESOURCES_LIST,
    RESOURCES_READ,
    TOOLS_CALL,
    TOOLS_LIST,
    Access,
    Caller,
    Catalog,
)
from p2pnode.core.card import AgentCard
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.core.identity import Identity
from p2pnode.node.policy import PolicyConfig
from tests.sim import FAST_NODE, open_swarm, wait_until
from tests.test_tools import caller, failure, mesh, returns, serve

# -- access rules ---------------------------------------------------------------------------------

_AGENTS, _PEERS, _SANDBOXES, _ROLES = ("ana", "bo"), ("p1", "p2"), ("lab", "ops"), ("admin", "ops")
callers = st.builds(
    Caller,
    agent_id=st.sampled_from(_AGENTS),
    peer_id=st.sampled_from(_PEERS),
    tier=st.integers(0, 3),
    sandbox=st.none() | st.sampled_from(_SANDBOXES),
    roles=st.frozensets(st.sampled_from(_ROLES)),
)
rules = st.fixed_dictionaries(
    {},
    optional={
        "tiers": st.frozensets(st.integers(0, 3)),
        "sandboxes": st.frozensets(st.sampled_from(_SANDBOXES)),
        "agents": st.frozensets(st.sampled_from(_AGENTS)),
        "peers": st.frozensets(st.sampled_from(_PEERS)),
        "roles": st.frozensets(st.sampled_from(_ROLES)),
    },
)


def admits(given_rules: dict[str, frozenset[Any]], who: Caller | None) -> bool:
    """The rule of :class:`Access`, written out: every rule given holds."""
    if not given_rules:
        return True
    if who is None:
        return False
    held = {
        "tiers": who.tier in given_rules.get("tiers", {who.tier}),
        "sandboxes": who.sandbox in given_rules.get("sandboxes", {who.sandbox}),
        "agents": who.agent_id in given_rules.get("agents", {who.agent_id}),
        "peers": who.peer_id in given_rules.get("peers", {who.peer_id}),
        "roles": bool(who.roles & given_rules["roles"]) if "roles" in given_rules else True,
    }
    return all(held.values())


@settings(max_examples=300, deadline=None)
@given(rules, st.none() | callers)
def test_an_entry_is_listed_and_usable_exactly_when_every_rule_admits_the_caller(
    given_rules: dict[str, frozenset[Any]], who: Caller | None
) -> None:
    access = Access(**given_rules)
    catalog = Catalog("owner")
    catalog.add_tool(returns("ok"), name="guarded", input_schema={}, access=access)
    catalog.add_tool(returns("ok"), name="open", input_schema={})
    catalog.add_resource(lambda: "ok", "x:guarded", access=access)
    catalog.add_prompt("ok", name="guarded", access=access)
    allowed = admits(given_rules, who)
    assert (access.refusal(who) is None) == allowed
    tools = {t["name"] for t in serve(catalog, TOOLS_LIST, {}, who)["tools"]}
    assert tools == ({"guarded", "open"} if allowed else {"open"})
    assert bool(serve(catalog, RESOURCES_LIST, {}, who)["resources"]) == allowed
    assert bool(serve(catalog, PROMPTS_LIST, {}, who)["prompts"]) == allowed
    uses = [
        (TOOLS_CALL, {"name": "guarded"}),
        (RESOURCES_READ, {"uri": "x:guarded"}),
        (PROMPTS_GET, {"name": "guarded"}),
    ]
    for method, params in uses:
        if allowed:
            serve(catalog, method, params, who)
        else:
            error = failure(catalog, method, params, who)
            assert error.code is ErrorCode.PERMISSION_DENIED
            assert error.details["agentId"] == "owner"
            assert error.details["caller"] == (who.agent_id if who else "an unknown caller")
    assert serve(catalog, TOOLS_CALL, {"name": "open"}, who) == {"structuredContent": "ok"}


def test_a_refusal_says_which_rule_failed() -> None:
    access = Access(tiers=[0, 1], sandboxes=["lab"], agents=["ana"], peers=["p1"], roles=["admin"])
    assert access.refusal(caller("ana", tier=3)) == "tier L3 is not one of L0, L1"
    assert "sandbox None" in (access.refusal(caller("ana", tier=0)) or "")
    assert "agent 'bo'" in (access.refusal(caller("bo", tier=0, sandbox="lab")) or "")
    assert "peer p2" in (access.refusal(caller("ana", tier=0, sandbox="lab", peer="p2")) or "")
    who = caller("ana", tier=0, sandbox="lab", peer="p1")
    assert access.refusal(who) == "no endorsed role among admin"
    assert access.refusal(dataclasses.replace(who, roles=frozenset({"admin"}))) is None
    assert access.refusal(None) == "the caller is not authenticated"
    assert Access().refusal(None) is None


def endorsed_roles_owner() -> Agent:
    owner = Agent("vault", tier=2)

    @owner.tool(access=Access(roles=["admin"]))
    def rotate_keys() -> str:
        return "rotated"

    @owner.tool()
    def roles(caller: Caller) -> list[str]:
        return sorted(caller.roles)

    return owner


AUTHORITY = Identity(bytes([200]) * 32)
CLOSED = dataclasses.replace(FAST_NODE, policy=PolicyConfig(authority_key=AUTHORITY.public_key))


async def test_roles_count_when_the_swarm_authority_endorsed_them(autojump_clock: Any) -> None:
    async with open_swarm(3, CLOSED) as sw:
        vault_node, admin_node, clerk_node = sw.nodes
        await vault_node.add_agent(endorsed_roles_owner(), authority=AUTHORITY)
        await admin_node.add_agent(Agent("boss"), authority=AUTHORITY, roles=("admin",))
        await clerk_node.add_agent(Agent("clerk"), authority=AUTHORITY, roles=("ops",))
        await mesh(sw.nodes)
        assert await admin_node.tools.call_tool("vault.roles") == ["admin"]
        assert await admin_node.tools.call_tool("vault.rotate_keys") == "rotated"
        assert await clerk_node.tools.call_tool("vault.roles") == ["ops"]
        with pytest.raises(RemoteError) as info:
            await clerk_node.tools.call_tool("vault.rotate_keys")
        assert info.value.code is ErrorCode.PERMISSION_DENIED
        listed = await clerk_node.tools.list_tools()
        assert [i["name"] for i in listed.items] == ["vault.roles"]


async def test_an_open_swarm_counts_no_role_a_caller_endorsed_itself(autojump_clock: Any) -> None:
    async with open_swarm(2) as sw:
        vault_node, forger_node = sw.nodes
        await vault_node.add_agent(endorsed_roles_owner())
        # Its own node's key as "authority": an endorsement anyone can make.
        await forger_node.add_agent(
            Agent("mallory"), authority=sw.members[1].identity, roles=("admin",)
        )
        await mesh(sw.nodes)
        assert await forger_node.tools.call_tool("vault.roles") == []
        with pytest.raises(RemoteError) as info:
            await forger_node.tools.call_tool("vault.rotate_keys")
        assert info.value.code is ErrorCode.PERMISSION_DENIED
        assert "no endorsed role" in info.value.message


async def test_a_closed_swarm_lets_no_forged_endorsement_reach_a_tool(autojump_clock: Any) -> None:
    rotated: list[str] = []
    owner = endorsed_roles_owner()

    @owner.tool(name="rotate", access=Access(roles=["admin"]))
    def rotate(caller: Caller) -> str:
        rotated.append(caller.agent_id)
        return "rotated"

    forger = Identity(bytes([201]) * 32)
    async with open_swarm(3, CLOSED) as sw:
        vault_node, forger_node, witness_node = sw.nodes
        await vault_node.add_agent(owner, authority=AUTHORITY)
        await witness_node.add_agent(Agent("witness"), authority=AUTHORITY)
        await forger_node.add_agent(Agent("mallory"), authority=forger, roles=("admin",))
        await vault_node.connect(forger_node.listen_address)
        await mesh([vault_node, witness_node])
        assert vault_node.registry.find("mallory") is None  # refused at admission
        with pytest.raises(P2PError):
            with trio.fail_after(2 * CLOSED.request_timeout):
                await forger_node.tools.call_tool("vault.rotate", caller="mallory")
        assert rotated == []
        assert await witness_node.tools.call_tool("vault.roles") == []


def test_a_caller_gets_only_the_roles_the_configured_authority_signed() -> None:
    owner = Identity(bytes([7]) * 32)
    card = AgentCard(id="ana", name="Ana", version="1", public_key=owner.public_key, tier=2)
    endorsed = card.with_endorsement(AUTHORITY, ("admin", "ops")).signed(owner)
    assert Caller.from_card(endorsed, AUTHORITY.public_key).roles == {"admin", "ops"}
    # No authority configured (an open swarm): no roles at all.
    assert Caller.from_card(endorsed, None).roles == frozenset()
    # Endorsed by someone else (the caller itself, say).
    self_made = card.with_endorsement(owner, ("admin",)).signed(owner)
    assert Caller.from_card(self_made, AUTHORITY.public_key).roles == frozenset()
    assert Caller.from_card(self_made, owner.public_key).roles == {"admin"}
    # The authority's signature over other roles: roles added after signing count not.
    plain = card.with_endorsement(AUTHORITY, ("ops",))
    assert plain.endorsement is not None
    widened = dataclasses.replace(
        plain, endorsement=dataclasses.replace(plain.endorsement, roles=("admin", "ops"))
    ).signed(owner)
    assert Caller.from_card(widened, AUTHORITY.public_key).roles == frozenset()
    # Nor does a tier or sandbox changed after the authority signed.
    moved = dataclasses.replace(endorsed, tier=0).signed(owner)
    assert Caller.from_card(moved, AUTHORITY.public_key).roles == frozenset()


# -- how a tool takes its arguments and the caller -------------------------------------------------


async def test_a_caller_parameter_is_the_authenticated_caller_never_an_argument() -> None:
    seen: list[Caller | None] = []
    catalog = Catalog("owner")

    def plain(x: int, caller: Caller) -> int:
        seen.append(caller)
        return x

    def optional(x: int, caller: Caller | None = None) -> int:
        seen.append(caller)
        return x

    def annotated(x: int, who: Annotated[Caller, "the caller"]) -> int:
        seen.append(who)
        return x

    for function in (plain, optional, annotated):
        spec = catalog.add_tool(function)
        # The schema a peer sees has the arguments only.
        assert spec.descriptor()["inputSchema"]["properties"].keys() == {"x"}
    ana = caller("ana", tier=1, roles=("admin",))
    forged = {"agent_id": "root", "peer_id": "p", "tier": 0, "sandbox": None, "roles": ["admin"]}
    for name in ("plain", "optional", "annotated"):
        answer = await catalog.serve(TOOLS_CALL, {"name": name, "arguments": {"x": 1}}, ana)
        assert answer == {"structuredContent": 1}
        assert seen.pop() is ana
        # A peer cannot hand in a caller of its choice.
        params = {"name": name, "arguments": {"x": 1, "caller": forged, "who": forged}}
        with pytest.raises(RemoteError) as info:
            await catalog.serve(TOOLS_CALL, params, ana)
        assert info.value.code is ErrorCode.INVALID_INPUT
        assert seen == []
    await catalog.serve(TOOLS_CALL, {"name": "optional", "arguments": {"x": 2}}, None)
    assert seen == [None]


async def test_a_tool_with_an_explicit_schema_takes_the_arguments_object() -> None:
    catalog = Catalog("owner")
    schema = {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "integer"}}},
        "required": ["items"],
        "additionalProperties": False,
    }

    def total(arguments: dict[str, Any], caller: Caller) -> dict[str, Any]:
        return {"sum": sum(arguments["items"]), "by": caller.agent_id}

    catalog.add_tool(total, input_schema=schema, output_schema={"type": "object"})
    (listed,) = (await catalog.serve(TOOLS_LIST, {}, None))["tools"]
    assert listed["inputSchema"] == schema
    answer = await catalog.serve(
        TOOLS_CALL, {"name": "total", "arguments": {"items": [1, 2, 3]}}, caller("ana")
    )
    assert answer == {"structuredContent": {"sum": 6, "by": "ana"}}
    for arguments, where in (
        ({"items": [1, "x"]}, "arguments.items[1]:"),
        ({}, "arguments:"),
        ({"items": [], "more": 1}, "arguments:"),
    ):
        with pytest.raises(RemoteError) as info:
            await catalog.serve(TOOLS_CALL, {"name": "total", "arguments": arguments}, None)
        assert info.value.code is ErrorCode.INVALID_INPUT
        assert info.value.message.startswith(where)
        assert info.value.details == {"tool": "total", "agentId": "owner"}


async def test_a_call_without_arguments_is_a_call_with_the_empty_object() -> None:
    # MCP lets tools/call leave "arguments" out, whichever way the tool got its schema.
    catalog = Catalog("owner")
    catalog.add_tool(lambda arguments: arguments, name="raw", input_schema={"type": "object"})

    def derived(limit: int = 3) -> int:
        return limit

    catalog.add_tool(derived)
    for name, result in (("raw", {}), ("derived", 3)):
        for params in ({"name": name}, {"name": name, "arguments": None}):
            assert await catalog.serve(TOOLS_CALL, params, None) == {"structuredContent": result}


@pytest.mark.parametrize(
    "schema",
    [
        5,
        "object",
        [{"type": "object"}],
        {"type": "nope"},
        {"$schema": "http://example.com/no-such-draft", "type": "object"},
        {"$schema": ["not", "a", "uri"]},
    ],
)
def test_a_schema_that_is_not_one_is_refused_at_declaration(schema: Any) -> None:
    with pytest.raises(LocalError) as info:
        Catalog("owner").add_tool(returns(1), name="t", input_schema=schema)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    with pytest.raises(LocalError) as output:
        Catalog("owner").add_tool(returns(1), name="t", output_schema=schema)
    assert output.value.code is ErrorCode.INVALID_ARGUMENT


def test_a_schema_of_a_known_draft_is_used() -> None:
    catalog = Catalog("owner")
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object"}
    catalog.add_tool(returns(1), name="t", input_schema=draft7)
    assert failure(catalog, TOOLS_CALL, {"name": "t", "arguments": []}).code is (
        ErrorCode.INVALID_INPUT
    )


# -- what a tool returns or raises ----------------------------------------------------------------


def misbehaving_agent() -> Agent:
    agent = Agent("shaky")

    @agent.tool()
    def wrong_type() -> int:
        return "seven"  # type: ignore[return-value]

    @agent.tool(output_schema={"type": "string"})
    def wrong_schema() -> Any:
        return 7

    @agent.tool()
    def not_json():  # type: ignore[no-untyped-def]  # no annotation: no output schema
        return {1, 2}

    @agent.tool()
    def typed_error() -> int:
        raise LocalError(ErrorCode.AGENT_UNAVAILABLE, "the backend is down", backend="db")

    @agent.tool()
    def odd_details() -> int:
        raise RemoteError(ErrorCode.AGENT_UNAVAILABLE, "down", since={1}, ok=[1])

    @agent.tool()
    def crash() -> int:
        raise ValueError("a secret the caller must not see")

    @agent.tool()
    async def fine() -> int:
        await trio.sleep(0.1)
        return 1

    return agent


async def test_what_a_tool_returns_is_checked_and_what_it_raises_is_typed(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_swarm(2) as sw:
        owner, user = sw.nodes
        await owner.add_agent(misbehaving_agent())
        await user.add_agent(Agent("user"))
        await mesh(sw.nodes)
        outcomes: dict[str, RemoteError] = {}
        for tool in ("wrong_type", "wrong_schema", "not_json", "typed_error", "odd_details"):
            with pytest.raises(RemoteError) as info:
                await user.tools.call_tool(f"shaky.{tool}")
            outcomes[tool] = info.value
            assert info.value.details["agentId"] == "shaky"
        for tool in ("wrong_type", "wrong_schema", "not_json"):
            assert outcomes[tool].code is ErrorCode.INVALID_OUTPUT
            assert outcomes[tool].message.startswith("result")
        assert outcomes["typed_error"].code is ErrorCode.AGENT_UNAVAILABLE
        assert outcomes["typed_error"].message == "the backend is down"
        assert outcomes["typed_error"].details["backend"] == "db"
        # Details a reply cannot carry are described, the rest kept, the code passed on.
        assert outcomes["odd_details"].code is ErrorCode.AGENT_UNAVAILABLE
        assert outcomes["odd_details"].details["since"] == "{1}"
        assert outcomes["odd_details"].details["ok"] == [1]
        with pytest.raises(RemoteError) as crashed:
            await user.tools.call_tool("shaky.crash")
        assert crashed.value.code is ErrorCode.HANDLER_FAILED
        assert crashed.value.details["agentId"] == "shaky"
        assert "secret" not in str(crashed.value)
        assert any("secret" in r.getMessage() or r.exc_info for r in caplog.records)
        # The owner serves on.
        assert await user.tools.call_tool("shaky.fine") == 1
        with pytest.raises(RemoteError) as unknown:
            await user.tools.call_tool("shaky.nope")
        assert unknown.value.code is ErrorCode.TOOL_NOT_FOUND
        assert unknown.value.details["agentId"] == "shaky"
        with pytest.raises(RemoteError) as no_prompt:
            await user.tools.get_prompt("shaky.nope")
        assert no_prompt.value.code is ErrorCode.PROMPT_NOT_FOUND


async def test_the_caller_of_an_id_two_owners_claim_is_the_owner_that_called(
    autojump_clock: Any,
) -> None:
    # "twin" is held by the first owner the vault met; the second owner's call must be
    # checked and answered as the second owner (its peer, its roles), never the first.
    async with open_swarm(3) as sw:
        vault_node, first, second = sw.nodes
        vault = Agent("vault", tier=3)

        def whoami(caller: Caller) -> list[Any]:
            return [caller.agent_id, caller.peer_id]

        vault.catalog.add_tool(whoami)
        await vault_node.add_agent(vault)
        await first.add_agent(Agent("twin", tier=3))
        await mesh([vault_node, first])
        await second.add_agent(Agent("twin", tier=3))
        await second.connect(vault_node.listen_address)
        await wait_until(lambda: len(vault_node.registry.owners("twin")) == 2)
        assert vault_node.registry.owners("twin")[0].peer_id == first.peer_id  # held
        assert await first.tools.call_tool("vault.whoami") == ["twin", str(first.peer_id)]
        assert await second.tools.call_tool("vault.whoami") == ["twin", str(second.peer_id)]
