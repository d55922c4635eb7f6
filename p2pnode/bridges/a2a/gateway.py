"""``p2pnode a2a serve``: the swarm's agents as A2A 1.0 agents over HTTP.

Theory of operation (docs/protocol/a2a.md):

* The gateway acts in the swarm as one agent of its node (the *acting agent*).
  :class:`Swarm` is all it uses of the swarm: the agents that agent may
  discover, and a request to one of them. :class:`NodeSwarm` is that
  interface over an in-process node (:mod:`p2pnode.hosting.aio`), so the
  owner applies its access rules to the acting agent's signed card, and a
  request given up is cancelled at the owner (p2pnode.node.callcancel).
* Each discoverable agent with at least one capability is one A2A agent at
  ``/agents/<id>``: its AgentCard at ``/agents/<id>/.well-known/agent-card.json``
  (the card ``card export --a2a`` makes, with the gateway's HTTP interfaces
  first), JSON-RPC at ``/agents/<id>/jsonrpc`` and HTTP+JSON under
  ``/agents/<id>/rest``. ``/agents`` is the index. The SDK's own request
  handler serves the methods; :class:`SwarmExecutor` is the agent behind it.
* A message is one request to the owning agent: its parts become the payload
  (:mod:`p2pnode.bridges.a2a.mapping`), the task is ``working`` while the
  request waits, and the response becomes the task's artifact. CancelTask
  cancels the waiting request, which tells the owner.
* The push-notification configs of every task are kept by one bounded store, and
  the gateway posts each task's events to its webhooks itself, in the
  background (:mod:`p2pnode.bridges.a2a.push`).
* Every task store is bounded (:class:`BoundedTaskStore`), every agent's app is
  built once per card revision, and the discovered agents are cached for
  ``refresh`` seconds, so no client can grow the gateway without bound.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from functools import partial
from typing import Any, Final, Protocol

from a2a.helpers.proto_helpers import new_task_from_user_message
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.context import ServerCallContext
from a2a.server.events import Event, EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.request_handlers.response_helpers import build_error_response
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes, create_rest_routes
from a2a.server.tasks import InMemoryTaskStore, TaskStore, TaskUpdater
from a2a.types import AgentCard as A2ACard
from a2a.types import (
    ListTasksRequest,
    ListTasksResponse,
    Message,
    Part,
    SendMessageRequest,
    Task,
)
from a2a.utils.error_handlers import build_rest_error_payload
from a2a.utils.errors import A2A_ERROR_MAPPING, InvalidParamsError, VersionNotSupportedError
from google.protobuf.json_format import MessageToDict, ParseDict, ParseError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route, Router

from p2pnode.bridges.a2a.mapping import (
    Outcome,
    error_data,
    json_numbers,
    outcome_of,
    parts_of_payload,
    payload_of_parts_untrusted,
    skill_for_untrusted,
)
from p2pnode.bridges.a2a.push import PushConfigStore, PushDelivery
from p2pnode.core.a2a import A2A_PROTOCOL_VERSION, to_a2a
from p2pnode.core.card import AgentCard
from p2pnode.core.envelope import Metadata
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.hosting.aio import AioNode

logger = logging.getLogger("p2pnode.a2a")

#: Seconds the gateway waits for an owner's answer (it travels as metadata.deadlineMs).
REQUEST_TIMEOUT: Final = 30.0
#: Seconds a discovery of the swarm's agents is reused.
REFRESH: Final = 5.0
#: Most agents the gateway serves, capabilities it looks up per discovery, and tasks it
#: keeps per agent (the oldest go first).
MAX_AGENTS: Final = 1024
MAX_CAPABILITIES: Final = 256
MAX_TASKS: Final = 1000
#: The card extension listing each skill's JSON Schemas (A2A's AgentSkill has no field).
SCHEMAS_EXTENSION: Final = "urn:p2pnode:a2a:skill-schemas:1"
CARD_PATH: Final = "/.well-known/agent-card.json"
#: The A2A version the gateway serves (Major.Minor; a patch number is ignored), and the
#: most of a refused JSON-RPC body it reads to answer with the request's id.
SERVED_VERSION: Final = (1, 0)
MAX_REFUSED_BODY: Final = 1 << 20
#: Where the handler keeps a message's payload and capability for the executor.
_REQUEST_STATE: Final = "p2pnode.a2a.request"
_VERSION = re.compile(r"\s*(\d{1,6})\.(\d{1,6})(?:\.\d{1,6})?\s*")


class Swarm(Protocol):
    """What the gateway uses of the swarm."""

    @property
    def acting_agent(self) -> str: ...

    async def agents(self) -> list[AgentCard]:
        """The agents the acting agent may discover that have a capability."""

    async def request(
        self, agent_id: str, payload: Any, *, capability: str | None, seconds: float
    ) -> Any:
        """The response payload of a request to ``agent_id``, waited for ``seconds`` at
        most (the owner bounds its handler by it); raises its P2PError."""


class NodeSwarm:
    """:class:`Swarm` over an in-process node, as its local agent ``acting_agent``.
    ``clock`` is a monotonic clock in seconds (for the discovery cache)."""

    def __init__(
        self,
        node: AioNode,
        acting_agent: str,
        *,
        refresh: float = REFRESH,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        self._acting = acting_agent
        self._refresh = refresh
        self._clock = clock
        self._cached: list[AgentCard] | None = None
        self._at = 0.0
        self._lock = asyncio.Lock()

    @property
    def acting_agent(self) -> str:
        return self._acting

    async def agents(self) -> list[AgentCard]:
        async with self._lock:  # one discovery at a time; the others reuse it
            if self._cached is None or self._clock() - self._at >= self._refresh:
                self._cached = await self._discover()
                self._at = self._clock()
            return self._cached

    async def _discover(self) -> list[AgentCard]:
        registry = self.node.registry
        known = [*registry.list_local(), *registry.list_remote()]
        capabilities = sorted({c.id for card in known for c in card.capabilities})
        found: dict[str, AgentCard] = {}
        for capability in capabilities[:MAX_CAPABILITIES]:
            # find() applies what discovery means: live cards the viewer's sandbox may see.
            for card in await self.node.find(capability, viewer=self._acting):
                if card.id != self._acting:
                    found.setdefault(card.id, card)
        return [found[k] for k in sorted(found)][:MAX_AGENTS]

    async def request(
        self, agent_id: str, payload: Any, *, capability: str | None, seconds: float
    ) -> Any:
        meta = Metadata(capability=capability) if capability is not None else None
        call = partial(
            self.node.node.request,
            self._acting,
            agent_id,
            payload,
            metadata=meta,
            timeout=seconds,
        )
        envelope = await self.node.run_trio(call)
        return envelope.payload


# -- the agent behind each A2A agent ------------------------------------------------------------


def _parts(parts: list[dict[str, Any]]) -> list[Part]:
    return [_part(part) for part in parts]


def _part(part: dict[str, Any]) -> Part:
    text = part.get("text")
    if len(part) == 1 and isinstance(text, str):
        return Part(text=text)  # what ParseDict makes of it, without its generic walk
    return ParseDict(part, Part())


def _error_message(updater: TaskUpdater, exc: P2PError) -> Message:
    """The status message of a task that ended with ``exc``: its text and its data."""
    return updater.new_agent_message(
        _parts([{"text": f"{exc.code}: {exc.message}"}, {"data": error_data(exc)}])
    )


class SwarmExecutor(AgentExecutor):
    """The A2A agent of swarm agent ``card``: each message one request to it."""

    def __init__(self, swarm: Swarm, card: AgentCard, *, timeout: float = REQUEST_TIMEOUT) -> None:
        self.swarm = swarm
        self.card = card
        self.skills = tuple(c.id for c in card.capabilities)
        self.timeout = timeout

    def request_of(self, message: Message) -> tuple[Any, str | None]:
        """The payload and capability of ``message``. Raises InvalidParamsError."""
        parts = [MessageToDict(p) for p in message.parts]
        for part in parts:  # JSON numbers came as doubles (protobuf Value)
            for key in ("data", "metadata"):
                if key in part:
                    part[key] = json_numbers(part[key])
        metadata = MessageToDict(message.metadata) if message.HasField("metadata") else None
        try:
            return payload_of_parts_untrusted(parts), skill_for_untrusted(metadata, self.skills)
        except RemoteError as exc:
            logger.info("message %s to %s refused: %s", message.message_id, self.card.id, exc)
            raise InvalidParamsError(exc.message, data=error_data(exc)) from None

    def checked_request_of(self, message: Message, context: ServerCallContext) -> None:
        """Check ``message`` as :meth:`request_of` does (raises InvalidParamsError) and
        keep what it asks in ``context`` for :meth:`execute`, so a message is read once."""
        context.state[_REQUEST_STATE] = (message, self.request_of(message))

    def _request_for(self, context: RequestContext, message: Message) -> tuple[Any, str | None]:
        kept = context.call_context.state.get(_REQUEST_STATE)
        if kept is not None and kept[0] is message:
            request: tuple[Any, str | None] = kept[1]
            return request
        return self.request_of(message)

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        message = context.message
        if message is None:
            raise InvalidParamsError("a message is required")
        payload, capability = self._request_for(context, message)
        assert context.task_id is not None and context.context_id is not None
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        if context.current_task is None:
            await event_queue.enqueue_event(new_task_from_user_message(message))
        await updater.start_work()
        try:
            value = await self.swarm.request(
                self.card.id, payload, capability=capability, seconds=self.timeout
            )
            parts = _parts(parts_of_payload(value))
        except P2PError as exc:
            await self._ended(updater, exc)
            return
        except (ParseError, TypeError, ValueError) as exc:  # a value A2A cannot carry
            failure = RemoteError(ErrorCode.INVALID_OUTPUT, f"the response is not JSON: {exc}")
            await updater.failed(_error_message(updater, failure))
            return
        await updater.add_artifact(parts, name="response")
        await updater.complete()

    async def _ended(self, updater: TaskUpdater, exc: P2PError) -> None:
        logger.info("request to %s: %s", self.card.id, exc)
        outcome = outcome_of(exc.code)
        message = _error_message(updater, exc)
        if outcome is Outcome.REJECTED:
            await updater.reject(message)
        elif outcome is Outcome.CANCELED:
            await updater.cancel(message)
        else:
            await updater.failed(message)
            if outcome is Outcome.INVALID_PARAMS:  # the client's input: a JSON-RPC error too
                raise InvalidParamsError(exc.message, data=error_data(exc))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        # The SDK has cancelled execute() already: its request was given up, and the
        # node told the owner. What is left is the task's state.
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


class GatewayHandler(DefaultRequestHandler):
    """The SDK's request handler, refusing a message the mapping refuses before the SDK
    opens a task for it (InvalidParams, the owner never asked)."""

    def __init__(
        self,
        executor: SwarmExecutor,
        store: TaskStore,
        card: A2ACard,
        *,
        push: PushDelivery | None = None,
    ) -> None:
        configs = push.store if push is not None else None
        super().__init__(
            agent_executor=executor,
            task_store=store,
            agent_card=card,
            push_config_store=configs,
            push_sender=push,
        )
        self._executor = executor

    async def on_message_send(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> Message | Task:
        self._executor.checked_request_of(params.message, context)
        answer: Message | Task = await super().on_message_send(params, context)
        return answer

    async def on_message_send_stream(
        self, params: SendMessageRequest, context: ServerCallContext
    ) -> AsyncGenerator[Event, None]:
        self._executor.checked_request_of(params.message, context)
        async for event in super().on_message_send_stream(params, context):
            yield event


class BoundedTaskStore(TaskStore):
    """The SDK's in-memory task store keeping the ``limit`` tasks saved last."""

    def __init__(self, limit: int = MAX_TASKS) -> None:
        self._inner = InMemoryTaskStore()
        self._limit = limit
        self._order: OrderedDict[str, ServerCallContext] = OrderedDict()

    async def save(self, task: Task, context: ServerCallContext) -> None:
        await self._inner.save(task, context)
        self._order[task.id] = context
        self._order.move_to_end(task.id)
        while len(self._order) > self._limit:
            task_id, owner = self._order.popitem(last=False)
            await self._inner.delete(task_id, owner)

    async def get(self, task_id: str, context: ServerCallContext) -> Task | None:
        return await self._inner.get(task_id, context)

    async def list(self, params: ListTasksRequest, context: ServerCallContext) -> ListTasksResponse:
        return await self._inner.list(params, context)

    async def delete(self, task_id: str, context: ServerCallContext) -> None:
        self._order.pop(task_id, None)
        await self._inner.delete(task_id, context)


# -- cards -------------------------------------------------------------------------------------


def card_document(card: AgentCard, base_url: str) -> dict[str, Any]:
    """The A2A AgentCard (JSON) the gateway serves for ``card`` at ``base_url``: the card
    ``card export --a2a`` makes, unsigned (the gateway is not its owner), with the
    gateway's HTTP interfaces first, the bearer scheme and the skills' schemas."""
    document = to_a2a(card)
    http = [
        {"url": f"{base_url}/jsonrpc", "protocolBinding": "JSONRPC"},
        {"url": f"{base_url}/rest", "protocolBinding": "HTTP+JSON"},
    ]
    for interface in http:
        interface["protocolVersion"] = A2A_PROTOCOL_VERSION
    document["supportedInterfaces"] = [*http, *document["supportedInterfaces"]]
    document["defaultInputModes"] = ["text/plain", "application/json"]
    document["defaultOutputModes"] = ["text/plain", "application/json"]
    schemas = {
        c.id: {"inputSchema": c.input_schema, "outputSchema": c.output_schema}
        for c in card.capabilities
    }
    document["capabilities"] = {
        "streaming": True,
        "pushNotifications": True,
        "extensions": [
            {
                "uri": SCHEMAS_EXTENSION,
                "description": "JSON Schemas of each skill's input and output, by skill id",
                "required": False,
                "params": {"skills": schemas},
            }
        ],
    }
    document["securitySchemes"] = {
        "bearer": {
            "httpAuthSecurityScheme": {
                "scheme": "Bearer",
                "description": "the token p2pnode a2a serve wrote to its token file",
            }
        }
    }
    document["securityRequirements"] = [{"schemes": {"bearer": {"list": []}}}]
    return document


def _a2a_card(document: dict[str, Any]) -> A2ACard:
    # Schemas are JSON, so they fit the Struct; a card that does not is not served.
    card = A2ACard()
    ParseDict(json.loads(json.dumps(document)), card)
    return card


# -- versions ----------------------------------------------------------------------------------


def unserved_version(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The ``A2A-Version`` a request names when it is a version (Major.Minor[.patch]) other
    than 1.0, else None. The SDK refuses a request without the header (it takes 0.3) or
    with one that is not a version; it takes every 1.x as 1.0, which the gateway does not."""
    value = dict(headers).get(b"a2a-version")
    if value is None:
        return None
    text = value.decode("latin-1")
    match = _VERSION.fullmatch(text)
    if match is None or (int(match[1]), int(match[2])) == SERVED_VERSION:
        return None
    return text.strip()


async def _refuse_version(version: str, rpc: bool, receive: Any, send: Any) -> None:
    """Answer a request of an unserved A2A version with the spec's VersionNotSupported:
    JSON-RPC ``-32009`` with the request's id, HTTP+JSON 400 ``VERSION_NOT_SUPPORTED``."""
    error = VersionNotSupportedError(
        f"A2A version {version!r} is not served; the gateway speaks A2A 1.0"
    )
    if rpc:
        body = b""
        more = True
        while more and len(body) <= MAX_REFUSED_BODY:
            event = await receive()
            body += event.get("body", b"")
            more = event.get("more_body", False)
        try:
            request = json.loads(body)
            given = request.get("id") if isinstance(request, dict) else None
        except ValueError:
            given = None
        request_id = given if isinstance(given, (str, int)) else None
        answer = JSONResponse(build_error_response(request_id, error))
    else:
        status = A2A_ERROR_MAPPING[VersionNotSupportedError].http_code
        answer = JSONResponse(build_rest_error_payload(error), status_code=status)
    await answer({"type": "http"}, receive, send)


# -- the HTTP app ------------------------------------------------------------------------------


class Gateway:
    """The ASGI app of the gateway (see the module docstring). ``base_url`` is where
    clients reach it (``http://127.0.0.1:8080``), for the cards' interfaces."""

    def __init__(
        self,
        swarm: Swarm,
        base_url: str,
        *,
        timeout: float = REQUEST_TIMEOUT,
        push: PushDelivery | None = None,
    ) -> None:
        self.swarm = swarm
        #: Delivers every agent's pushes; one config store serves all agents, as task ids
        #: are unique and each agent's handler finds only its own tasks.
        self.push = push if push is not None else PushDelivery(PushConfigStore())
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._apps: OrderedDict[str, tuple[tuple[object, ...], Starlette]] = OrderedDict()
        self._stores: OrderedDict[str, BoundedTaskStore] = OrderedDict()
        # A bare router: each agent's app is a Starlette app with its own error and
        # exception middleware, and a second such stack around it cost every request
        # its layers and every send two more wrappers.
        self.app = Router(
            routes=[
                Route("/agents", self._index, methods=["GET"]),
                Mount("/agents/{agent_id}", app=self._agent_app),
            ]
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)

    async def aclose(self) -> None:
        """Stop delivering pushes (those waiting are lost) and close their HTTP client."""
        await self.push.aclose()

    def agent_url(self, agent_id: str) -> str:
        """Where agent ``agent_id``'s A2A interfaces are (its card is below it)."""
        return f"{self.base_url}/agents/{agent_id}"

    async def _index(self, request: Request) -> JSONResponse:
        try:
            cards = await self.swarm.agents()
        except P2PError as exc:
            return JSONResponse({"error": error_data(exc)}, status_code=503)
        items = [
            {
                "id": card.id,
                "name": card.name,
                "description": card.description,
                "url": self.agent_url(card.id),
                "card": self.agent_url(card.id) + CARD_PATH,
            }
            for card in cards
        ]
        return JSONResponse({"agents": items})

    async def _find(self, agent_id: str) -> AgentCard | None:
        for card in await self.swarm.agents():
            if card.id == agent_id:
                return card
        return None

    async def _agent_app(self, scope: Any, receive: Any, send: Any) -> None:
        agent_id = scope.get("path_params", {}).get("agent_id", "")
        try:
            card = await self._find(agent_id)
        except P2PError as exc:
            card, failure = None, error_data(exc)
        else:
            failure = LocalError(
                ErrorCode.AGENT_NOT_FOUND,
                f"no agent {agent_id!r} that {self.swarm.acting_agent} may discover",
            ).to_dict()
        if card is None:
            await JSONResponse({"error": failure}, status_code=404)(scope, receive, send)
            return
        try:
            app = self._app_for(card)
        except (ParseError, TypeError, ValueError) as exc:  # a card A2A cannot carry
            logger.warning("agent %s: no A2A card: %s", agent_id, exc)
            refused = LocalError(ErrorCode.INVALID_CARD, f"no A2A card for {agent_id!r}: {exc}")
            answer = JSONResponse({"error": error_data(refused)}, status_code=502)
            await answer(scope, receive, send)
            return
        root, path = scope.get("root_path", ""), scope.get("path", "")
        inside = path[len(root) :] if path.startswith(root) else path
        binding = inside == "/jsonrpc" or inside.startswith("/rest/")
        version = unserved_version(list(scope.get("headers") or ())) if binding else None
        if version is not None:
            logger.info("agent %s: A2A version %r refused", agent_id, version)
            await _refuse_version(version, inside == "/jsonrpc", receive, send)
            return
        await app(scope, receive, send)

    def _app_for(self, card: AgentCard) -> Starlette:
        """The A2A app of ``card``, built once per revision of the card."""
        key = (card.peer_id, card.revision, card.capabilities)
        cached = self._apps.get(card.id)
        if cached is not None and cached[0] == key:
            self._apps.move_to_end(card.id)
            return cached[1]
        store = self._stores.pop(card.id, None) or BoundedTaskStore()
        self._stores[card.id] = store  # tasks outlive a card update
        a2a_card = _a2a_card(card_document(card, self.agent_url(card.id)))
        executor = SwarmExecutor(self.swarm, card, timeout=self.timeout)
        handler = GatewayHandler(executor, store, a2a_card, push=self.push)
        app = Starlette(
            routes=[
                *create_agent_card_routes(a2a_card, card_url=CARD_PATH),
                *create_jsonrpc_routes(handler, "/jsonrpc"),
                *create_rest_routes(handler, path_prefix="/rest"),
            ]
        )
        self._apps[card.id] = (key, app)
        for cache in (self._apps, self._stores):
            while len(cache) > MAX_AGENTS:
                cache.popitem(last=False)
        return app


__all__ = [
    "CARD_PATH",
    "MAX_AGENTS",
    "MAX_TASKS",
    "REQUEST_TIMEOUT",
    "SCHEMAS_EXTENSION",
    "SERVED_VERSION",
    "BoundedTaskStore",
    "Gateway",
    "GatewayHandler",
    "NodeSwarm",
    "Swarm",
    "SwarmExecutor",
    "card_document",
    "unserved_version",
]
