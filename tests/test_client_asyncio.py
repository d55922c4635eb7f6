"""p2pnode.hosting.client on asyncio: the asyncio.Protocol link and the eagerly started handler.

The node runs in the same asyncio program (p2pnode.hosting.aio, a trio guest run) and serves
agent.sock; the client attaches to it over the real Unix socket. Plain ``def`` tests,
each on its own loop, asyncio's and uvloop (pytest-trio runs ``async def`` tests in trio).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import sniffio

from p2pnode import Agent, Identity, Message, NodeConfig, TrioNetwork, aio
from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode, RemoteError
from p2pnode.hosting.client import AgentClient
from p2pnode.hosting.clientlink import ProtocolLink
from p2pnode.services.attach.service import AgentSocket
from p2pnode.services.attach.wire import AGENT_SOCKET_NAME
from tests.test_aio import LOOPS, LoopFactory

#: Every wait in these tests gives up after this long.
LIMIT = 10.0


def run(factory: LoopFactory, main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(LIMIT):
            await main()

    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(bounded())


async def ignore(envelope: Envelope) -> None:
    """The handler of the agent that only asks."""


@asynccontextmanager
async def node_serving(tmp_path: Path) -> AsyncIterator[aio.AioNode]:
    """A node of this loop serving agent.sock in ``tmp_path``, hosting "asker"."""
    async with aio.open_node(Identity.generate(), TrioNetwork(), NodeConfig()) as node:
        await node.add_agent("asker", ignore)
        service = AgentSocket(node.node, tmp_path / AGENT_SOCKET_NAME)
        await node.run_trio(node.node.start_service, service)
        yield node


@pytest.mark.slow
@pytest.mark.parametrize("factory", LOOPS)
def test_on_asyncio_envelopes_are_handled_in_arrival_order_by_asyncio_tasks(
    factory: LoopFactory, tmp_path: Path
) -> None:
    who: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="nobody")
    agent = Agent("worker")
    seen: list[Any] = []
    tasks: set[asyncio.Task[Any] | None] = set()

    @agent.on_notification
    async def note(message: Message) -> None:
        tasks.add(asyncio.current_task())
        if message.payload == 0:
            await asyncio.sleep(0.01)  # the others arrive meanwhile and wait their turn
        seen.append(message.payload)  # as each ends: handled one at a time, in order

    @agent.on_request()
    async def work(message: Message) -> dict[str, Any]:
        tasks.add(asyncio.current_task())
        return {"n": message.payload, "who": who.get(), "lib": sniffio.current_async_library()}

    async def main() -> None:
        async with node_serving(tmp_path) as node:
            who.set("opener")
            async with AgentClient(agent, data_dir=tmp_path) as client:
                assert isinstance(client._link, ProtocolLink)  # the asyncio fast path
                notes = [
                    node.envelope("asker", "worker", MessageType.NOTIFICATION, n) for n in range(5)
                ]
                await node.send_many(notes)  # routed, and written to the process, in order
                reply = await node.request("asker", "worker", 5)  # answered after them
        assert reply.payload == {"n": 5, "who": "opener", "lib": "asyncio"}
        assert seen == [0, 1, 2, 3, 4]
        assert None not in tasks  # every handler ran as an asyncio task

    run(factory, main)


@pytest.mark.slow
@pytest.mark.parametrize("factory", LOOPS)
def test_on_asyncio_a_full_inbox_answers_busy_and_the_agent_goes_on(
    factory: LoopFactory, tmp_path: Path
) -> None:
    agent = Agent("slow")
    release = asyncio.Event()

    @agent.on_request()
    async def wait(message: Message) -> Any:
        await release.wait()
        return message.payload

    async def main() -> None:
        async with (
            node_serving(tmp_path) as node,
            AgentClient(agent, data_dir=tmp_path, queue_size=1, concurrency=1),
        ):
            first = asyncio.create_task(node.request("asker", "slow", 1))
            await asyncio.sleep(0.05)  # handled, and waiting for release
            second = asyncio.create_task(node.request("asker", "slow", 2))
            await asyncio.sleep(0.05)  # the one envelope the inbox holds
            with pytest.raises(RemoteError) as busy:
                await node.request("asker", "slow", 3)
            assert busy.value.code is ErrorCode.BUSY
            release.set()
            assert (await first).payload == 1
            assert (await second).payload == 2
            assert (await node.request("asker", "slow", 4)).payload == 4

    run(factory, main)


@pytest.mark.slow
@pytest.mark.parametrize("factory", LOOPS)
def test_on_asyncio_closing_the_client_cancels_a_waiting_handler(
    factory: LoopFactory, tmp_path: Path
) -> None:
    agent = Agent("stuck")
    started = asyncio.Event()
    seen: list[str] = []

    @agent.on_request()
    async def forever(message: Message) -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    async def main() -> None:
        async with node_serving(tmp_path) as node:
            async with AgentClient(agent, data_dir=tmp_path):
                pending = asyncio.create_task(node.request("asker", "stuck", 1))
                await started.wait()
            assert seen == ["cancelled"]
            with pytest.raises(RemoteError) as gone:
                await pending
            assert gone.value.code is ErrorCode.AGENT_UNAVAILABLE

    run(factory, main)
