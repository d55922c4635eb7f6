"""The A2A gateway (p2pnode.bridges.a2a) driven by the A2A SDK's own client over loopback
HTTP, in front of a two-node swarm: the owner's node hosts the agents, the gateway's node
acts as agent ``gateway`` (tier 1). Plain ``def`` tests, each running its own asyncio loop
(the SDK is asyncio; the nodes run in trio's guest mode on that loop).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from a2a.client import A2AClientError, Client, ClientConfig, create_client
from a2a.helpers.proto_helpers import get_artifact_text
from a2a.types import (
    CancelTaskRequest,
    GetTaskRequest,
    ListTasksRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    StreamResponse,
    SubscribeToTaskRequest,
    Task,
    TaskState,
)
from a2a.utils.errors import InvalidParamsError, TaskNotCancelableError, TaskNotFoundError
from google.protobuf.json_format import MessageToDict, ParseDict
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode import Agent, Identity, NodeConfig, TrioNetwork, aio
from p2pnode.agent.definition import Message as AgentMessage
from p2pnode.bridges.a2a.gateway import CARD_PATH, SCHEMAS_EXTENSION, Gateway, NodeSwarm
from p2pnode.bridges.a2a.http import BearerGuard, base_url, listen, serve
from p2pnode.bridges.a2a.mapping import MAX_PARTS, MAX_RAW_BYTES
from p2pnode.core.envelope import Envelope
from tests.loopthread import LoopThread

#: Real sockets on loopback: the nodes' and the gateway's. One worker runs the module, so
#: the swarm its tests share starts once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("a2a-gateway")]

HOST = "127.0.0.1"
TOKEN = "test-token"
#: Every wait in these tests gives up after this long.
LIMIT = 10.0


@dataclass
class Swarm:
    """What a test sees: the gateway's URL, an authorized HTTP client, and what the
    owner's agents recorded."""

    url: str
    http: httpx.AsyncClient
    seen: list[Any] = field(default_factory=list)
    owner_cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    started: asyncio.Event = field(default_factory=asyncio.Event)

    async def client(self, agent: str, *, streaming: bool = False, rest: bool = False) -> Client:
        config = ClientConfig(
            httpx_client=self.http,
            streaming=streaming,
            supported_protocol_bindings=["HTTP+JSON"] if rest else ["JSONRPC"],
        )
        return await create_client(f"{self.url}/agents/{agent}", client_config=config)


def _owner_agents(swarm: Swarm) -> list[Agent]:
    echo = Agent("echo", description="says back what it is sent", tier=1)

    @echo.on_request("echo.back", description="the payload, unchanged")
    async def back(message: AgentMessage) -> Any:
        swarm.seen.append(message.payload)
        return message.payload

    @echo.on_request("echo.object", input_schema={"type": "object"})
    async def as_object(message: AgentMessage) -> Any:
        return {"got": message.payload}

    @echo.on_request("echo.fail")
    async def fail(message: AgentMessage) -> Any:
        raise RuntimeError("the handler broke")

    slow = Agent("slow", tier=1)

    @slow.on_request("slow.wait")
    async def wait(message: AgentMessage) -> Any:
        swarm.started.set()
        try:
            await asyncio.sleep(LIMIT * 2)
        except asyncio.CancelledError:
            swarm.owner_cancelled.set()
            raise
        return "late"

    vault = Agent("vault", tier=3)  # L1 agents may send to L0 and L1 only (default rules)

    @vault.on_request("vault.open")
    async def open_vault(message: AgentMessage) -> Any:
        return "opened"

    hidden = Agent("hidden", sandbox="lab")  # outside the gateway agent's sandbox rules

    @hidden.on_request("hidden.x")
    async def hidden_x(message: AgentMessage) -> Any:
        return "x"

    return [echo, slow, vault, hidden]


async def _ignore(envelope: Envelope) -> None:
    """The gateway's agent only asks."""


@asynccontextmanager
async def gateway_swarm() -> AsyncIterator[Swarm]:
    """Two nodes on loopback and ``a2a serve``'s app in front of the second."""
    network = TrioNetwork()
    config = NodeConfig(listen=(HOST, 0))
    async with (
        aio.open_node(Identity.generate(), network, config) as owner,
        aio.open_node(Identity.generate(), network, config) as node,
    ):
        sock = listen(HOST, 0)
        url = base_url(HOST, sock.getsockname()[1])
        http = httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=LIMIT)
        swarm = Swarm(url, http)
        for agent in _owner_agents(swarm):
            await owner.add_agent(agent)
        await node.add_agent("gateway", _ignore, tier=1)
        await node.connect((HOST, owner.listen_address[1]))
        gateway = Gateway(NodeSwarm(node, "gateway", refresh=0.0), url, timeout=LIMIT)
        ready = asyncio.Event()
        server = asyncio.create_task(serve(BearerGuard(gateway, TOKEN), sock, ready.set))
        try:
            async with asyncio.timeout(LIMIT):
                await ready.wait()
            yield swarm
        finally:
            await http.aclose()
            server.cancel()
            with pytest.raises(asyncio.CancelledError):
                await server
            sock.close()


Running = LoopThread[Swarm]


@pytest.fixture(scope="module")
def running() -> Iterator[Running]:
    served = Running(gateway_swarm, LIMIT)
    served.start()
    yield served
    served.stop()


def message(*parts: Part, skill: str | None = None, task_id: str = "") -> Message:
    msg = Message(message_id=f"m-{id(parts)}", role=Role.ROLE_USER, parts=list(parts))
    if task_id:
        msg.task_id = task_id
    if skill is not None:
        msg.metadata.update({"skillId": skill})
    return msg


async def send(client: Client, msg: Message, *, immediately: bool = False) -> Task:
    """The task SendMessage answers (its last event)."""
    config = SendMessageConfiguration(return_immediately=immediately)
    last: StreamResponse | None = None
    async for event in client.send_message(SendMessageRequest(message=msg, configuration=config)):
        last = event
    assert last is not None and last.HasField("task"), last
    return last.task


def artifact_json(task: Task) -> list[dict[str, Any]]:
    assert len(task.artifacts) == 1, task
    return [MessageToDict(p) for p in task.artifacts[0].parts]


# -- cards and the index -----------------------------------------------------------------------


def test_index_lists_the_discoverable_agents_and_each_card_is_served(running: Running) -> None:
    async def check(swarm: Swarm) -> None:
        index = (await swarm.http.get(f"{swarm.url}/agents")).json()
        ids = [a["id"] for a in index["agents"]]
        # "hidden" is sandboxed away from the gateway's agent; the gateway's own is left out.
        assert ids == ["echo", "slow", "vault"]
        card = (await swarm.http.get(f"{swarm.url}/agents/echo{CARD_PATH}")).json()
        bindings = [(i["protocolBinding"], i["url"]) for i in card["supportedInterfaces"]]
        assert bindings[:2] == [
            ("JSONRPC", f"{swarm.url}/agents/echo/jsonrpc"),
            ("HTTP+JSON", f"{swarm.url}/agents/echo/rest"),
        ]
        assert bindings[2][0] == "P2PNODE-NOISE"
        assert {s["id"] for s in card["skills"]} == {"echo.back", "echo.object", "echo.fail"}
        (extension,) = card["capabilities"]["extensions"]
        assert extension["uri"] == SCHEMAS_EXTENSION
        schemas = extension["params"]["skills"]
        assert schemas["echo.object"]["inputSchema"] == {"type": "object"}
        assert card["securitySchemes"]["bearer"]["httpAuthSecurityScheme"]["scheme"] == "Bearer"

    running.run(check)


def test_no_token_no_access(running: Running) -> None:
    async def check(swarm: Swarm) -> None:
        async with httpx.AsyncClient() as bare:
            answer = await bare.get(f"{swarm.url}/agents/echo{CARD_PATH}")
            assert answer.status_code == 401
            wrong = await bare.get(f"{swarm.url}/agents", headers={"Authorization": "Bearer x"})
            assert wrong.status_code == 401

    running.run(check)


def test_an_unknown_or_undiscoverable_agent_is_404(running: Running) -> None:
    async def check(swarm: Swarm) -> None:
        for agent in ("nobody", "hidden"):
            answer = await swarm.http.get(f"{swarm.url}/agents/{agent}{CARD_PATH}")
            assert answer.status_code == 404
            assert answer.json()["error"]["code"] == "AGENT_NOT_FOUND"
            with pytest.raises(A2AClientError):
                await swarm.client(agent)

    running.run(check)


# -- SendMessage, GetTask, ListTasks -------------------------------------------------------------


def test_send_message_is_a_request_to_the_owner_and_parts_survive(running: Running) -> None:
    raw = bytes(range(256))
    parts = [
        Part(text="hello"),
        Part(raw=raw, filename="b.bin", media_type="application/octet-stream"),
        ParseDict({"data": {"n": 3, "list": [1, "two", None, True]}}, Part()),
        Part(url="https://example.org/x", media_type="text/html"),
    ]

    async def check(swarm: Swarm) -> None:
        client = await swarm.client("echo")
        before = len(swarm.seen)
        text = await send(client, message(Part(text="hi"), skill="echo.back"))
        assert text.status.state == TaskState.TASK_STATE_COMPLETED
        assert get_artifact_text(text.artifacts[0]) == "hi"
        data_part = ParseDict({"data": {"a": [1, 2]}}, Part())
        data = await send(client, message(data_part, skill="echo.back"))
        assert artifact_json(data) == [{"data": {"a": [1, 2]}}]
        assert swarm.seen[before:] == ["hi", {"a": [1, 2]}]  # the owner got plain JSON
        mixed = await send(client, message(*parts, skill="echo.back"))
        assert artifact_json(mixed) == [MessageToDict(p) for p in parts]
        assert base64.b64decode(swarm.seen[-1]["a2a/parts"][1]["raw"]) == raw

    running.run(check)


def test_get_task_and_list_tasks_show_finished_tasks(running: Running) -> None:
    async def check(swarm: Swarm) -> None:
        client = await swarm.client("echo")
        first = await send(client, message(Part(text="1"), skill="echo.back"))
        second = await send(client, message(Part(text="2"), skill="echo.back"))
        got = await client.get_task(GetTaskRequest(id=first.id))
        assert got.status.state == TaskState.TASK_STATE_COMPLETED
        assert get_artifact_text(got.artifacts[0]) == "1"
        listed = await client.list_tasks(ListTasksRequest())
        assert {first.id, second.id} <= {t.id for t in listed.tasks}
        with pytest.raises(TaskNotFoundError):
            await client.get_task(GetTaskRequest(id="no-such-task"))

    running.run(check)


def test_streaming_reports_working_then_the_artifact_then_completed(running: Running) -> None:
    async def check(swarm: Swarm) -> None:
        client = await swarm.client("echo", streaming=True)
        request = SendMessageRequest(message=message(Part(text="s"), skill="echo.back"))
        events = [event async for event in client.send_message(request)]
        kinds = [e.WhichOneof("payload") for e in events]
        assert kinds[-1] == "status_update"
        assert events[-1].status_update.status.state == TaskState.TASK_STATE_COMPLETED
        artifacts = [e.artifact_update.artifact for e in events if e.HasField("artifact_update")]
        assert [get_artifact_text(a) for a in artifacts] == ["s"]
        states = [e.status_update.status.state for e in events if e.HasField("status_update")]
        assert TaskState.TASK_STATE_WORKING in states

    running.run(check)


def test_rest_binding_serves_the_same_methods(running: Running) -> None:
    async def check(swarm: Swarm) -> None:
        client = await swarm.client("echo", rest=True)
        task = await send(client, message(Part(text="r"), skill="echo.back"))
        assert get_artifact_text(task.artifacts[0]) == "r"
        got = await client.get_task(GetTaskRequest(id=task.id))
        assert got.status.state == TaskState.TASK_STATE_COMPLETED
        with pytest.raises(InvalidParamsError) as refused:
            await send(client, message(Part(text="x"), skill="echo.nothing"))
        assert refused.value.data is not None
        assert refused.value.data["code"] == "CAPABILITY_NOT_FOUND"
        with pytest.raises(TaskNotFoundError):
            await client.get_task(GetTaskRequest(id="no-such-task"))
        broken = await swarm.http.post(
            f"{swarm.url}/agents/echo/rest/message:send",
            content=b"{not json",
            headers={"content-type": "application/json", "A2A-Version": "1.0"},
        )
        assert broken.status_code == 400

    running.run(check)


# -- errors --------------------------------------------------------------------------------------


def test_owner_refusal_rejects_the_task_with_its_code(running: Running) -> None:
    async def check(swarm: Swarm) -> None:
        task = await send(await swarm.client("vault"), message(Part(text="open")))
        assert task.status.state == TaskState.TASK_STATE_REJECTED
        parts = [MessageToDict(p) for p in task.status.message.parts]
        assert parts[1]["data"]["code"] == "TIER_VIOLATION"

    running.run(check)


def test_input_the_owner_refuses_is_invalid_params(running: Running) -> None:
    async def check(swarm: Swarm) -> None:
        client = await swarm.client("echo")
        with pytest.raises(InvalidParamsError) as refused:  # the owner's schema check
            await send(client, message(Part(text="not an object"), skill="echo.object"))
        assert refused.value.data is not None and refused.value.data["code"] == "INVALID_INPUT"
        with pytest.raises(InvalidParamsError) as unknown:  # a skill the agent lacks
            await send(client, message(Part(text="x"), skill="echo.nothing"))
        assert unknown.value.data is not None
        assert unknown.value.data["code"] == "CAPABILITY_NOT_FOUND"

    running.run(check)


def test_an_owner_failure_fails_the_task_with_its_code(running: Running) -> None:
    async def check(swarm: Swarm) -> None:
        task = await send(await swarm.client("echo"), message(Part(text="x"), skill="echo.fail"))
        assert task.status.state == TaskState.TASK_STATE_FAILED
        text, data = (MessageToDict(p) for p in task.status.message.parts)
        assert data["data"]["code"] == "HANDLER_FAILED"
        assert text["text"].startswith("HANDLER_FAILED: ")

    running.run(check)


def test_parts_over_the_limits_are_refused_before_any_task(running: Running) -> None:
    async def check(swarm: Swarm) -> None:
        client = await swarm.client("echo")
        before = {t.id for t in (await client.list_tasks(ListTasksRequest())).tasks}
        asked = len(swarm.seen)
        many = [Part(text=str(i)) for i in range(MAX_PARTS + 1)]
        with pytest.raises(InvalidParamsError) as refused:
            await send(client, message(*many, skill="echo.back"))
        assert refused.value.data is not None
        assert refused.value.data["code"] == "MESSAGE_TOO_LARGE"
        assert len(swarm.seen) == asked  # the owner never saw it
        after = {t.id for t in (await client.list_tasks(ListTasksRequest())).tasks}
        assert after == before  # nor was a task opened for it

    running.run(check)


def test_a_streamed_message_over_the_limits_is_refused_too(running: Running) -> None:
    async def check(swarm: Swarm) -> None:
        client = await swarm.client("echo", streaming=True)
        raw = Part(raw=bytes(MAX_RAW_BYTES + 1))
        with pytest.raises(InvalidParamsError) as refused:
            await send(client, message(raw, skill="echo.back"))
        assert refused.value.data is not None
        assert refused.value.data["code"] == "MESSAGE_TOO_LARGE"

    running.run(check)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", -32700),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "NoSuchMethod", "params": {}}', -32601),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {"message": 5}}', -32602),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "GetTask", "params": {"id": "nope"}}', -32001),
        (b"[]", -32600),
    ],
)
def test_malformed_json_rpc_gets_a_json_rpc_error(running: Running, body: bytes, code: int) -> None:
    async def check(swarm: Swarm) -> None:
        answer = await swarm.http.post(
            f"{swarm.url}/agents/echo/jsonrpc",
            content=body,
            headers={"content-type": "application/json", "A2A-Version": "1.0"},
        )
        assert answer.json()["error"]["code"] == code, answer.text
        again = await send(await swarm.client("echo"), message(Part(text="ok"), skill="echo.back"))
        assert again.status.state == TaskState.TASK_STATE_COMPLETED  # still serving

    running.run(check)


_METHODS = ["SendMessage", "GetTask", "ListTasks", "CancelTask", "SubscribeToTask",
            "GetExtendedAgentCard", "SendStreamingMessage", "tasks/get", ""]  # fmt: skip
_scalars = st.none() | st.booleans() | st.integers() | st.text(max_size=8)
_json = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
_rpc = st.fixed_dictionaries(
    {"jsonrpc": st.sampled_from(["2.0", "1.0"]), "method": st.sampled_from(_METHODS)},
    optional={"id": _scalars, "params": _json},
)


@settings(max_examples=40, deadline=None)
@given(_rpc | _json)
def test_any_json_body_gets_a_json_rpc_answer(running: Running, body: Any) -> None:
    """Whatever JSON a client posts, the answer is a JSON-RPC response (an error or a
    result), never a server error, and the gateway goes on serving."""

    async def check(swarm: Swarm) -> None:
        headers = {"content-type": "application/json", "A2A-Version": "1.0"}
        url = f"{swarm.url}/agents/echo/jsonrpc"
        answer = await swarm.http.post(url, content=json.dumps(body), headers=headers)
        assert answer.status_code < 500, answer.text
        if answer.headers["content-type"].startswith("application/json"):
            reply = answer.json()
            assert "error" in reply or "result" in reply, reply
            if "error" in reply:
                assert isinstance(reply["error"]["code"], int)

    running.run(check)


# -- CancelTask ----------------------------------------------------------------------------------


def test_cancel_task_cancels_the_request_at_the_owner(running: Running) -> None:
    async def check(swarm: Swarm) -> None:
        client = await swarm.client("slow")
        task = await send(client, message(Part(text="wait")), immediately=True)
        await swarm.started.wait()
        streams = await swarm.client("slow", streaming=True)

        subscribed = asyncio.Event()

        async def follow() -> list[int]:  # SubscribeToTask, until the task ends
            states: list[int] = []
            async for event in streams.subscribe(SubscribeToTaskRequest(id=task.id)):
                subscribed.set()  # the first event is the task as it is
                if event.HasField("status_update"):
                    states.append(event.status_update.status.state)
            return states

        followed = asyncio.create_task(follow())
        await subscribed.wait()
        cancelled = await client.cancel_task(CancelTaskRequest(id=task.id))
        assert cancelled.status.state == TaskState.TASK_STATE_CANCELED
        await swarm.owner_cancelled.wait()  # the owner's handler was cancelled
        got = await client.get_task(GetTaskRequest(id=task.id))
        assert got.status.state == TaskState.TASK_STATE_CANCELED
        with pytest.raises(TaskNotCancelableError):  # a finished task cannot be cancelled again
            await client.cancel_task(CancelTaskRequest(id=task.id))
        assert (await followed)[-1:] == [TaskState.TASK_STATE_CANCELED]

    running.run(check)
