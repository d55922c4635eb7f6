"""Push notifications of the A2A gateway (docs/protocol/a2a.md §6.1): the four config
operations on both bindings, and the gateway posting each task's events to a webhook
(a small HTTP server on 127.0.0.1 in the test) in order, with the config's token and
credentials, without a slow or dead webhook holding up the task.

The swarm is a stand-in (:class:`HeldSwarm`): one agent whose owner works until the test
lets it answer. Plain ``def`` tests, each running its own asyncio loop (the SDK is asyncio).
"""

from __future__ import annotations

import asyncio
import socket
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from a2a.client import Client, ClientConfig, create_client
from a2a.server.context import ServerCallContext
from a2a.types import (
    AuthenticationInfo,
    DeleteTaskPushNotificationConfigRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    Task,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils.errors import InvalidParamsError, TaskNotFoundError
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from p2pnode.bridges.a2a.gateway import Gateway
from p2pnode.bridges.a2a.http import BearerGuard, base_url, listen, serve
from p2pnode.bridges.a2a.push import (
    MAX_CONFIGS_PER_TASK,
    MAX_URL,
    PushConfigStore,
    PushDelivery,
    push_config_problem,
)
from p2pnode.core.card import AgentCard, Capability
from p2pnode.core.identity import Identity

HOST = "127.0.0.1"
TOKEN = "test-token"
#: Every wait in these tests gives up after this long.
LIMIT = 10.0
OWNER = Identity.generate()
CARD = AgentCard(
    id="worker",
    name="Worker",
    version="1.0.0",
    description="works until told to answer",
    public_key=OWNER.public_key,
    tier=1,
    capabilities=(Capability("work.long", "Long work", "takes a while"),),
    addresses=("127.0.0.1:7000",),
    issued_at=1,
    expires_at=2**40,
).signed(OWNER)


class HeldSwarm:
    """A swarm of one agent whose owner answers each request once ``answer`` is set."""

    acting_agent = "gateway"

    def __init__(self) -> None:
        self.working = asyncio.Event()
        self.answer = asyncio.Event()

    async def agents(self) -> list[AgentCard]:
        return [CARD]

    async def request(
        self, agent_id: str, payload: Any, *, capability: str | None, seconds: float
    ) -> Any:
        self.working.set()
        await self.answer.wait()
        return {"done": payload}


@dataclass
class Hook:
    """The webhook: what it was posted, by path. ``hold`` set: it never answers."""

    url: str
    posts: list[tuple[str, dict[str, str], dict[str, Any]]] = field(default_factory=list)
    hold: bool = False
    status: int = 200
    posted: asyncio.Condition = field(default_factory=asyncio.Condition)

    def bodies(self, path: str = "/hook") -> list[dict[str, Any]]:
        return [body for at, _, body in self.posts if at == path]


@dataclass
class Served:
    gateway: Gateway
    swarm: HeldSwarm
    hook: Hook
    http: httpx.AsyncClient
    url: str

    async def client(self, *, rest: bool = False, streaming: bool = False) -> Client:
        config = ClientConfig(
            httpx_client=self.http,
            streaming=streaming,
            supported_protocol_bindings=["HTTP+JSON"] if rest else ["JSONRPC"],
        )
        return await create_client(f"{self.url}/agents/worker", client_config=config)


@asynccontextmanager
async def _serving(app: Any) -> AsyncIterator[str]:
    sock = listen(HOST, 0)
    ready = asyncio.Event()
    server = asyncio.create_task(serve(app, sock, ready.set))
    try:
        async with asyncio.timeout(LIMIT):
            await ready.wait()
        yield base_url(HOST, sock.getsockname()[1])
    finally:
        server.cancel()
        with pytest.raises(asyncio.CancelledError):
            await server
        sock.close()


def _hook_app(hook: Hook) -> Starlette:
    async def record(request: Request) -> Response:
        hook.posts.append((request.url.path, dict(request.headers), await request.json()))
        async with hook.posted:
            hook.posted.notify_all()
        if hook.hold:
            await asyncio.Event().wait()
        return Response(status_code=hook.status)

    return Starlette(routes=[Route("/hook{rest:path}", record, methods=["POST"])])


@asynccontextmanager
async def served(push: PushDelivery | None = None) -> AsyncIterator[Served]:
    """The gateway over :class:`HeldSwarm`, and the webhook, both on loopback."""
    hook = Hook("")
    swarm = HeldSwarm()
    async with _serving(_hook_app(hook)) as hook_url:
        hook.url = hook_url + "/hook"
        holder = _Late()
        async with _serving(BearerGuard(holder, TOKEN)) as url:
            gateway = Gateway(swarm, url, timeout=LIMIT, push=push)
            holder.app = gateway
            http = httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=LIMIT)
            try:
                yield Served(gateway, swarm, hook, http, url)
            finally:
                swarm.answer.set()  # no owner waits past the test
                await http.aclose()
                await gateway.aclose()


class _Late:
    """An ASGI app set once the gateway knows its URL (the port is bound first)."""

    app: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), LIMIT * 2))


async def wait_until(hook: Hook, condition: Callable[[], bool]) -> None:
    """Wait (LIMIT at most) until ``condition`` holds, checked after each post to ``hook``."""
    async with asyncio.timeout(LIMIT), hook.posted:
        await hook.posted.wait_for(condition)


def message(text: str) -> Message:
    return Message(message_id=str(uuid.uuid4()), role=Role.ROLE_USER, parts=[Part(text=text)])


def push_config(url: str, config_id: str = "", token: str = "") -> TaskPushNotificationConfig:
    config = TaskPushNotificationConfig(url=url, token=token)
    if config_id:
        config.id = config_id
    return config


async def send(
    client: Client, text: str, *, config: TaskPushNotificationConfig | None = None,
    immediately: bool = True,
) -> Task:  # fmt: skip
    configuration = SendMessageConfiguration(return_immediately=immediately)
    if config is not None:
        configuration.task_push_notification_config.CopyFrom(config)
    request = SendMessageRequest(message=message(text), configuration=configuration)
    tasks = [e.task async for e in client.send_message(request) if e.HasField("task")]
    assert tasks, "no task in the answer"
    return tasks[-1]  # the answer of a blocking send; the first event of a stream


def states(bodies: list[dict[str, Any]]) -> list[str]:
    """The task state each push reports (``artifact`` for an artifact update)."""
    seen = []
    for body in bodies:
        if "task" in body:
            seen.append(body["task"]["status"]["state"])
        elif "statusUpdate" in body:
            seen.append(body["statusUpdate"]["status"]["state"])
        else:
            assert "artifactUpdate" in body, body
            seen.append("artifact")
    return seen


# -- delivery ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_webhook_gets_the_task_updates_in_order_with_its_token_and_credentials() -> None:
    async def main() -> None:
        async with served() as s:
            client = await s.client()
            config = push_config(s.hook.url, token="tok-1")
            config.authentication.CopyFrom(AuthenticationInfo(scheme="Bearer", credentials="c-1"))
            task = await send(client, "job", config=config)
            await asyncio.wait_for(s.swarm.working.wait(), LIMIT)
            await wait_until(s.hook, lambda: "TASK_STATE_WORKING" in states(s.hook.bodies()))
            assert "TASK_STATE_COMPLETED" not in states(s.hook.bodies())  # the owner works
            s.swarm.answer.set()
            await wait_until(s.hook, lambda: "TASK_STATE_COMPLETED" in states(s.hook.bodies()))
            await s.gateway.push.wait_idle()
            got = states(s.hook.bodies())
            assert got == [
                "TASK_STATE_SUBMITTED", "TASK_STATE_WORKING", "artifact", "TASK_STATE_COMPLETED"
            ]  # fmt: skip
            for _, headers, body in s.hook.posts:
                assert headers["x-a2a-notification-token"] == "tok-1"
                assert headers["authorization"] == "Bearer c-1"
                event = next(iter(body.values()))
                assert event.get("taskId", event.get("id")) == task.id
            artifact = s.hook.bodies()[2]["artifactUpdate"]["artifact"]
            assert artifact["parts"] == [{"data": {"done": "job"}}]
            assert s.gateway.push.statistics()["sent"] == 4

    run(main)


@pytest.mark.slow
def test_an_unreachable_webhook_does_not_break_the_task() -> None:
    async def main() -> None:
        closed = socket.socket()
        closed.bind((HOST, 0))  # bound, never listening: connections are refused
        dead = f"http://{HOST}:{closed.getsockname()[1]}/hook"
        push = PushDelivery(PushConfigStore(), backoff=0.01)
        async with served(push) as s:
            s.swarm.answer.set()
            client = await s.client()
            task = await send(client, "job", config=push_config(dead), immediately=False)
            assert task.status.state == TaskState.TASK_STATE_COMPLETED
            await push.wait_idle()
            assert push.statistics()["failed"] == 4 and push.statistics()["sent"] == 0
            again = await client.get_task(GetTaskRequest(id=task.id))
            assert again.status.state == TaskState.TASK_STATE_COMPLETED
        closed.close()

    run(main)


@pytest.mark.slow
def test_a_webhook_that_never_answers_holds_up_nothing_but_its_own_pushes() -> None:
    async def main() -> None:
        push = PushDelivery(PushConfigStore(), client=httpx.AsyncClient(timeout=LIMIT * 3))
        async with served(push) as s:
            s.hook.hold = True
            s.swarm.answer.set()
            client = await s.client(streaming=True)
            async with asyncio.timeout(LIMIT / 2):  # a webhook that held it would take 30 s
                task = await send(client, "job", config=push_config(s.hook.url))
                other = await send(await s.client(), "other", immediately=False)
            assert other.status.state == TaskState.TASK_STATE_COMPLETED
            await wait_until(s.hook, lambda: len(s.hook.posts) == 1)
            assert push.statistics()["pending"] >= 1  # the rest wait behind the first
            assert s.hook.posts[0][2]["task"]["id"] == task.id

    run(main)


@pytest.mark.slow
def test_a_failing_webhook_is_tried_three_times_per_push() -> None:
    async def main() -> None:
        push = PushDelivery(PushConfigStore(), backoff=0.01)
        async with served(push) as s:
            s.hook.status = 500
            s.swarm.answer.set()
            client = await s.client()
            await send(client, "job", config=push_config(s.hook.url), immediately=False)
            await push.wait_idle()
            assert states(s.hook.bodies()) == [
                state for state in ["TASK_STATE_SUBMITTED", "TASK_STATE_WORKING", "artifact",
                                    "TASK_STATE_COMPLETED"] for _ in range(3)
            ]  # fmt: skip
            assert push.statistics()["failed"] == 4

    run(main)


@pytest.mark.slow
def test_a_push_whose_body_is_too_large_is_not_sent() -> None:
    async def main() -> None:
        small = PushDelivery(PushConfigStore(), max_body=300)
        async with served(small) as s:
            s.swarm.answer.set()
            client = await s.client()
            await send(client, "x" * 400, config=push_config(s.hook.url), immediately=False)
            await small.wait_idle()
            sent = states(s.hook.bodies())
            assert sent == ["TASK_STATE_WORKING", "TASK_STATE_COMPLETED"], sent
            assert small.statistics()["too_large"] == 2  # the task and the artifact

    run(main)


# -- the config operations ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("rest", [False, True], ids=["jsonrpc", "rest"])
def test_create_get_list_delete_and_only_live_configs_are_pushed(rest: bool) -> None:
    async def main() -> None:
        async with served() as s:
            client = await s.client(rest=rest)
            task = await send(client, "job")
            await asyncio.wait_for(s.swarm.working.wait(), LIMIT)
            for name in ("a", "b"):
                config = push_config(f"{s.hook.url}/{name}", name, token=f"t-{name}")
                config.task_id = task.id
                made = await client.create_task_push_notification_config(config)
                assert (made.id, made.task_id, made.url) == (name, task.id, config.url)
            got = await client.get_task_push_notification_config(
                GetTaskPushNotificationConfigRequest(task_id=task.id, id="a")
            )
            assert (got.url, got.token) == (f"{s.hook.url}/a", "t-a")
            listed = await client.list_task_push_notification_configs(
                ListTaskPushNotificationConfigsRequest(task_id=task.id)
            )
            assert sorted(c.id for c in listed.configs) == ["a", "b"]
            await client.delete_task_push_notification_config(
                DeleteTaskPushNotificationConfigRequest(task_id=task.id, id="a")
            )
            listed = await client.list_task_push_notification_configs(
                ListTaskPushNotificationConfigsRequest(task_id=task.id)
            )
            assert [c.id for c in listed.configs] == ["b"]
            s.swarm.answer.set()
            b_done = lambda: "TASK_STATE_COMPLETED" in states(s.hook.bodies("/hook/b"))  # noqa: E731
            await wait_until(s.hook, b_done)
            await s.gateway.push.wait_idle()
            assert s.hook.bodies("/hook/a") == []
            assert states(s.hook.bodies("/hook/b")) == ["artifact", "TASK_STATE_COMPLETED"]

    run(main)


@pytest.mark.slow
def test_the_card_says_push_notifications_and_bad_configs_are_invalid_params() -> None:
    async def main() -> None:
        async with served() as s:
            answer = await s.http.get(f"{s.url}/agents/worker/.well-known/agent-card.json")
            assert answer.json()["capabilities"]["pushNotifications"] is True
            client = await s.client()
            task = await send(client, "job")
            refused = [
                "ftp://127.0.0.1/x",
                "http:///no-host",
                "http://h/" + "x" * MAX_URL,
            ]
            for url in refused:
                config = push_config(url)
                config.task_id = task.id
                with pytest.raises(InvalidParamsError):
                    await client.create_task_push_notification_config(config)
            for n in range(MAX_CONFIGS_PER_TASK):
                config = push_config(s.hook.url, f"c{n}")
                config.task_id = task.id
                await client.create_task_push_notification_config(config)
            config = push_config(s.hook.url, "one-too-many")
            config.task_id = task.id
            with pytest.raises(InvalidParamsError):
                await client.create_task_push_notification_config(config)
            again = push_config(s.hook.url + "/new", "c0")  # replacing one is no new one
            again.task_id = task.id
            assert (await client.create_task_push_notification_config(again)).url == again.url
            with pytest.raises(InvalidParamsError):  # also when set with the message
                await send(client, "job", config=push_config("file:///etc/passwd"))
            config = push_config(s.hook.url)
            config.task_id = "no-such-task"
            with pytest.raises(TaskNotFoundError):
                await client.create_task_push_notification_config(config)

    run(main)


# -- bounds ------------------------------------------------------------------------------------


def test_the_store_keeps_the_configs_of_the_tasks_set_last() -> None:
    async def main() -> None:
        store = PushConfigStore(limit=2)
        for task_id in ("t1", "t2", "t3"):
            await store.set_info(task_id, push_config("http://h/x"), ServerCallContext())
        assert await store.get_info_for_dispatch("t1") == []
        assert [c.task_id for c in await store.get_info_for_dispatch("t3")] == ["t3"]
        assert store.statistics() == {"tasks": 2}

    run(main)


def test_pushes_past_the_pending_limit_are_dropped_not_queued() -> None:
    async def main() -> None:
        store = PushConfigStore()
        await store.set_info("t", push_config("http://h/x"), ServerCallContext())
        await store.delete_info("t", ServerCallContext(), "t")
        push = PushDelivery(store, max_pending=2)
        for _ in range(5):  # its config deleted: each push is dropped once its turn comes
            push.send_nowait("t", Task(id="t"))
        assert push.statistics()["pending"] == 2 and push.statistics()["dropped"] == 3
        await push.wait_idle()
        assert push.statistics()["pending"] == 0
        await push.aclose()

    run(main)


def test_events_of_a_task_without_a_config_are_not_queued() -> None:
    async def main() -> None:
        store = PushConfigStore()
        push = PushDelivery(store)
        for _ in range(3):
            push.send_nowait("t", Task(id="t"))
        assert push.statistics() == {"sent": 0, "failed": 0, "dropped": 0, "too_large": 0,
                                     "pending": 0}  # fmt: skip
        await store.set_info("t", push_config("http://h/x"), ServerCallContext())
        await store.delete_info("t", ServerCallContext(), "t")
        push.send_nowait("t", Task(id="t"))  # given a config once: queued, read at its turn
        assert push.statistics()["pending"] == 1
        await push.wait_idle()
        assert push.statistics()["pending"] == 0 and push.statistics()["sent"] == 0
        await push.aclose()

    run(main)


@given(st.text(max_size=64), st.sampled_from(["http://", "https://", "ftp://", ""]))
def test_a_push_url_is_taken_only_when_http_with_a_host(tail: str, scheme: str) -> None:
    url = scheme + tail
    problem = push_config_problem(TaskPushNotificationConfig(url=url))
    if problem is None:
        assert scheme in ("http://", "https://") and len(url) <= MAX_URL
        assert urllib.parse.urlsplit(url).hostname
    else:
        assert isinstance(problem, str)
