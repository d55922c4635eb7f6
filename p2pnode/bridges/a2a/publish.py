"""An A2A server (any implementation) as one agent of the swarm: its card read, its
skills published, each request one A2A message to it (docs/protocol/a2a.md §9).

Theory of operation:

* :class:`A2AServer` reads the server's AgentCard from its well-known path
  (``<url>/.well-known/agent-card.json``, or ``url`` itself when it names a
  ``.json`` file), parses it with the SDK's own card parser
  (:func:`a2a.client.card_resolver.parse_agent_card`), takes what the swarm
  needs of it (:func:`~p2pnode.bridges.a2a.mapping.card_facts_untrusted`) and
  makes the SDK's client for the first JSON-RPC or HTTP+JSON interface the
  card lists (:class:`a2a.client.ClientFactory`). A read sends the last
  ``ETag`` as ``If-None-Match``; a 304 is "unchanged".
* :class:`Forwarder` answers a swarm request: the payload becomes the
  message's parts (mapping.py), the capability its ``metadata.skillId``; the
  message is sent streaming when the card says the server streams (so the task
  id is known while the call runs), else as a blocking ``SendMessage`` (a task
  answered before it ended is then followed with ``GetTask``). The answer is
  the message the server sent, or the parts of the task's artifacts; a task
  that ended otherwise is a typed error. The request's ``metadata.deadlineMs``
  (else ``call_timeout``) bounds the whole call and is the HTTP timeout. A call
  cancelled (its caller gave up, or its deadline passed) sends ``CancelTask``
  for the task the server opened, bounded by CANCEL_TIMEOUT.
* Who may call: the :class:`~p2pnode.agent.tools.Access` rule of ``--allow-*``
  (the one ``mcp publish`` gives its tools), checked before anything is sent
  against the :class:`~p2pnode.agent.tools.Caller` the owner's node
  authenticated (``message.caller``: the sender's signed card, the peer it
  came from, the roles the swarm authority endorsed), never against what the
  request claims. A refusal is ``PERMISSION_DENIED`` and the server is not asked.
* Every HTTP call is bounded: a timeout, and response bodies of at most
  MAX_BODY_BYTES (:class:`BoundedTransport`; a card MAX_CARD_BYTES). Whatever
  the SDK or httpx raises is translated at this boundary (:func:`error_of`):
  nothing but a :class:`~p2pnode.core.errors.RemoteError` reaches the swarm.

:mod:`p2pnode.bridges.a2a.supervise` keeps the agent published while the
server answers, and publishes it again when its card changes.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Final, cast

import anyio
import anyio.lowlevel
import httpx
from a2a.client import Client, ClientCallContext, ClientConfig, ClientFactory
from a2a.client.card_resolver import parse_agent_card
from a2a.client.errors import A2AClientTimeoutError
from a2a.types import (
    AgentCard as A2ACard,
)
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
)
from a2a.utils.constants import TransportProtocol
from a2a.utils.errors import A2A_ERROR_REASONS, A2AError
from google.protobuf.json_format import MessageToDict, ParseDict, ParseError

from p2pnode.agent.definition import Agent
from p2pnode.agent.definition import Message as AgentMessage
from p2pnode.agent.tools import Access, Caller
from p2pnode.agent.toolschema import schema_checker
from p2pnode.bridges.a2a.mapping import (
    INTERRUPTED_STATES,
    SKILL_KEY,
    TERMINAL_STATES,
    CardFacts,
    card_facts_untrusted,
    error_of_a2a_untrusted,
    error_of_task_untrusted,
    parts_of_payload,
    payload_of_answer_untrusted,
)
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError

logger = logging.getLogger("p2pnode.a2a")

CARD_PATH: Final = "/.well-known/agent-card.json"
#: Seconds a card read may take, in all.
CARD_TIMEOUT: Final = 10.0
#: Seconds a call may take when the request carries no deadline.
CALL_TIMEOUT: Final = 30.0
#: Seconds the CancelTask of a call given up may take.
CANCEL_TIMEOUT: Final = 5.0
#: Largest card, and largest response body (a stream's in all), in bytes: an answer must
#: fit the node's 4 MiB envelope anyway.
MAX_CARD_BYTES: Final = 1024 * 1024
MAX_BODY_BYTES: Final = 4 * 1024 * 1024
#: GetTask of a task answered before it ended: the first wait, doubling to the last.
FOLLOW_FIRST: Final = 0.1
FOLLOW_LAST: Final = 2.0
#: The bindings the bridge speaks, in its order of preference.
BINDINGS: Final = (TransportProtocol.JSONRPC, TransportProtocol.HTTP_JSON)


# -- bounded HTTP ------------------------------------------------------------------------------


class BodyTooLarge(httpx.ReadError):
    """A response body over the transport's limit (an httpx error, so the SDK wraps it as
    it wraps any network error; :func:`error_of` finds it in the chain)."""

    def __init__(self, limit: int, request: httpx.Request) -> None:
        super().__init__(f"the response body is over {limit} bytes", request=request)
        self.limit = limit


class _CountedStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, limit: int, request: httpx.Request) -> None:
        self._inner = inner
        self._limit = limit
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        total = 0
        chunks = aiter(self._inner)
        try:
            async for chunk in chunks:
                total += len(chunk)
                if total > self._limit:
                    raise BodyTooLarge(self._limit, self._request)
                yield chunk
        finally:
            # The inner stream may be a generator: closed here, not by the collector.
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()

    async def aclose(self) -> None:
        await self._inner.aclose()


class BoundedTransport(httpx.AsyncBaseTransport):
    """httpx's transport (or ``inner``) refusing a response body over ``limit`` bytes: a
    declared ``Content-Length`` over it at once, a body growing past it as it is read
    (a stream counted in all)."""

    def __init__(self, limit: int, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self.limit = limit
        self._inner = inner if inner is not None else httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self._inner.handle_async_request(request)
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.limit:
            await response.aclose()
            raise BodyTooLarge(self.limit, request)
        assert isinstance(response.stream, httpx.AsyncByteStream)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_CountedStream(response.stream, self.limit, request),
            extensions=response.extensions,
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


def bounded_client(inner: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """The HTTP client of a publisher: bodies of at most MAX_BODY_BYTES, CARD_TIMEOUT per
    operation unless a call gives its own."""
    return httpx.AsyncClient(
        transport=BoundedTransport(MAX_BODY_BYTES, inner), timeout=CARD_TIMEOUT
    )


# -- errors ------------------------------------------------------------------------------------


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _status_error(status: int) -> RemoteError:
    if status in (401, 403):
        return RemoteError(
            ErrorCode.PERMISSION_DENIED, f"the A2A server refused the bridge (HTTP {status})"
        )
    return RemoteError(ErrorCode.HANDLER_FAILED, f"the A2A server answered HTTP {status}")


def error_of(exc: BaseException) -> RemoteError:
    """What an exception raised by the SDK or httpx while talking to the server means to
    the swarm (docs/protocol/a2a.md §9.4). ``unreachable=True`` in the details: the
    server could not be reached at all (a connection refused or reset before an answer)."""
    chain = list(_chain(exc))
    for link in chain:
        if isinstance(link, RemoteError):
            return link
        if isinstance(link, BodyTooLarge):
            return RemoteError(
                ErrorCode.MESSAGE_TOO_LARGE,
                f"the A2A server's answer is over {link.limit} bytes",
                limit=link.limit,
            )
        if isinstance(link, httpx.TimeoutException | A2AClientTimeoutError | TimeoutError):
            return RemoteError(ErrorCode.TIMEOUT, "the A2A server did not answer in time")
        if isinstance(link, httpx.ConnectError):
            return RemoteError(
                ErrorCode.AGENT_UNAVAILABLE,
                f"the A2A server cannot be reached: {link}",
                unreachable=True,
            )
        if isinstance(link, httpx.HTTPStatusError):
            return _status_error(link.response.status_code)
    reason = A2A_ERROR_REASONS.get(type(exc)) if isinstance(exc, A2AError) else None
    if isinstance(exc, A2AError) and reason is not None:
        return error_of_a2a_untrusted(reason, exc.message, exc.data)
    if any(isinstance(link, httpx.TransportError) for link in chain):
        return RemoteError(ErrorCode.AGENT_UNAVAILABLE, f"the A2A server went away: {exc}")
    return RemoteError(ErrorCode.INVALID_OUTPUT, f"the A2A server's answer is unreadable: {exc}")


# -- the card ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CardRead:
    """One read of the server's card: its JSON, what the swarm takes of it, its ETag, and
    the SDK's client for the interface chosen."""

    document: dict[str, Any]
    facts: CardFacts
    etag: str | None
    client: Client = field(compare=False)


def card_url(url: str) -> str:
    """Where the card of the server at ``url`` is: ``url`` itself when it names a
    ``.json`` file, else its well-known path below ``url``."""
    base = url.rstrip("/")
    return base if base.endswith(".json") else base + CARD_PATH


class A2AServer:
    """The A2A server at ``url``, reached with ``http`` (a :func:`bounded_client`); a card
    read takes ``timeout`` seconds at most."""

    def __init__(self, http: httpx.AsyncClient, url: str, *, timeout: float = CARD_TIMEOUT) -> None:
        self.http = http
        self.url = url
        self.card_url = card_url(url)
        self.timeout = timeout

    async def read_card(self, etag: str | None = None) -> CardRead | None:
        """The card, or None when it is unchanged since the read that gave ``etag``.
        Raises RemoteError: INVALID_CARD (not 200, not JSON, not a card, no skill, no
        interface the bridge speaks), MESSAGE_TOO_LARGE, TIMEOUT, AGENT_UNAVAILABLE."""
        headers = {"If-None-Match": etag} if etag else {}
        try:
            with anyio.fail_after(self.timeout):
                status, body, tag = await self._get(headers)
        except Exception as exc:  # httpx's and the transport's: translated
            raise error_of(exc) from None
        if status == 304 and etag:
            return None
        if status != 200:
            raise RemoteError(
                ErrorCode.INVALID_CARD, f"{self.card_url} answered HTTP {status}", status=status
            )
        return self._parse_untrusted(body, tag)

    async def _get(self, headers: dict[str, str]) -> tuple[int, bytes, str | None]:
        async with self.http.stream("GET", self.card_url, headers=headers) as response:
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_CARD_BYTES:
                    raise RemoteError(
                        ErrorCode.MESSAGE_TOO_LARGE,
                        f"the agent card is over {MAX_CARD_BYTES} bytes",
                        limit=MAX_CARD_BYTES,
                    )
            return response.status_code, bytes(body), response.headers.get("etag")

    def _parse_untrusted(self, body: bytes, etag: str | None) -> CardRead:
        try:
            document = json.loads(body)
            facts = card_facts_untrusted(document)
            # The SDK's own parser (it maps 0.3 cards' fields to 1.0 ones in place).
            card = parse_agent_card(json.loads(body))
        except RemoteError:
            raise
        except (ValueError, TypeError, ParseError, RecursionError) as exc:
            raise RemoteError(
                ErrorCode.INVALID_CARD, f"{self.card_url} is not an A2A agent card: {exc}"
            ) from None
        return CardRead(document, facts, etag, self._client(card, facts))

    def _client(self, card: A2ACard, facts: CardFacts) -> Client:
        config = ClientConfig(
            httpx_client=self.http,
            streaming=facts.streaming,
            supported_protocol_bindings=list(BINDINGS),
            use_client_preference=False,
        )
        try:
            return ClientFactory(config).create(card)
        except (ValueError, TypeError) as exc:
            raise RemoteError(
                ErrorCode.INVALID_CARD,
                f"{self.card_url} lists no {' or '.join(BINDINGS)} interface ({exc})",
            ) from None


# -- one call ----------------------------------------------------------------------------------


def _json_parts(parts: Any) -> list[dict[str, Any]]:
    return [MessageToDict(part) for part in parts]


class _Answer:
    """What the server has said of one call so far (stream events, or one task)."""

    def __init__(self) -> None:
        self.task_id: str | None = None
        self.state = "TASK_STATE_UNSPECIFIED"
        self.status_parts: list[dict[str, Any]] = []
        self.artifacts: dict[str, list[dict[str, Any]]] = {}
        self.message: list[dict[str, Any]] | None = None

    @property
    def ended(self) -> bool:
        """The call has its answer: a message, or a task that ended or stopped."""
        return (
            self.message is not None
            or self.state in TERMINAL_STATES
            or self.state in INTERRUPTED_STATES
        )

    def take(self, event: StreamResponse) -> None:
        if event.HasField("message"):
            self.message = _json_parts(event.message.parts)
        elif event.HasField("task"):
            self.take_task(event.task)
        elif event.HasField("status_update"):
            self.task_id = self.task_id or event.status_update.task_id
            self._status(event.status_update.status.state, event.status_update.status)
        elif event.HasField("artifact_update"):
            update = event.artifact_update
            parts = _json_parts(update.artifact.parts)
            known = self.artifacts.setdefault(update.artifact.artifact_id, [])
            if update.append:
                known.extend(parts)
            else:
                known[:] = parts

    def take_task(self, task: Task) -> None:
        self.task_id = task.id
        self._status(task.status.state, task.status)
        self.artifacts = {a.artifact_id: _json_parts(a.parts) for a in task.artifacts}

    def _status(self, state: int, status: Any) -> None:
        self.state = TaskState.Name(state)
        if status.HasField("message"):
            self.status_parts = _json_parts(status.message.parts)

    def result(self) -> Any:
        """The response payload. Raises RemoteError (the task's error, or an answer the
        swarm cannot carry)."""
        try:
            if self.message is not None:
                return payload_of_answer_untrusted(self.message)
            if self.state != "TASK_STATE_COMPLETED":
                raise error_of_task_untrusted(self.state, self.status_parts)
            parts = [part for listed in self.artifacts.values() for part in listed]
            if not parts:
                parts = self.status_parts
            return payload_of_answer_untrusted(parts) if parts else None
        except RecursionError:  # data nested past what Python's stack holds
            raise RemoteError(
                ErrorCode.INVALID_OUTPUT, "the A2A server's answer nests too deep"
            ) from None


def _request_of(payload: Any, skill_id: str | None) -> SendMessageRequest:
    """The SendMessage request of a swarm payload. Raises RemoteError(INVALID_INPUT)."""
    message = Message(role=Role.ROLE_USER, message_id=uuid.uuid4().hex)
    try:
        message.parts.extend(ParseDict(part, Part()) for part in parts_of_payload(payload))
    except (ParseError, TypeError, ValueError) as exc:  # bytes, non-finite numbers
        raise RemoteError(ErrorCode.INVALID_INPUT, f"the payload is not JSON: {exc}") from None
    if skill_id is not None:
        message.metadata.update({SKILL_KEY: skill_id})
    return SendMessageRequest(message=message)


class Forwarder:
    """Sends the swarm's requests to the server through ``client`` (see the module
    docstring). ``unreachable()`` is called when a call finds the server gone, so its
    supervisor looks at once. Only the callers ``access`` lets in (None: any) may call;
    ``callers`` names the sender of a request its node passed no caller with (a node
    hosting the agent in process)."""

    def __init__(
        self,
        client: Client,
        *,
        call_timeout: float = CALL_TIMEOUT,
        access: Access | None = None,
        callers: Callable[[str], Caller | None] | None = None,
        unreachable: Callable[[], None] = lambda: None,
    ) -> None:
        self.client = client
        self.call_timeout = call_timeout
        self.access = access
        self._callers = callers
        self._unreachable = unreachable

    def check(self, message: AgentMessage, skill_id: str | None) -> None:
        """Raise RemoteError(PERMISSION_DENIED) unless the access rule lets the sender of
        ``message`` use the server (as ``Catalog`` refuses a tool)."""
        access = self.access
        if access is None or access.is_open():
            return
        caller = message.caller
        if caller is None and self._callers is not None:
            caller = self._callers(message.sender)
        refusal = access.refusal(caller)
        if refusal is None:
            return
        who = caller.agent_id if caller is not None else "an unknown caller"
        what = f"skill {skill_id!r} of the A2A server" if skill_id else "the A2A server"
        logger.warning("refused %s (sender %r): %s", what, message.sender, refusal)
        raise RemoteError(
            ErrorCode.PERMISSION_DENIED, f"{who} may not use {what}: {refusal}", caller=who
        )

    def handler(self, skill_id: str | None) -> Callable[[AgentMessage], Awaitable[Any]]:
        """The request handler of skill ``skill_id`` (None: no skill named)."""

        async def forward(message: AgentMessage) -> Any:
            self.check(message, skill_id)
            meta = message.envelope.metadata
            deadline = meta.deadline_ms if meta is not None else None
            seconds = deadline / 1000 if deadline else self.call_timeout
            return await self.send(message.payload, skill_id, seconds)

        return forward

    async def send(self, payload: Any, skill_id: str | None, seconds: float) -> Any:
        """The answer of the server to ``payload`` for ``skill_id``, within ``seconds``.
        Raises RemoteError (docs/protocol/a2a.md §9.4)."""
        request = _request_of(payload, skill_id)
        answer = _Answer()
        # A handler's first step may run inside the trio tick that delivered its envelope
        # (p2pnode.hosting.aio starts it eagerly): the SDK's async generators must first
        # run in the handler's own loop step, or trio's hooks would finalize them.
        await anyio.lowlevel.checkpoint()
        try:
            with anyio.fail_after(seconds):
                await self._exchange(request, answer, seconds)
        except TimeoutError:
            await self._cancel(answer)
            raise RemoteError(
                ErrorCode.TIMEOUT, f"the A2A server did not answer within {seconds:g} s"
            ) from None
        except anyio.get_cancelled_exc_class():
            await self._cancel(answer)  # the caller gave up
            raise
        except Exception as exc:
            error = error_of(exc)
            if error.details.get("unreachable"):
                self._unreachable()
            logger.info("A2A call for skill %s failed: %s", skill_id, error)
            raise error from None
        try:
            return answer.result()
        except RemoteError as error:
            logger.info("A2A call for skill %s failed: %s", skill_id, error)
            raise

    async def _exchange(self, request: SendMessageRequest, answer: _Answer, seconds: float) -> None:
        context = ClientCallContext(timeout=seconds)
        # The SDK's clients implement send_message as an async generator (it is declared
        # an iterator): closed here, not left to the garbage collector.
        sent = self.client.send_message(request, context=context)
        stream = cast(AsyncGenerator[StreamResponse], sent)
        async with aclosing(stream) as events:
            async for event in events:
                answer.take(event)
                if answer.ended:
                    return
        wait = FOLLOW_FIRST
        while not answer.ended and answer.task_id is not None:
            # A blocking send answered before the task ended: follow it (bounded by the
            # call's deadline).
            await anyio.sleep(wait)
            wait = min(wait * 2, FOLLOW_LAST)
            task = await self.client.get_task(GetTaskRequest(id=answer.task_id), context=context)
            answer.take_task(task)
        if not answer.ended:
            raise RemoteError(ErrorCode.INVALID_OUTPUT, "the A2A server sent no task or message")

    async def _cancel(self, answer: _Answer) -> None:
        """CancelTask for the task the server opened for a call given up, if it has not
        ended; bounded, and whatever happens is only logged."""
        if answer.task_id is None or answer.ended:
            return
        request = CancelTaskRequest(id=answer.task_id)
        context = ClientCallContext(timeout=CANCEL_TIMEOUT)
        with anyio.CancelScope(shield=True), anyio.move_on_after(CANCEL_TIMEOUT):
            try:
                await self.client.cancel_task(request, context=context)
                logger.info("A2A task %s canceled: its caller gave up", answer.task_id)
            except Exception as exc:
                logger.info("CancelTask %s: %s", answer.task_id, error_of(exc))


# -- the agent ---------------------------------------------------------------------------------


def publisher_agent(
    agent_id: str,
    facts: CardFacts,
    forwarder: Forwarder,
    *,
    tier: int = 3,
    sandbox: str | None = None,
) -> Agent:
    """The agent ``agent_id`` offering each skill of ``facts`` as a capability, and taking
    requests without one too (sent without ``skillId``). A skill's input schema the node
    cannot check is left off (logged). Raises LocalError for an agent id, tier or sandbox
    the node refuses (when it is hosted)."""
    agent = Agent(
        agent_id,
        name=facts.name,
        description=facts.description,
        tier=tier,
        sandbox=sandbox,
        version=facts.version,
    )
    for skill in facts.skills:
        cap = skill.capability
        schemas = (cap.input_schema, cap.output_schema)
        try:
            schema_checker(cap.input_schema)
        except LocalError as exc:
            logger.warning("%s: skill %r: schemas left off: %s", agent_id, skill.skill_id, exc)
            schemas = (None, None)
        agent.on_request(
            cap.id,
            name=cap.name,
            description=cap.description,
            input_schema=schemas[0],
            output_schema=schemas[1],
        )(forwarder.handler(skill.skill_id))
    agent.on_request()(forwarder.handler(None))
    return agent


__all__ = [
    "CALL_TIMEOUT",
    "CANCEL_TIMEOUT",
    "CARD_PATH",
    "CARD_TIMEOUT",
    "MAX_BODY_BYTES",
    "MAX_CARD_BYTES",
    "A2AServer",
    "BodyTooLarge",
    "BoundedTransport",
    "CardRead",
    "Forwarder",
    "bounded_client",
    "card_url",
    "error_of",
    "publisher_agent",
]
