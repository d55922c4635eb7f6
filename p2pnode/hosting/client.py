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
  before the reader waits again. Op replies wake their callers by ``id``;
  ``envelope`` events go to the agent's handlers through :class:`HandlerInbox`,
  which runs them as the node runs an in-process agent: envelopes start in
  arrival order; notifications (every envelope that gets no answer) one at a
  time, each after the previous one's handler ended; requests concurrently,
  each in its own task, up to ``concurrency`` at once (then the inbox waits).
  A handler runs the definition's own dispatch, :meth:`Agent.handle`, so input
  validation and typed errors are the same as in-process, and writes its
  :class:`~p2pnode.agent.definition.Reply` as a ``reply`` line at once, from its
  own task.
* A request's handler that runs past ``request_deadline`` (the node's own
  30 s life of a forwarded request) is cancelled and answered ``TIMEOUT``, so
  a hung handler holds its slot no longer than the node holds the request.
* On asyncio the connection is an :class:`asyncio.Protocol` (lines are handled
  in the loop pass that read them, and written without a task hop), and each
  handler's task starts eagerly (:func:`~p2pnode.hosting.aiohandoff.start_eagerly`):
  one that answers without waiting is answered in the loop pass that read its
  envelope. On trio it is anyio's socket stream
  (:mod:`p2pnode.hosting.clientlink`), one task takes envelopes from the inbox
  and each request gets a task in the client's task group. The protocol on
  the wire is the same.
* The reader never waits for a handler: envelopes beyond ``queue_size``
  waiting to start are refused here as the node refuses them (a request is
  answered ``BUSY``, anything else is dropped and logged), so a handler that
  itself awaits a ``request`` cannot deadlock the connection.
* Leaving ``async with`` detaches (the node withdraws the agent at once),
  cancels the handlers still running and waits for them to end, and closes
  the connection; if the process dies instead, the node sees the socket
  close and withdraws the agent by itself.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import signal
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, Generic, Literal, Self, TypeVar

import anyio
import anyio.abc
import outcome
import sniffio

from p2pnode.agent.definition import Agent, Reply
from p2pnode.agent.surface import Listing
from p2pnode.agent.task import TERMINAL_STATES, Task, TaskState
from p2pnode.agent.tools import Caller
from p2pnode.core.card import AgentCard
from p2pnode.core.envelope import Envelope, EnvelopeError, MessageType
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.core.identity import default_data_dir
from p2pnode.core.progress import ProgressCallback, progress_untrusted
from p2pnode.crdt.ops import CounterAdd, MapRemove, Op, RegisterSet, SetAdd, SetRemove
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
#: Proposed tasks followed at once (each is a handle updated by the node's events).
MAX_OPEN_TASKS = 10_000
#: Request handlers of the agent that may wait at once: the node's own bound for the
#: agents it hosts (``NodeConfig.agent_concurrency``).
DEFAULT_CONCURRENCY = 64
#: Seconds a request's handler may run before it is cancelled and answered TIMEOUT: the
#: life the node gives a forwarded request (``AttachLimits.request_timeout``), after
#: which it no longer takes a reply to it.
REQUEST_DEADLINE = 30.0

T = TypeVar("T")


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
    """The error of an ``{"ok": false}`` reply (or of a ``task`` event), typed by its code
    and blame: RemoteError when the node marks it ``remote`` (a responder's or a peer's,
    as the in-process node raises it), else LocalError."""
    if not isinstance(body, dict):
        return LocalError(ErrorCode.INTERNAL, "unreadable error from the node")
    code = str(body.get("code"))
    details = body.get("details")
    details = {k: v for k, v in details.items() if k not in ("code", "message")} if isinstance(
        details, dict
    ) else {}  # fmt: skip
    kind = RemoteError if body.get("remote") is True else LocalError
    return kind(
        ErrorCode(code) if code in ErrorCode.__members__ else ErrorCode.INTERNAL,
        str(body.get("message", "")),
        **details,
    )


class HandlerInbox(Generic[T]):
    """The envelopes waiting for the agent's handlers, and which may start now (sans-IO).

    Envelopes start in arrival order. A request takes one of ``concurrency`` slots
    until its handler ends; a notification (any envelope that gets no answer) starts
    only while no other notification's handler runs. The first envelope that may not
    start yet holds back every one behind it. At most ``queue_size`` wait to start:
    :meth:`offer` refuses more.
    """

    __slots__ = ("_waiting", "concurrency", "notifying", "queue_size", "requests")

    def __init__(self, queue_size: int, concurrency: int) -> None:
        if queue_size < 1 or concurrency < 1:
            raise LocalError(ErrorCode.CONFIG_ERROR, "queue_size and concurrency must be positive")
        self._waiting: deque[tuple[T, bool]] = deque()
        self.queue_size = queue_size
        self.concurrency = concurrency
        #: Request handlers running (started and not ended).
        self.requests = 0
        #: Whether a notification's handler runs.
        self.notifying = False

    def __len__(self) -> int:
        """Envelopes waiting to start."""
        return len(self._waiting)

    def offer(self, item: T, request: bool) -> bool:
        """Queue ``item`` (a request when ``request``); False when ``queue_size`` wait."""
        if len(self._waiting) >= self.queue_size:
            return False
        self._waiting.append((item, request))
        return True

    def next_start(self) -> tuple[T, bool] | None:
        """Take the next envelope, marked running, if it may start now (else None)."""
        if not self._waiting:
            return None
        item, request = self._waiting[0]
        if request:
            if self.requests >= self.concurrency:
                return None
            self.requests += 1
        elif self.notifying:
            return None
        else:
            self.notifying = True
        self._waiting.popleft()
        return item, request

    def ended(self, request: bool) -> None:
        """A handler :meth:`next_start` started ended. Raises LocalError
        (ILLEGAL_TRANSITION) when none of that kind runs."""
        if request and self.requests > 0:
            self.requests -= 1
        elif not request and self.notifying:
            self.notifying = False
        else:
            kind = "request" if request else "notification"
            raise LocalError(ErrorCode.ILLEGAL_TRANSITION, f"no {kind} handler runs")

    def clear(self) -> None:
        """Drop every envelope waiting (the client closes)."""
        self._waiting.clear()


class _Running:
    """(asyncio) A handler that waited: its task, and for a request, its deadline's timer."""

    __slots__ = ("request", "task", "timed_out", "timer")

    def __init__(self, request: bool) -> None:
        self.request = request
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timed_out = False


class _Call:
    """An op waiting for its reply (``task``: the handle a ``tasks.propose`` made)."""

    __slots__ = ("done", "on_progress", "reply", "task")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.reply: dict[str, Any] | None = None
        self.task: TaskHandle | None = None
        #: Given each ``progress`` event of the op (a tools.call asked with progress).
        self.on_progress: Any = None


class AgentClient:
    """One agent process attached to a node (see the module docstring).

    ``data_dir`` names the node's data directory, or ``path`` its
    ``agent.sock``. ``queue_size`` envelopes may wait to start, ``concurrency``
    request handlers run at once, each for ``request_deadline`` seconds at most.
    Raises LocalError(CONFIG_ERROR) for a bound that is not positive.
    """

    def __init__(
        self,
        agent: Agent,
        *,
        data_dir: Path | str | None = None,
        path: Path | str | None = None,
        queue_size: int = 256,
        concurrency: int = DEFAULT_CONCURRENCY,
        request_deadline: float = REQUEST_DEADLINE,
    ) -> None:
        if not request_deadline > 0:
            raise LocalError(ErrorCode.CONFIG_ERROR, "request_deadline must be positive")
        self.agent = agent
        self.path = Path(path) if path is not None else socket_path(data_dir)
        #: The signed card the node published for the agent (its plain form), once attached.
        self.card: dict[str, Any] = {}
        self._request_deadline = request_deadline
        self._ids = itertools.count(1)
        self._calls: dict[int, _Call] = {}
        self._lines = LineBuffer(MAX_LINE)
        self._link: Link | None = None
        self._tasks: anyio.abc.TaskGroup | None = None
        self._closed = anyio.Event()
        self._failure: P2PError | None = None
        # Envelopes waiting for their handlers (at most queue_size), and what wakes the
        # task that starts them on trio.
        self._inbox = HandlerInbox[_Delivered](queue_size, concurrency)
        self._inbox_ready: anyio.Event | None = None
        # On asyncio every handler's task starts eagerly (see _pump): None elsewhere.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._context = contextvars.copy_context()
        self._running: set[asyncio.Task[None]] = set()  # handlers that waited (asyncio)
        self._stopping = False
        #: Tasks the agent proposed that have not ended, by id (their events update them).
        self._open_tasks: dict[str, TaskHandle] = {}
        #: The swarm's tools, resources and prompts, used as the agent.
        self.tools = Tools(self)
        #: Task negotiation, as the agent.
        self.tasks = Tasks(self)
        #: Shared documents, as the agent.
        self.shared = SharedDocs(self)

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
        self._stopping = True  # no handler starts any more
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
                running = set(self._running)
                if running:  # as the task group cancels the handlers' tasks on trio
                    for task in running:
                        task.cancel()
                    await asyncio.wait(running)
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

    async def find(self, capability: str) -> list[AgentCard]:
        """Agents offering ``capability`` that the agent may discover (as :meth:`Node.find`
        with the agent as viewer). Raises LocalError(INTERNAL) for a card the node sent
        that cannot be read."""
        result = await self._call({"op": "find", "capability": capability})
        try:
            return [AgentCard.from_dict_untrusted(card) for card in result["cards"]]
        except (P2PError, KeyError, TypeError) as exc:
            raise LocalError(ErrorCode.INTERNAL, f"unreadable card from the node: {exc}") from None

    async def _call(self, op: dict[str, Any], on_progress: Any = None) -> Any:
        """Run one op; its result. Raises the node's error for it, typed by its code and
        blame (``remote``), or the connection's failure. ``on_progress`` gets the op's
        progress events."""
        call = await self._exchange(op, on_progress)
        assert call.reply is not None
        return call.reply.get("result")

    async def _exchange(self, op: dict[str, Any], on_progress: Any = None) -> _Call:
        if self._closed.is_set():
            raise self._failure or LocalError(ErrorCode.CHANNEL_CLOSED, "not connected")
        call_id = next(self._ids)
        call = self._calls[call_id] = _Call()
        call.on_progress = on_progress
        try:
            await self._write({**op, "id": call_id})
            await call.done.wait()
        finally:
            del self._calls[call_id]
            if call.reply is None and op.get("op") == "tools.call":
                await self._give_up(call_id)
        reply = call.reply
        if reply is None:
            raise self._failure or LocalError(ErrorCode.CHANNEL_CLOSED, "the node closed")
        if reply.get("ok") is not True:
            raise _error(reply.get("error"))
        return call

    async def _give_up(self, call_id: int) -> None:
        """Tell the node a ``tools.call`` is no longer waited for (it was cancelled), so
        the node cancels it at its owner; best effort, within a second."""
        if self._closed.is_set():
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(1.0):
            try:
                await self._write({"op": "tools.cancel", "callId": call_id, "id": next(self._ids)})
            except (P2PError, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass  # the connection is gone: the node cancels what it ran for us

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
        elif event == "task":
            self._on_task_event(obj)
        elif event == "progress":
            self._on_progress(obj)
        elif event == "overflow":
            logger.warning("%s: the node dropped %s envelopes", self.agent_id, obj.get("dropped"))
        elif "ok" in obj:
            self._on_reply(obj)

    def _on_progress(self, event: dict[str, Any]) -> None:
        """A ``progress`` event of a running tools.call: to its caller's callback."""
        call = self._calls.get(event["id"]) if type(event.get("id")) is int else None
        update = progress_untrusted(event)
        if call is None or call.on_progress is None or update is None:
            return
        try:
            call.on_progress(update)
        except Exception:  # the caller's callback: logged, never the connection's end
            logger.exception("%s: a progress callback failed", self.agent_id)

    def _on_reply(self, reply: dict[str, Any]) -> None:
        call = self._calls.get(reply["id"]) if type(reply.get("id")) is int else None
        if call is not None:
            call.reply = reply
            if reply.get("op") == "tasks.propose" and reply.get("ok") is True:
                # Made here, in the reader, so the task's events (the next lines) find it.
                call.task = self._open_task(reply.get("result"))
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
        request = envelope.type is MessageType.REQUEST
        if not self._inbox.offer((envelope, caller), request):
            logger.warning("%s: %d envelopes wait: dropping", self.agent_id, len(self._inbox))
            if request:
                busy = RemoteError(ErrorCode.BUSY, f"agent {self.agent_id!r} is not keeping up")
                refusals.append(_reply_line(envelope, MessageType.ERROR, busy.to_dict()))
            return
        if self._loop is not None:
            self._pump()
        else:
            self._wake()

    def _wake(self) -> None:
        """(trio) The inbox changed: the task that starts handlers looks again."""
        ready = self._inbox_ready
        if ready is not None:
            self._inbox_ready = None
            ready.set()

    async def _handle_loop(self) -> None:
        """(trio, and other non-asyncio backends) Start handlers as the inbox allows: a
        notification runs here, a request in a task of its own."""
        assert self._tasks is not None
        while True:  # until the client closes (its task group is cancelled)
            start = self._inbox.next_start()
            if start is None:
                ready = self._inbox_ready = anyio.Event()
                await ready.wait()
                continue
            (envelope, caller), request = start
            if request:
                self._tasks.start_soon(self._serve_request, envelope, caller)
                continue
            try:
                await self._handle(envelope, caller)
            finally:
                self._inbox.ended(False)

    async def _serve_request(self, envelope: Envelope, caller: Caller | None) -> None:
        """(trio) One request's handler, cut at ``request_deadline``."""
        try:
            with anyio.move_on_after(self._request_deadline) as scope:
                reply = await self.agent.handle(envelope, caller)
            if scope.cancelled_caught:
                reply = self._timed_out(envelope)
            if reply is not None:
                await self._reply(envelope, reply.type, reply.payload)
        finally:
            self._inbox.ended(True)
            self._wake()

    def _pump(self) -> None:
        """(asyncio) Start every envelope the inbox lets start, each handler in a task
        whose first step runs now, in the loop pass that read the envelope (or in the
        done callback of the handler that freed its turn): a handler that answers
        without waiting is answered in that pass, with no pass spent waking a task
        (as the node hosts asyncio agents, :mod:`p2pnode.hosting.aiohandoff`)."""
        assert self._loop is not None
        for _ in range(len(self._inbox)):  # bounded: each turn starts one, or stops
            start = None if self._stopping else self._inbox.next_start()
            if start is None:
                return
            (envelope, caller), request = start
            running = _Running(request)
            coro = self._serve_eagerly(envelope, caller, running)
            started = start_eagerly(self._loop, coro, self._context)
            if isinstance(started, outcome.Outcome):
                self._settle(running, started)
                continue
            running.task = started
            self._running.add(started)
            if request:
                running.timer = self._loop.call_later(
                    self._request_deadline, self._time_out, running
                )
            started.add_done_callback(partial(self._waited, running))

    async def _serve_eagerly(
        self, envelope: Envelope, caller: Caller | None, running: _Running
    ) -> None:
        """(asyncio) One handler; a request's is cancelled by its timer at the deadline."""
        try:
            reply = await self.agent.handle(envelope, caller)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not running.timed_out or task is None or task.uncancel() > 0:
                raise  # the client closes (or the cancel is someone else's)
            reply = self._timed_out(envelope)
        if reply is not None:
            await self._reply(envelope, reply.type, reply.payload)

    def _time_out(self, running: _Running) -> None:
        running.timed_out = True
        if running.task is not None:
            running.task.cancel()

    def _timed_out(self, envelope: Envelope) -> Reply:
        """The answer of a request whose handler ran past its deadline (cancelled)."""
        limit = self._request_deadline
        logger.warning(
            "%s: the handler of %s ran past %g s: cancelled", self.agent_id, envelope.id, limit
        )
        error = RemoteError(
            ErrorCode.TIMEOUT,
            f"the handler of agent {self.agent_id!r} ran past its deadline of {limit:g} s",
            deadlineSeconds=limit,
            agentId=self.agent_id,
        )
        return Reply(MessageType.ERROR, error.to_dict())

    def _waited(self, running: _Running, task: asyncio.Task[None]) -> None:
        """(asyncio) A handler that waited ended: its turn is free for the next."""
        self._running.discard(task)
        self._settle(running, outcome.capture(task.result))
        self._pump()

    def _settle(self, running: _Running, result: outcome.Outcome[None]) -> None:
        if running.timer is not None:
            running.timer.cancel()
        self._inbox.ended(running.request)
        if isinstance(result, outcome.Error) and not isinstance(
            result.error, asyncio.CancelledError
        ):
            # Agent.handle contains what handlers raise: this is a defect of ours.
            logger.error("%s: a handler task failed", self.agent_id, exc_info=result.error)
            self._end(LocalError(ErrorCode.INTERNAL, "a handler task failed"))

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

    def _open_task(self, result: object) -> TaskHandle | None:
        """The handle of a task the node says it proposed (None: an unreadable result)."""
        if not isinstance(result, dict) or not isinstance(result.get("taskId"), str):
            return None
        if len(self._open_tasks) >= MAX_OPEN_TASKS:
            logger.warning("%s: %d tasks open: not following more", self.agent_id, MAX_OPEN_TASKS)
            return None
        handle = TaskHandle(self, result)
        self._open_tasks[handle.task_id] = handle
        return handle

    def _on_task_event(self, event: dict[str, Any]) -> None:
        handle = self._open_tasks.get(str(event.get("taskId")))
        if handle is None:
            logger.debug("%s: an event of no open task: %s", self.agent_id, event.get("taskId"))
            return
        if handle._apply(event):
            del self._open_tasks[handle.task_id]

    def _end(self, failure: P2PError) -> None:
        if self._closed.is_set():
            return
        self._failure = failure
        self._closed.set()
        for call in self._calls.values():
            call.done.set()  # no reply: the caller raises the failure
        for handle in self._open_tasks.values():
            handle._lost(failure)  # their events cannot come any more
        self._open_tasks.clear()


# -- the grouped ops: the same names as the in-process node's (p2pnode.agent.surface) ----------


class Tools:
    """``client.tools``: the swarm's tools, resources and prompts, used as the agent
    (as ``node.tools`` with the agent as ``caller``; docs/protocol/tools.md)."""

    def __init__(self, client: AgentClient) -> None:
        self._client = client

    async def _listing(self, op: str) -> Listing:
        result = await self._client._call({"op": op})
        return Listing(result["items"], result["unreachable"], result["dropped"])

    async def list_tools(self) -> Listing:
        """Every tool the agent may use in the swarm (items named ``agent.tool``)."""
        return await self._listing("tools.list")

    async def list_resources(self) -> Listing:
        """Every resource the agent may read."""
        return await self._listing("resources.list")

    async def list_prompts(self) -> Listing:
        """Every prompt the agent may get."""
        return await self._listing("prompts.list")

    async def call_tool(
        self,
        name: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (it travels to the owner)
    ) -> Any:
        """Call tool ``name`` (``agent.tool``); returns its result. ``timeout``: the
        caller's own deadline in seconds (default: the node's). Raises RemoteError with
        the owner's code (TOOL_NOT_FOUND, PERMISSION_DENIED, INVALID_INPUT, ...)."""
        op: dict[str, Any] = {"op": "tools.call", "name": name, "arguments": dict(arguments or {})}
        if timeout is not None:
            op["timeout"] = timeout
        return (await self._client._call(op))["result"]

    async def call_tool_result(
        self,
        name: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 (it travels to the owner)
        on_progress: ProgressCallback | None = None,
    ) -> Any:
        """The owner's whole ``tools/call`` answer (``content`` blocks and
        ``structuredContent``: tools.md §3); ``on_progress`` gets each progress the
        node passes on (agents.md ``progress`` events), in the reader's task."""
        op: dict[str, Any] = {"op": "tools.call", "name": name, "arguments": dict(arguments or {})}
        op["content"] = True
        if timeout is not None:
            op["timeout"] = timeout
        if on_progress is not None:
            op["progress"] = True
        return (await self._client._call(op, on_progress))["result"]

    async def read_resource(self, uri: str, *, agent: str | None = None) -> dict[str, Any]:
        """Read resource ``uri`` (from ``agent``, default: the agent whose card lists it):
        ``{"contents": [...]}``. Raises LocalError(RESOURCE_NOT_FOUND) when none does."""
        op: dict[str, Any] = {"op": "resources.read", "uri": uri}
        if agent is not None:
            op["agent"] = agent
        result: dict[str, Any] = await self._client._call(op)
        return result

    async def get_prompt(
        self, name: str, arguments: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """Prompt ``name`` (``agent.prompt``) rendered: ``{"description", "messages"}``."""
        op = {"op": "prompts.get", "name": name, "arguments": dict(arguments or {})}
        result: dict[str, Any] = await self._client._call(op)
        return result


class Tasks:
    """``client.tasks``: task negotiation as the agent (as ``node.tasks``)."""

    def __init__(self, client: AgentClient) -> None:
        self._client = client

    async def propose(
        self,
        target: str | Iterable[str],
        task: Task,
        *,
        deadline: float | None = None,
        capability: bool = False,
        justification: str | None = None,
    ) -> TaskHandle:
        """Propose ``task`` and return it once awarded (see ``TaskService.propose``).
        Raises LocalError: PROPOSAL_TIMEOUT, AGENT_NOT_FOUND, CAPABILITY_NOT_FOUND, BUSY,
        a policy refusal; RemoteError(TASK_REJECTED) when every target rejected it."""
        op: dict[str, Any] = {
            "op": "tasks.propose",
            "to": target if isinstance(target, str) else list(target),
            "task": task.to_dict(),
        }
        if capability:
            op["capability"] = True
        if deadline is not None:
            op["deadline"] = deadline
        if justification is not None:
            op["justification"] = justification
        call = await self._client._exchange(op)
        if call.task is None:
            raise LocalError(ErrorCode.INTERNAL, "the node's answer names no task to follow")
        return call.task


class TaskHandle:
    """A task the agent proposed, followed through the node's ``task`` events: the
    proposer's side of ``TaskService``'s handle (``state``, ``result()``, ``updates()``,
    ``cancel()``)."""

    def __init__(self, client: AgentClient, result: dict[str, Any]) -> None:
        self._client = client
        self.task_id: str = result["taskId"]
        self.state = _state(result.get("state"))
        self.assignee: str | None = result.get("assignee")
        self.progress: float | None = None
        self.message = ""
        self._end: dict[str, Any] | None = None  # the last event, once the task ended
        self._failure: P2PError | None = None  # the connection ended first
        self._changed = anyio.Event()

    def _apply(self, event: dict[str, Any]) -> bool:
        """An event of the node; True once the task ended."""
        self.state = _state(event.get("state"))
        assignee, progress, message = (event.get(k) for k in ("assignee", "progress", "message"))
        self.assignee = assignee if isinstance(assignee, str) else self.assignee
        if isinstance(progress, int | float) and not isinstance(progress, bool):
            self.progress = float(progress)
        self.message = message if isinstance(message, str) else self.message
        if self.state in TERMINAL_STATES:
            self._end = event
        self._notify()
        return self._end is not None

    def _lost(self, failure: P2PError) -> None:
        self._failure = failure
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_changed(self) -> None:
        """Return at the next change of the task's state or progress."""
        await self._changed.wait()

    async def result(self) -> Any:
        """The result once the task completed; raises as the in-process handle does
        (RemoteError with the executor's code, LocalError(TASK_CANCELED)), or the
        connection's failure when it ended first."""
        while self._end is None and self._failure is None:
            await self._changed.wait()
        return self.outcome()

    def outcome(self) -> Any:
        """The result of a completed task (raises as :meth:`result`; LocalError
        (INVALID_ARGUMENT) while it runs)."""
        if self._end is not None:
            if "error" in self._end:
                raise _error(self._end["error"])
            return self._end.get("result")
        if self._failure is not None:
            raise self._failure
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"task {self.task_id} is {self.state}")

    async def updates(self) -> AsyncIterator[TaskState]:
        """The state after each change, until and including the end."""
        while True:  # ends with the task, or with the connection
            changed = self._changed
            yield self.state
            if self._end is not None or self._failure is not None:
                return
            await changed.wait()

    async def cancel(self, reason: str = "") -> None:
        """Cancel the task. Raises LocalError(ILLEGAL_TRANSITION) once it ended (as the
        in-process handle does), INVALID_ARGUMENT when the node no longer follows it."""
        if self._end is not None:
            raise LocalError(ErrorCode.ILLEGAL_TRANSITION, f"task {self.task_id} is {self.state}")
        op: dict[str, Any] = {"op": "tasks.cancel", "taskId": self.task_id}
        if reason:
            op["reason"] = reason
        await self._client._call(op)


def _state(value: object) -> TaskState:
    known = {state.value: state for state in TaskState}
    return known.get(value, TaskState.WORKING) if isinstance(value, str) else TaskState.WORKING


class SharedDocs:
    """``client.shared``: shared CRDT documents, as the agent (as ``node.shared`` with the
    agent as member)."""

    def __init__(self, client: AgentClient) -> None:
        self._client = client

    async def subscribe(self, doc: str) -> None:
        """Make the agent a member of ``doc``."""
        await self._client._call({"op": "doc.subscribe", "doc": doc})

    async def update(self, doc: str, op: Op) -> dict[str, Any]:
        """Apply ``op`` to ``doc``; returns ``{"doc", "origin", "seq", "durable"}`` once
        durable. Raises LocalError(INVALID_ARGUMENT) for an operation the node refuses or
        one without a JSON form (bytes)."""
        update = {"op": "doc.update", "doc": doc, "update": op_to_json(op)}
        result: dict[str, Any] = await self._client._call(update)
        return result

    async def read(self, doc: str) -> dict[str, Any]:
        """The current value of ``doc`` as plain data (``{}`` if unknown; sets as sorted
        lists, as the node's ``value_to_json`` writes them)."""
        result = await self._client._call({"op": "doc.read", "doc": doc})
        value: dict[str, Any] = result["value"]
        return value


def _element(op: SetAdd | SetRemove) -> int | str:
    if isinstance(op.element, bytes):
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "a set element over agent.sock: int or str")
    return op.element


_OP_JSON: dict[type[Op], Any] = {
    CounterAdd: lambda op: {"op": "counter.add", "amount": op.amount, "growOnly": op.grow_only},
    RegisterSet: lambda op: {"op": "register.set", "value": op.value, "timestamp": op.timestamp},
    SetAdd: lambda op: {"op": "set.add", "element": _element(op)},
    SetRemove: lambda op: {"op": "set.remove", "element": _element(op)},
    MapRemove: lambda op: {"op": "map.remove"},
}


def op_to_json(op: Op) -> dict[str, Any]:
    """The ``update`` object of ``doc.update`` for ``op`` (docs/protocol/agents.md).
    Raises LocalError(INVALID_ARGUMENT) for an operation it has no form for."""
    form = _OP_JSON.get(type(op))
    if form is None:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"no doc.update form for {type(op).__name__}")
    obj: dict[str, Any] = form(op)
    return {**obj, "path": list(op.path)}


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


#: An attached agent whose node closed the connection (a restart) attaches again every
#: REATTACH_DELAY seconds for up to REATTACH_WINDOW seconds (:func:`stay_attached`).
REATTACH_DELAY = 1.0
REATTACH_WINDOW = 300.0


async def _attached_until(
    agent: Agent,
    gone: anyio.Event,
    data_dir: Path | str | None,
    path: Path | str | None,
    hosted: Callable[[], None],
) -> bool:
    """Host ``agent`` on the node until ``gone`` is set (False) or the node closes the
    connection (True); ``hosted()`` once the node hosts it."""
    async with (
        AgentClient(agent, data_dir=data_dir, path=path) as client,
        anyio.create_task_group() as tasks,
    ):
        hosted()
        closed: list[bool] = []

        async def node_closed() -> None:
            await client.wait_closed()
            closed.append(True)
            tasks.cancel_scope.cancel()

        tasks.start_soon(node_closed)
        await gone.wait()
        tasks.cancel_scope.cancel()
    return bool(closed)


async def stay_attached(
    agent: Agent,
    gone: anyio.Event,
    *,
    data_dir: Path | str | None = None,
    path: Path | str | None = None,
    reattach_for: float = REATTACH_WINDOW,
    hosted: Callable[[], None] = lambda: None,
) -> None:
    """Host ``agent`` on the node of ``data_dir`` (or socket ``path``) until ``gone`` is
    set; detaching withdraws it. ``hosted()`` is called each time the node hosts it (its
    agents can reach it from then on). A node that closes the connection (it is
    restarting) is attached to again, every REATTACH_DELAY seconds, for up to
    ``reattach_for`` seconds. Raises what :class:`AgentClient` raises on the first
    attach, and LocalError(CHANNEL_CLOSED) when the node was not back in time."""
    if not await _attached_until(agent, gone, data_dir, path, hosted):
        return
    logger.warning("%s: the node closed the agent's connection; attaching again", agent.id)
    with anyio.move_on_after(reattach_for):
        while not gone.is_set():  # bounded by reattach_for
            await anyio.sleep(REATTACH_DELAY)
            try:
                closed = await _attached_until(agent, gone, data_dir, path, hosted)
            except (P2PError, OSError) as exc:  # the node is not back yet
                logger.debug("%s: attaching again: %s", agent.id, exc)
                continue
            if not closed:
                return
            logger.warning("%s: the node closed the agent's connection again", agent.id)
    if not gone.is_set():
        raise LocalError(
            ErrorCode.CHANNEL_CLOSED,
            f"the node closed the agent's connection and was not back within {reattach_for:g} s",
        )


async def cancel_on_signal(scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` at the first SIGINT or SIGTERM: how an agent process or a
    publisher stops (it detaches, and the node withdraws its agent)."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            scope.cancel()
            return


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

            tasks.start_soon(cancel_on_signal, tasks.cancel_scope)
            await client.wait_closed()
            tasks.cancel_scope.cancel()

    anyio.run(serve, backend=backend)


__all__ = [
    "REATTACH_DELAY",
    "REATTACH_WINDOW",
    "AgentClient",
    "SharedDocs",
    "TaskHandle",
    "Tasks",
    "Tools",
    "cancel_on_signal",
    "card_template",
    "op_to_json",
    "run_agent",
    "socket_path",
    "stay_attached",
]
