"""Answers too large for one envelope are streamed (p2pnode.node.replystream): the parts
round-trip, a stream out of protocol is a typed error, and a tool's large result
crosses nodes."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode import Agent
from p2pnode.core.envelope import EnvelopeFactory, MessageType
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.wire import pack
from p2pnode.node.replystream import (
    CHUNK_BYTES,
    INLINE_LIMIT,
    MAX_STREAMED_BYTES,
    ReplyStream,
    stream_parts,
    surely_inline,
)
from tests.sim import connect_all, open_swarm, wait_until

factory = EnvelopeFactory(lambda: 1_700_000_000_000)
request = factory.create("caller", "owner", MessageType.REQUEST, None)


def received(parts: list[tuple[MessageType, Any]], final: Any) -> Any:
    stream = ReplyStream()
    for type_, payload in parts:
        stream.take(factory.reply(request, "owner", type_, payload))
    return stream.assemble(factory.reply(request, "owner", MessageType.RESPONSE, final)).payload


@settings(max_examples=15, deadline=None)
@given(
    st.integers(INLINE_LIMIT + 1, 3 * CHUNK_BYTES + 7),
    st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**63 - 1), max_size=4),
)
def test_parts_round_trip(size: int, extra: dict[str, int]) -> None:
    payload = {"text": "x" * size, "extra": extra}
    streamed = stream_parts(payload)
    assert streamed is not None
    parts, final = streamed
    assert [t for t, _ in parts[:1]] == [MessageType.STREAM_START]
    assert parts[-1][0] is MessageType.STREAM_END
    assert received(parts, final) == payload


def test_small_answers_are_not_streamed_and_huge_ones_refused() -> None:
    assert stream_parts({"a": "x" * 1000}) is None
    with pytest.raises(LocalError) as info:
        stream_parts("x" * (MAX_STREAMED_BYTES + 1))
    assert info.value.code is ErrorCode.MESSAGE_TOO_LARGE


_scalars = st.none() | st.booleans() | st.floats() | st.integers(-(2**63), 2**64 - 1)
_long_text = st.text(st.characters(min_codepoint=0x10000, max_codepoint=0x10FFFF), max_size=4096)


@settings(max_examples=40, deadline=None)
@given(
    _scalars
    | st.dictionaries(_long_text, _scalars | _long_text, max_size=16)
    | st.lists(st.just(""), max_size=300_000)
)
def test_what_is_left_unpacked_is_surely_within_one_envelope(payload: Any) -> None:
    # An answer is packed to measure it unless it is surely small: whatever the glance
    # lets through, four-byte characters at the longest strings included, must fit.
    if surely_inline(payload):
        assert len(pack(payload)) <= INLINE_LIMIT
        assert stream_parts(payload) is None
    big = [""] * (INLINE_LIMIT + 1)  # counts nothing by length, packs past the limit
    assert not surely_inline(big)
    assert stream_parts(big) is not None


def test_the_largest_map_the_glance_admits_fits() -> None:
    astral = "\U0001f600" * 4095
    widest = {chr(0x10000 + i) + astral: chr(0x10000 + i) + astral for i in range(16)}
    assert surely_inline(widest)
    assert len(pack(widest)) <= INLINE_LIMIT


def _parts() -> tuple[list[tuple[MessageType, Any]], Any]:
    streamed = stream_parts("y" * (2 * CHUNK_BYTES + 5))
    assert streamed is not None
    return streamed


def _reordered(parts: list[tuple[MessageType, Any]]) -> list[tuple[MessageType, Any]]:
    return [parts[0], parts[2], parts[1], *parts[3:]]


def _inflated(parts: list[tuple[MessageType, Any]]) -> list[tuple[MessageType, Any]]:
    start = dict(parts[0][1], bytes=MAX_STREAMED_BYTES + 1)
    return [(parts[0][0], start), *parts[1:]]


def _truncated(parts: list[tuple[MessageType, Any]]) -> list[tuple[MessageType, Any]]:
    return [*parts[:-2], parts[-1]]


def _tampered(parts: list[tuple[MessageType, Any]]) -> list[tuple[MessageType, Any]]:
    data = dict(parts[1][1], data=parts[2][1]["data"])
    return [parts[0], (parts[1][0], data), *parts[2:]]


def _garbage(parts: list[tuple[MessageType, Any]]) -> list[tuple[MessageType, Any]]:
    return [parts[0], (MessageType.STREAM_DATA, ["not", "an", "object"]), *parts[1:]]


@pytest.mark.parametrize("mangle", [_reordered, _inflated, _truncated, _tampered, _garbage])
def test_a_stream_out_of_protocol_is_malformed(mangle: Any) -> None:
    parts, final = _parts()
    with pytest.raises(RemoteError) as info:
        received(mangle(parts), final)
    assert info.value.code is ErrorCode.MALFORMED_MESSAGE


def test_a_peer_cannot_buffer_past_what_it_declared() -> None:
    parts, _ = _parts()
    stream = ReplyStream()
    stream.take(factory.reply(request, "owner", *parts[0]))
    for _ in range(10):  # data keeps coming: refused once past the declared size
        stream.take(factory.reply(request, "owner", *parts[1]))
    assert stream.problem is not None
    assert stream._chunks == []


async def test_a_large_tool_result_crosses_nodes(autojump_clock: object) -> None:
    owner = Agent("store")

    @owner.tool()
    def blob(n: int) -> str:
        return "z" * n

    async with open_swarm(2) as sw:
        a, b = sw.nodes
        await a.add_agent(owner)
        await b.add_agent(Agent("user"))
        await connect_all(sw.nodes)
        await wait_until(lambda: b.registry.find("store") is not None)
        for n in (10, 3_000_000, 20_000_000):
            assert await b.tools.call_tool("store.blob", {"n": n}) == "z" * n
        with pytest.raises(RemoteError) as info:
            await b.tools.call_tool("store.blob", {"n": MAX_STREAMED_BYTES + 10})
        assert info.value.code is ErrorCode.MESSAGE_TOO_LARGE
        assert info.value.details["agentId"] == "store"
        assert await b.tools.call_tool("store.blob", {"n": 3}) == "zzz"  # still serving
