"""Requests to an agent embedded in asyncio (p2pnode.hosting.aio) are concurrent as in trio: a
handler that hangs holds its own call only, its asyncio task is cancelled at the deadline
and its requester answered TIMEOUT, while the agent's next requests are answered."""

from __future__ import annotations

import asyncio
import time

import pytest

from p2pnode import Agent, Message
from p2pnode.core.errors import ErrorCode, P2PError
from tests.test_aio import LOOPS, LoopFactory, ignore, open_node, run

#: The node's request timeout, hence the deadline of a request's handler (seconds).
DEADLINE = 1.0


@pytest.mark.slow
@pytest.mark.parametrize("factory", LOOPS)
def test_a_hanging_asyncio_handler_holds_only_its_call_and_is_cancelled_at_its_deadline(
    factory: LoopFactory,
) -> None:
    agent = Agent("worker")
    cancelled: list[str] = []

    @agent.on_request("work.hang")
    async def hang(message: Message) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append("hang")
            raise

    @agent.on_request("work.quick")
    async def quick(message: Message) -> int:
        await asyncio.sleep(0.001)  # waits too: a call of its own
        return int(message.payload) + 1

    async def main() -> None:
        async with open_node(request_timeout=DEADLINE) as node:
            await node.add_agent(agent)
            await node.add_agent("asker", ignore)
            start = time.monotonic()
            hanging = [
                asyncio.ensure_future(node.request("asker", "work.hang", None, capability=True))
                for _ in range(3)
            ]
            await asyncio.sleep(0.05)
            for n in range(5):
                reply = await node.request("asker", "work.quick", n, capability=True)
                assert reply.payload == n + 1
            assert time.monotonic() - start < DEADLINE / 2  # not behind the hung calls
            for future in hanging:
                with pytest.raises(P2PError) as info:
                    await asyncio.wait_for(future, DEADLINE * 3)
                assert info.value.code is ErrorCode.TIMEOUT
            for _ in range(100):  # the handlers' tasks saw their cancellation
                if len(cancelled) == 3:
                    break
                await asyncio.sleep(0.01)
            assert cancelled == ["hang"] * 3

    run(factory, main)
