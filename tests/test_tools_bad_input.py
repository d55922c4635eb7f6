"""Bad input to tools is bounded and typed, and the node keeps serving: arguments near
and over the envelope limit, schema bombs in an owner's listing and in a card, cards
listing more tools than a card may (in a HELLO, in the DHT), malformed ``tools/list``
answers, and garbage ``params`` to the MCP methods."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

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
)
from p2pnode.core.card import (
    CARD_SIGNING_DOMAIN,
    MAX_PROMPTS,
    MAX_RESOURCES,
    MAX_TOOLS,
    AgentCard,
    card_problems,
)
from p2pnode.core.envelope import Metadata
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.core.identity import Identity
from p2pnode.core.jsonutil import b64encode, is_flat_json_map, is_json_value
from p2pnode.core.wire import canonical_pack, pack
from p2pnode.dht.records import ProviderInfo, RecordKind, SignedRecord, capability_key, card_key
from p2pnode.node.discovery import DhtDiscovery
from p2pnode.node.events import EventKind
from p2pnode.node.frames import FrameKind
from p2pnode.runtime import Node
from p2pnode.services.tools.client import MAX_LISTED, _past_frame_limits
from tests.sim import FAST_NODE, met, open_swarm, wait_until
from tests.strategies import one_field_replaced

MIB = 1024 * 1024
#: How long a request to a silent owner may take at most (the timeout is checked every
#: eighth of it), plus slack.
BOUND = FAST_NODE.request_timeout * 1.25 + 1


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def honest_agent() -> Agent:
    calc = Agent("calc", tier=2)

    @calc.tool()
    def echo(s: Any) -> Any:
        return s

    calc.add_prompt("greet", "Hello {name}, about {topic}")

    @calc.resource("calc:readme")
    def readme() -> str:
        return "# calc"

    return calc


class Scripted(Catalog):
    """What a hostile owner's node may answer: ``answer(method)`` to every MCP request,
    while its card lists one tool, resource and prompt (so that callers ask it)."""

    def __init__(self, owner: str, answer: Callable[[str], Any]) -> None:
        super().__init__(owner)
        self.answer = answer
        self.add_tool(lambda: None, name="t")
        self.add_resource(lambda: "", "x:r")
        self.add_prompt("p", name="p")

    async def serve(self, method: str, params: Any, caller: Caller | None) -> Any:
        return self.answer(method)


def scripted(agent_id: str, answer: Callable[[str], Any]) -> Agent:
    agent = Agent(agent_id)
    agent.catalog = Scripted(agent_id, answer)
    return agent


class Three(NamedTuple):
    calc: Node  # hosts the honest "calc"
    user: Node  # hosts "user", the caller
    evil: Node  # hosts what a test adds


async def mesh(nodes: list[Node]) -> None:
    """Connect every pair and wait until each knows every other's cards."""
    for i, node in enumerate(nodes):
        for other in nodes[i + 1 :]:
            await node.connect(other.listen_address)
    await wait_until(lambda: all(met(a, b) for a in nodes for b in nodes if a is not b))


@asynccontextmanager
async def three(*evil_agents: Agent) -> AsyncIterator[Three]:
    async with open_swarm(3) as sw:
        nodes = Three(*sw.nodes)
        await nodes.calc.add_agent(honest_agent())
        await nodes.user.add_agent(Agent("user"))
        for agent in evil_agents:
            await nodes.evil.add_agent(agent)
        await mesh(sw.nodes)
        yield nodes


async def still_serving(nodes: Three) -> None:
    assert await nodes.user.tools.call_tool("calc.echo", {"s": "still here"}) == "still here"


# -- arguments near and over the envelope limit ----------------------------------------------------


async def test_arguments_over_the_envelope_limit_are_refused_before_sending(
    autojump_clock: Any,
) -> None:
    async with three() as nodes:
        for size in (4 * MIB, 4 * MIB + 1, 9 * MIB):
            with trio.fail_after(1), pytest.raises(LocalError) as info:
                await nodes.user.tools.call_tool("calc.echo", {"s": "x" * size})
            assert info.value.code is ErrorCode.MESSAGE_TOO_LARGE
        assert nodes.calc.tool_audit.invocations() == []
        await still_serving(nodes)


async def test_arguments_near_the_limit_are_answered_or_refused_within_the_timeout(
    autojump_clock: Any,
) -> None:
    async with three() as nodes:
        # Just under the limit and within the decoder's limits: answered (the answer is
        # as large, and streamed back).
        big = ["x" * 1_000_000] * 3
        with trio.fail_after(BOUND):
            assert await nodes.user.tools.call_tool("calc.echo", {"s": big}) == big
        # Under the envelope limit but over what the owner's decoder takes in one
        # string: typed, and bounded by the request timeout.
        with trio.fail_after(BOUND), pytest.raises(P2PError):
            await nodes.user.tools.call_tool("calc.echo", {"s": "x" * (4 * MIB - 1024)})
        await still_serving(nodes)


@pytest.mark.parametrize(
    "argument",
    [
        pytest.param("x" * (MIB + 1), id="string-over-1MiB"),
        pytest.param([0] * 65_537, id="array-over-65536"),
        pytest.param(nested(29), id="nesting-past-the-frame-depth"),
    ],
)
def test_arguments_the_owner_cannot_decode_fail_at_once_and_blame_nobody(argument: Any) -> None:
    outcome: dict[str, Any] = {}

    async def call() -> None:  # run here, so what fails is the assertion, not a nursery
        async with three() as nodes:
            started = trio.current_time()
            with trio.fail_after(BOUND), pytest.raises(P2PError) as info:
                await nodes.user.tools.call_tool("calc.echo", {"s": argument})
            outcome["code"] = info.value.code
            outcome["took"] = trio.current_time() - started
            outcome["blamed"] = nodes.calc.events.recent(kind=EventKind.SECURITY)

    trio.run(call, clock=trio.testing.MockClock(autojump_threshold=0))
    assert outcome["code"] in (ErrorCode.MESSAGE_TOO_LARGE, ErrorCode.INVALID_ARGUMENT)
    assert outcome["took"] < 1
    assert outcome["blamed"] == []


def answers_a_set(envelope: Any) -> Any:
    """A catch-all handler (an agent with no catalog answers MCP methods itself) whose
    answer no reply can carry."""
    return {"tools": {1, 2}}


def fine_agent() -> Agent:
    fine = Agent("fine")

    @fine.tool()
    def ok() -> str:
        return "ok"

    return fine


async def test_a_catch_all_answer_no_reply_can_carry_ends_only_that_call(
    autojump_clock: Any,
) -> None:
    # Before the audit caught what wire.pack raises (LocalError), this answer to a
    # tools/call took the owner's node down with it.
    async with open_swarm(2) as sw:
        owner, user = sw.nodes
        await owner.add_agent("raw", answers_a_set)
        await owner.add_agent(fine_agent())
        await user.add_agent(Agent("user"))
        await mesh(sw.nodes)
        with trio.fail_after(BOUND), pytest.raises(P2PError):
            await user.tools.call_tool("raw.anything", {})
        assert await user.tools.call_tool("fine.ok") == "ok"


# -- schema bombs ----------------------------------------------------------------------------------


def ref_chain(length: int) -> dict[str, Any]:
    """A schema whose ``$ref`` leads through ``length`` definitions before any type."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(length)}
    defs[f"d{length}"] = {"type": "object"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def listing_of(entries: list[Any]) -> Callable[[str], Any]:
    """An owner answering ``tools/list`` with ``entries`` and every use with "used"."""

    def answer(method: str) -> Any:
        return {"tools": entries} if method == TOOLS_LIST else {"structuredContent": "used"}

    return answer


async def test_schema_bombs_in_a_listing_stay_bounded(autojump_clock: Any) -> None:
    chain = ref_chain(20_000)
    bombs = [
        scripted("chain", listing_of([{"name": "t", "inputSchema": chain}])),
        scripted("selfref", listing_of([{"name": "t", "inputSchema": {"$ref": "#"}}])),
        # Deeper than a frame may nest: the owner's answer is dropped on arrival.
        scripted("deep", listing_of([{"name": "t", "inputSchema": nested(40)}])),
    ]
    async with three(*bombs) as nodes:
        with trio.fail_after(BOUND):
            listing = await nodes.user.tools.list_tools()
        schemas = {item["name"]: item["inputSchema"] for item in listing.items}
        # Kept as data: a caller resolves no $ref of a listing.
        assert schemas["chain.t"] == chain and schemas["selfref.t"] == {"$ref": "#"}
        assert "calc.echo" in schemas
        assert listing.unreachable == {"deep": str(ErrorCode.TIMEOUT)}
        with trio.fail_after(1):
            assert await nodes.user.tools.call_tool("chain.t", {"a": 1}) == "used"
            assert await nodes.user.tools.call_tool("selfref.t", {}) == "used"
        await still_serving(nodes)


def looping_agent() -> Agent:
    """An agent whose own schemas are bombs: a capability whose card carries a
    self-referencing inputSchema, and tools whose $refs loop or lead nowhere."""
    agent = Agent("loopy")

    @agent.on_request("loop", input_schema={"$ref": "#"})
    def loop(message: Any) -> str:
        return "ran"

    cycle = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}

    @agent.tool(input_schema=cycle)
    def cyclic(arguments: Any) -> str:
        return "ran"

    @agent.tool(input_schema={"$ref": "#/$defs/missing"})
    def dangling(arguments: Any) -> str:
        return "ran"

    return agent


async def test_a_card_whose_schema_refers_to_itself_is_carried_and_checked_bounded(
    autojump_clock: Any,
) -> None:
    async with three(looping_agent()) as nodes:
        # The caller holds the card as it is: nothing on its side compiles the schema.
        (card,) = await nodes.user.find("loop")
        assert card.capabilities[0].input_schema == {"$ref": "#"}
        # The owner checks a request against it, boundedly: refused, typed.
        with trio.fail_after(1), pytest.raises(RemoteError) as looped:
            await nodes.user.request("user", "loopy", {}, metadata=Metadata(capability="loop"))
        assert looped.value.code is ErrorCode.INVALID_INPUT
        assert looped.value.message.startswith("payload: cannot be checked")
        for tool in ("cyclic", "dangling"):
            with trio.fail_after(1), pytest.raises(RemoteError) as info:
                await nodes.user.tools.call_tool(f"loopy.{tool}", {"a": 1})
            assert info.value.code is ErrorCode.INVALID_INPUT
            assert info.value.message.startswith("arguments: cannot be checked")
            assert info.value.details["agentId"] == "loopy"
        # Both nodes serve on.
        await still_serving(nodes)
        listing = await nodes.user.tools.list_tools()
        assert {"loopy.cyclic", "loopy.dangling", "calc.echo"} <= {i["name"] for i in listing.items}


# -- cards listing more than a card may ------------------------------------------------------------

#: Fields the owner's signature does not cover (p2pnode.core.card).
UNSIGNED = ("signature", "origin", "lastSeenAt", "endorsement")


def signed_card_bytes(
    owner: Identity, agent_id: str, now_ms: int, address: str = "10.0.0.4:7000", **lists: list[str]
) -> bytes:
    """A card's bytes with ``lists`` (tools, resources, prompts) of any length, signed
    by ``owner`` as a real card is: what a hostile peer can send, whatever the limits.
    ``address``: where its owner listens (find dials it)."""
    card = AgentCard(
        id=agent_id,
        name=agent_id,
        version="1",
        public_key=owner.public_key,
        issued_at=now_ms,
        expires_at=now_ms + 3_600_000,
        addresses=(address,),
    )
    plain = card.to_dict() | lists
    signed = {k: v for k, v in plain.items() if k not in UNSIGNED}
    plain["signature"] = b64encode(owner.sign(CARD_SIGNING_DOMAIN + canonical_pack(signed)))
    return pack(plain)


def too_many(key: str, count: int) -> list[str]:
    return [f"r:{i}" if key == "resources" else f"t{i}" for i in range(count)]


@pytest.mark.parametrize(("key", "limit"), [("tools", MAX_TOOLS), ("resources", MAX_RESOURCES),
                                            ("prompts", MAX_PROMPTS)])  # fmt: skip
@pytest.mark.parametrize("count", [None, 10_000])
def test_a_card_listing_more_than_its_limit_is_an_invalid_card(
    key: str, limit: int, count: int | None
) -> None:
    owner = Identity(bytes([9]) * 32)
    names = too_many(key, limit + 1 if count is None else count)
    plain = AgentCard(id="wide", name="W", version="1", public_key=owner.public_key).to_dict()
    problems = card_problems(plain | {key: names})
    assert problems == [f"card 'wide': {key}: more than {limit} entries"]
    with pytest.raises(LocalError) as local:
        AgentCard.from_dict(plain | {key: names})
    assert local.value.code is ErrorCode.INVALID_CARD
    with pytest.raises(RemoteError) as remote:
        AgentCard.from_dict_untrusted(plain | {key: names})
    assert remote.value.code is ErrorCode.INVALID_CARD
    offers: dict[str, Any] = {key: tuple(names)}
    with pytest.raises(LocalError):
        AgentCard(id="wide", name="W", version="1", public_key=owner.public_key, **offers)
    # At the limit it is a card.
    assert AgentCard.from_dict(plain | {key: names[:limit]}).id == "wide"


async def test_a_hello_carrying_a_card_with_too_many_tools_registers_nothing(
    autojump_clock: Any,
) -> None:
    async with three() as nodes:
        owner = Identity(bytes([3]) * 32)  # the evil node's own identity (tests.sim)
        assert owner.peer_id == nodes.evil.peer_id
        now = nodes.user.events.now_ms()
        link = nodes.evil.links.link(nodes.user.peer_id)
        for agent_id, count in (("wide", MAX_TOOLS + 1), ("huge", 10_000)):
            card = signed_card_bytes(owner, agent_id, now, tools=too_many("tools", count))
            await link.send(pack([FrameKind.HELLO, {"cards": [card], "addresses": []}]))
        # The same card within the limit, sent after them, shows the way was open.
        fine = signed_card_bytes(owner, "fine", now, tools=too_many("tools", 3))
        await link.send(pack([FrameKind.HELLO, {"cards": [fine], "addresses": []}]))
        await wait_until(lambda: nodes.user.registry.find("fine") is not None)
        assert nodes.user.registry.find("wide") is None
        assert nodes.user.registry.find("huge") is None
        refused = [
            e
            for e in nodes.user.events.recent(kind=EventKind.SECURITY)
            if e.peer == str(nodes.evil.peer_id)
        ]
        assert len(refused) >= 2
        assert await nodes.user.find("tool:t64") == []
        await still_serving(nodes)


async def test_a_dht_record_carrying_a_card_with_too_many_tools_is_ignored(
    autojump_clock: Any,
) -> None:
    async with open_swarm(4, FAST_NODE, dht=True) as sw:
        nodes = sw.nodes
        await nodes[1].add_agent(Agent("asker"))
        for node in nodes:
            await node.join()
        await wait_until(lambda: all(met(nodes[0], node) for node in nodes[1:]))
        publisher = sw.members[3]
        discovery = publisher.node.discovery if publisher.node else None
        assert isinstance(discovery, DhtDiscovery)
        dht, owner = discovery.dht, publisher.identity
        now = dht.wall_clock_ms()
        expires = now + 3_600_000

        async def publish(kind: RecordKind, key: bytes, payload: bytes) -> None:
            record = SignedRecord.create(owner, kind, key, 1, expires, payload)
            await dht.put_records(key, [record])

        for agent_id, tools in (("wide", too_many("tools", MAX_TOOLS + 1)), ("fine", ["c0"])):
            card = signed_card_bytes(owner, agent_id, now, tools=tools)
            await publish(RecordKind.CARD, card_key(owner.peer_id, agent_id), card)
            capability = f"tool:{tools[0]}"
            # With an address: a provider record without one is a withdrawal (dht.md §4.5).
            provider = ProviderInfo(capability, agent_id, (("10.0.0.4", 7000),)).to_bytes()
            await publish(RecordKind.PROVIDER, capability_key(capability), provider)
        asker = nodes[1]
        assert [c.id for c in await asker.find("tool:c0")] == ["fine"]
        assert await asker.find("tool:t0") == []
        assert asker.registry.find("wide") is None


# -- malformed listings ----------------------------------------------------------------------------


async def test_malformed_listings_are_dropped_and_counted(autojump_clock: Any) -> None:
    mixed = [
        5,
        "t",
        None,
        [],
        {"name": 3},
        {"name": "calc.echo"},  # another owner's name: a dot is not in a name
        {"name": "x" * 65},
        {"name": "odd", "description": 5},
        {"name": "ok"},
        {"name": "fine", "description": "d", "inputSchema": {"type": "object"}},
    ]
    many = [{"name": f"t{i}"} for i in range(10_000)]

    def resources_and_prompts(method: str) -> Any:
        if method == RESOURCES_LIST:
            return {"resources": [{"uri": 5}, {"uri": "x:1", "mimeType": 7}, {"uri": "x:ok"}]}
        if method == PROMPTS_LIST:
            many_arguments = [{"name": f"a{i}"} for i in range(65)]
            return {"prompts": [{"name": "p", "arguments": "a"}, {"name": "q",
                    "arguments": many_arguments}, {"name": "r"}]}  # fmt: skip
        return {"tools": "not a list"}

    owners = [
        scripted("mixed", listing_of(mixed)),
        scripted("many", listing_of(many)),
        scripted("garbage", listing_of([None] * 10_000)),
        scripted("other", resources_and_prompts),
        scripted("notamap", lambda method: ["tools"]),
    ]
    async with three(*owners) as nodes:
        with trio.fail_after(BOUND):
            listing = await nodes.user.tools.list_tools()
        by_owner: dict[str, list[str]] = {}
        for item in listing.items:
            by_owner.setdefault(item["agentId"], []).append(item["name"])
        assert by_owner["mixed"] == ["mixed.ok", "mixed.fine"]
        assert by_owner["many"] == [f"many.t{i}" for i in range(MAX_TOOLS)]
        assert "garbage" not in by_owner and by_owner["calc"] == ["calc.echo"]
        assert listing.dropped == (len(mixed) - 2) + (10_000 - MAX_TOOLS) + 10_000
        malformed = str(ErrorCode.MALFORMED_MESSAGE)
        assert listing.unreachable == {"other": malformed, "notamap": malformed}
        resources = await nodes.user.tools.list_resources()
        assert [(r["agentId"], r["uri"]) for r in resources.items if r["agentId"] == "other"] == [
            ("other", "x:ok")
        ]
        prompts = await nodes.user.tools.list_prompts()
        assert [p["name"] for p in prompts.items if p["agentId"] == "other"] == ["other.r"]
        assert prompts.dropped == 2
        await still_serving(nodes)


async def test_a_listing_keeps_at_most_max_listed_entries(autojump_clock: Any) -> None:
    full = listing_of([{"name": f"t{i}"} for i in range(MAX_TOOLS)])
    per_node = MAX_LISTED // MAX_TOOLS // 2 + 1  # two nodes' worth: past the limit
    async with open_swarm(3) as sw:
        user, *owners = sw.nodes
        await user.add_agent(Agent("user"))
        for n, node in enumerate(owners):
            for i in range(per_node):
                await node.add_agent(scripted(f"owner{n}-{i}", full))
        await mesh(sw.nodes)
        with trio.fail_after(BOUND):
            listing = await user.tools.list_tools()
        assert len(listing.items) == MAX_LISTED
        assert listing.dropped == 2 * per_node * MAX_TOOLS - MAX_LISTED
        assert listing.unreachable == {}


# -- garbage params --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "params", "prefix"),
    [
        (TOOLS_CALL, 5, "params: must be an object"),
        (TOOLS_CALL, [1], "params: must be an object"),
        (TOOLS_CALL, "echo", "params: must be an object"),
        (TOOLS_CALL, {}, "params.name: "),
        (TOOLS_CALL, {"name": ""}, "params.name: "),
        (TOOLS_CALL, {"name": 3}, "params.name: "),
        (TOOLS_CALL, {"name": "e" * 65}, "params.name: "),
        (TOOLS_CALL, {"name": "echo", "arguments": [1]}, "params.arguments: must be an object"),
        (TOOLS_CALL, {"name": "echo", "arguments": "s"}, "params.arguments: must be an object"),
        (TOOLS_CALL, {"name": "echo", "arguments": {}}, "arguments.s: "),
        (PROMPTS_GET, {"name": "greet", "arguments": {"name": 1, "topic": "t"}}, "arguments.name"),
        (PROMPTS_GET, {"name": "greet", "arguments": {"name": "", "topic": [1]}}, "arguments.to"),
        (PROMPTS_GET, {"name": "greet", "arguments": 7}, "params.arguments: must be an object"),
        (RESOURCES_READ, {"uri": 5}, "params.uri: "),
        (RESOURCES_READ, {"uri": "x:" + "y" * 200}, "params.uri: "),
        (RESOURCES_READ, None, "params.uri: "),
    ],
)  # fmt: skip
async def test_garbage_params_are_invalid_input_naming_the_key(
    autojump_clock: Any, method: str, params: Any, prefix: str
) -> None:
    async with three() as nodes:
        with trio.fail_after(1), pytest.raises(RemoteError) as info:
            await nodes.user.request("user", "calc", params, metadata=Metadata(capability=method))
        assert info.value.code is ErrorCode.INVALID_INPUT
        assert info.value.message.startswith(prefix), info.value.message
        assert info.value.details["agentId"] == "calc"
        await still_serving(nodes)


@functools.cache  # serving keeps no state: one catalog for every example
def fuzz_catalog() -> Catalog:
    catalog = Catalog("calc")

    def add(a: int, b: int = 2) -> int:
        return a + b

    catalog.add_tool(add)
    catalog.add_tool(lambda arguments: arguments, name="raw", input_schema={"type": "object"})
    catalog.add_prompt("Hello {name}", name="greet")
    catalog.add_resource(lambda: "text", "calc:readme")
    return catalog


VALID_PARAMS = [
    (TOOLS_CALL, {"name": "add", "arguments": {"a": 1, "b": 2}}),
    (TOOLS_CALL, {"name": "raw", "arguments": {"k": [1, {"x": None}]}}),
    (PROMPTS_GET, {"name": "greet", "arguments": {"name": "Ada"}}),
    (RESOURCES_READ, {"uri": "calc:readme"}),
    (TOOLS_LIST, {}),
]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(VALID_PARAMS).flatmap(
    lambda mp: st.tuples(st.just(mp[0]), one_field_replaced(mp[1]))))  # fmt: skip
def test_a_catalog_answers_any_params_or_raises_a_typed_error(case: tuple[str, Any]) -> None:
    method, params = case
    catalog = fuzz_catalog()
    try:
        trio.run(catalog.serve, method, params, None)
    except RemoteError as exc:
        assert exc.code in (
            ErrorCode.INVALID_INPUT,
            ErrorCode.INVALID_OUTPUT,  # "raw" echoing back bytes or NaN it was sent
            ErrorCode.TOOL_NOT_FOUND,
            ErrorCode.PROMPT_NOT_FOUND,
            ErrorCode.RESOURCE_NOT_FOUND,
        )
        assert exc.details["agentId"] == "calc"


_FLAT_VALUES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.binary(max_size=4)
    | st.lists(st.integers(), max_size=2)
)


@given(st.dictionaries(st.text(max_size=6) | st.integers(), _FLAT_VALUES, max_size=6))
def test_the_flat_arguments_shortcut_admits_only_what_both_walks_admit(value: Any) -> None:
    # is_flat_json_map lets the caller skip the JSON and frame-limit walks: whatever it
    # admits, both walks must admit too.
    if is_flat_json_map(value, max_str_len=8, max_items=4):
        assert is_json_value(value)
        assert _past_frame_limits(value) is None
        assert len(value) <= 4
        assert all(len(v) <= 8 for v in value.values() if isinstance(v, str))
    if is_flat_json_map(value, max_str_len=8, max_items=4, max_key_len=3):
        assert is_flat_json_map(value, max_str_len=8, max_items=4)
        assert all(len(k) <= 3 for k in value)
    elif all(isinstance(k, str) and len(k) <= 3 for k in value):
        # the key bound is the only difference: without it the answer is the same
        assert not is_flat_json_map(value, max_str_len=8, max_items=4)
