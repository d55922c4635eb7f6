"""Tools, resources and prompts (seed Properties 18-22 and 33), on one agent's catalog
and through nodes in the simulator: registration and listing, a call reaching its
handler, unique names, resource reads, prompt templates, the invocation metrics, and
the least-privilege rules (tiers, sandboxes, agents, peers, authority-endorsed roles)
checked against the caller the owner's node authenticated."""

from __future__ import annotations

import base64
import dataclasses
import json
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.agent import Agent
from p2pnode.card import AgentCard
from p2pnode.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.identity import Identity
from p2pnode.node.node import Node
from p2pnode.node.policy import PolicyConfig
from p2pnode.tools import (
    PROMPTS_GET,
    PROMPTS_LIST,
    RESOURCES_LIST,
    RESOURCES_READ,
    TOOLS_CALL,
    TOOLS_LIST,
    Access,
    Caller,
    Catalog,
    PromptArgument,
    template_fields,
)
from tests.sim import FAST_NODE, met, open_swarm, wait_until
from tests.strategies import json_values

# -- helpers ------------------------------------------------------------------------------------


def run_virtual(scenario: Callable[[], Awaitable[None]]) -> None:
    """Run ``scenario`` on trio's virtual clock (hypothesis examples cannot take the
    function-scoped ``autojump_clock`` fixture)."""
    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


def serve(catalog: Catalog, method: str, params: Any, caller: Caller | None = None) -> Any:
    """The catalog's answer to one MCP request, from a synchronous test."""
    return trio.run(catalog.serve, method, params, caller)


def failure(catalog: Catalog, method: str, params: Any, caller: Caller | None = None) -> P2PError:
    """The error the catalog answers one MCP request with."""
    with pytest.raises(P2PError) as info:
        serve(catalog, method, params, caller)
    return info.value


async def mesh(nodes: list[Node]) -> None:
    """Connect every pair of nodes and wait until each knows every other's cards (a
    star is not enough: a node learns only the cards of the peers it met)."""
    for i, node in enumerate(nodes):
        for other in nodes[i + 1 :]:
            await node.connect(other.listen_address)
    await wait_until(lambda: all(met(a, b) for a in nodes for b in nodes if a is not b))


def caller(
    agent_id: str = "user",
    *,
    tier: int = 3,
    sandbox: str | None = None,
    peer: str = "peer-user",
    roles: tuple[str, ...] = (),
) -> Caller:
    return Caller(agent_id, peer, tier, sandbox, frozenset(roles))


def text_of(prompt: dict[str, Any]) -> str:
    (message,) = prompt["messages"]
    assert message["role"] == "user" and message["content"]["type"] == "text"
    text: str = message["content"]["text"]
    return text


# -- strategies ---------------------------------------------------------------------------------

# Agent ids with a prefix: a planetary name ("io", "mars") must claim its assigned tier.
agent_ids = st.from_regex(r"ag[a-z0-9-]{0,8}", fullmatch=True)
tool_names = st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True)
texts = st.text(st.characters(codec="utf-8"), max_size=40)
_TYPES = ("string", "integer", "number", "boolean", "array", "object", "null")


@st.composite
def object_schemas(draw: st.DrawFn) -> dict[str, Any]:
    """An object schema with a few typed properties, some required."""
    properties = draw(
        st.dictionaries(
            st.from_regex(r"[a-z]{1,6}", fullmatch=True),
            st.sampled_from(_TYPES).map(lambda t: {"type": t}),
            max_size=3,
        )
    )
    schema: dict[str, Any] = {"type": "object", "properties": properties}
    if properties:
        required = draw(st.lists(st.sampled_from(sorted(properties)), unique=True))
        if required:
            schema["required"] = required
    return schema


output_schemas = st.none() | st.sampled_from(_TYPES).map(lambda t: {"type": t})
#: One tool as declared: (description, input schema, output schema or None).
tool_specs = st.tuples(texts, object_schemas(), output_schemas)
#: Tools of several agents: agent id -> tool name -> declaration.
tool_sets = st.dictionaries(
    agent_ids, st.dictionaries(tool_names, tool_specs, min_size=1, max_size=4), max_size=4
)


def returns(value: Any) -> Callable[[Any], Any]:
    """A tool function (taking the arguments object) that returns ``value``."""

    def tool(arguments: Any) -> Any:
        return value

    return tool


def declare(catalog: Catalog, name: str, spec: tuple[str, Any, Any]) -> None:
    description, schema, output = spec
    catalog.add_tool(
        returns(None), name=name, description=description, input_schema=schema, output_schema=output
    )


def descriptor(name: str, spec: tuple[str, Any, Any]) -> dict[str, Any]:
    """What ``tools/list`` must say of a tool declared with ``spec``."""
    description, schema, output = spec
    out = {"name": name, "description": description, "inputSchema": schema}
    return out if output is None else out | {"outputSchema": output}


# -- Property 18: registration and listing -------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(tool_sets)
def test_p18_a_catalog_lists_exactly_the_tools_registered(
    declared: dict[str, dict[str, tuple[str, Any, Any]]],
) -> None:
    for agent_id, tools in declared.items():
        catalog = Catalog(agent_id)
        for name, spec in tools.items():
            declare(catalog, name, spec)
        listed = serve(catalog, TOOLS_LIST, {})["tools"]
        assert sorted(listed, key=lambda t: t["name"]) == sorted(
            (descriptor(name, spec) for name, spec in tools.items()), key=lambda t: t["name"]
        )


@settings(max_examples=10, deadline=None)
@given(tool_sets)
def test_p18_a_node_lists_every_agents_tools_qualified_with_their_source(
    declared: dict[str, dict[str, tuple[str, Any, Any]]],
) -> None:
    expected = {
        f"{agent_id}.{name}": {"agentId": agent_id, **descriptor(f"{agent_id}.{name}", spec)}
        for agent_id, tools in declared.items()
        for name, spec in tools.items()
    }

    async def scenario() -> None:
        async with open_swarm(3) as sw:
            owners, asker = sw.nodes[:2], sw.nodes[2]
            for i, (agent_id, tools) in enumerate(declared.items()):
                agent = Agent(agent_id)
                for name, spec in tools.items():
                    declare(agent.catalog, name, spec)
                await owners[i % 2].add_agent(agent)
            await asker.add_agent(Agent("ASKER"))
            await mesh(sw.nodes)
            listing = await asker.tools.list_tools()
            assert {item["name"]: item for item in listing.items} == expected
            assert len(listing.items) == len(expected)
            assert listing.unreachable == {} and listing.dropped == 0

    run_virtual(scenario)


# -- Property 19: a call reaches the handler its owner registered --------------------------------


@settings(max_examples=100, deadline=None)
@given(
    st.lists(tool_names, min_size=1, max_size=6, unique=True),
    st.data(),
)
def test_p19_a_call_runs_the_handler_of_that_tool_and_returns_its_result(
    names: list[str], data: st.DataObject
) -> None:
    calls: list[tuple[str, Any]] = []
    catalog = Catalog("owner")
    for name in names:

        def handler(arguments: Any, name: str = name) -> Any:
            calls.append((name, arguments))
            return {"tool": name, "got": arguments}

        catalog.add_tool(handler, name=name, input_schema={"type": "object"})
    chosen = data.draw(st.sampled_from(names))
    arguments = data.draw(st.dictionaries(st.text(max_size=5), json_values, max_size=3))
    answer = serve(catalog, TOOLS_CALL, {"name": chosen, "arguments": arguments})
    assert answer == {"structuredContent": {"tool": chosen, "got": arguments}}
    assert calls == [(chosen, arguments)]


def owner_agent(agent_id: str, names: list[str]) -> Agent:
    """An agent whose tools answer who they are, who called and with what."""
    agent = Agent(agent_id)
    for name in names:

        def tool(arguments: Any, caller: Caller, name: str = name) -> Any:
            return [agent_id, name, caller.agent_id, arguments]

        agent.catalog.add_tool(tool, name=name, input_schema={"type": "object"})
    return agent


@settings(max_examples=8, deadline=None)
@given(
    st.dictionaries(agent_ids, st.lists(tool_names, min_size=1, max_size=3, unique=True),
                    min_size=1, max_size=3),
    st.dictionaries(
        st.from_regex(r"[a-z]{1,4}", fullmatch=True), st.integers(-(2**53), 2**53), max_size=2
    ),
)  # fmt: skip
def test_p19_through_nodes_each_call_reaches_its_owner(
    declared: dict[str, list[str]], arguments: dict[str, int]
) -> None:
    async def scenario() -> None:
        async with open_swarm(3) as sw:
            for i, (agent_id, names) in enumerate(declared.items()):
                await sw.nodes[i % 2].add_agent(owner_agent(agent_id, names))
            await sw.nodes[2].add_agent(Agent("ASKER"))
            await mesh(sw.nodes)
            for agent_id, names in declared.items():
                for name in names:
                    result = await sw.nodes[2].tools.call_tool(f"{agent_id}.{name}", arguments)
                    assert result == [agent_id, name, "ASKER", arguments]

    run_virtual(scenario)


# -- Property 20: one tool per qualified name -----------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(agent_ids, tool_names, texts, texts)
def test_p20_a_second_tool_of_a_name_is_refused(
    agent_id: str, name: str, first: str, second: str
) -> None:
    catalog = Catalog(agent_id)
    catalog.add_tool(returns(1), name=name, description=first, input_schema={"type": "object"})
    with pytest.raises(LocalError) as info:
        catalog.add_tool(returns(2), name=name, description=second)
    assert info.value.code is ErrorCode.DUPLICATE_TOOL
    assert f"{agent_id}.{name}" in info.value.message  # descriptive: names the tool
    assert info.value.details["tool"] == f"{agent_id}.{name}"
    # The first registration stands.
    (listed,) = serve(catalog, TOOLS_LIST, {})["tools"]
    assert listed["description"] == first
    assert serve(catalog, TOOLS_CALL, {"name": name}) == {"structuredContent": 1}
    # The same name under another agent is another tool.
    Catalog(agent_id + "x").add_tool(returns(2), name=name)


@settings(max_examples=50, deadline=None)
@given(agent_ids, tool_names)
def test_p20_a_second_prompt_of_a_name_is_refused(agent_id: str, name: str) -> None:
    catalog = Catalog(agent_id)
    catalog.add_prompt("first {x}", name=name)
    catalog.add_tool(returns(1), name=name)  # tools and prompts are apart
    with pytest.raises(LocalError) as info:
        catalog.add_prompt("second", name=name)
    assert info.value.code is ErrorCode.DUPLICATE_TOOL
    assert info.value.details["tool"] == f"{agent_id}.{name}"
    answer = serve(catalog, PROMPTS_GET, {"name": name, "arguments": {"x": "1"}})
    assert text_of(answer) == "first 1"


uris = st.from_regex(r"[a-z][a-z0-9+.-]{0,8}:[A-Za-z0-9/._~-]{1,40}", fullmatch=True)


@settings(max_examples=50, deadline=None)
@given(uris)
def test_p20_a_second_resource_of_a_uri_is_refused(uri: str) -> None:
    catalog = Catalog("owner")
    catalog.add_resource(lambda: "first", uri, name="one")
    with pytest.raises(LocalError) as info:
        catalog.add_resource(lambda: "second", uri, name="two")
    assert info.value.code is ErrorCode.DUPLICATE_TOOL
    assert info.value.details["tool"] == uri and uri in info.value.message
    assert serve(catalog, RESOURCES_READ, {"uri": uri})["contents"][0]["text"] == "first"


def test_p20_the_agent_decorators_refuse_a_second_name_too() -> None:
    agent = Agent("calc")

    @agent.tool()
    def add(a: int) -> int:
        return a

    with pytest.raises(LocalError) as info:

        @agent.tool(name="add")
        def other(a: int) -> int:
            return a

    assert info.value.code is ErrorCode.DUPLICATE_TOOL
    assert agent.card_offers()["tools"] == ("add",)


# -- Property 21: resource read round trip ---------------------------------------------------------

contents = st.one_of(
    st.text(max_size=60),
    st.binary(max_size=60),
    json_values.filter(lambda v: not isinstance(v, str)),
)
mime_types = st.from_regex(r"[a-z]{1,10}/[a-z0-9.+-]{1,12}", fullmatch=True)


def check_content(item: dict[str, Any], content: Any) -> None:
    """``item`` (one of ``contents``) carries ``content`` as MCP says: text as text,
    bytes as base64 ``blob``, other JSON data as its JSON text."""
    if isinstance(content, bytes):
        assert "text" not in item
        assert base64.b64decode(item["blob"], validate=True) == content
    elif isinstance(content, str):
        assert "blob" not in item and item["text"] == content
    else:
        assert json.loads(item["text"]) == content


@settings(max_examples=150, deadline=None)
@given(uris, contents, mime_types, texts)
def test_p21_reading_a_resource_returns_its_loaders_content_and_mime_type(
    uri: str, content: Any, mime: str, description: str
) -> None:
    catalog = Catalog("owner")
    catalog.add_resource(lambda: content, uri, name="r", description=description, mime_type=mime)
    listed = serve(catalog, RESOURCES_LIST, {})["resources"]
    assert listed == [{"uri": uri, "name": "r", "description": description, "mimeType": mime}]
    (item,) = serve(catalog, RESOURCES_READ, {"uri": uri})["contents"]
    assert item["uri"] == uri and item["mimeType"] == mime
    check_content(item, content)


async def test_p21_resources_read_through_nodes(autojump_clock: Any) -> None:
    docs = Agent("docs")
    stored = {
        "docs:readme": ("# p2pnode", "text/markdown"),
        "docs:logo": (bytes(range(256)), "image/png"),
        "docs:config": ({"retries": 3, "hosts": ["a", "b"]}, "application/json"),
    }
    for uri, (content, mime) in stored.items():
        docs.catalog.add_resource(lambda content=content: content, uri, mime_type=mime)

    @docs.resource("docs:async")
    async def later() -> str:
        await trio.sleep(0.5)
        return "loaded"

    async with open_swarm(2) as sw:
        owner, reader = sw.nodes
        await owner.add_agent(docs)
        await reader.add_agent(Agent("reader"))
        await mesh(sw.nodes)
        listing = await reader.tools.list_resources()
        assert {item["uri"]: item["mimeType"] for item in listing.items} == {
            **{uri: mime for uri, (_, mime) in stored.items()},
            "docs:async": "text/plain",
        }
        assert {item["agentId"] for item in listing.items} == {"docs"}
        for uri, (content, mime) in stored.items():
            (item,) = (await reader.tools.read_resource(uri))["contents"]
            assert item["mimeType"] == mime
            check_content(item, content)
        (item,) = (await reader.tools.read_resource("docs:async", agent="docs"))["contents"]
        assert item["text"] == "loaded"
        # No agent lists it: refused before anything is sent.
        with pytest.raises(LocalError) as missing:
            await reader.tools.read_resource("docs:nowhere")
        assert missing.value.code is ErrorCode.RESOURCE_NOT_FOUND
        assert missing.value.details["uri"] == "docs:nowhere"
        # The owner asked all the same: its own answer names the URI and the agent.
        with pytest.raises(RemoteError) as unknown:
            await reader.tools.read_resource("docs:nowhere", agent="docs")
        assert unknown.value.code is ErrorCode.RESOURCE_NOT_FOUND
        assert unknown.value.details["uri"] == "docs:nowhere"
        assert unknown.value.details["agentId"] == "docs"


def test_p21_a_loader_returning_what_is_not_content_is_the_owners_error() -> None:
    catalog = Catalog("owner")
    catalog.add_resource(lambda: {1, 2}, "x:set")
    error = failure(catalog, RESOURCES_READ, {"uri": "x:set"})
    assert error.code is ErrorCode.INVALID_OUTPUT
    assert error.details == {"uri": "x:set", "agentId": "owner"}


# -- Property 22: prompt templates ---------------------------------------------------------------

placeholders = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True)
#: A piece of literal template text and what it renders as ("{{" is a brace).
literals = st.lists(
    st.text(st.characters(codec="utf-8", exclude_characters="{}"), min_size=1, max_size=6).map(
        lambda t: (t, t)
    )
    | st.sampled_from([("{{", "{"), ("}}", "}")]),
    max_size=3,
).map(lambda parts: ("".join(p[0] for p in parts), "".join(p[1] for p in parts)))


@st.composite
def templates(draw: st.DrawFn) -> tuple[str, list[str], dict[str, str], str]:
    """(template, its placeholders in order of first use, values, the rendered text)."""
    names = draw(st.lists(placeholders, max_size=5, unique=True))
    uses = names + (draw(st.lists(st.sampled_from(names), max_size=3)) if names else [])
    order = draw(st.permutations(uses))
    pieces = draw(st.lists(literals, min_size=len(order) + 1, max_size=len(order) + 1))
    values = {n: draw(st.text(max_size=12)) for n in names}
    source, rendered = pieces[0]
    for name, (literal, shown) in zip(order, pieces[1:], strict=True):
        source += "{" + name + "}" + literal
        rendered += values[name] + shown
    first_use = list(dict.fromkeys(order))
    return source, first_use, values, rendered


@settings(max_examples=200, deadline=None)
@given(templates())
def test_p22_every_placeholder_is_replaced_by_its_argument(
    template: tuple[str, list[str], dict[str, str], str],
) -> None:
    source, names, values, rendered = template
    assert template_fields(source) == names
    catalog = Catalog("owner")
    catalog.add_prompt(source, name="p", description="a prompt")
    (listed,) = serve(catalog, PROMPTS_LIST, {})["prompts"]
    assert [a["name"] for a in listed["arguments"]] == names
    assert all(a["required"] for a in listed["arguments"])
    answer = serve(catalog, PROMPTS_GET, {"name": "p", "arguments": values})
    assert answer["description"] == "a prompt"
    assert text_of(answer) == rendered


@settings(max_examples=100, deadline=None)
@given(templates(), st.data())
def test_p22_a_missing_argument_is_invalid_input_naming_it(
    template: tuple[str, list[str], dict[str, str], str], data: st.DataObject
) -> None:
    source, names, values, _ = template
    if not names:
        return
    missing = data.draw(st.sampled_from(names))
    catalog = Catalog("owner")
    catalog.add_prompt(source, name="p")
    given_values = {k: v for k, v in values.items() if k != missing}
    error = failure(catalog, PROMPTS_GET, {"name": "p", "arguments": given_values})
    assert error.code is ErrorCode.INVALID_INPUT
    assert error.message.startswith(f"arguments.{missing}:")
    assert error.details == {"prompt": "p", "agentId": "owner"}


@pytest.mark.parametrize(
    "template",
    ["{a.b}", "{a[0]}", "{0}", "{}", "{a!r}", "{a:>3}", "{a:{b}}", "{a", "a}", "x {a-b} y"],
)
def test_p22_placeholders_other_than_plain_names_are_refused(template: str) -> None:
    with pytest.raises(LocalError) as info:
        template_fields(template)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    with pytest.raises(LocalError) as declared:
        Agent("a").add_prompt("p", template)
    assert declared.value.code is ErrorCode.INVALID_ARGUMENT


def test_p22_declared_arguments_optional_unknown_and_function_prompts() -> None:
    agent = Agent("writer")
    agent.add_prompt(
        "brief",
        "About {topic}{tone}",
        arguments=[PromptArgument("topic", "what"), PromptArgument("tone", required=False)],
    )
    with pytest.raises(LocalError) as undeclared:
        agent.add_prompt("bad", "{topic} {other}", arguments=["topic"])
    assert undeclared.value.code is ErrorCode.INVALID_ARGUMENT

    @agent.prompt(description="messages of my own")
    def review(code: str, language: str = "python") -> list[dict[str, Any]]:
        text = f"review this {language}: {code}"
        return [{"role": "user", "content": {"type": "text", "text": text}}]

    catalog = agent.catalog
    assert text_of(serve(catalog, PROMPTS_GET, {"name": "brief", "arguments": {"topic": "x"}})) == (
        "About x"
    )
    unknown = failure(catalog, PROMPTS_GET, {"name": "brief", "arguments": {"topic": "x", "y": ""}})
    assert unknown.code is ErrorCode.INVALID_INPUT
    assert unknown.message.startswith("arguments.y:")
    listed = {p["name"]: p for p in serve(catalog, PROMPTS_LIST, {})["prompts"]}
    assert listed["review"]["arguments"] == [
        {"name": "code", "description": "", "required": True},
        {"name": "language", "description": "", "required": False},
    ]
    answer = serve(catalog, PROMPTS_GET, {"name": "review", "arguments": {"code": "f()"}})
    assert text_of(answer) == "review this python: f()"
    assert answer["description"] == "messages of my own"


# -- Property 33: invocation metrics ------------------------------------------------------------


def metered_agents() -> tuple[Agent, Agent]:
    calc = Agent("calc", tier=2)

    @calc.tool()
    def add(a: int, b: int = 2) -> int:
        return a + b

    @calc.tool()
    def fail() -> int:
        raise RemoteError(ErrorCode.AGENT_UNAVAILABLE, "the backend is down")

    geo = Agent("geo")

    @geo.tool()
    def echo(a: int) -> int:
        return a

    return calc, geo


@settings(max_examples=8, deadline=None)
@given(st.lists(st.sampled_from(["calc.add", "calc.fail", "geo.echo", "calc.nope"]), max_size=12))
def test_p33_the_owners_metrics_count_every_invocation_per_tool(sequence: list[str]) -> None:
    async def scenario() -> None:
        calc, geo = metered_agents()
        async with open_swarm(3) as sw:
            calc_node, geo_node, user_node = sw.nodes
            await calc_node.add_agent(calc)
            await geo_node.add_agent(geo)
            await user_node.add_agent(Agent("user"))
            await mesh(sw.nodes)
            await user_node.tools.list_tools()  # listing is not an invocation
            failed: Counter[str] = Counter()
            for name in sequence:
                try:
                    await user_node.tools.call_tool(name, {"a": 1})
                except RemoteError:
                    failed[name.partition(".")[0]] += 1
            for node, owner in ((calc_node, "calc"), (geo_node, "geo")):
                expected = Counter(n for n in sequence if n.startswith(owner + "."))
                metrics = node.status()["metrics"]
                assert metrics["totalToolInvocations"] == sum(expected.values())
                assert metrics["toolInvocationsByTool"] == dict(expected)
                assert metrics["toolErrorCount"] == failed[owner]
                records = node.tool_audit.invocations()
                assert Counter(r.tool for r in records) == expected

    run_virtual(scenario)


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
