"""The owner's audit of tool uses keeps a bounded amount per use: small arguments and
results as they are, large ones as a size and digest, and nothing of a large value
once the use is over (the digest of the event is computed at once for them)."""

from __future__ import annotations

import sys
from typing import Any

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.agent.definition import Agent
from p2pnode.agent.tools import PROMPTS_GET, RESOURCES_READ, TOOLS_CALL
from p2pnode.core.envelope import EnvelopeFactory, MessageType, Metadata, wall_clock_ms
from p2pnode.core.registry import Registry
from p2pnode.core.wire import pack
from p2pnode.node.events import EventKind
from p2pnode.node.observability import Observability
from p2pnode.services.tools.audit import (
    RECORDED_VALUE_BYTES,
    ToolAudit,
    arguments_digest,
    used_name,
)
from tests.test_tools import USER_CARD


def echo_tool_agent() -> Agent:
    agent = Agent("owner", tier=3)

    @agent.tool()
    def size(text: str) -> int:
        return len(text)

    return agent


def call(arguments: Any) -> Any:
    return EnvelopeFactory().create(
        "user",
        "owner",
        MessageType.REQUEST,
        {"name": "size", "arguments": arguments},
        metadata=Metadata(3, None, capability=TOOLS_CALL),
    )


async def test_large_arguments_are_digested_at_once_and_not_kept() -> None:
    events = Observability(wall_clock_ms)
    audit = ToolAudit(Registry(), events, lambda: None)
    agent = echo_tool_agent()
    text = "x" * (RECORDED_VALUE_BYTES + 1)
    arguments = {"text": text}
    digest = arguments_digest(arguments)
    packed = len(pack(arguments))
    envelope = call(arguments)
    reply = await audit.serve(agent, envelope, TOOLS_CALL, USER_CARD)
    assert reply is not None and reply.payload == {"structuredContent": len(text)}
    del envelope, arguments, reply
    await trio.lowlevel.checkpoint()
    # Only this frame holds the text now (and getrefcount's own argument): neither the
    # event ring nor the history keeps the arguments of a large use.
    assert sys.getrefcount(text) == 2
    (event,) = events.recent(kind=EventKind.TOOL_INVOCATION)
    assert event.arguments_digest == digest
    (record,) = audit.invocations()
    assert record.arguments == {"omitted": f"{packed} bytes", "sha256": digest}
    assert record.result == len(text)


async def test_small_arguments_are_kept_as_they_are() -> None:
    events = Observability(wall_clock_ms)
    audit = ToolAudit(Registry(), events, lambda: None)
    await audit.serve(echo_tool_agent(), call({"text": "abc"}), TOOLS_CALL, USER_CARD)
    (record,) = audit.invocations()
    assert record.arguments == {"text": "abc"} and record.result == 3
    (event,) = events.recent(kind=EventKind.TOOL_INVOCATION)
    assert event.arguments_digest == arguments_digest({"text": "abc"})


_anything = st.none() | st.integers() | st.text(max_size=80) | st.lists(st.integers(), max_size=2)


@settings(max_examples=200, deadline=None)
@given(
    owner=st.text(min_size=1, max_size=20),
    method=st.sampled_from([TOOLS_CALL, RESOURCES_READ, PROMPTS_GET]),
    params=st.none() | st.dictionaries(st.sampled_from(["name", "uri", "x"]), _anything),
)
def test_used_names_are_the_formatted_names(owner: str, method: str, params: Any) -> None:
    # The shortcut for plain tool names gives what the general formatting gives.
    body = params if isinstance(params, dict) else {}
    if method == RESOURCES_READ:
        expected = f"resource:{body.get('uri')!s:.256}"
    else:
        name = f"{owner}.{body.get('name')!s:.64}"
        expected = name if method == TOOLS_CALL else f"prompt:{name}"
    assert used_name(owner, method, params) == expected
