"""Requests to one agent run concurrently (p2pnode.node.agents): a handler that hangs holds
one slot until its deadline, is cancelled then and answered TIMEOUT, while the agent's
other calls and other agents are served; a caller that gives up cancels the handler at
its owner; the concurrency limit holds; notifications keep their order. Simulated nodes
on trio's virtual clock."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.agent.definition import Agent, Message
from p2pnode.core.envelope import MessageType, Metadata
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.node.callcancel import CANCELLED
from p2pnode.runtime import Node
from tests.sim import FAST_NODE, Inbox, connect_all, open_swarm, wait_until

#: FAST_NODE's request timeout is 5 s; the hanging tool's own deadline is shorter.
HANG_DEADLINE = 2.0


class Observed:
    """What the handlers of the toolbox saw: running now, the most at once, cancels."""

    def __init__(self) -> None:
        self.running = 0
        self.most = 0
        self.cancelled = 0
        self.release = trio.Event()

    async def hold(self, forever: bool) -> None:
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            if forever:
                await trio.sleep_forever()
            await self.release.wait()
        except trio.Cancelled:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1


def toolbox(seen: Observed) -> Agent:
    agent = Agent("toolbox", tier=3)

    @agent.tool(deadline=HANG_DEADLINE)
    async def hang() -> int:
        await seen.hold(forever=True)
        return 0

    @agent.tool()
    async def slow() -> int:  # the node's default tool deadline (30 s)
        await seen.hold(forever=True)
        return 0

    @agent.tool()
    def add(a: int, b: int) -> int:
        return a + b

    return agent


@asynccontextmanager
async def two_nodes(**config: Any) -> AsyncIterator[tuple[Node, Node, Observed]]:
    """A user's node and a node hosting ``toolbox`` and ``other``."""
    seen = Observed()
    async with open_swarm(2, dataclasses.replace(FAST_NODE, **config)) as sw:
        user, owner = sw.nodes
        await user.add_agent("user", Inbox(), tier=3)
        await owner.add_agent(toolbox(seen))
        await owner.add_agent("other", Inbox(), tier=3)
        await connect_all([user, owner])
        yield user, owner, seen


async def test_a_hanging_call_delays_neither_the_agent_nor_its_neighbours_and_times_out(
    autojump_clock: Any,
) -> None:
    async with two_nodes() as (user, owner, seen):
        outcomes: list[tuple[float, P2PError]] = []
        start = trio.current_time()

        async def hang() -> None:
            try:
                await user.tools.call_tool("toolbox.hang")
            except P2PError as exc:
                outcomes.append((trio.current_time() - start, exc))

        async with trio.open_nursery() as nursery:
            for _ in range(30):
                nursery.start_soon(hang)
            await wait_until(lambda: seen.running == 30)
            # Meanwhile the same agent and the other agent answer at once.
            asked = trio.current_time()
            assert await user.tools.call_tool("toolbox.add", {"a": 2, "b": 3}) == 5
            assert (await user.request("user", "other", "hi")).payload == {"echo": "hi"}
            assert trio.current_time() - asked < 0.1
            assert seen.running == 30
        # Each hung call was cut at its deadline, its handler cancelled, its caller told.
        assert seen.cancelled == 30 and seen.running == 0
        assert len(outcomes) == 30
        for waited, exc in outcomes:
            assert isinstance(exc, RemoteError) and exc.code is ErrorCode.TIMEOUT
            assert f"deadline of {HANG_DEADLINE:g} s" in exc.message
            assert exc.details["deadlineSeconds"] == HANG_DEADLINE
            assert HANG_DEADLINE <= waited < HANG_DEADLINE + 0.1
        assert owner.hosting.calls_cut == 30
        assert owner.hosting.agents["toolbox"].calls == {}
        cut = [r for r in owner.tool_audit.invocations() if r.tool == "toolbox.hang"]
        assert [r.error for r in cut] == ["TIMEOUT"] * 30


async def test_a_caller_that_gives_up_cancels_the_handler_at_its_owner(
    autojump_clock: Any,
) -> None:
    async with two_nodes() as (user, owner, seen):
        start = trio.current_time()
        with trio.move_on_after(1.0) as gave_up:
            await user.tools.call_tool("toolbox.slow")  # its deadline: 30 s
        assert gave_up.cancelled_caught
        await wait_until(lambda: seen.cancelled == 1)
        assert trio.current_time() - start < 1.1  # cancelled at once, not at 30 s
        assert owner.hosting.calls_cut == 1
        assert owner.hosting.agents["toolbox"].calls == {}
        # A caller whose own timeout passes (FAST_NODE: 5 s) cancels it the same way.
        start = trio.current_time()
        with pytest.raises(LocalError) as info:
            await user.tools.call_tool("toolbox.slow")
        assert info.value.code is ErrorCode.TIMEOUT
        await wait_until(lambda: seen.cancelled == 2)
        assert trio.current_time() - start < FAST_NODE.request_timeout * 1.125 + 0.1
        # The cancels never reached the agent's handler and were not answered.
        assert seen.running == 0 and owner.hosting.calls_cut == 2


async def test_a_local_caller_that_gives_up_cancels_the_handler_too(autojump_clock: Any) -> None:
    async with two_nodes() as (_, owner, seen):
        await owner.add_agent("neighbour", Inbox(), tier=3)
        with trio.move_on_after(0.5):
            await owner.tools.call_tool("toolbox.slow", caller="neighbour")
        await wait_until(lambda: seen.cancelled == 1)
        assert owner.hosting.agents["toolbox"].calls == {}


async def test_a_cancel_names_only_its_own_requesters_call(autojump_clock: Any) -> None:
    async with two_nodes() as (user, owner, seen):
        await user.add_agent("mallory", Inbox(), tier=3)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(user.tools.call_tool, "toolbox.slow")
            await wait_until(lambda: seen.running == 1)
            calls = owner.hosting.agents["toolbox"].calls
            ((_, requester, request_id),) = calls
            assert requester == "user"
            cancel = Metadata(capability=CANCELLED)
            # Another agent naming the request, junk payloads, an unknown id: ignored.
            for sender, payload in [
                ("mallory", {"requestId": request_id}),
                ("user", {"requestId": "no-such-request"}),
                ("user", {"requestId": 7}),
                ("user", ["junk"]),
            ]:
                await user.send(
                    user.envelope(
                        sender, "toolbox", MessageType.NOTIFICATION, payload, metadata=cancel
                    )
                )
            await trio.sleep(1.0)
            assert seen.running == 1 and seen.cancelled == 0 and len(calls) == 1
            await user.send(
                user.envelope(
                    "user",
                    "toolbox",
                    MessageType.NOTIFICATION,
                    {"requestId": request_id},
                    metadata=cancel,
                )
            )
            await wait_until(lambda: seen.cancelled == 1)
            nursery.cancel_scope.cancel()


async def test_at_the_limit_requests_wait_then_are_refused_busy(autojump_clock: Any) -> None:
    async with two_nodes(agent_concurrency=3, inbox_size=2) as (user, _, seen):
        errors: list[P2PError] = []

        async def call() -> None:
            try:
                await user.tools.call_tool("toolbox.slow")
            except P2PError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(call)
            await wait_until(lambda: seen.running == 3)
            for _ in range(2):  # wait in the inbox: no slot
                nursery.start_soon(call)
            await trio.sleep(0.5)
            assert seen.running == 3 and seen.most == 3
            for _ in range(2):  # the inbox is full too: refused at once
                nursery.start_soon(call)
            await wait_until(lambda: len(errors) == 2)
            assert all(e.code is ErrorCode.BUSY for e in errors)
            assert all(0 < e.details["retryAfterMs"] <= 30_000 for e in errors)
            seen.release.set()  # the running ones answer; the waiting ones run
        assert seen.most == 3 and seen.cancelled == 0


@settings(max_examples=20, deadline=None)
@given(
    limit=st.integers(1, 5),
    steps=st.lists(st.one_of(st.just("ask"), st.integers(0, 9)), min_size=1, max_size=25),
)
def test_no_more_handlers_wait_at_once_than_the_limit(limit: int, steps: list[Any]) -> None:
    """Requests that hang until released, asked and released in any order: never more
    than ``limit`` handlers wait at once, and as many as can do."""

    async def main() -> None:
        gates: list[trio.Event] = []
        state = {"running": 0, "most": 0, "answered": 0}
        config = dataclasses.replace(FAST_NODE, agent_concurrency=limit, request_timeout=600.0)
        async with open_swarm(1, config) as sw:
            (node,) = sw.nodes

            async def worker(message: Message) -> int:
                gate = trio.Event()
                gates.append(gate)
                state["running"] += 1
                state["most"] = max(state["most"], state["running"])
                try:
                    await gate.wait()
                finally:
                    state["running"] -= 1
                return 1

            agent = Agent("worker", tier=3)
            agent.on_request()(worker)
            await node.add_agent(agent)
            await node.add_agent("asker", Inbox(), tier=3)

            async def ask() -> None:
                await node.request("asker", "worker", None)
                state["answered"] += 1

            asked = 0
            async with trio.open_nursery() as nursery:
                for step in steps:
                    if step == "ask":
                        nursery.start_soon(ask)
                        asked += 1
                    else:
                        waiting = [g for g in gates if not g.is_set()]
                        if waiting:
                            waiting[step % len(waiting)].set()
                    await trio.sleep(0.01)
                    open_calls = asked - state["answered"]
                    assert state["running"] == min(open_calls, limit)
                for _ in range(len(steps) + 1):  # release all, those that start meanwhile too
                    for gate in gates:
                        gate.set()
                    await trio.sleep(0.01)
                assert state["answered"] == asked
            assert state["most"] <= limit

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def test_notifications_keep_their_order_while_requests_wait(autojump_clock: Any) -> None:
    seen: list[Any] = []
    release = trio.Event()
    agent = Agent("mixed", tier=3)

    @agent.on_request()
    async def held(message: Message) -> str:
        await release.wait()
        return "done"

    @agent.on_notification
    async def note(message: Message) -> None:
        seen.append(("start", message.payload))
        await trio.sleep(0.01 * (message.payload % 3))  # handlers that wait, one at a time
        seen.append(("end", message.payload))

    async with two_nodes() as (user, owner, _):
        await owner.add_agent(agent)
        await connect_all([user, owner])
        async with trio.open_nursery() as nursery:
            for n in range(20):
                if n % 4 == 0:
                    nursery.start_soon(user.request, "user", "mixed", n)
                await user.send(user.envelope("user", "mixed", MessageType.NOTIFICATION, n))
            await wait_until(lambda: len(seen) == 40)
            release.set()
        expected = [(kind, n) for n in range(20) for kind in ("start", "end")]
        assert seen == expected


async def test_a_repeated_request_id_takes_a_slot_of_its_own(autojump_clock: Any) -> None:
    async with two_nodes(agent_concurrency=2) as (_, owner, seen):
        await owner.add_agent("neighbour", Inbox(), tier=3)
        params = {"name": "slow", "arguments": {}}
        ask = owner.envelope(
            "neighbour",
            "toolbox",
            MessageType.REQUEST,
            params,
            metadata=Metadata(capability="tools/call"),
        )
        for _ in range(3):  # the same envelope, id and all, from a local agent
            await owner.send(ask)
        await wait_until(lambda: seen.running == 2)
        await trio.sleep(1.0)
        assert seen.running == 2 and len(owner.hosting.agents["toolbox"].calls) == 2
