"""Calls that take minutes, in the simulator on trio's virtual clock: a requester's own
deadline travels to the owner (``metadata.deadlineMs``), each progress the owner reports
starts the requester's and the handler's deadline again, a silent call fails at the
caller's deadline, and a caller that gives up cancels the handler."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from p2pnode.agent.definition import Agent, agent_for_handler
from p2pnode.core.envelope import Envelope
from p2pnode.core.errors import ErrorCode, LocalError, P2PError
from p2pnode.node.progress import Progress, current_progress, report_progress
from p2pnode.runtime import Node
from tests.sim import FAST_NODE, open_swarm, wait_until
from tests.test_tools_sim import mesh

#: The owner's tools may run ten minutes; the caller's default wait stays 5 s (FAST_NODE).
CONFIG = dataclasses.replace(FAST_NODE, tool_deadline=600.0)


class Observed:
    """What the slow tool's handler saw."""

    def __init__(self) -> None:
        self.started = 0
        self.cancelled = 0
        self.deadline_ms: list[int | None] = []


def slow_agent(seen: Observed) -> Agent:
    slow = Agent("slow")

    @slow.tool(deadline=600)
    async def work(seconds: int, beat: int, report: bool) -> int:
        """Work ``seconds`` in beats of ``beat`` s, reporting progress after each."""
        seen.started += 1
        reporter = current_progress()
        seen.deadline_ms.append(None if reporter is None else _deadline_ms(reporter.request))
        try:
            for done in range(beat, seconds + 1, beat):
                await trio.sleep(beat)
                if report:
                    assert await report_progress(done, seconds, f"{done} of {seconds} s")
        except trio.Cancelled:
            seen.cancelled += 1
            raise
        return seconds

    return slow


def _deadline_ms(request: Any) -> int | None:
    meta = request.metadata
    return None if meta is None else meta.deadline_ms


@asynccontextmanager
async def two_nodes(seen: Observed) -> AsyncIterator[tuple[Node, Node]]:
    """The slow agent's node and the user's, meshed."""
    async with open_swarm(2, CONFIG) as sw:
        owner, user = sw.nodes
        await owner.add_agent(slow_agent(seen))
        await user.add_agent(Agent("user"))
        await mesh(sw.nodes)
        yield owner, user


async def test_a_90_s_tool_reporting_every_5_s_completes_through_two_nodes(
    autojump_clock: Any,
) -> None:
    seen = Observed()
    async with two_nodes(seen) as (_, user):
        progress: list[Progress] = []
        start = trio.current_time()
        result = await user.tools.call_tool(
            "slow.work",
            {"seconds": 90, "beat": 5, "report": True},
            timeout=10,
            on_progress=progress.append,
        )
        elapsed = trio.current_time() - start
    assert result == 90
    assert 90 <= elapsed < 91
    # Every report arrived in order, each with its total and message.
    assert [p.progress for p in progress] == list(range(5, 91, 5))
    assert progress[-1] == Progress(90, 90, "90 of 90 s")
    assert seen.deadline_ms == [10_000] and seen.cancelled == 0


async def test_the_same_tool_without_progress_fails_at_the_callers_deadline(
    autojump_clock: Any,
) -> None:
    seen = Observed()
    async with two_nodes(seen) as (_, user):
        start = trio.current_time()
        with pytest.raises(P2PError) as caught:
            await user.tools.call_tool(
                "slow.work", {"seconds": 90, "beat": 5, "report": False}, timeout=12
            )
        elapsed = trio.current_time() - start
        # The owner bounds the handler by the caller's 12 s, not its own 600 s.
        await wait_until(lambda: seen.cancelled == 1)
    assert caught.value.code is ErrorCode.TIMEOUT
    assert 12 <= elapsed < 12 + CONFIG.request_timeout / 8 + 1
    assert seen.deadline_ms == [12_000]


async def test_without_a_timeout_progress_keeps_the_default_wait_alive(
    autojump_clock: Any,
) -> None:
    seen = Observed()
    async with two_nodes(seen) as (_, user):
        start = trio.current_time()
        result = await user.tools.call_tool("slow.work", {"seconds": 30, "beat": 4, "report": True})
        elapsed = trio.current_time() - start
    # The node's 5 s default is an idle deadline too; no deadline travels, so the owner
    # bounds the call by the tool's own 600 s.
    assert result == 30 and 28 <= elapsed < 29
    assert seen.deadline_ms == [None]


async def test_a_caller_that_gives_up_cancels_the_handler(autojump_clock: Any) -> None:
    seen = Observed()
    async with two_nodes(seen) as (_, user):
        with trio.move_on_after(7):
            await user.tools.call_tool(
                "slow.work", {"seconds": 90, "beat": 5, "report": True}, timeout=60
            )
        # The cancel reaches the owner, whose handler observes its cancellation long
        # before either deadline.
        await wait_until(lambda: seen.cancelled == 1)
        assert trio.current_time() < 60


async def test_a_plain_request_is_bounded_by_the_requesters_deadline(
    autojump_clock: Any,
) -> None:
    got: list[int | None] = []
    cut = trio.Event()

    async def sleepy(envelope: Envelope) -> str:
        got.append(_deadline_ms(envelope))
        try:
            await trio.sleep(8)
        except trio.Cancelled:
            cut.set()
            raise
        return "late"

    async with open_swarm(2, CONFIG) as sw:
        owner, user = sw.nodes
        await owner.add_agent(agent_for_handler("sleepy", sleepy))
        await user.add_agent(Agent("user"))
        await mesh(sw.nodes)
        with pytest.raises(P2PError) as caught:
            await user.request("user", "sleepy", "hi", timeout=1.5)
        await cut.wait()
        assert got == [1500]
        assert caught.value.code is ErrorCode.TIMEOUT
        # A longer wait than the owner's maximum (request_timeout, 5 s) is cut to it.
        with pytest.raises(P2PError) as longer:
            await user.request("user", "sleepy", "hi", timeout=30)
        assert longer.value.code is ErrorCode.TIMEOUT
        assert "5 s" in longer.value.message


@pytest.mark.parametrize("wait", [0, -1, 86_401, float("nan"), True])
async def test_a_timeout_outside_a_day_is_refused_before_anything_is_sent(
    autojump_clock: Any, wait: Any
) -> None:
    async with open_swarm(1, CONFIG) as sw:
        [node] = sw.nodes
        await node.add_agent(Agent("user"))
        with pytest.raises(LocalError) as caught:
            await node.request("user", "user", "hi", timeout=wait)
        assert caught.value.code is ErrorCode.INVALID_ARGUMENT
