"""Tools, resources and prompts (seed Properties 18-22 and 33), on one agent's catalog
and through nodes in the simulator: registration and listing, a call reaching its
handler, unique names, resource reads, prompt templates, the invocation metrics, and
the least-privilege rules (tiers, sandboxes, agents, peers, authority-endorsed roles)
checked against the caller the owner's node authenticated."""

from __future__ import annotations

import base64
import json
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

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
    Caller,
    Catalog,
    PromptArgument,
    template_fields,
)
from p2pnode.core.card import AgentCard
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.core.identity import Identity
from p2pnode.runtime import Node
from tests.sim import met, open_swarm, wait_until
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


USER = Identity(bytes(range(32)))
#: The card of ``user``, the sender of the tests' requests, as the kernel hands it to a
#: served method.
USER_CARD = AgentCard(
    id="user", name="user", version="1.0.0", public_key=USER.public_key, tier=3,
    expires_at=2**40,
).signed(USER)  # fmt: skip



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


#: An object schema's properties (built once: a strategy built at every draw is validated
#: again at every draw).
_properties = st.dictionaries(
    st.from_regex(r"[a-z]{1,6}", fullmatch=True),
    st.sampled_from(_TYPES).map(lambda t: {"type": t}),
    max_size=3,
)


#: A call's arguments.
_arguments = st.dictionaries(st.text(max_size=5), json_values, max_size=3)


@st.composite
def object_schemas(draw: st.DrawFn) -> dict[str, Any]:
    """An object schema with a few typed properties, some required."""
    properties = draw(_properties)
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
    arguments = data.draw(_arguments)
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
_placeholder_sets = st.lists(placeholders, max_size=5, unique=True)
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
    names = draw(_placeholder_sets)
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
