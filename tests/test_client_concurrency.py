"""An attached agent process never stalls on one slow handler (p2pnode.hosting.client).

The client runs request handlers concurrently, up to its ``concurrency`` bound, each
cut at ``request_deadline``; notifications stay one at a time, in arrival order; closing
cancels what runs. First the sans-IO rule (:class:`HandlerInbox`, a property test
against a model), then a real node serving agent.sock on loopback and a client
attached to it, on asyncio (the Protocol link, eagerly started tasks) and on trio (the
stream link, a task per request).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from p2pnode import Agent, Message, Node
from p2pnode.core.envelope import MessageType
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.hosting import aiohandoff
from p2pnode.hosting.client import DEFAULT_CONCURRENCY, REQUEST_DEADLINE, AgentClient, HandlerInbox
from p2pnode.services.attach.service import AgentSocket
from p2pnode.services.attach.session import AttachLimits
from p2pnode.services.attach.wire import AGENT_SOCKET_NAME
from tests.sim import Inbox, open_swarm, wait_until
from tests.test_aio import LOOPS, LoopFactory
from tests.test_client_asyncio import node_serving, run

# -- the rule, sans-IO --------------------------------------------------------------------------

#: An operation on the inbox: offer a request (True) or a notification (False), start
#: the next envelope, or end the oldest running handler of a kind.
_Op = tuple[str, bool]
_ops = st.lists(st.tuples(st.sampled_from(["offer", "start", "end"]), st.booleans()), max_size=200)


@given(_ops, st.integers(1, 4), st.integers(1, 5))
def test_the_inbox_starts_in_order_within_the_limit_one_notification_at_a_time(
    ops: list[_Op], concurrency: int, queue_size: int
) -> None:
    inbox = HandlerInbox[int](queue_size, concurrency)
    offered: list[tuple[int, bool]] = []  # the model: what waits, in order
    started: list[int] = []
    running = {True: 0, False: 0}
    for n, (op, request) in enumerate(ops):
        if op == "offer":
            accepted = inbox.offer(n, request)
            assert accepted is (len(offered) < queue_size)
            if accepted:
                offered.append((n, request))
        elif op == "start":
            start = inbox.next_start()
            head = offered[0] if offered else None
            may = head is not None and (
                running[True] < concurrency if head[1] else running[False] == 0
            )
            assert (start is not None) is may
            if start is not None:
                assert start == offered.pop(0)  # arrival order, never a later one first
                running[start[1]] += 1
                started.append(start[0])
        elif running[request] > 0:
            inbox.ended(request)
            running[request] -= 1
        else:
            with pytest.raises(LocalError) as illegal:
                inbox.ended(request)
            assert illegal.value.code is ErrorCode.ILLEGAL_TRANSITION
        assert running[True] <= concurrency and running[False] <= 1
        assert (inbox.requests, inbox.notifying) == (running[True], running[False] == 1)
        assert len(inbox) == len(offered) <= queue_size
    assert started == sorted(started)


def test_the_defaults_are_the_nodes_and_bounds_must_be_positive() -> None:
    assert DEFAULT_CONCURRENCY == 64  # NodeConfig.agent_concurrency's default
    assert AttachLimits().request_timeout == REQUEST_DEADLINE  # the node forgets it then
    for bad in ({"queue_size": 0}, {"concurrency": 0}, {"request_deadline": 0.0}):
        with pytest.raises(LocalError) as info:
            AgentClient(Agent("x"), path="/nowhere", **bad)
        assert info.value.code is ErrorCode.CONFIG_ERROR


# -- the agent under test -----------------------------------------------------------------------


class Worker:
    """An agent whose request ``"hang"`` waits until cancelled, ``("gate", n)`` until
    :attr:`release` is set, anything else answers at once; its notification handler
    records when each starts and ends. Make it inside the running event loop."""

    def __init__(self) -> None:
        self.agent = Agent("worker")
        self.hung = anyio.Event()
        self.release = anyio.Event()
        self.hanging = 0
        self.cancelled = 0
        self.gates = 0  # gate handlers running now
        self.most_gates = 0
        self.log: list[tuple[str, int]] = []
        self.agent.on_request()(self.work)
        self.agent.on_notification(self.note)

    async def work(self, message: Message) -> Any:
        if message.payload == "hang":
            self.hanging += 1
            self.hung.set()
            try:
                await anyio.sleep_forever()
            except anyio.get_cancelled_exc_class():
                self.cancelled += 1
                raise
        if isinstance(message.payload, list) and message.payload[:1] == ["gate"]:
            self.gates += 1
            self.most_gates = max(self.most_gates, self.gates)
            try:
                await self.release.wait()
            finally:
                self.gates -= 1
        return message.payload

    async def note(self, message: Message) -> None:
        n = int(message.payload)
        self.log.append(("start", n))
        if n % 2 == 0:
            await anyio.sleep(0.01)  # the next ones arrive meanwhile and must wait
        self.log.append(("end", n))


def in_order(count: int) -> list[tuple[str, int]]:
    """Each notification's start and end, in arrival order, none overlapping another."""
    return [(what, n) for n in range(count) for what in ("start", "end")]


async def timed(ask: Any) -> tuple[Any, float]:
    """``await ask`` and the seconds it took."""
    began = time.monotonic()
    result = await ask
    return result, time.monotonic() - began


# -- asyncio: the Protocol link and eagerly started handler tasks -------------------------------

#: Both ways a handler's task starts (aiohandoff.EAGER): its first step in the loop pass
#: that read its envelope, or at the next pass through the public create_task.
EAGER = pytest.mark.parametrize("eager", [True, False], ids=["eager", "public"])


@pytest.mark.slow
@pytest.mark.parametrize("factory", LOOPS)
@EAGER
def test_on_asyncio_a_hanging_handler_delays_no_other_request_and_closing_cancels_it(
    factory: LoopFactory, eager: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aiohandoff, "EAGER", eager)

    async def main() -> None:
        worker = Worker()
        async with node_serving(tmp_path) as node:
            async with AgentClient(worker.agent, data_dir=tmp_path):
                hung = asyncio.create_task(node.request("asker", "worker", "hang"))
                await worker.hung.wait()
                reply, took = await timed(node.request("asker", "worker", 7))
                assert reply.payload == 7 and took < 1.0
                assert worker.cancelled == 0  # still waiting, beside the answered one
            assert worker.cancelled == 1  # closing cancelled it and waited for it
            with pytest.raises(RemoteError) as gone:
                await hung
            assert gone.value.code is ErrorCode.AGENT_UNAVAILABLE

    run(factory, main)


@pytest.mark.slow
@pytest.mark.parametrize("factory", LOOPS)
def test_on_asyncio_notifications_run_one_at_a_time_in_order(
    factory: LoopFactory, tmp_path: Path
) -> None:
    async def main() -> None:
        worker = Worker()
        async with node_serving(tmp_path) as node, AgentClient(worker.agent, data_dir=tmp_path):
            hung = asyncio.create_task(node.request("asker", "worker", "hang"))
            await worker.hung.wait()  # a request waiting does not reorder them either
            notes = [
                node.envelope("asker", "worker", MessageType.NOTIFICATION, n) for n in range(8)
            ]
            await node.send_many(notes)
            assert (await node.request("asker", "worker", 1)).payload == 1  # after them all
            assert worker.log == in_order(8)
            hung.cancel()

    run(factory, main)


@pytest.mark.slow
@pytest.mark.parametrize("factory", LOOPS)
def test_on_asyncio_the_concurrency_bound_holds_and_a_freed_slot_starts_the_next(
    factory: LoopFactory, tmp_path: Path
) -> None:
    async def main() -> None:
        worker = Worker()
        client = AgentClient(worker.agent, data_dir=tmp_path, concurrency=2)
        async with node_serving(tmp_path) as node, client:
            gates = [
                asyncio.create_task(node.request("asker", "worker", ["gate", n])) for n in range(3)
            ]
            quick = asyncio.create_task(node.request("asker", "worker", 9))
            for _ in range(100):  # bounded: 5 s
                if worker.gates == 2:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # a third would have started by now: it waits
            assert (worker.gates, worker.most_gates, quick.done()) == (2, 2, False)
            worker.release.set()
            assert [(await gate).payload for gate in gates] == [["gate", n] for n in range(3)]
            assert (await quick).payload == 9
            assert worker.most_gates == 2

    run(factory, main)


@pytest.mark.slow
@pytest.mark.parametrize("factory", LOOPS)
@EAGER
def test_on_asyncio_a_handler_past_its_deadline_is_cancelled_answered_timeout_and_frees_its_slot(
    factory: LoopFactory, eager: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aiohandoff, "EAGER", eager)

    async def main() -> None:
        worker = Worker()
        client = AgentClient(worker.agent, data_dir=tmp_path, concurrency=1, request_deadline=0.3)
        async with node_serving(tmp_path) as node, client:
            with pytest.raises(RemoteError) as late:
                await node.request("asker", "worker", "hang")
            assert late.value.code is ErrorCode.TIMEOUT
            assert late.value.details["deadlineSeconds"] == 0.3
            assert worker.cancelled == 1
            assert (await node.request("asker", "worker", 3)).payload == 3  # its slot is free

    run(factory, main)


# -- trio: the stream link and a task per request -----------------------------------------------


@asynccontextmanager
async def trio_serving(tmp_path: Path) -> AsyncIterator[Node]:
    """A node serving agent.sock in ``tmp_path``, hosting "asker"."""
    async with open_swarm(1) as sw:
        node = sw.nodes[0]
        await node.add_agent("asker", Inbox())
        await node.start_service(AgentSocket(node, tmp_path / AGENT_SOCKET_NAME))
        yield node


@pytest.mark.slow
async def test_on_trio_a_hanging_handler_delays_no_other_request_and_closing_cancels_it(
    tmp_path: Path,
) -> None:
    worker = Worker()
    outcomes: list[ErrorCode] = []

    async def ask_hang(node: Node) -> None:
        with pytest.raises(RemoteError) as gone:
            await node.request("asker", "worker", "hang")
        outcomes.append(gone.value.code)

    with trio.fail_after(20):
        async with trio_serving(tmp_path) as node, trio.open_nursery() as nursery:
            async with AgentClient(worker.agent, data_dir=tmp_path):
                nursery.start_soon(ask_hang, node)
                await worker.hung.wait()
                reply, took = await timed(node.request("asker", "worker", 7))
                assert reply.payload == 7 and took < 1.0
                assert worker.cancelled == 0
            assert worker.cancelled == 1  # closing cancelled it and waited for it
            await wait_until(lambda: outcomes == [ErrorCode.AGENT_UNAVAILABLE])


@pytest.mark.slow
async def test_on_trio_notifications_run_one_at_a_time_in_order(tmp_path: Path) -> None:
    worker = Worker()
    with trio.fail_after(20):
        async with (
            trio_serving(tmp_path) as node,
            trio.open_nursery() as nursery,
            AgentClient(worker.agent, data_dir=tmp_path),
        ):
            nursery.start_soon(_ignore_failure, node.request("asker", "worker", "hang"))
            await worker.hung.wait()  # a request waiting does not reorder them either
            notes = [
                node.envelope("asker", "worker", MessageType.NOTIFICATION, n) for n in range(8)
            ]
            await node.send_many(notes)
            assert (await node.request("asker", "worker", 1)).payload == 1  # after them all
            assert worker.log == in_order(8)


@pytest.mark.slow
async def test_on_trio_the_concurrency_bound_holds_and_a_deadline_frees_a_slot(
    tmp_path: Path,
) -> None:
    worker = Worker()
    answers: dict[int, Any] = {}

    async def ask(n: int, payload: Any) -> None:
        try:
            answers[n] = (await node.request("asker", "worker", payload)).payload
        except RemoteError as exc:
            answers[n] = exc.code

    with trio.fail_after(20):
        async with trio_serving(tmp_path) as node, trio.open_nursery() as nursery:
            client = AgentClient(
                worker.agent, data_dir=tmp_path, concurrency=2, request_deadline=1.0
            )
            async with client:
                nursery.start_soon(ask, 0, "hang")
                nursery.start_soon(ask, 1, "hang")
                await wait_until(lambda: worker.hanging == 2)
                nursery.start_soon(ask, 2, 2)  # both slots taken: it waits
                await trio.sleep(0.3)
                assert 2 not in answers and worker.cancelled == 0
                # The deadlines cancel the hung handlers, answer TIMEOUT and free the slots.
                await wait_until(lambda: answers.get(2) == 2)
                assert answers[0] is answers[1] is ErrorCode.TIMEOUT
                assert worker.cancelled == worker.hanging == 2


async def _ignore_failure(ask: Any) -> None:
    try:
        await ask
    except RemoteError:
        pass  # the agent went away while it was waiting: answered AGENT_UNAVAILABLE
