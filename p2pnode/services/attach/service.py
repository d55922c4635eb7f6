"""Agent processes attached to a running node over ``agent.sock``: a protocol service.

Theory of operation (docs/protocol/agents.md is the specification):

* :class:`AgentSocket` runs on the node's :class:`~p2pnode.node.service.ServiceHost`:
  it listens on an owner-only Unix socket and runs one connection per agent
  process. A connection is a thin trio driver of the sans-IO
  :class:`~p2pnode.services.attach.session.AgentSession`: a reader feeds it bytes and
  performs the events it returns, a writer writes what it has to send, and a
  timer lets it forget requests the process never answered.
* Attaching hosts a forwarder: an :class:`~p2pnode.agent.definition.Agent` whose dispatch
  checks a request as an in-process agent would (a capability it offers, the
  capability's input schema) and then queues the envelope for the process
  instead of running a handler. The node's agent task never waits for the
  process: a slow process fills its own bounded queue, and what does not fit
  is refused (a request is answered ``BUSY``). The process's ``reply`` leaves
  as the agent's ``response`` or ``error`` envelope.
* Withdrawal: when the process detaches, disconnects or dies (the kernel
  closes its socket, so the reader sees the end at once), the session
  closes, every request it had not answered gets ``AGENT_UNAVAILABLE`` from
  the agent, and the host removes the agent (what is still queued in the
  node is answered the same way, the card is unregistered and peers get a
  HELLO without it), all within :data:`WITHDRAW_TIMEOUT`.
* Failures: a line the process got wrong is the session's business (a typed
  error reply); an op that fails is answered with its error; anything else
  a connection raises is contained by the host's failure boundary and ends
  that connection only, never the node.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import trio

from p2pnode.agent.definition import Agent, Message
from p2pnode.agent.definition import Reply as AgentReply
from p2pnode.agent.surface import Listing
from p2pnode.agent.task import TERMINAL_STATES, Task
from p2pnode.agent.taskwork import TaskThread
from p2pnode.agent.tools import MCP_METHODS, Caller
from p2pnode.core.boundary import describe
from p2pnode.core.card import Origin
from p2pnode.core.envelope import (
    ROUTING_HINT_CAPABILITY,
    Envelope,
    MessageType,
    Metadata,
    wall_clock_ms,
)
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.core.identity import Identity
from p2pnode.crdt.clock import VectorClock
from p2pnode.crdt.ops import Op
from p2pnode.crdt.replica import Delta
from p2pnode.node.service import Progress, ProgressCallback, ServiceHost
from p2pnode.services.attach.session import (
    NEED_DATA,
    PAUSED,
    REFUSALS,
    AgentSession,
    Answer,
    Attach,
    AttachLimits,
    Closed,
    Delivery,
    Detach,
    DocOp,
    Event,
    FindOp,
    Request,
    Send,
    TaskOp,
    ToolOp,
)
from p2pnode.services.attach.wire import (
    AGENT_SOCKET_NAME,
    CardTemplate,
    caller_to_plain,
    error_line,
)
from p2pnode.services.shared.docops import check_doc_name, op_from_json, value_to_json
from p2pnode.transport.localsocket import listen_owner_only

logger = logging.getLogger("p2pnode.agents")

#: Seconds within which a departed process's agent is withdrawn (docs promise 5).
WITHDRAW_TIMEOUT = 4.0
#: Seconds the last lines (a detach's reply, a fatal error) may take to be written.
FLUSH_TIMEOUT = 1.0
READ_SIZE = 65536
#: Seconds between two progress events of one tools.call at least (the rest dropped).
PROGRESS_INTERVAL = 0.05
#: Characters of a process's refusal message kept in its security event.
MAX_DETAIL = 512


class Documents(Protocol):
    """The shared documents an attached agent may use (the node's SharedState)."""

    async def subscribe(self, agent_id: str, doc: str) -> None: ...

    async def update(self, agent_id: str, doc: str, op: Op) -> Delta: ...

    def read(self, doc: str) -> dict[str, Any]: ...

    def clock(self, doc: str) -> VectorClock: ...

    def peers(self, doc: str) -> tuple[str, ...]: ...


class ToolUse(Protocol):
    """The swarm's tools, resources and prompts as a local agent uses them (node.tools)."""

    async def list_tools(self, caller: str | None = None) -> Listing: ...

    async def list_resources(self, caller: str | None = None) -> Listing: ...

    async def list_prompts(self, caller: str | None = None) -> Listing: ...

    async def call_tool(
        self,
        name: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        caller: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (it travels to the owner)
        on_progress: ProgressCallback | None = None,
    ) -> Any: ...

    async def call_tool_result(
        self,
        name: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        caller: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (it travels to the owner)
        on_progress: ProgressCallback | None = None,
    ) -> Any: ...

    async def read_resource(
        self, uri: str, *, caller: str | None = None, agent: str | None = None
    ) -> dict[str, Any]: ...

    async def get_prompt(
        self, name: str, arguments: Mapping[str, str] | None = None, *, caller: str | None = None
    ) -> dict[str, Any]: ...


class ProposedTask(TaskThread, Protocol):
    """A task the agent proposed, as its proposer holds it (a TaskHandle): what it is
    now, and its outcome once it ended."""

    def outcome(self) -> Any: ...


class Proposer(Protocol):
    """Task negotiation as a local agent uses it (the node's TaskService)."""

    async def propose(
        self,
        sender: str,
        target: str | Iterable[str],
        task: Task,
        *,
        deadline: float | None = None,
        capability: bool = False,
        justification: str | None = None,
    ) -> ProposedTask: ...


class ForwardedAudit(Protocol):
    """Records a use of an attached agent's tool when the process answers it, and tells
    who sent a request as the node authenticated it."""

    def answered(self, request: Envelope, type: MessageType, payload: Any) -> None: ...

    def caller_of(self, agent_id: str) -> Caller | None: ...


class AgentSocket:
    """Serves ``agent.sock`` (see the module docstring). Run it with
    ``await node.start_service(AgentSocket(node, data_dir / AGENT_SOCKET_NAME))``.

    ``documents`` (the node's shared state) enables the ``doc.*`` ops, ``tools``
    (``node.tools``) the ``tools.*``, ``resources.*`` and ``prompts.*`` ops, ``tasks``
    (``node.tasks``) the ``tasks.*`` ops;
    ``audit`` (``node.tool_audit``) records the uses of attached agents' tools;
    ``endorser`` endorses attached agents' cards (a swarm with an authority,
    whose key the node's owner holds); ``limits`` bound each connection;
    at most ``max_connections`` processes are connected at once; one that has
    not attached within ``attach_timeout`` seconds is closed.
    """

    def __init__(
        self,
        host: ServiceHost,
        path: Path,
        *,
        documents: Documents | None = None,
        tools: ToolUse | None = None,
        tasks: Proposer | None = None,
        audit: ForwardedAudit | None = None,
        endorser: Identity | None = None,
        limits: AttachLimits | None = None,
        max_connections: int = 128,
        attach_timeout: float = 10.0,
    ) -> None:
        self.host = host
        self.path = path
        self.documents = documents
        self.tools = tools
        self.tasks = tasks
        self.audit = audit
        self.endorser = endorser
        self.limits = limits if limits is not None else AttachLimits()
        self.max_connections = max_connections
        self.attach_timeout = attach_timeout
        self._connections: set[_Connection] = set()

    def attached(self) -> list[str]:
        """The ids of the agents attached now."""
        return sorted(c.agent_id for c in self._connections if c.agent_id is not None)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled. Raises OSError when the socket cannot be created."""
        listener = listen_owner_only(self.path)
        try:
            async with trio.open_nursery() as nursery:
                serve = partial(trio.serve_listeners, handler_nursery=nursery)
                await nursery.start(serve, self._handle, [listener])
                task_status.started()
        finally:
            self.path.unlink(missing_ok=True)

    async def _handle(self, stream: trio.SocketStream) -> None:
        if len(self._connections) >= self.max_connections:
            busy = LocalError(ErrorCode.BUSY, f"{self.max_connections} agent processes attached")
            with trio.move_on_after(FLUSH_TIMEOUT):
                try:
                    await stream.send_all(error_line(None, busy, fatal=True))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
            await stream.aclose()
            return
        try:
            connection = _Connection(self, stream)
        except OSError as exc:  # out of descriptors for its second handle: this one ends
            logger.warning("agent connection refused: %s", exc)
            await stream.aclose()
            return
        self._connections.add(connection)
        try:
            await connection.serve()
        except Exception as exc:  # a defect ends this connection only, never the node
            self.host.boundary.contain(_source(connection), "agent connection", exc)
        finally:
            self._connections.discard(connection)


def _source(connection: _Connection) -> str:
    return f"agent process {connection.agent_id or '(not attached)'}"


async def _accept(message: Message) -> None:
    """The handler of the forwarder's request routes: only their checks matter."""


class _Forwarder(Agent):
    """The attached agent as the node hosts it: checks a request like an in-process agent
    (capability offered, input schema), then queues it for the process."""

    def __init__(self, template: CardTemplate, connection: _Connection) -> None:
        super().__init__(
            template.id,
            name=template.name,
            description=template.description,
            tier=template.tier,
            sandbox=template.sandbox_id,
            version=template.version,
            capabilities=template.capabilities,
        )
        for capability in template.capabilities:
            self.on_request(capability.id)(_accept)
        self.on_request()(_accept)  # a request addressed to the agent itself
        self._connection = connection
        self._template = template

    def card_offers(self) -> dict[str, tuple[str, ...]]:
        return self._template.offers()

    async def handle(self, envelope: Envelope, caller: Caller | None = None) -> AgentReply | None:
        meta = envelope.metadata
        if (
            meta is not None
            and meta.capability in MCP_METHODS
            and envelope.type is MessageType.REQUEST
            and any(self._template.offers().values())
        ):
            # The process's own catalog answers, with the caller the node authenticated.
            plain = caller_to_plain(caller) if caller is not None else None
            return self._connection.forward(envelope, plain)
        if envelope.type is MessageType.REQUEST:
            checked = await super().handle(envelope, caller)
            if checked is not None and checked.type is MessageType.ERROR:
                return checked
            # Every request goes with its sender as the node authenticated it, for the
            # process's own access rules (a published A2A server's, say).
            audit = self._connection.audit
            if caller is None and audit is not None:
                caller = audit.caller_of(envelope.sender)
            return self._connection.forward(
                envelope, caller_to_plain(caller) if caller is not None else None
            )
        return self._connection.forward(envelope)


class _Connection:
    """One agent process: drives its :class:`AgentSession`."""

    def __init__(self, service: AgentSocket, stream: trio.SocketStream) -> None:
        self._service = service
        self._host = service.host
        self.audit = service.audit  # who sent a forwarded request (None: nobody says)
        self._stream = stream
        self.session = AgentSession(service.limits)
        self.agent_id: str | None = None
        self._wake = trio.Event()  # set when the session has output for the writer
        self._drained = trio.Event()  # set (and replaced) each time the writer wrote
        self._closing = False  # the writer ends once it has written everything
        # Output is written at once, from whichever task produced it, while nothing is
        # waiting to be written: through a second handle on the socket, non-blocking, so
        # an envelope costs no switch to the writer task. What the kernel does not take
        # (its buffer is full) is left to the writer, which waits for room.
        self._direct = socket.socket(fileno=os.dup(stream.socket.fileno()))
        self._direct.setblocking(False)
        self._leftover = b""  # taken from the session, not yet written: the writer's
        self._writing = False  # the writer holds data it is writing
        self._writer_done = trio.Event()
        self._withdrawn = False
        self._nursery: trio.Nursery | None = None
        self._attach_scope = trio.CancelScope()
        self._perform: dict[type[Event], Callable[[Any], Awaitable[None]]] = {
            Attach: self._attach,
            Answer: self._answer,
            Send: self._start_op,
            Request: self._start_op,
            DocOp: self._start_op,
            ToolOp: self._start_op,
            FindOp: self._start_op,
            TaskOp: self._start_op,
        }
        self._ops: dict[type[Event], Callable[[Any], Awaitable[Any]]] = {
            Send: self._send,
            Request: self._request,
            DocOp: self._doc,
            ToolOp: self._tool,
            FindOp: self._find,
            TaskOp: self._task,
        }
        #: Running tools.call ops by their id, for a tools.cancel to find.
        self._tool_calls: dict[int | str, trio.CancelScope] = {}
        #: Tasks the agent proposed that have not ended, by id (their events are streamed).
        self._proposed: dict[str, ProposedTask] = {}

    # -- lifetime ---------------------------------------------------------------------------

    async def serve(self) -> None:
        # Bound before the nursery: the writer cancels the reader when the process is gone
        # (it left while replies were unwritten), and then the read returns nothing.
        detach: Detach | None = None
        try:
            async with trio.open_nursery() as outer:
                outer.start_soon(self._write_loop)
                async with trio.open_nursery() as inner:
                    self._nursery = inner
                    inner.start_soon(self._timer_loop)
                    detach = await self._read_until_closed()
                    inner.cancel_scope.cancel()  # running ops and the timer end with it
                await self._withdraw()
                if detach is not None:  # answered once the agent is withdrawn
                    self.session.op_succeeded(detach.ref, {"agent": self.agent_id})
                # The writer writes what is left (a detach's answer, a fatal error), then ends.
                self._closing = True
                self._wake.set()
                with trio.move_on_after(FLUSH_TIMEOUT):
                    await self._writer_done.wait()
                outer.cancel_scope.cancel()
        finally:
            await self._withdraw()  # when cancelled or failed before the step above
            self._direct.close()
            with trio.CancelScope(shield=True):
                await self._stream.aclose()

    async def _read_until_closed(self) -> Detach | None:
        with trio.CancelScope(deadline=trio.current_time() + self._service.attach_timeout) as scope:
            self._attach_scope = scope
            return await self._read_loop()
        self.session.abort(
            LocalError(ErrorCode.TIMEOUT, f"no attach within {self._service.attach_timeout:g} s")
        )
        return None

    async def _read_loop(self) -> Detach | None:
        session = self.session
        while True:  # one event per turn; each turn consumes a line or waits on the process
            event = session.next_event()
            self._kick()  # error replies to bad lines
            if event is NEED_DATA:
                try:
                    data = await self._stream.receive_some(READ_SIZE)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""  # reset by the process: the same as its end
                session.receive_data(data)
            elif event is PAUSED:
                await self._drained.wait()  # replies back up: read on once some are written
            elif isinstance(event, Closed):
                return None
            elif isinstance(event, Detach):
                return event
            else:
                await self._perform[type(event)](event)
                self._kick()

    async def _withdraw(self) -> None:
        """Answer what the process will not, then remove its agent (once; bounded)."""
        agent_id = self.agent_id
        if agent_id is None or self._withdrawn:
            return
        self._withdrawn = True
        self.session.close()
        pending = self.session.take_pending()
        # Shielded: a node that closes, or a connection cancelled, still withdraws.
        with trio.CancelScope(shield=True), trio.move_on_after(WITHDRAW_TIMEOUT):
            try:
                for request in pending:
                    await self._refuse(request, ErrorCode.AGENT_UNAVAILABLE, "its process left")
                await self._cancel_proposed()
                await self._host.remove_agent(agent_id)
            except P2PError as exc:
                logger.info("withdrawing %s: %s", agent_id, exc)
            except Exception as exc:  # a defect must not keep the node from closing
                self._host.boundary.contain(_source(self), "agent withdrawal", exc)
        logger.info("agent %s withdrawn (%s)", agent_id, self.session.close_reason)

    # -- writing and timers -----------------------------------------------------------------

    def _kick(self) -> None:
        """Write what the session has to send: at once when the writer is idle and the
        kernel takes it all, else through the writer."""
        session = self.session
        if not session.has_output():
            return
        if self._writing or self._leftover or self._closing:
            self._wake.set()
            return
        data = session.data_to_send()
        try:
            sent = self._direct.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            sent = 0  # the writer meets the same error through trio and ends the session
        if sent == len(data):
            session.send_done()
        else:
            self._leftover = data[sent:]
            self._wake.set()

    async def _write_loop(self) -> None:
        session = self.session
        try:
            while True:  # until the session is over and written, or the process is gone
                await self._wake.wait()
                self._wake = trio.Event()
                data = self._leftover + session.data_to_send()
                self._leftover = b""
                if data:
                    self._writing = True
                    try:
                        await self._stream.send_all(data)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        # The process is gone (it left without reading what it asked
                        # for): so is the session. A normal end, not a defect.
                        logger.info(
                            "agent connection of %s closed: the process left with %d bytes"
                            " unwritten",
                            self.agent_id or "(not attached)",
                            len(data),
                        )
                        session.close()
                        if self._nursery is not None:
                            self._nursery.cancel_scope.cancel()  # the reader may be waiting
                        return
                    finally:
                        self._writing = False
                    session.send_done()
                self._drained.set()
                self._drained = trio.Event()
                if self._closing and not session.has_output():
                    return
        finally:
            self._writer_done.set()

    async def _timer_loop(self) -> None:
        # Expiry needs no precision: a quarter of the timeout late at most, and no wake-up
        # to reschedule when a request arrives.
        interval = self.session.limits.request_timeout / 4
        while True:  # until the connection's nursery is cancelled
            now = trio.current_time()
            await trio.sleep_until(min(self.session.next_deadline(), now + interval))
            self.session.handle_timer(trio.current_time())

    # -- envelopes to the process (called by the node's agent task) -------------------------

    def forward(
        self, envelope: Envelope, caller: dict[str, Any] | None = None
    ) -> AgentReply | None:
        """Queue ``envelope`` (with a request's authenticated ``caller``) for the process; a
        refused request's error reply."""
        outcome = self.session.deliver(envelope, trio.current_time(), caller)
        if outcome is Delivery.QUEUED:
            self._kick()
            return None
        if envelope.type is not MessageType.REQUEST:
            logger.debug("%s: %s envelope dropped (%s)", self.agent_id, envelope.type, outcome)
            return None
        code, message = REFUSALS[outcome]
        error = RemoteError(code, f"{message}: {self.agent_id}", agent_id=self.agent_id)
        return AgentReply(MessageType.ERROR, error.to_dict())

    # -- events the reader performs ---------------------------------------------------------

    async def _attach(self, event: Attach) -> None:
        self._attach_scope.deadline = math.inf  # attached or refused, the timer has done
        template = event.card
        known = self._host.registry.find(template.id)
        if known is not None and known.origin is Origin.LOCAL:
            taken = LocalError(
                ErrorCode.INVALID_CARD, f"agent {template.id!r} is already hosted by this node"
            )
            self.session.attach_failed(taken)
            return
        try:
            forwarder = _Forwarder(template, self)
            card = await self._host.add_agent(forwarder, authority=self._service.endorser)
        except P2PError as exc:
            self.session.attach_failed(exc)
            return
        self.agent_id = card.id
        result = {"agent": card.id, "peerId": str(card.peer_id), "card": card.to_dict()}
        self.session.attach_succeeded(card.id, result)
        logger.info("agent %s attached", card.id)

    async def _answer(self, event: Answer) -> None:
        request = event.request
        try:
            reply = self._reply_envelope(request, event.type, event.payload)
            await self._host.send(reply)
            audit = self._service.audit
            if audit is not None:
                audit.answered(request, event.type, event.payload)
            if event.type is MessageType.ERROR:
                self._refused_access(request, event.payload)
        except P2PError as exc:
            self.session.op_failed(event.ref, exc, to=request.id)

    def _refused_access(self, request: Envelope, payload: Any) -> None:
        """A security event when the process refused a request by its own access rule
        (``PERMISSION_DENIED``), as the audit records a refused tool use (which it does
        itself for the MCP methods)."""
        meta = request.metadata
        if meta is not None and meta.capability in MCP_METHODS:
            return
        body = payload if isinstance(payload, dict) else {}
        if body.get("code") != ErrorCode.PERMISSION_DENIED:
            return
        card = self._host.registry.find(request.sender)
        peer = str(card.peer_id) if card is not None else None
        why = str(body.get("message", ""))[:MAX_DETAIL]
        self._host.events.security(ErrorCode.PERMISSION_DENIED, why, peer, request)

    def _reply_envelope(self, request: Envelope, type_: MessageType, payload: Any) -> Envelope:
        assert self.agent_id is not None, "only an attached session answers requests"
        thread = request.correlation_id or request.id
        return self._host.envelope(
            self.agent_id, request.sender, type_, payload, correlation_id=thread
        )

    async def _refuse(self, request: Envelope, code: ErrorCode, why: str) -> None:
        error = RemoteError(code, f"agent {self.agent_id!r} is unavailable: {why}")
        try:
            await self._host.send(self._reply_envelope(request, MessageType.ERROR, error.to_dict()))
        except P2PError as exc:
            logger.info("%s to %s not delivered: %s", code, request.sender, exc)

    async def _start_op(self, event: _Op) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._run_op, event)

    async def _run_op(self, event: _Op) -> None:
        """One op's failure boundary: whatever it raises becomes its error reply."""
        try:
            result = await self._ops[type(event)](event)
        except P2PError as exc:
            self.session.op_failed(event.ref, exc)
        except Exception as exc:
            self._host.boundary.contain(_source(self), f"{event.ref.op} op", exc)
            failed = LocalError(ErrorCode.INPUT_FAILED, f"the op failed: {describe(exc)}")
            self.session.op_failed(event.ref, failed)
        else:
            self.session.op_succeeded(event.ref, result)
        self._kick()

    # -- ops ----------------------------------------------------------------------------------

    @property
    def _agent(self) -> str:
        assert self.agent_id is not None, "ops run only in an attached session"
        return self.agent_id

    async def _send(self, event: Send) -> Any:
        meta = Metadata(routing_hint=ROUTING_HINT_CAPABILITY) if event.capability else None
        envelope = self._host.envelope(
            self._agent,
            event.to,
            event.type,
            event.payload,
            correlation_id=event.correlation_id,
            metadata=meta,
        )
        result = await self._host.send(envelope)
        return {"envelope": result.envelope_id, "path": result.path, "targets": [*result.targets]}

    async def _request(self, event: Request) -> Any:
        with trio.move_on_after(event.timeout if event.timeout is not None else math.inf):
            reply = await self._host.request(
                self._agent, event.to, event.payload, capability=event.capability
            )
            return reply.to_dict()
        raise LocalError(ErrorCode.TIMEOUT, f"no response from {event.to} in {event.timeout:g} s")

    async def _doc(self, event: DocOp) -> Any:
        documents = self._service.documents
        if documents is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "this node runs no shared state")
        doc = check_doc_name(event.doc)
        if event.ref.op == "doc.subscribe":
            await documents.subscribe(self._agent, doc)
            return {"doc": doc, "agent": self._agent}
        if event.ref.op == "doc.update":
            op = op_from_json(event.update, now_ms=wall_clock_ms())
            delta = await documents.update(self._agent, doc, op)
            return {"doc": doc, "origin": delta.origin, "seq": delta.seq, "durable": True}
        return {
            "doc": doc,
            "value": value_to_json(documents.read(doc)),
            "clock": documents.clock(doc).to_wire(),
            "peers": list(documents.peers(doc)),
        }

    async def _tool(self, event: ToolOp) -> Any:
        tools = self._service.tools
        if tools is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "this node offers no tool ops")
        op, params, caller = event.ref.op, event.params, self._agent
        if op == "tools.call":
            return {"result": await self._call_tool(tools, event)}
        if op == "tools.cancel":  # the process gave up that call: cancel it (node.md "Cancel")
            scope = self._tool_calls.get(params["callId"])
            if scope is not None:
                scope.cancel()
            return {"cancelled": scope is not None}
        if op == "resources.read":
            owner = params.get("agent")
            return await tools.read_resource(params["uri"], caller=caller, agent=owner)
        if op == "prompts.get":
            return await tools.get_prompt(params["name"], params["arguments"], caller=caller)
        listing = {
            "tools.list": tools.list_tools,
            "resources.list": tools.list_resources,
            "prompts.list": tools.list_prompts,
        }[op or ""]
        return (await listing(caller)).to_dict()

    async def _call_tool(self, tools: ToolUse, event: ToolOp) -> Any:
        """A ``tools.call``, cancelled by a ``tools.cancel`` naming its id."""
        params, key = event.params, event.ref.id
        call = tools.call_tool_result if params["content"] else tools.call_tool
        on_progress = self._progress_events(key) if params["progress"] else None
        with trio.CancelScope() as scope:
            if key is not None and key not in self._tool_calls:
                self._tool_calls[key] = scope
            try:
                return await call(
                    params["name"], params["arguments"], caller=self._agent,
                    timeout=params.get("timeout"), on_progress=on_progress,
                )  # fmt: skip
            finally:
                if key is not None and self._tool_calls.get(key) is scope:
                    del self._tool_calls[key]
        raise LocalError(ErrorCode.TIMEOUT, f"tools.call {key!r} was cancelled by its caller")

    def _progress_events(self, key: int | str | None) -> ProgressCallback:
        """A callback writing each progress of call ``key`` to the process as a
        ``progress`` event line; at most one per :data:`PROGRESS_INTERVAL` seconds (the
        others are dropped: each supersedes the one before), so no owner can flood the
        connection."""
        last = -math.inf

        def forward(update: Progress) -> None:
            nonlocal last
            now = trio.current_time()
            if now - last < PROGRESS_INTERVAL:
                return
            last = now
            self.session.notify({"event": "progress", "id": key, **update.to_payload()})
            self._kick()

        return forward

    async def _find(self, event: FindOp) -> Any:
        cards = await self._host.find(event.capability)
        viewer = self._host.local_agent(self._agent)
        visible = self._host.policy.filter_discoverable(viewer, cards)
        return {"cards": [card.to_dict() for card in visible]}

    async def _task(self, event: TaskOp) -> Any:
        tasks = self._service.tasks
        if tasks is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "this node offers no task ops")
        params = event.params
        if event.ref.op == "tasks.cancel":
            handle = self._proposed.get(params["taskId"])
            if handle is None:
                raise LocalError(
                    ErrorCode.INVALID_ARGUMENT, f"no open task {params['taskId']!r} of this agent"
                )
            await handle.cancel(params["reason"])
            return {"taskId": handle.task_id, "state": str(handle.state)}
        handle = await tasks.propose(
            self._agent,
            params["to"],
            params["task"],
            deadline=params["deadline"],
            capability=params["capability"],
            justification=params["justification"],
        )
        self._proposed[handle.task_id] = handle
        assert self._nursery is not None
        self._nursery.start_soon(self._watch_task, handle)  # its events follow this reply
        return {"taskId": handle.task_id, "assignee": handle.assignee, "state": str(handle.state)}

    async def _watch_task(self, handle: ProposedTask) -> None:
        """Stream ``task`` events of ``handle`` to the process until it ends."""
        try:
            async for _ in handle.updates():
                self.session.notify(task_event(handle))
                self._kick()
        finally:
            self._proposed.pop(handle.task_id, None)

    async def _cancel_proposed(self) -> None:
        """The agent is withdrawn: tasks it proposed that still run are cancelled."""
        for handle in list(self._proposed.values()):
            try:
                await handle.cancel("the proposer's process left")
            except P2PError as exc:
                logger.debug("cancel of %s: %s", handle.task_id, exc)
        self._proposed.clear()


_Op = Send | Request | DocOp | ToolOp | FindOp | TaskOp


def task_event(handle: ProposedTask) -> dict[str, Any]:
    """The ``task`` event of ``handle`` now (docs/protocol/agents.md): its state and, once
    it ended, its ``result`` or ``error``."""
    event: dict[str, Any] = {
        "event": "task",
        "taskId": handle.task_id,
        "state": str(handle.state),
        "assignee": handle.assignee,
        "progress": handle.progress,
        "message": handle.message,
    }
    if handle.state in TERMINAL_STATES:
        try:
            event["result"] = handle.outcome()
        except P2PError as exc:
            event["error"] = exc.to_dict()
            if isinstance(exc, RemoteError):
                event["error"]["remote"] = True
    return event


__all__ = [
    "AGENT_SOCKET_NAME",
    "FLUSH_TIMEOUT",
    "WITHDRAW_TIMEOUT",
    "AgentSocket",
    "Documents",
    "ProposedTask",
    "Proposer",
    "ToolUse",
    "task_event",
]
