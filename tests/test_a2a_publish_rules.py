"""``a2a publish``'s rules without a network (docs/protocol/a2a.md §9): the inverse card
mapping round-trips the gateway's and ``card export --a2a``'s cards and refuses anything
else with INVALID_CARD only; answers and errors map back as the gateway mapped them; the
bounded transport refuses large bodies; a call that hangs times out and cancels its task;
and the supervisor's state machine withdraws, restores and republishes as the card says.
HTTP is httpx's MockTransport; the A2A client a fake one."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
import httpx
import pytest
from a2a.client.errors import A2AClientError
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_rest_routes
from a2a.server.tasks import InMemoryTaskStore
from a2a.types import AgentCard as A2ACard
from a2a.types import (
    CancelTaskRequest,
    GetTaskRequest,
    Message,
    Part,
    Role,
    SendMessageRequest,
    StreamResponse,
    Task,
    TaskState,
    TaskStatus,
)
from a2a.utils.errors import InternalError, InvalidParamsError, UnsupportedOperationError
from google.protobuf.json_format import ParseDict
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette

from p2pnode.agent.definition import Agent
from p2pnode.agent.definition import Message as AgentMessage
from p2pnode.agent.tools import Access, Caller
from p2pnode.bridges.a2a.gateway import SCHEMAS_EXTENSION as GATEWAY_EXTENSION
from p2pnode.bridges.a2a.gateway import card_document
from p2pnode.bridges.a2a.mapping import (
    SCHEMAS_EXTENSION,
    capability_id_of,
    card_facts_untrusted,
    error_data,
    error_of_task_untrusted,
    json_numbers,
    parts_of_payload,
    payload_of_answer_untrusted,
)
from p2pnode.bridges.a2a.publish import (
    A2AServer,
    BoundedTransport,
    Forwarder,
    bounded_client,
    card_url,
    error_of,
)
from p2pnode.bridges.a2a.supervise import TRANSITIONS, PublishSpec, ServerPublisher, ServerState
from p2pnode.core.a2a import to_a2a
from p2pnode.core.card import AgentCard, Capability
from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.identity import Identity
from tests.test_a2a_mapping import json_values
from tests.test_a2a_publish import Executor, Seen, server_card

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"
URL = "http://a2a.test"

capability_ids = st.from_regex(r"\A[A-Za-z0-9][A-Za-z0-9._:/-]{0,20}\Z")
schemas = st.none() | st.just({"type": "object"}) | st.just({"type": "string", "maxLength": 5})
capabilities = st.lists(
    st.builds(
        Capability,
        capability_ids,
        st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=10),
        st.just("what it does"),
        schemas,
        schemas,
    ),
    min_size=1,
    max_size=6,
    unique_by=lambda c: c.id,
)


def swarm_card(caps: list[Capability]) -> AgentCard:
    owner = Identity.generate()
    return AgentCard(
        id="agent-1",
        name="Agent One",
        version="3.2.1",
        description="",
        public_key=owner.public_key,
        tier=2,
        capabilities=tuple(caps),
        issued_at=1,
        expires_at=2,
    ).signed(owner)


# -- the card ----------------------------------------------------------------------------------


def test_the_extension_uri_is_the_gateways() -> None:
    assert SCHEMAS_EXTENSION == GATEWAY_EXTENSION


@settings(max_examples=40, deadline=None)
@given(capabilities)
def test_the_gateways_card_gives_back_the_capabilities_it_was_made_from(
    caps: list[Capability],
) -> None:
    card = swarm_card(caps)
    facts = card_facts_untrusted(card_document(card, URL))
    assert [s.capability for s in facts.skills] == list(caps)
    assert [s.skill_id for s in facts.skills] == [c.id for c in caps]
    assert (facts.name, facts.version, facts.streaming) == ("Agent One", "3.2.1", True)
    exported = card_facts_untrusted(to_a2a(card))
    assert [(c.id, c.name) for c in (s.capability for s in exported.skills)] == [
        (c.id, c.name) for c in caps
    ]


@given(json_values)
def test_any_json_is_a_card_or_invalid_card(document: Any) -> None:
    try:
        facts = card_facts_untrusted(document)
    except RemoteError as exc:
        assert exc.code is ErrorCode.INVALID_CARD
        return
    ids = [s.capability.id for s in facts.skills]
    assert ids and len(set(ids)) == len(ids)


@given(st.dictionaries(st.sampled_from(["id", "name", "description"]), json_values))
def test_any_skill_entry_is_a_capability_or_left_out(skill: dict[str, Any]) -> None:
    try:
        facts = card_facts_untrusted({"name": "x", "skills": [skill, {"id": "ok"}]})
    except RemoteError as exc:
        pytest.fail(f"a card with one good skill was refused: {exc}")
    assert facts.skills[-1].capability.id == "ok"


@given(st.text(max_size=200))
def test_every_skill_id_becomes_a_capability_id_or_none(skill_id: str) -> None:
    renamed = capability_id_of(skill_id)
    if renamed is None:
        assert skill_id == ""
    else:
        assert re.fullmatch(ID_PATTERN, renamed)
        if re.fullmatch(ID_PATTERN, skill_id):
            assert renamed == skill_id


def test_a_renamed_skill_is_asked_by_its_own_id() -> None:
    facts = card_facts_untrusted({"name": "x", "skills": [{"id": "Get weather!", "name": "W"}]})
    (skill,) = facts.skills
    assert (skill.skill_id, skill.capability.id) == ("Get weather!", "Get_weather_")


def test_card_urls() -> None:
    assert card_url("http://h:1") == "http://h:1/.well-known/agent-card.json"
    assert card_url("http://h:1/a/") == "http://h:1/a/.well-known/agent-card.json"
    assert card_url("http://h:1/card.json") == "http://h:1/card.json"


# -- answers and errors --------------------------------------------------------------------------


@given(json_values)
def test_an_answer_reads_back_as_the_payload_it_was_made_of(value: Any) -> None:
    expected = json_numbers(value)
    if isinstance(expected, dict) and set(expected) == {"a2a/parts"}:
        return  # a wrapper stands for its parts
    assert payload_of_answer_untrusted(parts_of_payload(value)) == expected


@given(json_values)
def test_hostile_answer_parts_are_invalid_output_or_too_large(parts: Any) -> None:
    try:
        payload_of_answer_untrusted(parts)
    except RemoteError as exc:
        assert exc.code in (ErrorCode.INVALID_OUTPUT, ErrorCode.MESSAGE_TOO_LARGE)


@pytest.mark.parametrize("code", list(ErrorCode))
def test_the_gateways_failed_task_gives_back_its_error(code: ErrorCode) -> None:
    exc = RemoteError(code, "it went wrong", limit=3)
    exc.details["code"] = "a detail named as a keyword"
    parts = [{"text": f"{code}: it went wrong"}, {"data": error_data(exc)}]
    back = error_of_task_untrusted("TASK_STATE_FAILED", parts)
    assert (back.code, back.message, back.details) == (code, exc.message, exc.details)


@given(st.sampled_from(list(TaskState.keys())), json_values)
def test_any_status_is_a_typed_error(state: str, parts: Any) -> None:
    assert isinstance(error_of_task_untrusted(state, parts), RemoteError)


def test_task_states_without_a_carried_error() -> None:
    cases = {
        "TASK_STATE_FAILED": ErrorCode.HANDLER_FAILED,
        "TASK_STATE_REJECTED": ErrorCode.TASK_REJECTED,
        "TASK_STATE_CANCELED": ErrorCode.TASK_CANCELED,
        "TASK_STATE_INPUT_REQUIRED": ErrorCode.HANDLER_FAILED,
        "TASK_STATE_AUTH_REQUIRED": ErrorCode.PERMISSION_DENIED,
    }
    for state, code in cases.items():
        error = error_of_task_untrusted(state, [{"text": "why"}])
        assert (error.code, error.message) == (code, "why")


def _status(status: int) -> A2AClientError:
    request = httpx.Request("POST", URL)
    response = httpx.Response(status, request=request)
    cause = httpx.HTTPStatusError("status", request=request, response=response)
    error = A2AClientError(f"HTTP Error {status}")
    error.__cause__ = cause
    return error


@pytest.mark.parametrize(
    ("raised", "code"),
    [
        (InvalidParamsError("no"), ErrorCode.INVALID_INPUT),
        (UnsupportedOperationError("no"), ErrorCode.CAPABILITY_NOT_FOUND),
        (InternalError("no"), ErrorCode.HANDLER_FAILED),
        (
            InvalidParamsError("no", data={"code": "TIER_VIOLATION", "message": "m"}),
            ErrorCode.TIER_VIOLATION,
        ),
        (httpx.ConnectError("refused"), ErrorCode.AGENT_UNAVAILABLE),
        (httpx.ReadTimeout("slow"), ErrorCode.TIMEOUT),
        (httpx.RemoteProtocolError("cut"), ErrorCode.AGENT_UNAVAILABLE),
        (ValueError("garbage"), ErrorCode.INVALID_OUTPUT),
        (A2AClientError("JSON-RPC Error -1: odd"), ErrorCode.INVALID_OUTPUT),
        (_status(403), ErrorCode.PERMISSION_DENIED),
        (_status(502), ErrorCode.HANDLER_FAILED),
    ],
)
def test_what_the_sdk_raises_is_a_typed_error(raised: Exception, code: ErrorCode) -> None:
    assert error_of(raised).code is code


# -- bounded HTTP ------------------------------------------------------------------------------


def _mock(handler: Callable[[httpx.Request], httpx.Response]) -> httpx.MockTransport:
    return httpx.MockTransport(handler)


async def _chunks(n: int, size: int) -> AsyncIterator[bytes]:
    for _ in range(n):
        yield b"x" * size


@pytest.mark.parametrize("declared", [True, False])
async def test_a_body_over_the_limit_is_refused(declared: bool) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        if declared:
            return httpx.Response(200, content=b"x" * 2000)
        return httpx.Response(200, content=_chunks(10, 300))  # streamed, no length

    async with httpx.AsyncClient(transport=BoundedTransport(1000, _mock(answer))) as http:
        with pytest.raises(httpx.ReadError) as refused:
            await http.get("http://h/")
    assert error_of(refused.value).code is ErrorCode.MESSAGE_TOO_LARGE


async def test_a_server_that_hangs_is_a_timeout() -> None:
    async def hang(request: httpx.Request) -> httpx.Response:
        await anyio.sleep_forever()
        raise AssertionError

    async with bounded_client(httpx.MockTransport(hang)) as http:
        with pytest.raises(RemoteError) as late:
            await A2AServer(http, URL, timeout=0.05).read_card()
    assert late.value.code is ErrorCode.TIMEOUT


# -- one call, against a fake client -----------------------------------------------------------


class FakeClient:
    """The A2A client's three methods a call uses: ``events`` answers SendMessage,
    ``tasks`` GetTask (in turn); CancelTask is recorded."""

    def __init__(
        self, events: list[StreamResponse], tasks: Sequence[Task] = (), hang: bool = False
    ) -> None:
        self.events = events
        self.tasks = list(tasks)
        self.hang = hang
        self.sent: list[SendMessageRequest] = []
        self.canceled: list[str] = []

    async def send_message(self, request: SendMessageRequest, *, context: Any = None) -> Any:
        self.sent.append(request)
        for event in self.events:
            yield event
        if self.hang:
            await anyio.sleep_forever()

    async def get_task(self, request: GetTaskRequest, *, context: Any = None) -> Task:
        return self.tasks.pop(0)

    async def cancel_task(self, request: CancelTaskRequest, *, context: Any = None) -> Task:
        self.canceled.append(request.id)
        return Task(id=request.id)


def task(state: TaskState, *texts: str, task_id: str = "t1") -> Task:
    found = Task(id=task_id, status=TaskStatus(state=state))
    if texts:
        found.artifacts.add(artifact_id="a", parts=[Part(text=t) for t in texts])
    return found


def forward(client: FakeClient, payload: Any, skill: str | None = "s", seconds: float = 1.0) -> Any:
    async def main() -> Any:
        return await Forwarder(client).send(payload, skill, seconds)  # type: ignore[arg-type]

    return anyio.run(main)


def test_a_call_hanging_past_its_deadline_is_a_timeout_and_cancels_the_task() -> None:
    client = FakeClient([StreamResponse(task=task(TaskState.TASK_STATE_WORKING))], hang=True)
    with pytest.raises(RemoteError) as late:
        forward(client, "hi", seconds=0.05)
    assert late.value.code is ErrorCode.TIMEOUT
    assert client.canceled == ["t1"]
    (sent,) = client.sent
    assert [p.text for p in sent.message.parts] == ["hi"]
    assert sent.message.role == Role.ROLE_USER and sent.message.metadata["skillId"] == "s"


def test_a_task_answered_before_it_ended_is_followed() -> None:
    working = StreamResponse(task=task(TaskState.TASK_STATE_WORKING))
    done = task(TaskState.TASK_STATE_COMPLETED, "done")
    client = FakeClient([working], tasks=[task(TaskState.TASK_STATE_WORKING), done])
    assert forward(client, {"q": 1}) == "done"
    assert client.canceled == []


def test_a_message_answer_and_a_task_that_stops_for_input() -> None:
    reply = Message(message_id="r", role=Role.ROLE_AGENT, parts=[Part(text="hello")])
    assert forward(FakeClient([StreamResponse(message=reply)]), "hi", skill=None) == "hello"
    asking = task(TaskState.TASK_STATE_INPUT_REQUIRED)
    asking.status.message.parts.append(Part(text="which city?"))
    with pytest.raises(RemoteError) as stopped:
        forward(FakeClient([StreamResponse(task=asking)]), "hi")
    assert (stopped.value.code, stopped.value.message) == (ErrorCode.HANDLER_FAILED, "which city?")


def test_a_payload_a2a_cannot_carry_is_invalid_input() -> None:
    with pytest.raises(RemoteError) as refused:
        forward(FakeClient([]), {"b": b"\x00"})
    assert refused.value.code is ErrorCode.INVALID_INPUT


def test_artifact_updates_append_and_replace() -> None:
    events = [
        ParseDict({"task": {"id": "t", "status": {"state": "TASK_STATE_WORKING"}}},
                  StreamResponse()),
        ParseDict({"artifactUpdate": {"taskId": "t", "artifact": {
            "artifactId": "a", "parts": [{"text": "x"}]}}}, StreamResponse()),
        ParseDict({"artifactUpdate": {"taskId": "t", "append": True, "artifact": {
            "artifactId": "a", "parts": [{"data": {"n": 1.0}}]}}}, StreamResponse()),
        ParseDict({"statusUpdate": {"taskId": "t", "status": {"state": "TASK_STATE_COMPLETED"}}},
                  StreamResponse()),
    ]  # fmt: skip
    assert forward(FakeClient(events), "hi") == {"a2a/parts": [{"text": "x"}, {"data": {"n": 1}}]}


# -- the supervisor ----------------------------------------------------------------------------


def card(*skills: str) -> dict[str, Any]:
    return {
        "name": "Mock",
        "version": "1.0.0",
        "supportedInterfaces": [
            {"url": f"{URL}/rpc", "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}
        ],
        "skills": [{"id": s, "name": s} for s in skills],
    }


class MockServer:
    """What the mock transport answers: the card, an error status, or refused."""

    def __init__(self) -> None:
        self.card = card("a")
        self.status = 200
        self.refused = False
        self.reads = 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.reads += 1
        if self.refused:
            raise httpx.ConnectError("refused", request=request)
        body = json.dumps(self.card).encode()
        return httpx.Response(self.status, content=body)


class Recorder:
    """A host that records what it publishes, and how many card reads ``server`` had
    answered when each publication was withdrawn."""

    def __init__(self, server: MockServer | None = None) -> None:
        self.server = server
        self.published: list[Agent] = []
        self.withdrawn_after: list[int] = []
        self.live: Agent | None = None

    async def __call__(
        self, agent: Agent, withdraw: anyio.Event, hosted: Callable[[], None]
    ) -> None:
        self.published.append(agent)
        self.live = agent
        hosted()
        await withdraw.wait()
        self.withdrawn_after.append(self.server.reads if self.server is not None else 0)
        self.live = None


async def wait_for(predicate: Callable[[], bool], what: str) -> None:
    for _ in range(400):
        if predicate():
            return
        await anyio.sleep(0.005)
    pytest.fail(f"not within 2 s: {what}")


async def test_the_supervisor_withdraws_restores_and_republishes() -> None:
    server = MockServer()
    host = Recorder(server)
    spec = PublishSpec(URL, "mock", poll=0.01, retry=0.01, max_failures=2)
    publisher = ServerPublisher(spec, host, transport=httpx.MockTransport(server))
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(publisher.run)
        agent = await publisher.wait_published()
        assert [c.id for c in agent.capabilities] == ["a"]
        server.card = card("a", "b")  # the card changed: published again
        await wait_for(lambda: len(host.published) == 2, "published again")
        assert [c.id for c in host.published[1].capabilities] == ["a", "b"]
        server.status, before = 500, server.reads  # failing reads withdraw after two
        await wait_for(lambda: publisher.state is ServerState.WITHDRAWN, "withdrawn")
        assert host.live is None and host.withdrawn_after[-1] == before + 2
        server.status = 200
        await wait_for(lambda: host.live is not None, "back")
        server.refused, before = True, server.reads  # refused: withdrawn at the first read
        await wait_for(lambda: publisher.state is ServerState.WITHDRAWN, "refused")
        assert host.withdrawn_after[-1] == before + 1
        tasks.cancel_scope.cancel()
    assert publisher.state is ServerState.STOPPED
    assert publisher.publications == len(host.published) == 3


async def test_published_means_the_node_hosts_the_agent() -> None:
    # A host that takes its time to attach: the publisher says "published" (its ready
    # line) only once the node hosts the agent, so a caller told so can reach it.
    server, attached = MockServer(), anyio.Event()

    async def slow_host(agent: Agent, withdraw: anyio.Event, hosted: Callable[[], None]) -> None:
        await anyio.sleep(0.05)
        attached.set()
        hosted()
        await withdraw.wait()

    publisher = ServerPublisher(PublishSpec(URL, "mock"), slow_host, transport=_mock(server))
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(publisher.run)
        await publisher.wait_published()
        assert attached.is_set()
        tasks.cancel_scope.cancel()


async def test_a_first_read_that_fails_ends_the_publisher_with_its_code() -> None:
    server, host = MockServer(), Recorder()
    server.card = {"name": "x", "skills": "none"}
    publisher = ServerPublisher(PublishSpec(URL, "mock"), host, transport=_mock(server))
    with pytest.raises(LocalError) as failed:
        await publisher.run()
    assert failed.value.code is ErrorCode.INVALID_CARD and host.published == []


def test_bad_intervals_are_refused_and_stopped_is_final() -> None:
    for bad in (PublishSpec(URL, "x", poll=0), PublishSpec(URL, "x", max_failures=0)):
        with pytest.raises(LocalError) as refused:
            ServerPublisher(bad, Recorder())
        assert refused.value.code is ErrorCode.INVALID_ARGUMENT
    assert TRANSITIONS[ServerState.STOPPED] == frozenset()
    assert ServerState.WITHDRAWN not in TRANSITIONS[ServerState.READING]


# -- the HTTP+JSON binding and the allowed agents, in process -----------------------------------


def rest_app() -> Any:
    """The SDK's server (tests.test_a2a_publish's executor) with only an HTTP+JSON
    interface, not streaming."""
    document = server_card(URL)
    document["supportedInterfaces"] = [
        {"url": f"{URL}/rest", "protocolBinding": "HTTP+JSON", "protocolVersion": "1.0"}
    ]
    document["capabilities"] = {"streaming": False}
    card = ParseDict(document, A2ACard())
    handler = DefaultRequestHandler(
        agent_executor=Executor(Seen()), task_store=InMemoryTaskStore(), agent_card=card
    )
    routes = [*create_agent_card_routes(card), *create_rest_routes(handler, path_prefix="/rest")]
    return Starlette(routes=routes)


def test_a_server_speaking_http_json_only_is_called_through_it() -> None:
    async def main() -> None:
        async with bounded_client(httpx.ASGITransport(app=rest_app())) as http:
            read = await A2AServer(http, URL).read_card()
            assert read is not None and not read.facts.streaming
            forwarder = Forwarder(read.client)
            assert await forwarder.send("quiet", "shout", 5.0) == "QUIET"
            assert await forwarder.send({"n": 1}, "echo", 5.0) == {"n": 1}
            with pytest.raises(RemoteError) as failed:
                await forwarder.send("x", "fail", 5.0)
            assert (failed.value.code, failed.value.message) == (
                ErrorCode.HANDLER_FAILED,
                "it broke",
            )

    anyio.run(main)


def test_only_the_allowed_agents_reach_the_server() -> None:
    client = FakeClient([StreamResponse(task=task(TaskState.TASK_STATE_COMPLETED, "ok"))])
    forwarder = Forwarder(client, access=Access(agents=["friend"]))  # type: ignore[arg-type]
    handler = forwarder.handler("s")

    def asked_by(sender: str) -> AgentMessage:
        envelope = Envelope("e1", sender, "mock", MessageType.REQUEST, 1, "hi")
        return AgentMessage(envelope, Caller(sender, "peer", 3, None))

    assert anyio.run(handler, asked_by("friend")) == "ok"
    with pytest.raises(RemoteError) as refused:
        anyio.run(handler, asked_by("stranger"))
    assert refused.value.code is ErrorCode.PERMISSION_DENIED
    assert len(client.sent) == 1
