"""Run a full node in an asyncio program: trio's guest mode on the running asyncio loop.

``aio.open_node(identity, network, config)`` is the asyncio twin of
:func:`p2pnode.open_node`; the node itself is the trio node,
unchanged, and :class:`AioNode` is an awaitable proxy of it::

    async with aio.open_node(Identity.generate(), TrioNetwork(), NodeConfig()) as node:
        await node.add_agent(agent)
        reply = await node.request("planner", "plan.strategy", {"goal": 1}, capability=True)

Theory of operation:

* **One guest run per loop.** The first node opened on a loop starts a trio
  run in guest mode (``trio.lowlevel.start_guest_run``): trio's scheduler runs
  as callbacks of the asyncio loop, on its thread, and trio waits for I/O in
  a thread of its own that hands the events back through
  ``loop.call_soon_threadsafe`` (trio's design; we start no thread). trio
  allows one run per thread, so every node opened on the loop runs in that
  one guest run, each as a task owning its node; the run ends when the last
  node closes. Two nodes in one asyncio program therefore just work.
* **asyncio -> trio.** A coroutine method of :class:`AioNode` puts a call on
  a trio memory channel (``send_nowait``: waking a trio task from the host
  thread is what trio's guest mode supports) and awaits an asyncio future.
  A dispatcher task starts the call as a task in the node's own nursery;
  the call's result or exception is set on the future from inside the trio
  tick, which runs on the loop's thread, so no thread-safe hand-off is
  needed. Exceptions arrive unchanged (the typed
  :class:`~p2pnode.core.errors.P2PError` subclasses included).
* **Cancellation.** Cancelling the asyncio caller cancels the trio call's
  cancel scope, and the caller's ``CancelledError`` surfaces once the trio
  call has ended (at most ``CANCEL_GRACE`` seconds later), so nothing the
  call holds (a pending request, a send in flight) outlives it.
* **Handlers run in asyncio.** Every handler of an agent added through
  :meth:`AioNode.add_agent` (sync or async) runs in the asyncio loop: the
  node's agent task in trio hands the envelope to an asyncio task that runs
  the definition's dispatch (:meth:`p2pnode.agent.definition.Agent.handle`, so input
  validation and typed errors are the same as in trio) and awaits its
  reply. The task starts eagerly, as Python 3.12's eager tasks do: its first
  step runs at once, in the trio tick that delivered the envelope, so a
  handler that answers without waiting is answered in that tick; one that
  waits goes on as its task from the loop. So a handler may await anything
  asyncio (``asyncio.sleep``, an asyncio HTTP client, an MCP session);
  ``asyncio.current_task()`` is its task, and it sees the context variables
  of the code that opened the node. It must not call trio. As in trio, the
  agent's notifications are handled one at a time in arrival order and its
  requests concurrently: a request whose handler waits becomes a call of its
  own, and at its deadline its asyncio task is cancelled
  (p2pnode.node.agents).
  If the node closes while a handler runs, its asyncio task is cancelled.
* **Few loop passes.** trio's ticks run several in one loop callback while
  only trio has work, and the loop gets its turn as soon as trio hands it a
  result or a waiting handler (:mod:`p2pnode.hosting.aiohandoff`): a request to an
  agent of the same node costs one pass of the loop, not one per trio task
  it crosses.
* **Closing.** Leaving ``async with`` cancels the node's calls, closes the
  node (and its DHT), and waits for it, and for the guest run when it was
  the loop's last node; each wait is bounded (``CLOSE_TIMEOUT``) and goes on
  through a cancellation of the closing task, which is re-raised after.
  If the node fails while the body runs, the body's task is cancelled (as an
  ``asyncio.TaskGroup`` does) and the node's exception is raised on exit.

Plain data is read directly (``peer_id``, ``listen_address``, ``status()``,
``envelope()``): between trio ticks nothing in the node moves. Use
:meth:`AioNode.run_trio` to run any other trio function of the node.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from p2pnode import RoutingResult
from p2pnode.agent.definition import Agent, agent_for_handler, as_agent
from p2pnode.agent.surface import Listing
from p2pnode.agent.task import Task, TaskState
from p2pnode.core.card import AgentCard, Capability
from p2pnode.core.envelope import Envelope, MessageType, Metadata
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.identity import Identity, PeerId
from p2pnode.core.registry import Registry
from p2pnode.core.threadstore import ThreadStore
from p2pnode.crdt.clock import VectorClock
from p2pnode.crdt.ops import Op
from p2pnode.crdt.replica import Delta
from p2pnode.hosting.aioguest import _GUESTS as _GUESTS  # the loop's guest runs, for inspection
from p2pnode.hosting.aioguest import (
    CANCEL_GRACE,
    CLOSE_TIMEOUT,
    Call,
    Guest,
    InAsyncio,
    Pool,
    reject,
    resolve,
    settle,
)
from p2pnode.runtime import NodeConfig, SharedConfig, SharedState, Watch
from p2pnode.transport.net import Address, Network

if TYPE_CHECKING:
    from p2pnode import Node
    from p2pnode.runtime import TaskHandle

logger = logging.getLogger("p2pnode.hosting.aio")

#: An agent given as a plain envelope handler (the trio node's ``add_agent`` takes one).
Handler = Callable[[Envelope], Awaitable[Any]]

T = TypeVar("T")


# -- one node in the guest run -------------------------------------------------------------------


class _NodeState(enum.Enum):
    STARTING = "starting"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class _HostedNode:
    """A node running as a task of the guest run, and what its asyncio side waits on."""

    def __init__(
        self, guest: Guest, identity: Identity, network: Network, config: NodeConfig
    ) -> None:
        self.guest = guest
        self.identity = identity
        self.network = network
        self.config = config
        self.state = _NodeState.STARTING
        self.node: Node | None = None
        self.pool = Pool(guest.loop, guest.linger)
        self.error: Exception | None = None
        self.started: asyncio.Future[None] = guest.loop.create_future()
        self.ended: asyncio.Future[None] = guest.loop.create_future()
        self.body: asyncio.Task[Any] | None = None  # the task in `async with`, while it runs
        self.cancelled_body = False
        self._serving: Call[None] | None = None
        self._stop = trio.Event()

    async def serve(self) -> None:
        """The node's task in the guest run (trio side)."""
        import p2pnode  # the composed node, loaded with the node (not with this module)

        try:
            async with (
                p2pnode.open_node(self.identity, self.network, self.config) as node,
                trio.open_nursery() as calls,
            ):
                self.node = node
                self.pool.start(calls)
                self.state = _NodeState.OPEN
                resolve(self.started, None)
                await self._stop.wait()
                self.pool.close()
                calls.cancel_scope.cancel()
        except Exception as exc:
            self._failed(exc)
        finally:
            self.state = _NodeState.CLOSED
            self.pool.close()
            reject(self.started, self.error or LocalError(ErrorCode.INTERNAL, "node ended"))
            resolve(self.ended, None)

    def _failed(self, exc: Exception) -> None:
        self.error = exc
        if self.state is _NodeState.OPEN and self.body is not None and not self.body.done():
            # As an asyncio.TaskGroup does: the body learns at once that the node is gone.
            self.body.cancel()
            self.cancelled_body = True

    async def start(self) -> None:
        """Start the node's task and wait until the node is open (asyncio side)."""
        # The call settles when the node ends; `started` says when it is open.
        self._serving = self.guest.pool.submit(self.serve)
        try:
            ready = await settle(self.started, CLOSE_TIMEOUT)
        except asyncio.CancelledError:
            await self.close()
            raise
        if not ready:
            await self.close()
            raise LocalError(ErrorCode.TIMEOUT, "the node did not start")
        self.started.result()  # raises what failed the start

    async def close(self) -> None:
        """Close the node and wait until it closed (asyncio side)."""
        if self.state in (_NodeState.STARTING, _NodeState.OPEN):
            self.state = _NodeState.CLOSING
        self._stop.set()  # a host-thread set wakes the guest run
        if not await settle(self.ended, CLOSE_TIMEOUT):
            raise LocalError(ErrorCode.TIMEOUT, "the node did not close")
        serving = self._serving.future if self._serving is not None else None
        if serving is not None and serving.done() and not serving.cancelled():
            serving.exception()  # seen: serve() reports through `error`, not this future

    def running(self) -> Node:
        """The open node. Raises LocalError(INVALID_ARGUMENT) when it is not open."""
        if self.state is not _NodeState.OPEN or self.node is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "the node is not open")
        return self.node

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> Awaitable[T]:
        """``await fn(*args)`` run in trio (see :meth:`Pool.call`). Raises
        LocalError(INVALID_ARGUMENT) at once when the node is not open."""
        self.running()
        return self.pool.call(fn, *args)


class _OpenNode:
    """What :func:`open_node` returns: ``async with`` it."""

    def __init__(self, identity: Identity, network: Network, config: NodeConfig) -> None:
        self._args = (identity, network, config)
        self._hosted: _HostedNode | None = None

    async def __aenter__(self) -> AioNode:
        if self._hosted is not None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "open_node() is entered once")
        loop = asyncio.get_running_loop()
        guest = await Guest.acquire(loop)
        hosted = self._hosted = _HostedNode(guest, *self._args)
        try:
            await hosted.start()
        except BaseException:
            await guest.release()
            raise
        hosted.body = asyncio.current_task()
        return AioNode(hosted, contextvars.copy_context())

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        hosted = self._hosted
        assert hosted is not None
        hosted.body = None
        try:
            await hosted.close()
        finally:
            await hosted.guest.release()
        if hosted.cancelled_body:
            task = asyncio.current_task()
            ours = task is not None and task.uncancel() == 0
            if ours and isinstance(exc, asyncio.CancelledError):
                exc = None  # the cancellation was ours: the node's failure replaces it
        if hosted.error is None:
            return None
        if exc is None:
            raise hosted.error
        # The body's own exception goes on (as TaskOwner hands it on); the node's is logged.
        logger.error("the node failed while the body raised", exc_info=hosted.error)
        return None


def open_node(
    identity: Identity, network: Network, config: NodeConfig
) -> AbstractAsyncContextManager[AioNode]:
    """A running node with its DHT, for an asyncio program: ``async with open_node(...) as
    node`` (see the module docstring); everything is closed on exit.

    Raises what :func:`p2pnode.open_node` raises (LocalError, OSError), and
    LocalError: INVALID_ARGUMENT when a trio run is already active in this thread,
    TIMEOUT when the node does not start or close within ``CLOSE_TIMEOUT``.
    """
    return _OpenNode(identity, network, config)


# -- the proxies -------------------------------------------------------------------------------

_END = object()


class AioNode:
    """An awaitable proxy of a running :class:`~p2pnode.node.node.Node` (from
    :func:`open_node`). Coroutine methods run the node's method in trio and raise what it
    raises; they raise LocalError(INVALID_ARGUMENT) once the node is closed."""

    def __init__(self, hosted: _HostedNode, context: contextvars.Context) -> None:
        self._hosted = hosted
        self._context = context  # what agents' handlers see (the opener's context)

    @property
    def node(self) -> Node:
        """The trio node: for trio code run with :meth:`run_trio` only."""
        return self._hosted.running()

    async def run_trio(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` in the node's trio world (a task of the node, cancelled
        when it closes) and return what it returns."""
        return await self._hosted.call(fn, *args)

    # -- plain data -------------------------------------------------------------------------

    @property
    def peer_id(self) -> PeerId:
        return self.node.peer_id

    @property
    def listen_address(self) -> Address:
        return self.node.listen_address

    @property
    def registry(self) -> Registry:
        return self.node.registry

    @property
    def threads(self) -> ThreadStore:
        return self.node.threads

    @property
    def config(self) -> NodeConfig:
        return self._hosted.config

    def advertised_addresses(self) -> list[str]:
        return self.node.advertised_addresses()

    def status(self) -> dict[str, Any]:
        """A snapshot for ``p2pnode status``."""
        return self.node.status()

    def local_agent(self, agent_id: str) -> AgentCard:
        return self.node.local_agent(agent_id)

    def default_agent(self) -> str:
        return self.node.default_agent()

    def envelope(
        self,
        sender: str,
        recipient: str,
        type: MessageType,
        payload: Any = None,
        *,
        correlation_id: str | None = None,
        metadata: Metadata | None = None,
    ) -> Envelope:
        """A new envelope from a local agent (see :meth:`Node.envelope`)."""
        return self.node.envelope(
            sender, recipient, type, payload, correlation_id=correlation_id, metadata=metadata
        )

    # -- agents -----------------------------------------------------------------------------

    def _in_asyncio(self, agent: Agent) -> Agent:
        if isinstance(agent, InAsyncio):
            agent = agent.definition
        return InAsyncio(agent, self._hosted.guest, self._context)

    async def add_agent(
        self,
        agent: Agent | str,
        handler: Handler | None = None,
        *,
        name: str | None = None,
        tier: int = 3,
        capabilities: tuple[Capability, ...] = (),
        sandbox_id: str | None = None,
        description: str = "",
        version: str = "1.0.0",
        authority: Identity | None = None,
    ) -> AgentCard:
        """Host an agent whose handlers run in the asyncio loop; return its signed card
        (see :meth:`Node.add_agent` for the arguments and what it raises)."""
        agent = as_agent(
            agent,
            handler,
            name=name,
            tier=tier,
            capabilities=capabilities,
            sandbox=sandbox_id,
            description=description,
            version=version,
        )
        definition = self._in_asyncio(agent)
        return await self._hosted.call(self._add_agent, definition, authority)

    async def _add_agent(self, agent: Agent, authority: Identity | None) -> AgentCard:
        return await self.node.add_agent(agent, authority=authority)

    async def add_agent_card(
        self, card: AgentCard, agent: Agent | Handler, *, authority: Identity | None = None
    ) -> AgentCard:
        """Host an agent with a given card (see :meth:`Node.add_agent_card`); its handlers
        run in the asyncio loop."""
        if not isinstance(agent, Agent):
            agent = agent_for_handler(card.id, agent)
        return await self._hosted.call(self._add_card, card, self._in_asyncio(agent), authority)

    async def _add_card(
        self, card: AgentCard, agent: Agent, authority: Identity | None
    ) -> AgentCard:
        return await self.node.add_agent_card(card, agent, authority=authority)

    async def add_capability(self, agent_id: str, capability: Capability) -> AgentCard:
        return await self._hosted.call(self.node.add_capability, agent_id, capability)

    # -- messages ---------------------------------------------------------------------------

    async def send(self, envelope: Envelope) -> RoutingResult:
        """Route one envelope from a local agent (see :meth:`Node.send`)."""
        return await self._hosted.call(self.node.send, envelope)

    async def send_many(self, envelopes: Iterable[Envelope]) -> list[RoutingResult]:
        """Route envelopes in order (see :meth:`Node.send_many`)."""
        return await self._hosted.call(self.node.send_many, list(envelopes))

    async def request(
        self, sender: str, recipient: str, payload: Any = None, *, capability: bool = False
    ) -> Envelope:
        """Send a request and wait for its response (see :meth:`Node.request`)."""
        return await self._hosted.call(self._request, sender, recipient, payload, capability)

    async def _request(
        self, sender: str, recipient: str, payload: Any, capability: bool
    ) -> Envelope:
        return await self.node.request(sender, recipient, payload, capability=capability)

    # -- the swarm --------------------------------------------------------------------------

    async def connect(self, address: Address) -> PeerId:
        """Open a channel to the node at ``address`` (see :meth:`Node.connect`)."""
        return await self._hosted.call(self.node.connect, address)

    async def join(self) -> int:
        """Join the swarm through the bootstrap peers (see :meth:`Node.join`)."""
        return await self._hosted.call(self.node.join)

    async def find(self, capability: str, viewer: str | None = None) -> list[AgentCard]:
        """Agents offering ``capability`` that local agent ``viewer`` may discover (see
        :meth:`Node.find`)."""
        return await self._hosted.call(self.node.find, capability, viewer)

    @property
    def tools(self) -> AioTools:
        """The swarm's tools, resources and prompts, used as a local agent (``node.tools``)."""
        return AioTools(self._hosted)

    @property
    def tasks(self) -> AioTasks:
        """Task negotiation between agents (``node.tasks``)."""
        return AioTasks(self._hosted)

    @property
    def shared(self) -> AioShared:
        """The shared-state service started by :meth:`open_shared` (``node.shared``).
        Raises LocalError(INVALID_ARGUMENT) before it is open."""
        return AioShared(self._hosted, self.node.shared)

    async def open_shared(self, config: SharedConfig | None = None) -> AioShared:
        """Start the node's shared-state service (see :meth:`Node.open_shared`)."""
        shared = await self._hosted.call(self.node.open_shared, config)
        return AioShared(self._hosted, shared)


class AioTools:
    """An awaitable proxy of ``node.tools`` (a
    :class:`~p2pnode.services.tools.client.ToolClient`): the same methods, arguments,
    results and errors."""

    def __init__(self, hosted: _HostedNode) -> None:
        self._hosted = hosted

    async def list_tools(self, caller: str | None = None) -> Listing:
        return await self._hosted.call(self._hosted.running().tools.list_tools, caller)

    async def list_resources(self, caller: str | None = None) -> Listing:
        return await self._hosted.call(self._hosted.running().tools.list_resources, caller)

    async def list_prompts(self, caller: str | None = None) -> Listing:
        return await self._hosted.call(self._hosted.running().tools.list_prompts, caller)

    async def call_tool(
        self, name: str, arguments: Mapping[str, Any] | None = None, *, caller: str | None = None
    ) -> Any:
        tools = self._hosted.running().tools

        async def call() -> Any:
            return await tools.call_tool(name, arguments, caller=caller)

        return await self._hosted.call(call)

    async def call_tool_result(
        self,
        name: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        caller: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (it travels to the owner)
    ) -> Any:
        """The owner's whole ``tools/call`` answer (tools.md §3), ``content`` included."""
        tools = self._hosted.running().tools

        async def call() -> Any:
            return await tools.call_tool_result(name, arguments, caller=caller, timeout=timeout)

        return await self._hosted.call(call)

    async def read_resource(
        self, uri: str, *, caller: str | None = None, agent: str | None = None
    ) -> dict[str, Any]:
        tools = self._hosted.running().tools

        async def read() -> dict[str, Any]:
            return await tools.read_resource(uri, caller=caller, agent=agent)

        return await self._hosted.call(read)

    async def get_prompt(
        self, name: str, arguments: Mapping[str, str] | None = None, *, caller: str | None = None
    ) -> dict[str, Any]:
        tools = self._hosted.running().tools

        async def get() -> dict[str, Any]:
            return await tools.get_prompt(name, arguments, caller=caller)

        return await self._hosted.call(get)


class AioTasks:
    """An awaitable proxy of ``node.tasks`` (the task service): :meth:`propose`."""

    def __init__(self, hosted: _HostedNode) -> None:
        self._hosted = hosted

    async def propose(
        self, sender: str, target: str | Iterable[str], task: Task, **options: Any
    ) -> AioTaskHandle:
        """Propose ``task`` from local agent ``sender`` and return it once awarded (see
        ``TaskService.propose`` for ``options`` and what it raises)."""
        service = self._hosted.running().tasks
        targets = target if isinstance(target, str) else tuple(target)

        async def propose() -> TaskHandle:
            return await service.propose(sender, targets, task, **options)

        return AioTaskHandle(self._hosted, await self._hosted.call(propose))


class AioTaskHandle:
    """The asyncio side of a proposed task's handle: its plain data read directly, its
    waits run in trio."""

    def __init__(self, hosted: _HostedNode, handle: TaskHandle) -> None:
        self._hosted = hosted
        self._handle = handle

    @property
    def task_id(self) -> str:
        return self._handle.task_id

    @property
    def state(self) -> TaskState:
        return self._handle.state

    @property
    def assignee(self) -> str | None:
        return self._handle.assignee

    @property
    def progress(self) -> float | None:
        return self._handle.progress

    @property
    def message(self) -> str:
        return self._handle.message

    async def wait_changed(self) -> None:
        await self._hosted.call(self._handle.wait_changed)

    async def result(self) -> Any:
        """The result once the task completed (raises as the trio handle does)."""
        return await self._hosted.call(self._handle.result)

    def outcome(self) -> Any:
        return self._handle.outcome()

    async def updates(self) -> AsyncIterator[TaskState]:
        """The state after each change, until and including the end."""
        states = self._handle.updates()
        try:
            while True:  # ends with the task
                state = await self._hosted.call(_next_or_end, states)
                if state is _END:
                    return
                assert isinstance(state, TaskState)
                yield state
        finally:
            close = getattr(states, "aclose", None)  # an async generator's (the trio handle's)
            if close is not None and self._hosted.state is _NodeState.OPEN:
                await self._hosted.call(close)

    async def cancel(self, reason: str = "") -> None:
        await self._hosted.call(self._handle.cancel, reason)

    async def send_input(self, value: Any) -> None:
        await self._hosted.call(self._handle.send_input, value)


async def _next_or_end(iterator: AsyncIterator[Any]) -> object:
    # StopAsyncIteration must not cross into an asyncio future: a marker does.
    try:
        return await iterator.__anext__()
    except StopAsyncIteration:
        return _END


class AioShared:
    """An awaitable proxy of the node's :class:`~p2pnode.services.shared.service.SharedState`."""

    def __init__(self, hosted: _HostedNode, shared: SharedState) -> None:
        self._hosted = hosted
        self._shared = shared

    async def subscribe(self, agent_id: str, doc: str) -> None:
        """Make a local agent a member of ``doc`` (see :meth:`SharedState.subscribe`)."""
        await self._hosted.call(self._shared.subscribe, agent_id, doc)

    async def update(self, agent_id: str, doc: str, op: Op) -> Delta:
        """Apply ``op`` to ``doc``; returns once durable (see :meth:`SharedState.update`)."""
        return await self._hosted.call(self._shared.update, agent_id, doc, op)

    async def refresh(self, doc: str | None = None) -> None:
        await self._hosted.call(self._shared.refresh, doc)

    def read(self, doc: str) -> dict[str, Any]:
        """The current value of ``doc`` as plain data (``{}`` if unknown)."""
        return self._shared.read(doc)

    def clock(self, doc: str) -> VectorClock:
        return self._shared.clock(doc)

    def subscriptions(self) -> dict[str, list[str]]:
        return self._shared.subscriptions()

    def peers(self, doc: str) -> tuple[str, ...]:
        return self._shared.peers(doc)

    def watch(self, doc: str) -> AioWatch:
        """Change notifications for ``doc``: ``async for value in watch`` (see
        :class:`~p2pnode.services.shared.service.Watch`); close it (``with`` block) to stop."""
        return AioWatch(self._hosted, self._shared.watch(doc))


class AioWatch:
    """The asyncio side of a :class:`~p2pnode.services.shared.service.Watch`."""

    def __init__(self, hosted: _HostedNode, watch: Watch) -> None:
        self._hosted = hosted
        self._watch = watch

    def close(self) -> None:
        self._watch.close()  # sets a trio Event: a host-thread set wakes the guest run

    def __enter__(self) -> AioWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __aiter__(self) -> AioWatch:
        return self

    async def __anext__(self) -> dict[str, Any]:
        value = await self._hosted.call(self._next)
        if value is _END:
            raise StopAsyncIteration
        assert isinstance(value, dict)
        return value

    async def _next(self) -> object:
        return await _next_or_end(self._watch)


__all__ = [
    "CANCEL_GRACE",
    "CLOSE_TIMEOUT",
    "AioNode",
    "AioShared",
    "AioTaskHandle",
    "AioTasks",
    "AioTools",
    "AioWatch",
    "open_node",
]
