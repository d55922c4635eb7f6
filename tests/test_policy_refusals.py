"""A capability that exists but that policy forbids is reported as the refusal it is
(TIER_VIOLATION, SANDBOX_VIOLATION), never as CAPABILITY_NOT_FOUND; a shared document
no peer may replicate says so in `doc read` and `status`."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings

from p2pnode.cli.node import _doc_ops, _node_ops
from p2pnode.core.card import Capability
from p2pnode.core.envelope import Envelope
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.node.router import capability_refusal
from tests.sim import FAST_SHARED, connect_all, open_swarm, swarm, wait_until
from tests.test_router import agent_specs, world


async def echo(envelope: Envelope) -> Any:
    return {"from": envelope.recipient}


@settings(max_examples=200)
@given(agent_specs)
def test_refused_lists_every_provider_exactly_when_there_is_no_candidate(
    specs: list[tuple[int, int, int]],
) -> None:
    w = world([(0, specs[0][1], specs[0][2]), *specs])
    source = w.router.source("a0")
    refused = w.router.refused(source, "plan")
    offering = [c for c in w.registry.find_by_capability("plan") if c.id != source.id]
    if w.router.candidates(source, "plan") or not offering:
        assert refused == []
        return
    assert [r.card for r in refused] == offering
    for r in refused:
        assert not r.verdict.allowed
        assert r.visible == w.policy.can_discover(source, r.card)
    error = capability_refusal(source, "plan", refused)
    assert error.code is not ErrorCode.CAPABILITY_NOT_FOUND
    for r in refused:
        # What the source may discover is named; what it may not is only counted.
        assert (f"{r.card.id} (" in error.message) == r.visible


async def test_a_tier_refusal_of_every_provider_is_reported(autojump_clock: Any) -> None:
    async with swarm(2) as (_, (a, b)):
        await a.add_agent("earth", echo, tier=1)
        await b.add_agent("io", echo, tier=3, capabilities=(Capability("test.unit", "T"),))
        await connect_all([a, b])
        with pytest.raises(LocalError) as info:
            await a.request("earth", "test.unit", None, capability=True)
        assert info.value.code is ErrorCode.TIER_VIOLATION
        assert "io (TIER_VIOLATION" in info.value.message
        assert info.value.details["candidates"] == [{"agent": "io", "code": "TIER_VIOLATION"}]
        # A capability nobody offers is still "not found".
        with pytest.raises(LocalError) as info:
            await a.request("earth", "no.such.thing", None, capability=True)
        assert info.value.code is ErrorCode.CAPABILITY_NOT_FOUND


async def test_a_sandbox_refusal_is_reported_without_naming_the_hidden(
    autojump_clock: Any,
) -> None:
    async with swarm(2) as (_, (a, b)):
        await a.add_agent("lab-agent", echo, sandbox_id="lab")
        await b.add_agent("io", echo, capabilities=(Capability("test.unit", "T"),))
        await connect_all([a, b])
        with pytest.raises(LocalError) as info:
            await a.request("lab-agent", "test.unit", None, capability=True)
        assert info.value.code is ErrorCode.SANDBOX_VIOLATION
        assert "io" not in info.value.message  # it may not discover io (seed R10.4)
        assert info.value.details["candidates"] == []


async def test_a_document_no_peer_may_replicate_says_so(autojump_clock: Any) -> None:
    async with open_swarm(discovery=True, shared=FAST_SHARED) as sw:
        boxed = await sw.add(agent="boxed", sandbox="lab")
        free = await sw.add(agent="free")
        for member in (boxed, free):
            await member.shared.subscribe(member.agent, "plan")
        assert boxed.node is not None
        node = boxed.node
        await wait_until(lambda: node.shared.refused("plan") != [], timeout=30)
        [refused] = node.shared.refused("plan")
        assert refused["agent"] == "free" and refused["code"] == "SANDBOX_VIOLATION"
        warning = node.shared.convergence_warning("plan")
        assert warning is not None and "cannot converge" in warning and "free" in warning
        assert node.status()["documentWarnings"] == {"plan": warning}
        state = await _doc_ops(node)["doc.read"]({"doc": "plan"})
        assert state["peers"] == [] and state["warning"] == warning
        assert state["refused"] == [refused]


async def test_a_document_with_a_peer_has_no_warning(autojump_clock: Any) -> None:
    async with open_swarm(discovery=True, shared=FAST_SHARED) as sw:
        a = await sw.add(agent="a")
        b = await sw.add(agent="b")
        for member in (a, b):
            await member.shared.subscribe(member.agent, "plan")
        await wait_until(lambda: a.shared.peers("plan") != (), timeout=30)
        assert a.shared.convergence_warning("plan") is None
        assert a.shared.refused("plan") == []
        assert a.node is not None and a.node.status()["documentWarnings"] == {}


async def test_find_shows_what_the_viewing_agent_may_discover(autojump_clock: Any) -> None:
    async with swarm(3) as (_, (a, b, c)):
        await a.add_agent("boxed", echo, sandbox_id="lab")  # the first: the default viewer
        await a.add_agent("free", echo)
        await b.add_agent("io", echo, capabilities=(Capability("test.unit", "T"),))
        await connect_all([b, a, c])  # b, hosting io, is the hub
        # Capability routing would not let "boxed" see io (seed R10.4): nor does find.
        assert await a.find("test.unit") == []
        assert [c.id for c in await a.find("test.unit", "free")] == ["io"]
        ops = _node_ops(a)
        assert await ops["find"]({"capability": "test.unit"}) == []
        [found] = await ops["find"]({"capability": "test.unit", "agent": "free"})
        assert found["id"] == "io"
        with pytest.raises(LocalError) as info:
            await a.find("test.unit", "nobody")
        assert info.value.code is ErrorCode.AGENT_NOT_FOUND
        # A node without agents has no viewer: it sees every card it holds.
        await wait_until(lambda: c.registry.find("io") is not None)
        assert [card.id for card in await c.find("test.unit")] == ["io"]
