"""Attach an agent process to a running node: the client of ``agent.sock``, on anyio.

One node per device runs ``p2pnode run``; any number of agent processes attach
to it over its owner-only Unix socket ``agent.sock`` (docs/protocol/agents.md).
This module is that protocol for Python, on anyio, so the same code runs under
asyncio and trio::

    from p2pnode import Agent
    from p2pnode.hosting.client import AgentClient, run_agent

    agent = Agent("planner")

    @agent.on_request("plan.strategy")
    async def plan(message):
        return {"steps": ["think", "do"]}

    run_agent(agent, data_dir="~/.local/share/p2pnode")   # blocks; a script's main

    async with AgentClient(agent, data_dir=...) as client:  # inside an async program
        reply = await client.request("other-agent", {"q": 1})
        await client.wait_closed()

Theory of operation:

* :class:`AgentClient` connects, sends ``attach`` with the card the
  :class:`~p2pnode.agent.definition.Agent` definition describes, and then serves it:
  every complete line the node wrote is handled as soon as it is read,
  before the reader waits again. Each ``envelope`` event goes to one handler
  task (arrival order, as the node runs an in-process agent) and op replies
  wake their callers by ``id``. The handler task runs the definition's own
  dispatch, :meth:`Agent.handle`, so input validation and typed errors are
  the same as in-process, and writes its :class:`~p2pnode.agent.definition.Reply` as a
  ``reply`` line at once, from its own task.
* On asyncio the connection is an :class:`asyncio.Protocol` (lines are handled
  in the loop pass that read them, and written without a task hop: one loop
  pass per envelope); on trio it is anyio's socket stream
  (:mod:`p2pnode.hosting.clientlink`). The protocol on the wire is the same.
* The reader never waits for the handler: envelopes beyond ``queue_size``
  waiting for it are refused here as the node refuses them (a request is
  answered ``BUSY``, anything else is dropped and logged), so a handler that
  itself awaits a ``request`` cannot deadlock the connection.
* Leaving ``async with`` detaches (the node withdraws the agent at once)
  and closes the connection; if the process dies instead, the node sees
  the socket close and withdraws the agent by itself.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import signal
from collections import deque
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

import anyio
import anyio.abc
import outcome
import sniffio

from p2pnode.agent.definition import Agent
from p2pnode.agent.tools import Caller
from p2pnode.core.envelope import Envelope, EnvelopeError, MessageType
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.core.identity import default_data_dir
from p2pnode.hosting.aiohandoff import start_eagerly
from p2pnode.hosting.clientlink import Link, ProtocolLink, StreamLink
from p2pnode.services.attach.wire import (
    AGENT_SOCKET_NAME,
    MAX_LINE,
    PROTOCOL_VERSION,
    AttachError,
    LineBuffer,
    caller_from_plain,
    encode_line,
    object_untrusted,
)

logger = logging.getLogger("p2pnode.hosting.client")

#: Seconds ``detach`` may take when the client closes.
DETACH_TIMEOUT = 5.0


def socket_path(data_dir: Path | str | None = None) -> Path:
    """The ``agent.sock`` of the node using ``data_dir`` (default: the CLI's default)."""
    base = Path(data_dir).expanduser() if data_dir is not None else default_data_dir()
    return base / AGENT_SOCKET_NAME


#: An envelope for the agent, and the caller the node authenticated for an MCP request.
_Delivered = tuple[Envelope, Caller | None]


def card_template(agent: Agent) -> dict[str, Any]:
    """The ``card`` of an ``attach`` for ``agent`` (docs/protocol/agents.md)."""
    return {
        "id": agent.id,
        "name": agent.name,
        "description": agent.description,
        "version": agent.version,
        "tier": int(agent.tier),
        "sandboxId": agent.sandbox,
        "capabilities": [c.to_dict() for c in agent.capabilities],
        **{key: list(names) for key, names in agent.card_offers().items() if names},
    }


def _error(body: object) -> P2PError:
    """The error of an ``{"ok": false}`` reply, typed by its code."""
    if not isinstance(body, dict):
        return LocalError(ErrorCode.INTERNAL, "unreadable error from the node")
    code = str(body.get("code"))
    details = body.get("details")
    details = {k: v for k, v in details.items() if k not in ("code", "message")} if isinstance(
        details, dict
    ) else {}  # fmt: skip
    return LocalError(
        ErrorCode(code) if code in ErrorCode.__members__ else ErrorCode.INTERNAL,
        str(body.get("message", "")),
        **details,
    )


class _Call:
    """An op waiting for its reply."""

    __slots__ = ("done", "reply")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.reply: dict[str, Any] | None = None


class AgentClient:
    """One agent process attached to a node (see the module docstring).

    ``data_dir`` names the node's data directory, or ``path`` its
    ``agent.sock``. ``queue_size`` envelopes may wait for the handler.
    """

    def __init__(
        self,
        agent: Agent,
        *,
        data_dir: Path | str | None = None,
        path: Path | str | None = None,
        queue_size: int = 256,
    ) -> None:
        self.agent = agent
        self.path = Path(path) if path is not None else socket_path(data_dir)
        #: The signed card the node published for the agent (its plain form), once attached.
        self.card: dict[str, Any] = {}
        self._queue_size = queue_size
        self._ids = itertools.count(1)
        self._calls: dict[int, _Call] = {}
        self._lines = LineBuffer(MAX_LINE)
        self._link: Link | None = None
        self._tasks: anyio.abc.TaskGroup | None = None
        self._closed = anyio.Event()
        self._failure: P2PError | None = None
        # Envelopes waiting for the handler task (at most queue_size), and what wakes it.
        self._inbox: deque[_Delivered] = deque()
        self._inbox_ready: anyio.Event | None = None  # the handler task waits on it (trio)
        # On asyncio the handler task runs while the inbox holds envelopes and starts
        # eagerly (see _start_handling): None on other backends.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context = contextvars.copy_context()
        self._handling = False
        self._handler: asyncio.Task[None] | None = None

    @property
    def agent_id(self) -> str:
        return self.agent.id

    # -- lifetime ---------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Connect and attach. Raises LocalError(CONFIG_ERROR) when no node listens at the
        path, and the node's error (INVALID_CARD, PROTOCOL_VERSION_MISMATCH, ...) when it
        refuses the agent."""
        if _on_asyncio():
            self._loop = asyncio.get_running_loop()
            self._context = contextvars.copy_context()  # what handlers see: the opener's
        connect = ProtocolLink.connect if self._loop is not None else StreamLink.connect
        try:
            self._link = await connect(self.path, self._received)
        except OSError as exc:
            raise LocalError(
                ErrorCode.CONFIG_ERROR,
                f"no node answers on {self.path} ({exc}); is `p2pnode run` running?",
            ) from exc
        self._tasks = anyio.create_task_group()
        await self._tasks.__aenter__()
        try:
            self._tasks.start_soon(self._read_loop)
            if self._loop is None:
                self._tasks.start_soon(self._handle_loop)
            result = await self._call(
                {"v": PROTOCOL_VERSION, "op": "attach", "card": card_template(self.agent)}
            )
            self.card = result["card"]
        except BaseException as exc:
            await self._shutdown(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        """Detach (bounded by DETACH_TIMEOUT) and close."""
        if not self._closed.is_set():
            with anyio.move_on_after(DETACH_TIMEOUT, shield=True):
                try:
                    await self._call({"op": "detach"})
                except P2PError as failure:
                    logger.info("detach of %s: %s", self.agent_id, failure)
        return await self._shutdown(exc_type, exc, tb)

    async def _shutdown(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._tasks is not None and self._link is not None
        self._tasks.cancel_scope.cancel()
        try:
            # The body's own exception passes unwrapped (not in an ExceptionGroup of the
            # client's tasks); a cancellation may be the task group's, which must see it.
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                return await self._tasks.__aexit__(exc_type, exc, tb)
            await self._tasks.__aexit__(None, None, None)
            return None
        finally:
            self._inbox.clear()
            with anyio.CancelScope(shield=True):
                handler = self._handler
                if handler is not None and not handler.done():
                    handler.cancel()  # as the task group cancels the handler task on trio
                    await asyncio.wait({handler})
                await self._link.aclose()
            self._end(LocalError(ErrorCode.CHANNEL_CLOSED, "the client is closed"))

    async def wait_closed(self) -> None:
        """Return once the connection is over (the node closed it or stopped). Raises the
        node's fatal error when it ended the session with one."""
        await self._closed.wait()
        failure = self._failure
        if failure is not None and failure.code is not ErrorCode.CHANNEL_CLOSED:
            raise failure

    # -- ops --------------------------------------------------------------------------------

    async def send(
        self,
        to: str,
        payload: Any = None,
        *,
        type: MessageType | str = MessageType.NOTIFICATION,
        capability: bool = False,
        correlation_id: str | None = None,
    ) -> dict[str, Any]:
        """Send an envelope from the agent; returns ``{"envelope", "path", "targets"}``.
        Raises the routing error (AGENT_NOT_FOUND, TIER_VIOLATION, ...)."""
        op: dict[str, Any] = {"op": "send", "to": to, "type": str(type), "payload": payload}
        if capability:
            op["capability"] = True
        if correlation_id is not None:
            op["correlationId"] = correlation_id
        result: dict[str, Any] = await self._call(op)
        return result

    async def request(
        self,
        to: str,
        payload: Any = None,
        *,
        capability: bool = False,
    ) -> Envelope:
        """Send a request from the agent and return the response envelope. Raises the
        responder's error code, TIMEOUT (after the node's request timeout; bound the wait
        sooner with ``anyio.fail_after``), or what :meth:`send` raises."""
        op: dict[str, Any] = {"op": "request", "to": to, "payload": payload}
        if capability:
            op["capability"] = True
        result = await self._call(op)
        try:
            return Envelope.from_dict_untrusted(result)
        except EnvelopeError as exc:
            raise LocalError(ErrorCode.INTERNAL, f"unreadable response: {exc.message}") from None

    async def doc_subscribe(self, doc: str) -> dict[str, Any]:
        """Make the agent a member of shared document ``doc``."""
        result: dict[str, Any] = await self._call({"op": "doc.subscribe", "doc": doc})
        return result

    async def doc_update(self, doc: str, update: dict[str, Any]) -> dict[str, Any]:
        """Apply an operation (``{"op": "counter.add", "path": [...]}``, ...) once durable."""
        op = {"op": "doc.update", "doc": doc, "update": update}
        result: dict[str, Any] = await self._call(op)
        return result

    async def doc_read(self, doc: str) -> dict[str, Any]:
        """``{"doc", "value", "clock", "peers"}`` of shared document ``doc``."""
        result: dict[str, Any] = await self._call({"op": "doc.read", "doc": doc})
        return result

    # -- the swarm's tools, resources and prompts (docs/protocol/tools.md) -------------------

    async def list_tools(self) -> dict[str, Any]:
        """Every tool the agent may use in the swarm: ``{"items", "unreachable", "dropped"}``,
        each item with ``name`` (``agent.tool``), ``agentId``, ``description`` and schemas."""
        result: dict[str, Any] = await self._call({"op": "tools.list"})
        return result

    async def call_tool(self, name: str, arguments: dict[str, Any] | None = None) -> Any:
        """Call tool ``name`` (``agent.tool``); returns its result. Raises the owner's
        error (TOOL_NOT_FOUND, PERMISSION_DENIED, INVALID_INPUT, ...)."""
        op = {"op": "tools.call", "name": name, "arguments": arguments or {}}
        return (await self._call(op))["result"]

    async def list_resources(self) -> dict[str, Any]:
        """Every resource the agent may read: ``{"items", "unreachable", "dropped"}``."""
        result: dict[str, Any] = await self._call({"op": "resources.list"})
        return result

    async def read_resource(self, uri: str, *, agent: str | None = None) -> dict[str, Any]:
        """Read resource ``uri`` (from ``agent``, default: the agent whose card lists it):
        ``{"contents": [{"uri", "mimeType", "text" or "blob"}]}``."""
        op: dict[str, Any] = {"op": "resources.read", "uri": uri}
        if agent is not None:
            op["agent"] = agent
        result: dict[str, Any] = await self._call(op)
        return result

    async def list_prompts(self) -> dict[str, Any]:
        """Every prompt the agent may get: ``{"items", "unreachable", "dropped"}``."""
        result: dict[str, Any] = await self._call({"op": "prompts.list"})
        return result

    async def get_prompt(
        self, name: str, arguments: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """Prompt ``name`` (``agent.prompt``) rendered: ``{"description", "messages"}``."""
        op = {"op": "prompts.get", "name": name, "arguments": arguments or {}}
        result: dict[str, Any] = await self._call(op)
        return result

    async def _call(self, op: dict[str, Any]) -> Any:
        if self._closed.is_set():
            raise self._failure or LocalError(ErrorCode.CHANNEL_CLOSED, "not connected")
        call_id = next(self._ids)
        call = self._calls[call_id] = _Call()
        try:
            await self._write({**op, "id": call_id})
            await call.done.wait()
        finally:
            del self._calls[call_id]
        reply = call.reply
        if reply is None:
            raise self._failure or LocalError(ErrorCode.CHANNEL_CLOSED, "the node closed")
        if reply.get("ok") is not True:
            raise _error(reply.get("error"))
        return reply.get("result")

    async def _write(self, obj: dict[str, Any]) -> None:
        """One line to the node. Raises LocalError(INVALID_ARGUMENT) for data without a JSON
        form, LocalError(CHANNEL_CLOSED) once the connection is gone."""
        try:
            line = encode_line(obj)
        except (TypeError, ValueError) as exc:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"not JSON data: {exc}") from None
        if len(line) > MAX_LINE + 1:
            raise LocalError(ErrorCode.MESSAGE_TOO_LARGE, f"a line exceeds {MAX_LINE} bytes")
        assert self._link is not None
        await self._link.send(line)

    # -- the reader and the handler ---------------------------------------------------------

    async def _read_loop(self) -> None:
        assert self._link is not None
        try:
            await self._link.serve()
        finally:
            self._end(LocalError(ErrorCode.CHANNEL_CLOSED, "the node closed the connection"))

    def _received(self, data: bytes) -> list[bytes] | None:
        """Bytes from the node: every complete line is handled now. Returns the lines to
        write back at once (refusals), or None when the node sent a bad line (the
        connection ends)."""
        lines = self._lines
        lines.feed(data)
        refusals: list[bytes] = []
        try:
            for _ in range(len(lines) + 1):  # bounded: each turn takes a line, or stops
                line = lines.next_line()
                if line is None:
                    break
                if line.strip():
                    self._on_line(line, refusals)
        except AttachError as exc:
            logger.warning("the node sent a bad line: %s", exc.message)
            self._end(exc)
            return None
        return refusals

    def _on_line(self, line: bytes, refusals: list[bytes]) -> None:
        obj = object_untrusted(line)
        event = obj.get("event")
        if event == "envelope":
            caller = caller_from_plain(obj.get("caller"))
            self._on_envelope(obj.get("envelope"), caller, refusals)
        elif event == "overflow":
            logger.warning("%s: the node dropped %s envelopes", self.agent_id, obj.get("dropped"))
        elif "ok" in obj:
            self._on_reply(obj)

    def _on_reply(self, reply: dict[str, Any]) -> None:
        call = self._calls.get(reply["id"]) if type(reply.get("id")) is int else None
        if call is not None:
            call.reply = reply
            call.done.set()
            return
        error = reply.get("error")
        if reply.get("fatal"):
            self._end(_error(error))
        elif error is not None:  # a reply line the node could not deliver, say
            logger.warning("%s: %s failed: %s", self.agent_id, reply.get("op"), error)

    def _on_envelope(self, plain: object, caller: Caller | None, refusals: list[bytes]) -> None:
        try:
            envelope = Envelope.from_dict_untrusted(plain)
        except EnvelopeError as exc:
            logger.warning("%s: unreadable envelope from the node: %s", self.agent_id, exc)
            return
        if len(self._inbox) >= self._queue_size:
            logger.warning("%s: %d envelopes wait: dropping", self.agent_id, self._queue_size)
            if envelope.type is MessageType.REQUEST:
                busy = RemoteError(ErrorCode.BUSY, f"agent {self.agent_id!r} is not keeping up")
                refusals.append(_reply_line(envelope, MessageType.ERROR, busy.to_dict()))
            return
        self._inbox.append((envelope, caller))
        if self._loop is not None:
            if not self._handling:
                self._start_handling()
            return
        ready = self._inbox_ready
        if ready is not None:
            self._inbox_ready = None
            ready.set()

    async def _handle_loop(self) -> None:
        """The handler task on trio (and other non-asyncio backends)."""
        while True:  # until the client closes (its task group is cancelled)
            if not self._inbox:
                ready = self._inbox_ready = anyio.Event()
                await ready.wait()
                continue
            await self._handle(*self._inbox.popleft())

    def _start_handling(self) -> None:
        """(asyncio) Handle the inbox in a task whose first step runs now, in the loop
        pass that read the envelope: a handler that answers without waiting is
        answered in that pass, with no pass spent waking a task (as the node hosts
        asyncio agents, :mod:`p2pnode.hosting.aiohandoff`). The task ends once the inbox is
        empty; one at a time, so envelopes are still handled in arrival order."""
        assert self._loop is not None
        self._handling = True
        started = start_eagerly(self._loop, self._handle_inbox(), self._context)
        if isinstance(started, outcome.Outcome):
            self._handler_ended(started)
            return
        self._handler = started
        started.add_done_callback(lambda task: self._handler_ended(outcome.capture(task.result)))

    async def _handle_inbox(self) -> None:
        try:
            while self._inbox:  # what arrives while a handler waits is handled next
                await self._handle(*self._inbox.popleft())
        finally:
            self._handling = False

    def _handler_ended(self, result: outcome.Outcome[None]) -> None:
        self._handler = None
        if isinstance(result, outcome.Error) and not isinstance(
            result.error, asyncio.CancelledError
        ):
            # Agent.handle contains what handlers raise: this is a defect of ours.
            logger.error("%s: the handler task failed", self.agent_id, exc_info=result.error)
            self._end(LocalError(ErrorCode.INTERNAL, "the handler task failed"))

    async def _handle(self, envelope: Envelope, caller: Caller | None) -> None:
        reply = await self.agent.handle(envelope, caller)
        if reply is not None:
            await self._reply(envelope, reply.type, reply.payload)

    async def _reply(self, envelope: Envelope, type_: MessageType, payload: Any) -> None:
        line = _reply_op(envelope, type_, payload)
        try:
            await self._write(line)
        except LocalError as exc:
            if exc.code is ErrorCode.CHANNEL_CLOSED:
                return  # the node answers for us: the agent is unavailable
            logger.error(
                "%s: the reply to %s is not JSON data: %s", self.agent_id, envelope.id, exc
            )
            failed = RemoteError(
                ErrorCode.HANDLER_FAILED, f"the handler of {self.agent_id!r} failed"
            )
            await self._write({**line, "type": "error", "payload": failed.to_dict()})

    def _end(self, failure: P2PError) -> None:
        if self._closed.is_set():
            return
        self._failure = failure
        self._closed.set()
        for call in self._calls.values():
            call.done.set()  # no reply: the caller raises the failure


def _reply_op(envelope: Envelope, type_: MessageType, payload: Any) -> dict[str, Any]:
    return {"op": "reply", "to": envelope.id, "type": type_.value, "payload": payload}


def _reply_line(envelope: Envelope, type_: MessageType, payload: Any) -> bytes:
    """A ``reply`` line whose payload is JSON data already (a refusal's error)."""
    return encode_line(_reply_op(envelope, type_, payload))


def _on_asyncio() -> bool:
    try:
        return sniffio.current_async_library() == "asyncio"
    except sniffio.AsyncLibraryNotFoundError:
        return False


def run_agent(
    agent: Agent,
    *,
    data_dir: Path | str | None = None,
    path: Path | str | None = None,
    backend: Literal["asyncio", "trio"] = "asyncio",
) -> None:
    """Attach ``agent`` to the node of ``data_dir`` and serve it until the node closes the
    connection or the process gets SIGINT or SIGTERM (then it detaches). Blocks: the
    main of an agent script. Raises what :class:`AgentClient` raises."""

    async def serve() -> None:
        async with (
            AgentClient(agent, data_dir=data_dir, path=path) as client,
            anyio.create_task_group() as tasks,
        ):

            async def stop_on_signal() -> None:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for _ in signals:
                        tasks.cancel_scope.cancel()
                        return

            tasks.start_soon(stop_on_signal)
            await client.wait_closed()
            tasks.cancel_scope.cancel()

    anyio.run(serve, backend=backend)


__all__ = ["AgentClient", "card_template", "run_agent", "socket_path"]
