"""``a2a publish`` end to end: an A2A server written here with the SDK's server classes
(served by uvicorn on loopback) is published on one node and called from another, with
the library's ``request`` and through ``a2a serve``'s gateway, and its answers are the
ones the server gives when called directly. Stopping the server withdraws the agent
(the other node's ``find`` stops listing it) and starting it again restores it.

One module-wide swarm (two nodes, the server, the publisher, the gateway) runs in an
asyncio loop of its own thread; each test runs its checks in that loop, bounded.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import httpx
import pytest
import uvicorn
from a2a.client import Client, ClientConfig, create_client
from a2a.helpers.proto_helpers import new_task_from_user_message
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import AgentCard as A2ACard
from a2a.types import Message, Part, Role, SendMessageRequest, StreamResponse, Task
from google.protobuf.json_format import MessageToDict, ParseDict
from starlette.applications import Starlette

from p2pnode import Identity, NodeConfig, TrioNetwork, aio
from p2pnode.bridges.a2a.gateway import Gateway, NodeSwarm
from p2pnode.bridges.a2a.http import Announcing, BearerGuard, base_url, listen, serve
from p2pnode.bridges.a2a.mapping import parts_of_payload, payload_of_answer_untrusted
from p2pnode.bridges.a2a.supervise import (
    PublishSpec,
    ServerPublisher,
    ServerState,
    host_in_aio_node,
)
from p2pnode.core.envelope import Envelope, Metadata
from p2pnode.core.errors import ErrorCode, P2PError
from p2pnode.hosting.aio import AioNode
from tests.loopthread import LoopThread

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("a2a-publish")]

HOST = "127.0.0.1"
TOKEN = "test-token"
#: Every wait gives up after this long.
LIMIT = 10.0
AGENT = "weather"


# -- the A2A server ------------------------------------------------------------------------------


@dataclass
class Seen:
    """What the server saw: the skills asked for, and the tasks it was told to cancel."""

    skills: list[str | None] = field(default_factory=list)
    canceled: asyncio.Event = field(default_factory=asyncio.Event)
    slow_started: asyncio.Event = field(default_factory=asyncio.Event)


class Executor(AgentExecutor):
    """``echo``: the message's parts back as the artifact; ``shout``: its text in capitals;
    ``fail``: the task fails; ``reject``: it is rejected; ``slow``: waits to be canceled."""

    def __init__(self, seen: Seen) -> None:
        self.seen = seen

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        message = context.message
        assert message is not None and context.task_id and context.context_id
        meta = MessageToDict(message.metadata) if message.HasField("metadata") else {}
        skill = meta.get("skillId")
        self.seen.skills.append(skill)
        if context.current_task is None:
            await event_queue.enqueue_event(new_task_from_user_message(message))
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await updater.start_work()
        if skill == "fail":
            broke = updater.new_agent_message([Part(text="it broke")])
            await updater.failed(broke)
        elif skill == "reject":
            await updater.reject(updater.new_agent_message([Part(text="not for you")]))
        elif skill == "slow":
            self.seen.slow_started.set()
            await asyncio.sleep(LIMIT * 3)
        else:
            parts = list(message.parts)
            if skill == "shout":
                parts = [Part(text=" ".join(p.text for p in parts).upper())]
            await updater.add_artifact(parts, name="response")
            await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        self.seen.canceled.set()
        assert context.task_id and context.context_id
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


def server_card(url: str) -> dict[str, Any]:
    skill_ids = ("echo", "shout", "fail", "reject", "slow")
    return {
        "name": "Weather desk",
        "description": "an A2A server of the test",
        "version": "2.1.0",
        "supportedInterfaces": [
            {"url": f"{url}/jsonrpc", "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}
        ],
        "capabilities": {"streaming": True},
        "defaultInputModes": ["text/plain"],
        "defaultOutputModes": ["text/plain"],
        "skills": [
            {"id": s, "name": s.title(), "description": f"the {s} skill", "tags": [s]}
            for s in skill_ids
        ],
    }


class Server:
    """The A2A server on a fixed loopback port, started and stopped at will."""

    def __init__(self, seen: Seen) -> None:
        probe = listen(HOST, 0)
        self.port = probe.getsockname()[1]
        probe.close()
        self.url = base_url(HOST, self.port)
        card = ParseDict(server_card(self.url), A2ACard())
        handler = DefaultRequestHandler(
            agent_executor=Executor(seen), task_store=InMemoryTaskStore(), agent_card=card
        )
        self.app = Starlette(
            routes=[*create_agent_card_routes(card), *create_jsonrpc_routes(handler, "/jsonrpc")]
        )
        self._server: Announcing | None = None
        self._task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None

    async def start(self) -> None:
        self._sock = listen(HOST, self.port)
        ready = asyncio.Event()
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off")
        self._server = Announcing(config, ready.set)
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        async with asyncio.timeout(LIMIT):
            await ready.wait()

    async def stop(self) -> None:
        """Stop as a server process does: its connections closed (a cancelled uvicorn
        would go on answering on the connections it has)."""
        server, task, sock = self._server, self._task, self._sock
        self._server, self._task, self._sock = None, None, None
        if server is not None and task is not None:
            server.should_exit = server.force_exit = True
            async with asyncio.timeout(LIMIT):
                await task
        if sock is not None:
            sock.close()


# -- the swarm -----------------------------------------------------------------------------------


async def _ignore(envelope: Envelope) -> None:
    """The asking agents only ask."""


@dataclass
class Swarm:
    owner: AioNode
    caller: AioNode
    server: Server
    publisher: ServerPublisher
    gateway_url: str
    http: httpx.AsyncClient
    seen: Seen

    async def request(self, payload: Any, skill: str | None, *, seconds: float = LIMIT) -> Any:
        """The library's request from agent ``asker`` on the other node, waited for
        ``seconds`` (it travels as the request's deadline)."""
        meta = Metadata(capability=skill) if skill is not None else None
        call = partial(
            self.caller.node.request, "asker", AGENT, payload, metadata=meta, timeout=seconds
        )
        return (await self.caller.run_trio(call)).payload

    async def listed(self) -> bool:
        return any(card.id == AGENT for card in await self.caller.find("shout"))


async def wait_until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after LIMIT seconds."""
    for _ in range(int(LIMIT / 0.05)):
        if await check():
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"not within {LIMIT:g} s: {what}")


@asynccontextmanager
async def publish_swarm() -> AsyncIterator[Swarm]:
    network = TrioNetwork()
    config = NodeConfig(listen=(HOST, 0))
    seen = Seen()
    server = Server(seen)
    await server.start()
    async with (
        aio.open_node(Identity.generate(), network, config) as owner,
        aio.open_node(Identity.generate(), network, config) as caller,
    ):
        await caller.add_agent("asker", _ignore)
        await caller.add_agent("gateway", _ignore)
        await caller.connect((HOST, owner.listen_address[1]))
        spec = PublishSpec(server.url, AGENT, poll=0.2, retry=0.2, max_failures=2)
        publisher = ServerPublisher(spec, host_in_aio_node(owner))
        running = asyncio.create_task(publisher.run())
        sock = listen(HOST, 0)
        url = base_url(HOST, sock.getsockname()[1])
        gateway = Gateway(NodeSwarm(caller, "gateway", refresh=0.0), url, timeout=LIMIT)
        ready = asyncio.Event()
        served = asyncio.create_task(serve(BearerGuard(gateway, TOKEN), sock, ready.set))
        http = httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=LIMIT)
        swarm = Swarm(owner, caller, server, publisher, url, http, seen)
        try:
            async with asyncio.timeout(LIMIT):
                await ready.wait()
                await publisher.wait_published()
            await wait_until(swarm.listed, "the published agent is found")
            yield swarm
        finally:
            await http.aclose()
            for task in (served, running):
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            sock.close()
            await server.stop()


Running = LoopThread[Swarm]


@pytest.fixture(scope="module")
def running() -> Iterator[Running]:
    served = Running(publish_swarm, LIMIT)
    served.start()
    yield served
    served.stop()


# -- calling the server directly -----------------------------------------------------------------


async def direct(url: str, parts: list[Part], skill: str) -> Task:
    """The task the server ends with for ``parts`` asking ``skill``, called directly."""
    async with httpx.AsyncClient(timeout=LIMIT) as http:
        config = ClientConfig(httpx_client=http, streaming=False)
        client = await create_client(url, client_config=config)
        return await last_task(client, parts, skill)


async def last_task(client: Client, parts: list[Part], skill: str) -> Task:
    """The task a blocking SendMessage of ``parts`` asking ``skill`` answers."""
    message = Message(message_id=f"m-{id(parts)}", role=Role.ROLE_USER, parts=parts)
    message.metadata.update({"skillId": skill})
    last: StreamResponse | None = None
    async for event in client.send_message(SendMessageRequest(message=message)):
        last = event
    assert last is not None and last.HasField("task"), last
    return last.task


def artifact_parts(task: Task) -> list[dict[str, Any]]:
    return [MessageToDict(p) for a in task.artifacts for p in a.parts]


PAYLOADS: list[Any] = [
    "hello",
    {"city": "Oslo", "days": 3, "hourly": [1, 2.5, None, True]},
    [1, "two", {"three": 3}],
    {"a2a/parts": [{"text": "a"}, {"url": "https://example.org/x", "mediaType": "text/html"}]},
]


# -- the tests -----------------------------------------------------------------------------------


def test_the_card_becomes_the_agent_and_requests_answer_as_the_server_does(
    running: Running,
) -> None:
    async def check(swarm: Swarm) -> None:
        (card,) = [c for c in await swarm.caller.find("echo") if c.id == AGENT]
        assert [c.id for c in card.capabilities] == ["echo", "shout", "fail", "reject", "slow"]
        assert (card.name, card.version) == ("Weather desk", "2.1.0")
        for payload in PAYLOADS:
            parts = [ParseDict(p, Part()) for p in parts_of_payload(payload)]
            expected = payload_of_answer_untrusted(
                artifact_parts(await direct(swarm.server.url, parts, "echo"))
            )
            assert await swarm.request(payload, "echo") == expected == payload
        assert await swarm.request("quiet please", "shout") == "QUIET PLEASE"
        assert swarm.seen.skills[-1] == "shout"

    running.run(check)


def test_through_the_gateway_an_a2a_client_gets_what_the_server_answers(running: Running) -> None:
    parts = [
        Part(text="hello"),
        ParseDict({"data": {"n": 3, "list": [1, "two", None, True]}}, Part()),
        Part(url="https://example.org/x", media_type="text/html"),
    ]

    async def check(swarm: Swarm) -> None:
        config = ClientConfig(httpx_client=swarm.http, streaming=False)
        via = await create_client(f"{swarm.gateway_url}/agents/{AGENT}", client_config=config)
        for skill, sent in (("echo", parts), ("shout", [Part(text="loud")])):
            through = await last_task(via, sent, skill)
            straight = await direct(swarm.server.url, sent, skill)
            assert artifact_parts(through) == artifact_parts(straight)
            assert through.status.state == straight.status.state

    running.run(check)


def test_the_server_errors_are_typed_swarm_errors(running: Running) -> None:
    async def check(swarm: Swarm) -> None:
        with pytest.raises(P2PError) as failed:
            await swarm.request("x", "fail")
        assert (failed.value.code, failed.value.message) == (ErrorCode.HANDLER_FAILED, "it broke")
        with pytest.raises(P2PError) as rejected:
            await swarm.request("x", "reject")
        assert rejected.value.code is ErrorCode.TASK_REJECTED

    running.run(check)


def test_a_deadline_passed_cancels_the_task_at_the_server(running: Running) -> None:
    async def check(swarm: Swarm) -> None:
        swarm.seen.canceled.clear()
        # Long enough for the server's first event (the task's id) to come back first on a
        # loaded machine (2 s was not, on CI sharing its 2 cores with a simulation): a
        # call given up before that event cannot name the task to cancel.
        with pytest.raises(P2PError) as late:
            await swarm.request("x", "slow", seconds=5.0)
        assert late.value.code is ErrorCode.TIMEOUT
        assert swarm.seen.slow_started.is_set()
        async with asyncio.timeout(LIMIT):
            await swarm.seen.canceled.wait()

    running.run(check)


def test_the_server_stopping_withdraws_the_agent_and_its_return_restores_it(
    running: Running,
) -> None:
    async def check(swarm: Swarm) -> None:
        published = swarm.publisher.publications
        await swarm.server.stop()

        async def gone() -> bool:
            return not await swarm.listed()

        await wait_until(gone, "the agent is withdrawn")
        assert swarm.publisher.state is ServerState.WITHDRAWN
        await swarm.server.start()
        await wait_until(swarm.listed, "the agent is back")
        assert swarm.publisher.publications == published + 1
        assert await swarm.request("again", "echo") == "again"

    running.run(check)


def test_a_callers_cancel_cancels_the_task_at_the_server(running: Running) -> None:
    async def check(swarm: Swarm) -> None:
        swarm.seen.canceled.clear()
        swarm.seen.slow_started.clear()
        call = asyncio.create_task(swarm.request("x", "slow", seconds=LIMIT * 2))
        async with asyncio.timeout(LIMIT):
            await swarm.seen.slow_started.wait()
        await asyncio.sleep(0.3)  # the server's first event (the task's id) comes back
        call.cancel()  # the caller gives up long before any deadline
        with pytest.raises(asyncio.CancelledError):
            await call
        async with asyncio.timeout(LIMIT):
            await swarm.seen.canceled.wait()

    running.run(check)
