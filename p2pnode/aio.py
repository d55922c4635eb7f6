"""Run a full node in an asyncio program: trio's guest mode on the running asyncio loop.

``aio.open_node(identity, network, config)`` is the asyncio twin of
:func:`p2pnode.node.runtime.open_node`; the node itself is the trio node,
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
  :class:`~p2pnode.errors.P2PError` subclasses included).
* **Cancellation.** Cancelling the asyncio caller cancels the trio call's
  cancel scope, and the caller's ``CancelledError`` surfaces once the trio
  call has ended (at most ``CANCEL_GRACE`` seconds later), so nothing the
  call holds (a pending request, a send in flight) outlives it.
* **Handlers run in asyncio.** Every handler of an agent added through
  :meth:`AioNode.add_agent` (sync or async) runs in the asyncio loop: the
  node's agent task in trio hands the envelope to an asyncio task that runs
  the definition's dispatch (:meth:`p2pnode.agent.Agent.handle`, so input
  validation and typed errors are the same as in trio) and awaits its
  reply. So a handler may await anything asyncio (``asyncio.sleep``, an
  asyncio HTTP client, an MCP session); ``asyncio.current_task()`` is its
  task, and it sees the context variables of the code that opened the
  node. It must not call trio. The agent's envelopes are still handled one
  at a time in arrival order, as in trio. If the node closes while a
  handler runs, its asyncio task is cancelled.
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
from collections.abc import Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, Generic, TypeVar

import outcome
import trio
import trio.testing

from p2pnode.agent import Agent, Reply, agent_for_handler
from p2pnode.card import AgentCard, Capability
from p2pnode.crdt.clock import VectorClock
from p2pnode.crdt.ops import Op
from p2pnode.crdt.replica import Delta
from p2pnode.envelope import Envelope, MessageType, Metadata, ThreadStore
from p2pnode.errors import ErrorCode, LocalError, RemoteError
from p2pnode.identity import Identity, PeerId
from p2pnode.net import Address, Network
from p2pnode.node import runtime
from p2pnode.node.config import NodeConfig
from p2pnode.node.node import Node
from p2pnode.node.router import RoutingResult
from p2pnode.node.routing import Handler
from p2pnode.node.shared import SharedConfig, SharedState, Watch
from p2pnode.registry import Registry

logger = logging.getLogger("p2pnode.aio")

T = TypeVar("T")

#: Seconds a cancelled call may take to end in trio before its caller stops waiting.
CANCEL_GRACE = 5.0
#: Seconds a node may take to close, and then the guest run to end, before exit gives up.
CLOSE_TIMEOUT = 30.0
#: Calls queued for trio and not yet started (they start at the next trio tick).
MAX_PENDING_CALLS = 65_536
#: Most trio tasks running calls for one node at once (more calls wait for one).
MAX_WORKERS = 4096
#: Idle call-running tasks kept per node.
SPARE_WORKERS = 8
#: Loop passes the guest run keeps ticking after it handed something to asyncio.
LINGER_ROUNDS = 3
#: Times a closing task may be cancelled again while it waits for the node to close.
_MAX_CLOSE_CANCELS = 100


def _resolve(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)


def _reject(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


async def _settle(future: asyncio.Future[Any], seconds: float) -> bool:
    """Wait up to ``seconds`` for ``future``, through cancellations of the waiting task
    (re-raised once it is done or the time is up). True when it is done."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    cancelled = False
    for _ in range(_MAX_CLOSE_CANCELS):  # each pass ends in done, time up, or a cancel
        remaining = deadline - loop.time()
        if future.done() or remaining <= 0:
            break
        try:
            await asyncio.wait({future}, timeout=remaining)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return future.done()


# -- calls from asyncio into trio ----------------------------------------------------------------


class _Call(Generic[T]):
    """One trio call made for an asyncio caller (see the module docstring)."""

    __slots__ = ("args", "ended", "finished", "fn", "future", "scope")

    def __init__(
        self, fn: Callable[..., Awaitable[T]], args: tuple[Any, ...], future: asyncio.Future[T]
    ) -> None:
        self.fn = fn
        self.args = args
        self.future = future
        self.scope: trio.CancelScope | None = None
        self.finished = False
        #: Set when the trio side ends, once a cancelled caller waits for that.
        self.ended: asyncio.Future[None] | None = None

    async def run(self, scope: trio.CancelScope) -> None:
        """Run the call (trio side) in ``scope``, which the caller's cancellation cancels,
        and settle its future."""
        future = self.future
        if future.done():  # the caller was cancelled before the call started
            self.finished = True
            return
        self.scope = scope
        try:
            try:
                value = await self.fn(*self.args)
            except Exception as exc:
                _reject(future, exc)
            else:
                _resolve(future, value)
        finally:
            # Still pending: the node is closing (an outer cancellation) or a
            # BaseException ends the run; either way the caller gets an answer.
            if not future.done():
                closed = LocalError(ErrorCode.CHANNEL_CLOSED, "the node closed during the call")
                future.set_exception(closed)
            self.finished = True
            if self.ended is not None:
                _resolve(self.ended, None)

    async def cancel_and_wait(self, loop: asyncio.AbstractEventLoop) -> None:
        """The caller was cancelled (asyncio side): cancel the trio call, wait until it ended."""
        if self.finished or self.scope is None:
            return  # ended, or not started (run() sees the cancelled future and returns)
        self.scope.cancel()  # a host-thread cancel wakes the guest run (trio supports it)
        self.ended = loop.create_future()
        await asyncio.wait({self.ended}, timeout=CANCEL_GRACE)


class _Linger:
    """Keeps the guest run from going idle for a few loop passes after trio handed
    asyncio a result, so the caller's next call is picked up at the next tick.

    Why: an idle guest run waits for I/O in trio's worker thread, and waking it from
    the loop goes through that thread and back (``call_soon_threadsafe``): tens of
    microseconds per crossing, where a tick costs a few. The task waits with
    ``wait_all_tasks_blocked()``, which wakes it only on a pass where no other task
    is runnable (its zero cushion turns the I/O wait into a poll, never the thread),
    so lingering costs nothing while trio is busy. Bounded: after ``LINGER_ROUNDS``
    such passes the run goes idle as usual.
    """

    def __init__(self) -> None:
        self.rounds = 0
        self._parked: trio.Event | None = None

    def poke(self) -> None:
        self.rounds = LINGER_ROUNDS
        if self._parked is not None:
            self._parked.set()
            self._parked = None

    async def run(self) -> None:
        while True:  # until the guest run is cancelled; each pass waits for a pass or a poke
            if self.rounds > 0:
                self.rounds -= 1
                await trio.testing.wait_all_tasks_blocked()
            else:
                self._parked = trio.Event()
                await self._parked.wait()


class _Pool:
    """Tasks of one owner (the guest run, or one node) that run calls from asyncio.

    A call goes on a memory channel (``send_nowait`` from the loop's thread wakes a
    waiting worker: trio's guest mode supports waking tasks from the host) and an idle
    worker runs it at the next tick: no task is spawned per call, so a call costs one
    pass of the loop. A worker that takes the last idle slot starts a spare, so calls
    run concurrently (up to ``MAX_WORKERS``; more wait for a worker); workers above
    ``SPARE_WORKERS`` idle ones end. The workers are tasks of the owner's nursery, so
    closing the owner cancels the calls it runs.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, linger: _Linger) -> None:
        self.loop = loop
        self._linger = linger
        self._send, self._receive = trio.open_memory_channel[_Call[Any]](MAX_PENDING_CALLS)
        self._workers = 0
        self._idle = 0

    def start(self, nursery: trio.Nursery) -> None:
        """Start the first worker (trio side)."""
        self._spawn(nursery)

    def close(self) -> None:
        """Refuse further calls and answer the queued ones (trio side, before the
        workers are cancelled)."""
        self._send.close()
        for _ in range(MAX_PENDING_CALLS):  # the queue holds at most this many
            try:
                call = self._receive.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            _reject(call.future, LocalError(ErrorCode.INVALID_ARGUMENT, "the node is closed"))

    def _spawn(self, nursery: trio.Nursery) -> None:
        self._workers += 1
        nursery.start_soon(self._worker, nursery)

    async def _worker(self, nursery: trio.Nursery) -> None:
        try:
            while True:  # until the owner closes (end of channel, cancellation) or spare
                # One cancel scope serves call after call until a caller's cancellation
                # uses it up (a scope per call costs microseconds on every call). A
                # cancel is only made while a call runs (_Call.cancel_and_wait), and
                # the scope is checked before the next call is taken, so a cancel
                # meant for one call never reaches another.
                with trio.CancelScope() as scope:
                    while not scope.cancel_called:
                        self._idle += 1
                        try:
                            call = await self._receive.receive()
                        finally:
                            self._idle -= 1
                        if self._idle == 0 and self._workers < MAX_WORKERS:
                            self._spawn(nursery)  # the next call finds a worker waiting
                        await call.run(scope)
                        self._linger.poke()  # the caller's next call comes at the next pass
                        if self._idle >= SPARE_WORKERS:
                            return
        except trio.EndOfChannel:
            return
        finally:
            self._workers -= 1

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> _Call[T]:
        """Queue ``await fn(*args)`` for a worker (asyncio side); its future settles with
        what it returns or raises. Raises LocalError: BUSY (too many calls queued),
        INVALID_ARGUMENT (closed, or called from another loop)."""
        if asyncio.get_running_loop() is not self.loop:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "the node belongs to another loop")
        future: asyncio.Future[T] = self.loop.create_future()
        call = _Call(fn, args, future)
        try:
            self._send.send_nowait(call)
        except trio.WouldBlock:
            raise LocalError(ErrorCode.BUSY, "too many calls queued for the node") from None
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "the node is closed") from None
        return call

    async def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``await fn(*args)`` in trio and return what it returns (asyncio side);
        raises what it raises and what :meth:`submit` raises."""
        call = self.submit(fn, *args)
        try:
            return await call.future
        except asyncio.CancelledError:
            await call.cancel_and_wait(self.loop)
            raise


class _GuestState(enum.Enum):
    RUNNING = "running"
    STOPPING = "stopping"  # the last node closed; the run is ending
    FINISHED = "finished"


_GUESTS: dict[asyncio.AbstractEventLoop, _Guest] = {}


class _Guest:
    """The trio guest run on one asyncio loop, shared by the nodes opened on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.state = _GuestState.RUNNING
        self.users = 0
        self.finished: asyncio.Future[outcome.Outcome[None]] = loop.create_future()
        self._stop = trio.Event()
        self.linger = _Linger()
        #: Runs each node's task (one worker per open node, so they run side by side).
        self.pool = _Pool(loop, self.linger)
        self._ready: asyncio.Future[None] = loop.create_future()
        try:
            trio.lowlevel.start_guest_run(
                self._main,
                run_sync_soon_threadsafe=loop.call_soon_threadsafe,
                run_sync_soon_not_threadsafe=loop.call_soon,
                done_callback=self._done,
                # asyncio (and uvloop) own signal.set_wakeup_fd; trio must not take it.
                host_uses_signal_set_wakeup_fd=True,
            )
        except RuntimeError as exc:  # a trio run is already active in this thread
            raise LocalError(
                ErrorCode.INVALID_ARGUMENT, f"cannot start trio in this thread: {exc}"
            ) from None

    @classmethod
    async def acquire(cls, loop: asyncio.AbstractEventLoop) -> _Guest:
        """The loop's running guest (started if there is none), with one more user."""
        guest = _GUESTS.get(loop)
        if guest is not None and guest.state is not _GuestState.RUNNING:
            # The previous run is ending; a new one may start only after it.
            await _settle(guest.finished, CLOSE_TIMEOUT)
            guest = _GUESTS.get(loop)
            if guest is not None:
                raise LocalError(ErrorCode.TIMEOUT, "the loop's last trio guest run did not end")
        if guest is None:
            guest = _GUESTS[loop] = cls(loop)
        guest.users += 1
        try:
            await _settle(guest._ready, CLOSE_TIMEOUT)
        except BaseException:
            await guest.release()
            raise
        if not guest._ready.done():
            await guest.release()
            raise LocalError(ErrorCode.TIMEOUT, "the trio guest run did not start")
        guest._ready.result()  # raises what failed the run before it was ready
        return guest

    async def release(self) -> None:
        """One user fewer; the last one ends the run and waits for it."""
        self.users -= 1
        if self.users > 0 or self.state is not _GuestState.RUNNING:
            return
        self.state = _GuestState.STOPPING
        self._stop.set()
        if not await _settle(self.finished, CLOSE_TIMEOUT):
            raise LocalError(ErrorCode.TIMEOUT, "the trio guest run did not end")
        result = self.finished.result()
        if isinstance(result, outcome.Error):
            result.unwrap()

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            self.pool.start(nursery)
            nursery.start_soon(self.linger.run)
            _resolve(self._ready, None)
            await self._stop.wait()
            self.pool.close()
            nursery.cancel_scope.cancel()

    def _done(self, result: outcome.Outcome[None]) -> None:
        # trio calls this from a guest tick: on the loop's thread.
        self.state = _GuestState.FINISHED
        if _GUESTS.get(self.loop) is self:
            del _GUESTS[self.loop]
        failure = result.error if isinstance(result, outcome.Error) else None
        if failure is not None:
            logger.error("the trio guest run failed", exc_info=failure)
        _reject(self._ready, failure or LocalError(ErrorCode.INTERNAL, "the trio run ended"))
        _resolve(self.finished, result)

    # -- trio -> asyncio: handlers ----------------------------------------------------------

    async def handle_in_asyncio(
        self, definition: Agent, envelope: Envelope, context: contextvars.Context
    ) -> Reply | None:
        """Run ``definition.handle(envelope)`` as an asyncio task and await it (trio side)."""
        task = context.run(self.loop.create_task, definition.handle(envelope))
        done = trio.Event()
        try:
            # A quick handler ends within a pass or two of the loop: look at each tick
            # rather than park and be woken through trio's I/O thread (see _Linger);
            # a slow one is waited for with a done callback.
            for _ in range(LINGER_ROUNDS):
                await trio.lowlevel.checkpoint()
                if task.done():
                    break
            else:
                task.add_done_callback(lambda _: done.set())  # a host-thread set wakes trio
                await done.wait()
        except trio.Cancelled:
            task.cancel()
            if not task.done():
                task.add_done_callback(lambda _: done.set())
                with trio.move_on_after(CANCEL_GRACE) as scope:
                    scope.shield = True  # give the handler its chance to end before we go on
                    await done.wait()
            raise
        if task.cancelled():  # cancelled from outside: answer as a failed handler would
            logger.error("%s: the handler's asyncio task was cancelled", definition.id)
            if envelope.type is not MessageType.REQUEST:
                return None
            failed = f"the handler of agent {definition.id!r} failed"
            return Reply(MessageType.ERROR, RemoteError(ErrorCode.HANDLER_FAILED, failed).to_dict())
        return task.result()


class _InAsyncio(Agent):
    """An agent definition whose handlers run in the asyncio loop (see the module docstring).

    The node accepts only :class:`Agent` definitions, so this is one: the same id, card
    fields and capabilities as ``definition``, with a dispatch that crosses to asyncio.
    """

    def __init__(self, definition: Agent, guest: _Guest, context: contextvars.Context) -> None:
        super().__init__(
            definition.id,
            name=definition.name,
            description=definition.description,
            tier=definition.tier,
            sandbox=definition.sandbox,
            version=definition.version,
            capabilities=definition.capabilities,
        )
        self.definition = definition
        self._guest = guest
        self._context = context

    @property
    def capabilities(self) -> tuple[Capability, ...]:
        return self.definition.capabilities

    async def handle(self, envelope: Envelope) -> Reply | None:
        return await self._guest.handle_in_asyncio(self.definition, envelope, self._context)


# -- one node in the guest run -------------------------------------------------------------------


class _NodeState(enum.Enum):
    STARTING = "starting"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class _HostedNode:
    """A node running as a task of the guest run, and what its asyncio side waits on."""

    def __init__(
        self, guest: _Guest, identity: Identity, network: Network, config: NodeConfig
    ) -> None:
        self.guest = guest
        self.identity = identity
        self.network = network
        self.config = config
        self.state = _NodeState.STARTING
        self.node: Node | None = None
        self.pool = _Pool(guest.loop, guest.linger)
        self.error: Exception | None = None
        self.started: asyncio.Future[None] = guest.loop.create_future()
        self.ended: asyncio.Future[None] = guest.loop.create_future()
        self.body: asyncio.Task[Any] | None = None  # the task in `async with`, while it runs
        self.cancelled_body = False
        self._serving: _Call[None] | None = None
        self._stop = trio.Event()

    async def serve(self) -> None:
        """The node's task in the guest run (trio side)."""
        try:
            async with (
                runtime.open_node(self.identity, self.network, self.config) as node,
                trio.open_nursery() as calls,
            ):
                self.node = node
                self.pool.start(calls)
                self.state = _NodeState.OPEN
                _resolve(self.started, None)
                await self._stop.wait()
                self.pool.close()
                calls.cancel_scope.cancel()
        except Exception as exc:
            self._failed(exc)
        finally:
            self.state = _NodeState.CLOSED
            self.pool.close()
            _reject(self.started, self.error or LocalError(ErrorCode.INTERNAL, "node ended"))
            _resolve(self.ended, None)

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
            ready = await _settle(self.started, CLOSE_TIMEOUT)
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
        if not await _settle(self.ended, CLOSE_TIMEOUT):
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
        """``await fn(*args)`` run in trio (see :meth:`_Pool.call`). Raises
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
        guest = await _Guest.acquire(loop)
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

    Raises what :func:`p2pnode.node.runtime.open_node` raises (LocalError, OSError), and
    LocalError: INVALID_ARGUMENT when a trio run is already active in this thread,
    TIMEOUT when the node does not start or close within ``CLOSE_TIMEOUT``.
    """
    return _OpenNode(identity, network, config)


# -- the proxies -------------------------------------------------------------------------------


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
        if isinstance(agent, _InAsyncio):
            agent = agent.definition
        return _InAsyncio(agent, self._hosted.guest, self._context)

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
        if not isinstance(agent, Agent):
            if handler is None:
                raise LocalError(ErrorCode.INVALID_ARGUMENT, "an agent id needs a handler")
            agent = agent_for_handler(
                agent,
                handler,
                name=name or agent.upper(),
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

    async def find(self, capability: str) -> list[AgentCard]:
        """Agents offering ``capability`` (see :meth:`Node.find`)."""
        return await self._hosted.call(self.node.find, capability)

    async def open_shared(self, config: SharedConfig | None = None) -> AioShared:
        """Start the node's shared-state service (see :meth:`Node.open_shared`)."""
        shared = await self._hosted.call(self.node.open_shared, config)
        return AioShared(self._hosted, shared)


class AioShared:
    """An awaitable proxy of the node's :class:`~p2pnode.node.shared.SharedState`."""

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
        :class:`~p2pnode.node.shared.Watch`); close it (``with`` block) to stop."""
        return AioWatch(self._hosted, self._shared.watch(doc))


_END = object()


class AioWatch:
    """The asyncio side of a :class:`~p2pnode.node.shared.Watch`."""

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
        # StopAsyncIteration must not cross into an asyncio future: a marker does.
        try:
            return await self._watch.__anext__()
        except StopAsyncIteration:
            return _END


__all__ = ["CANCEL_GRACE", "CLOSE_TIMEOUT", "AioNode", "AioShared", "AioWatch", "open_node"]
