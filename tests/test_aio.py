"""p2pnode.hosting.aio: a node in an asyncio program (trio's guest mode on the running loop).

These are plain ``def`` tests that run their own loop (pytest-trio runs ``async def``
tests in trio), each once per available loop implementation.
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib
import json
import subprocess
import sys
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import pytest
import sniffio
import trio

from p2pnode import Agent, Identity, Message, NodeConfig, TrioNetwork, aio
from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.crdt.ops import CounterAdd
from p2pnode.hosting import aiohandoff
from tests.test_agent import check_planner, planner

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
HOST = "127.0.0.1"
#: Every wait in these tests gives up after this long.
LIMIT = 10.0


def _loop_factories() -> list[Any]:
    """The loop implementations at hand: asyncio's own always, uvloop when installed
    (a test extra, so CI has it)."""
    factories = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    try:
        import uvloop
    except ImportError:
        pass
    else:
        factories.append(pytest.param(uvloop.new_event_loop, id="uvloop"))
    return factories


LOOPS = _loop_factories()
LoopFactory = Callable[[], asyncio.AbstractEventLoop]


@pytest.fixture(params=[pytest.param(True, id="eager"), pytest.param(False, id="public")])
def eager(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both ways a handler's asyncio task starts (p2pnode.hosting.aiohandoff.EAGER): its first step
    inside the trio tick, or at the loop's next pass through the public create_task."""
    monkeypatch.setattr(aiohandoff, "EAGER", request.param)
    return bool(request.param)


def run(factory: LoopFactory, main: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main())


def open_node(**config: Any) -> AbstractAsyncContextManager[aio.AioNode]:
    return aio.open_node(Identity.generate(), TrioNetwork(), NodeConfig(**config))


async def ignore(envelope: Envelope) -> None:
    """The handler of an agent that only asks."""


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` after LIMIT seconds."""
    for _ in range(int(LIMIT / 0.005)):
        if predicate():
            return
        await asyncio.sleep(0.005)
    pytest.fail(f"not within {LIMIT:g} s: {what}")


def test_the_default_loop_is_always_tested() -> None:
    assert LOOPS[0].id == "asyncio"
    loop = LOOPS[0].values[0]()
    try:
        assert type(loop).__module__.startswith("asyncio.")  # the standard library's loop
    finally:
        loop.close()


# -- the same agent definition as in trio (tests/test_agent.py) -------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("factory", LOOPS)
def test_the_planner_behaves_as_embedded_in_trio(factory: LoopFactory) -> None:
    module = planner()

    async def main() -> None:
        async with open_node() as host, open_node() as caller:
            card = await host.add_agent(module.agent)
            assert card.has_capability("plan.strategy") and card.tier == 2
            await caller.add_agent("triton", ignore, tier=3)
            peer = await caller.connect((HOST, host.listen_address[1]))  # loopback TCP
            assert peer == host.peer_id

            async def ask(capability: str, payload: Any) -> Any:
                reply = await caller.request("triton", capability, payload, capability=True)
                return reply.payload

            await check_planner(ask)  # response, INVALID_INPUT, HANDLER_FAILED
            note = caller.envelope("triton", "planner", MessageType.NOTIFICATION, {"n": 1})
            result = await caller.send(note)
            assert result.targets
            await wait_until(lambda: module.notes == [{"n": 1}], "the notification handled")

    run(factory, main)


@pytest.mark.slow
@pytest.mark.parametrize("factory", LOOPS)
def test_handlers_run_as_asyncio_tasks_and_see_the_openers_context(
    factory: LoopFactory, eager: bool
) -> None:
    who: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="nobody")
    agent = Agent("probe")

    @agent.on_request("probe.async")
    async def probe(message: Message) -> dict[str, Any]:
        await asyncio.sleep(0.001)  # an asyncio timer: only works in the asyncio loop
        async with asyncio.timeout(LIMIT):  # needs a current asyncio task
            await asyncio.sleep(0)
        return {
            "library": sniffio.current_async_library(),
            "task": asyncio.current_task() is not None,
            "who": who.get(),
        }

    @agent.on_request("probe.sync")
    def probe_sync(message: Message) -> str:
        asyncio.get_running_loop()  # raises outside the loop
        return sniffio.current_async_library()

    async def main() -> None:
        who.set("opener")
        async with open_node() as node:
            await node.add_agent(agent)
            await node.add_agent("asker", ignore)
            reply = await node.request("asker", "probe.async", None, capability=True)
            assert reply.payload == {"library": "asyncio", "task": True, "who": "opener"}
            reply = await node.request("asker", "probe.sync", None, capability=True)
            assert reply.payload == "asyncio"

    run(factory, main)


@pytest.mark.slow
@pytest.mark.parametrize("factory", LOOPS)
def test_a_handler_task_cancelled_in_its_first_step_or_later_fails_its_request(
    factory: LoopFactory, eager: bool
) -> None:
    agent = Agent("quitter")

    @agent.on_request("quit.at-once")
    async def at_once(message: Message) -> None:
        raise asyncio.CancelledError  # in the step run inline, before any wait

    @agent.on_request("quit.later")
    async def later(message: Message) -> None:
        await asyncio.sleep(0)
        raise asyncio.CancelledError  # in a step the loop ran

    async def main() -> None:
        async with open_node() as node:
            await node.add_agent(agent)
            await node.add_agent("asker", ignore)
            for capability in ("quit.at-once", "quit.later"):
                with pytest.raises(RemoteError) as info:
                    await node.request("asker", capability, None, capability=True)
                assert info.value.code is ErrorCode.HANDLER_FAILED
            # The agent goes on answering.
            with pytest.raises(RemoteError):
                await node.request("asker", "quit.at-once", None, capability=True)

    run(factory, main)


@pytest.mark.slow
@pytest.mark.parametrize("factory", LOOPS)
def test_errors_arrive_as_the_trio_node_raised_them(factory: LoopFactory) -> None:
    async def main() -> None:
        async with open_node() as node:
            await node.add_agent("asker", ignore)
            with pytest.raises(LocalError) as local:
                await node.request("asker", "nobody", 1)
            assert local.value.code is ErrorCode.AGENT_NOT_FOUND
            with pytest.raises(LocalError) as unknown_sender:
                node.envelope("nobody", "asker", MessageType.NOTIFICATION)
            assert unknown_sender.value.code is ErrorCode.AGENT_NOT_FOUND

            raised = KeyError("exactly this")

            async def fail() -> None:
                raise raised

            with pytest.raises(KeyError) as info:
                await node.run_trio(fail)
            assert info.value is raised

    run(factory, main)


# -- cancellation and lifetime ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("factory", LOOPS)
def test_cancelling_the_caller_cancels_the_trio_call_before_it_returns(
    factory: LoopFactory,
) -> None:
    ended: list[str] = []

    async def forever() -> None:
        try:
            await trio.sleep_forever()
        finally:
            ended.append("trio call ended")

    stuck = Agent("stuck")
    never = None

    @stuck.on_request()
    async def wait_forever(message: Message) -> None:
        assert never is not None
        await never.wait()

    async def main() -> None:
        nonlocal never
        never = asyncio.Event()
        async with open_node() as node:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(node.run_trio(forever), 0.05)
            assert ended == ["trio call ended"]  # already, when the caller saw its cancel
            await node.add_agent(stuck)
            await node.add_agent("asker", ignore)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(node.request("asker", "stuck", 1), 0.05)
            assert node.node.routing.pending == {}  # the request is forgotten, not pending
            # The node still works after a cancelled call.
            await node.run_trio(trio.lowlevel.checkpoint)

    run(factory, main)


@pytest.mark.slow
@pytest.mark.parametrize("factory", LOOPS)
def test_closing_cancels_running_handlers_and_answers_calls_in_flight(
    factory: LoopFactory,
) -> None:
    seen: list[str] = []
    stuck = Agent("stuck")

    @stuck.on_request()
    async def wait_forever(message: Message) -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen.append("handler cancelled")
            raise

    started: asyncio.Event

    async def main() -> None:
        nonlocal started
        started = asyncio.Event()
        async with open_node() as node:
            await node.add_agent(stuck)
            await node.add_agent("asker", ignore)
            pending = asyncio.create_task(node.request("asker", "stuck", 1))
            async with asyncio.timeout(LIMIT):
                await started.wait()
        with pytest.raises(LocalError) as info:
            await pending
        assert info.value.code is ErrorCode.CHANNEL_CLOSED
        assert seen == ["handler cancelled"]
        with pytest.raises(LocalError) as closed:
            await node.request("asker", "stuck", 1)
        assert closed.value.code is ErrorCode.INVALID_ARGUMENT
        with pytest.raises(LocalError):
            node.status()
        assert aio._GUESTS == {}  # the guest run ended with its last node

    run(factory, main)


@pytest.mark.slow
@pytest.mark.parametrize("factory", LOOPS)
def test_the_bodys_exception_passes_unchanged_and_a_new_guest_run_starts_after(
    factory: LoopFactory,
) -> None:
    class Boom(Exception):
        pass

    async def main() -> str:
        with pytest.raises(Boom):
            async with open_node():
                raise Boom
        async with open_node() as again:  # the first run ended; a new one starts
            return str(again.status()["swarm"])

    assert "open" in run(factory, main)
    assert trio.lowlevel.in_trio_run() is False  # nothing of trio is left in this thread


@pytest.mark.slow
@pytest.mark.parametrize("factory", LOOPS)
def test_a_node_that_fails_cancels_the_body_and_its_error_surfaces_on_exit(
    factory: LoopFactory,
) -> None:
    async def crash_in_the_node(node: aio.AioNode) -> None:
        async def defect() -> None:
            raise RuntimeError("a task of the node failed")

        node.node.nursery.start_soon(defect)

    async def main() -> None:
        async with open_node() as node:
            await node.run_trio(crash_in_the_node, node)
            await asyncio.sleep(LIMIT)  # cancelled as soon as the node fails
        raise AssertionError("not reached: the node's failure is raised on exit")

    with pytest.raises(BaseExceptionGroup) as info:
        run(factory, main)
    assert info.value.subgroup(RuntimeError) is not None


@pytest.mark.slow
@pytest.mark.parametrize("factory", LOOPS)
def test_shared_state_through_the_proxy(factory: LoopFactory) -> None:
    async def main() -> None:
        async with open_node() as node:
            await node.add_agent("writer", ignore)
            shared = await node.open_shared()
            await shared.subscribe("writer", "doc")
            assert shared.subscriptions() == {"doc": ["writer"]}
            with shared.watch("doc") as watch:
                await shared.update("writer", "doc", CounterAdd(("n",), 2))
                async with asyncio.timeout(LIMIT):
                    value = await anext(watch)
            assert value == shared.read("doc") == {"n": 2}

    run(factory, main)


# -- the example --------------------------------------------------------------------------------


async def http_post(port: int, path: str, body: bytes, method: str = "POST") -> tuple[int, Any]:
    async with asyncio.timeout(LIMIT):
        reader, writer = await asyncio.open_connection(HOST, port)
        head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        writer.write(head.encode() + body)
        response = await reader.read()  # the server closes after one response
        writer.close()
    status_line, _, rest = response.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


@pytest.mark.slow
@pytest.mark.parametrize("factory", LOOPS)
def test_the_http_example_forwards_to_the_agent(factory: LoopFactory) -> None:
    sys.path.insert(0, str(EXAMPLES))
    try:
        sys.modules.pop("planner", None)
        sys.modules.pop("aio_http", None)
        example = importlib.import_module("aio_http")
    finally:
        sys.path.remove(str(EXAMPLES))

    async def main() -> None:
        port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        server = asyncio.create_task(example.run(HOST, 0, ready=port.set_result))
        try:
            async with asyncio.timeout(LIMIT):
                http = await asyncio.shield(port)
            status, body = await http_post(http, "/plan.strategy", b'{"goal": "ship"}')
            assert status == 200 and body["steps"] == ["understand ship", "do ship"]
            assert body["for"] == "gateway"
            status, body = await http_post(http, "/plan.strategy", b'{"goal": 3}')
            assert (status, body["code"]) == (400, "INVALID_INPUT")
            status, body = await http_post(http, "/no.such.thing", b"{}")
            assert (status, body["code"]) == (404, "CAPABILITY_NOT_FOUND")
            status, body = await http_post(http, "/plan.strategy", b"{not json")
            assert status == 400
            status, _ = await http_post(http, "/plan.strategy", b"", method="GET")
            assert status == 405
        finally:
            server.cancel()
            with pytest.raises(asyncio.CancelledError):
                await server  # the node closed with the program

    run(factory, main)


@pytest.mark.slow
def test_importing_the_package_loads_no_asyncio() -> None:
    script = (
        "import sys, p2pnode\n"
        "print('asyncio' in sys.modules, 'p2pnode.hosting.aio' in sys.modules)\n"
        "p2pnode.aio  # the lazy name loads p2pnode.hosting.aio\n"
        "print('p2pnode.hosting.aio' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == ["False", "False", "True"]
