"""Attach an agent process to a running node: the client of ``agent.sock``, on anyio.

One node per device runs ``p2pnode run``; any number of agent processes attach
to it over its owner-only Unix socket ``agent.sock`` (docs/protocol/agents.md).
This module is that protocol for Python, on anyio, so the same code runs under
asyncio and trio::

    from p2pnode import Agent
    from p2pnode.client import AgentClient, run_agent

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
  :class:`~p2pnode.agent.Agent` definition describes, and then serves it: one
  reader task reads every line the node writes, hands each ``envelope``
  event to one handler task (arrival order, as the node runs an in-process
  agent) and matches op replies to their callers by ``id``. The handler task
  runs the definition's own dispatch, :meth:`Agent.handle`, so input
  validation and typed errors are the same as in-process, and sends its
  :class:`~p2pnode.agent.Reply` as a ``reply`` line.
* The reader never waits for the handler: envelopes beyond ``queue_size``
  waiting for it are refused here as the node refuses them (a request is
  answered ``BUSY``, anything else is dropped and logged), so a handler that
  itself awaits a ``request`` cannot deadlock the connection.
* Leaving ``async with`` detaches (the node withdraws the agent at once)
  and closes the connection; if the process dies instead, the node sees
  the socket close and withdraws the agent by itself.
"""

from __future__ import annotations

import itertools
import logging
import signal
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from p2pnode.agent import Agent
from p2pnode.envelope import Envelope, EnvelopeError, MessageType
from p2pnode.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.identity import default_data_dir
from p2pnode.node.attachwire import (
    AGENT_SOCKET_NAME,
    MAX_LINE,
    PROTOCOL_VERSION,
    AttachError,
    LineBuffer,
    caller_from_plain,
    encode_line,
    object_untrusted,
)
from p2pnode.tools import Caller

logger = logging.getLogger("p2pnode.client")

#: Seconds ``detach`` may take when the client closes.
DETACH_TIMEOUT = 5.0
_READ_SIZE = 65536


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
        self._stream: anyio.abc.SocketStream | None = None
        self._write_lock = anyio.Lock()
        self._tasks: anyio.abc.TaskGroup | None = None
        self._closed = anyio.Event()
        self._failure: P2PError | None = None
        self._inbox_send: MemoryObjectSendStream[_Delivered] | None = None

    @property
    def agent_id(self) -> str:
        return self.agent.id

    # -- lifetime ---------------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        """Connect and attach. Raises LocalError(CONFIG_ERROR) when no node listens at the
        path, and the node's error (INVALID_CARD, PROTOCOL_VERSION_MISMATCH, ...) when it
        refuses the agent."""
        try:
            self._stream = await anyio.connect_unix(self.path)
        except OSError as exc:
            raise LocalError(
                ErrorCode.CONFIG_ERROR,
                f"no node answers on {self.path} ({exc}); is `p2pnode run` running?",
            ) from exc
        send, receive = anyio.create_memory_object_stream[_Delivered](self._queue_size)
        self._inbox_send = send
        self._tasks = anyio.create_task_group()
        await self._tasks.__aenter__()
        try:
            self._tasks.start_soon(self._read_loop)
            self._tasks.start_soon(self._handle_loop, receive)
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
        assert self._tasks is not None and self._stream is not None
        assert self._inbox_send is not None
        self._tasks.cancel_scope.cancel()
        try:
            # The body's own exception passes unwrapped (not in an ExceptionGroup of the
            # client's tasks); a cancellation may be the task group's, which must see it.
            if isinstance(exc, anyio.get_cancelled_exc_class()):
                return await self._tasks.__aexit__(exc_type, exc, tb)
            await self._tasks.__aexit__(None, None, None)
            return None
        finally:
            self._inbox_send.close()
            with anyio.CancelScope(shield=True):
                await self._stream.aclose()
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
        assert self._stream is not None
        try:
            async with self._write_lock:
                await self._stream.send(line)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise LocalError(ErrorCode.CHANNEL_CLOSED, f"the node is gone: {exc}") from None

    # -- the reader and the handler ---------------------------------------------------------

    async def _read_loop(self) -> None:
        assert self._stream is not None
        lines = LineBuffer(MAX_LINE)
        try:
            while True:  # until the node closes the connection
                line = lines.next_line()
                if line is None:
                    try:
                        data = await self._stream.receive(_READ_SIZE)
                    except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                        return
                    lines.feed(data)
                elif line.strip():
                    await self._on_line(line)
        except AttachError as exc:
            logger.warning("the node sent a bad line: %s", exc.message)
            self._end(exc)
        finally:
            self._end(LocalError(ErrorCode.CHANNEL_CLOSED, "the node closed the connection"))

    async def _on_line(self, line: bytes) -> None:
        obj = object_untrusted(line)
        event = obj.get("event")
        if event == "envelope":
            await self._on_envelope(obj.get("envelope"), caller_from_plain(obj.get("caller")))
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

    async def _on_envelope(self, plain: object, caller: Caller | None) -> None:
        try:
            envelope = Envelope.from_dict_untrusted(plain)
        except EnvelopeError as exc:
            logger.warning("%s: unreadable envelope from the node: %s", self.agent_id, exc)
            return
        assert self._inbox_send is not None
        try:
            self._inbox_send.send_nowait((envelope, caller))
        except anyio.WouldBlock:
            logger.warning("%s: %d envelopes wait: dropping", self.agent_id, self._queue_size)
            if envelope.type is MessageType.REQUEST:
                busy = RemoteError(ErrorCode.BUSY, f"agent {self.agent_id!r} is not keeping up")
                await self._reply(envelope, MessageType.ERROR, busy.to_dict())

    async def _handle_loop(self, inbox: MemoryObjectReceiveStream[_Delivered]) -> None:
        async with inbox:
            async for envelope, caller in inbox:
                reply = await self.agent.handle(envelope, caller)
                if reply is not None:
                    await self._reply(envelope, reply.type, reply.payload)

    async def _reply(self, envelope: Envelope, type_: MessageType, payload: Any) -> None:
        line = {"op": "reply", "to": envelope.id, "type": type_.value, "payload": payload}
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
