"""The shortcuts of a tool call, each held to the general path it stands for: plain
results on the wire (docs/protocol/tools.md §3.2), results of a plain declared type
taken as they are, and the audit's names of used tools."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.agent.definition import Agent
from p2pnode.agent.tools import PLAIN_RESULT, TOOLS_CALL, Catalog
from p2pnode.core.envelope import Envelope, EnvelopeFactory, MessageType, Metadata, wall_clock_ms
from p2pnode.core.errors import P2PError
from p2pnode.core.jsonutil import is_json_value
from p2pnode.core.registry import Registry
from p2pnode.node.observability import Observability
from p2pnode.services.tools.audit import ToolAudit, used_name
from p2pnode.services.tools.client import ToolClient
from tests.test_tools import USER_CARD, returns, serve

_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
json_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["structuredContent", "content", "x"]), inner, max_size=2)
    ),
    max_leaves=6,
)


def owner_of(value: Any) -> Catalog:
    catalog = Catalog("owner")
    catalog.add_tool(returns(value), name="give", input_schema={})
    return catalog


class OneOwner:
    """The host of a ToolClient whose every request is answered by one catalog: one
    that knows plain results, or one that wraps every result as before they existed."""

    def __init__(self, catalog: Catalog, *, knows_plain: bool) -> None:
        self.catalog = catalog
        self.knows_plain = knows_plain
        self.asked: list[Any] = []
        self.factory = EnvelopeFactory()

    def local_agent(self, agent_id: str) -> Any:
        return _CARD  # what the client reads of the calling agent's card: its claims

    async def request(
        self, sender: str, recipient: str, payload: Any = None, *, metadata: Any = None
    ) -> Envelope:
        self.asked.append(payload)
        params = payload if self.knows_plain else {k: payload[k] for k in ("name", "arguments")}
        answer = await self.catalog.serve(TOOLS_CALL, params, None)
        return self.factory.create(recipient, sender, MessageType.RESPONSE, answer)


class _Card:
    tier = 3
    sandbox_id = None


_CARD = _Card()


@settings(max_examples=300, deadline=None)
@given(value=json_values)
def test_a_plain_result_goes_bare_only_when_asked_and_not_a_map(value: Any) -> None:
    if not is_json_value(value):
        return  # refused by the owner whichever form: not what this test is about
    catalog = owner_of(value)
    wrapped = {"structuredContent": value}
    assert serve(catalog, TOOLS_CALL, {"name": "give"}) == wrapped
    assert serve(catalog, TOOLS_CALL, {"name": "give", PLAIN_RESULT: False}) == wrapped
    answer = serve(catalog, TOOLS_CALL, {"name": "give", PLAIN_RESULT: True})
    assert answer == (wrapped if isinstance(value, dict) else value)


@settings(max_examples=300, deadline=None)
@given(value=json_values, knows_plain=st.booleans())
def test_the_caller_reads_the_result_from_owners_old_and_new(value: Any, knows_plain: bool) -> None:
    if not is_json_value(value):
        return
    host = OneOwner(owner_of(value), knows_plain=knows_plain)
    client = ToolClient(host, lambda: "user")  # type: ignore[arg-type]
    got = trio.run(client.call_tool, "owner.give", {"a": 1})
    assert got == value
    (asked,) = host.asked
    assert asked == {"name": "give", "arguments": {"a": 1}, PLAIN_RESULT: True}


def plain_typed_tools() -> Catalog:
    catalog = Catalog("owner")

    def to_int(value: Any) -> int:
        return value  # type: ignore[no-any-return]

    def to_str(value: Any) -> str:
        return value  # type: ignore[no-any-return]

    def to_bool(value: Any) -> bool:
        return value  # type: ignore[no-any-return]

    def to_float(value: Any) -> float:
        return value  # type: ignore[no-any-return]

    for function in (to_int, to_str, to_bool, to_float):
        catalog.add_tool(function)
    return catalog


PLAIN_TYPED = plain_typed_tools()


def general_finish(name: str, value: Any) -> tuple[str, Any]:
    """What the output check answers without its shortcut: the conversion, then the
    test that the value is JSON data."""
    result = PLAIN_TYPED.tools[name].result
    assert result is not None
    converted, problem = result.convert(value)
    if problem is not None or not is_json_value(converted):
        return "INVALID_OUTPUT", None
    return "ok", (type(converted), converted)


def finish(name: str, value: Any) -> tuple[str, Any]:
    try:
        converted = PLAIN_TYPED.tools[name].finish(value)
    except P2PError as exc:
        return str(exc.code), None
    return "ok", (type(converted), converted)


@settings(max_examples=400, deadline=None)
@given(
    name=st.sampled_from(["to_int", "to_str", "to_bool", "to_float"]),
    value=st.none()
    | st.booleans()
    | st.integers()
    | st.integers(2**63 - 2, 2**64 + 2)
    | st.integers(-(2**63) - 2, -(2**63) + 2)
    | st.floats()
    | st.text(max_size=4)
    | st.lists(st.integers(), max_size=2),
)
def test_a_result_of_its_plain_declared_type_is_what_the_general_check_makes_of_it(
    name: str, value: Any
) -> None:
    assert finish(name, value) == general_finish(name, value)


def test_a_plain_result_out_of_msgpack_range_is_refused() -> None:
    assert finish("to_int", 2**64) == ("INVALID_OUTPUT", None)
    assert finish("to_int", -(2**63) - 1) == ("INVALID_OUTPUT", None)
    assert finish("to_int", 2**64 - 1) == ("ok", (int, 2**64 - 1))
    assert finish("to_float", float("nan")) == ("INVALID_OUTPUT", None)


def use(params: Any) -> Envelope:
    """A tools/call request from ``user`` to ``owner`` with ``params``."""
    meta = Metadata(3, None, capability=TOOLS_CALL)
    return EnvelopeFactory().create("user", "owner", MessageType.REQUEST, params, metadata=meta)



_names = st.none() | st.integers() | st.text(max_size=70) | st.lists(st.integers(), max_size=1)


@settings(max_examples=200, deadline=None)
@given(
    name=_names,
    arguments=st.none() | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    keys=st.sets(st.sampled_from(["name", "arguments"])),
)
def test_the_audit_names_a_used_tool_as_used_name_does(
    name: Any, arguments: Any, keys: set[str]
) -> None:
    owner = Agent("owner", tier=3)
    owner.tool()(returns(1))
    params = {k: v for k, v in (("name", name), ("arguments", arguments)) if k in keys}
    envelope = use(params)
    audit = ToolAudit(Registry(), Observability(wall_clock_ms), lambda: None)
    trio.run(audit.serve, owner, envelope, TOOLS_CALL, USER_CARD)
    (record,) = audit.invocations()
    assert record.tool == used_name("owner", TOOLS_CALL, params)


@pytest.mark.parametrize("value", [3, "three", None, [3], {"n": 3}])
async def test_the_audit_records_a_plain_result_as_the_result(value: Any) -> None:
    owner = Agent("owner", tier=3)
    owner.catalog.add_tool(returns(value), name="give", input_schema={})
    audit = ToolAudit(Registry(), Observability(wall_clock_ms), lambda: None)
    for asked in (True, False):
        params: dict[str, Any] = {"name": "give", "arguments": {}, PLAIN_RESULT: asked}
        reply = await audit.serve(owner, use(params), TOOLS_CALL, USER_CARD)
        assert reply is not None
        plain = asked and not isinstance(value, dict)
        assert reply.payload == (value if plain else {"structuredContent": value})
    assert [r.result for r in audit.invocations()] == [value, value]
