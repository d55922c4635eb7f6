"""The trio guest run under :mod:`p2pnode.hosting.aio` (private): trio's scheduler on a running
asyncio loop, the pools of trio tasks that run calls made from asyncio, and the bridge
that runs an agent's handlers as asyncio tasks. The theory of operation is in
:mod:`p2pnode.hosting.aio`'s docstring.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import outcome
import trio
import trio.testing

from p2pnode.agent.definition import Agent, Reply
from p2pnode.agent.tools import Caller
from p2pnode.core.card import Capability
from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.hosting.aiohandoff import TickDriver, start_eagerly

logger = logging.getLogger("p2pnode.hosting.aio")

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


def resolve(future: asyncio.Future[T], value: T) -> None:
    if not future.done():
        future.set_result(value)


def reject(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


async def settle(future: asyncio.Future[Any], seconds: float) -> bool:
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


class Call(Generic[T]):
    """One trio call made for an asyncio caller (see :mod:`p2pnode.hosting.aio`)."""

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
                reject(future, exc)
            else:
                resolve(future, value)
        finally:
            # Still pending: the node is closing (an outer cancellation) or a
            # BaseException ends the run; either way the caller gets an answer.
            if not future.done():
                closed = LocalError(ErrorCode.CHANNEL_CLOSED, "the node closed during the call")
                future.set_exception(closed)
            self.finished = True
            if self.ended is not None:
                resolve(self.ended, None)

    async def cancel_and_wait(self, loop: asyncio.AbstractEventLoop) -> None:
        """The caller was cancelled (asyncio side): cancel the trio call, wait until it ended."""
        if self.finished or self.scope is None:
            return  # ended, or not started (run() sees the cancelled future and returns)
        self.scope.cancel()  # a host-thread cancel wakes the guest run (trio supports it)
        self.ended = loop.create_future()
        await asyncio.wait({self.ended}, timeout=CANCEL_GRACE)


class Linger:
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

    def __init__(self, driver: TickDriver) -> None:
        self.rounds = 0
        self._parked: trio.Event | None = None
        self._driver = driver

    def poke(self) -> None:
        self.rounds = LINGER_ROUNDS
        self._driver.yield_to_host()  # a call settled: its caller runs in the loop
        if self._parked is not None:
            self._parked.set()
            self._parked = None

    async def run(self) -> None:
        while True:  # until the guest run is cancelled; each pass waits for a pass or a poke
            if self.rounds > 0:
                self.rounds -= 1
                await trio.testing.wait_all_tasks_blocked()
                self._driver.yield_to_host()  # trio has nothing else to do: the loop's turn
            else:
                self._parked = trio.Event()
                await self._parked.wait()


class Pool:
    """Tasks of one owner (the guest run, or one node) that run calls from asyncio.

    A call goes on a memory channel (``send_nowait`` from the loop's thread wakes a
    waiting worker: trio's guest mode supports waking tasks from the host) and an idle
    worker runs it at the next tick: no task is spawned per call, so a call costs one
    pass of the loop. A worker that takes the last idle slot starts a spare, so calls
    run concurrently (up to ``MAX_WORKERS``; more wait for a worker); workers above
    ``SPARE_WORKERS`` idle ones end. The workers are tasks of the owner's nursery, so
    closing the owner cancels the calls it runs.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, linger: Linger) -> None:
        self.loop = loop
        self._linger = linger
        self._send, self._receive = trio.open_memory_channel[Call[Any]](MAX_PENDING_CALLS)
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
            reject(call.future, LocalError(ErrorCode.INVALID_ARGUMENT, "the node is closed"))

    def _spawn(self, nursery: trio.Nursery) -> None:
        self._workers += 1
        nursery.start_soon(self._worker, nursery)

    async def _worker(self, nursery: trio.Nursery) -> None:
        try:
            while True:  # until the owner closes (end of channel, cancellation) or spare
                # One cancel scope serves call after call until a caller's cancellation
                # uses it up (a scope per call costs microseconds on every call). A
                # cancel is only made while a call runs (Call.cancel_and_wait), and
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

    def submit(self, fn: Callable[..., Awaitable[T]], *args: Any) -> Call[T]:
        """Queue ``await fn(*args)`` for a worker (asyncio side); its future settles with
        what it returns or raises. Raises LocalError: BUSY (too many calls queued),
        INVALID_ARGUMENT (closed, or called from another loop)."""
        if asyncio.get_running_loop() is not self.loop:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "the node belongs to another loop")
        future: asyncio.Future[T] = self.loop.create_future()
        call = Call(fn, args, future)
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


_GUESTS: dict[asyncio.AbstractEventLoop, Guest] = {}


class Guest:
    """The trio guest run on one asyncio loop, shared by the nodes opened on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.state = _GuestState.RUNNING
        self.users = 0
        self.finished: asyncio.Future[outcome.Outcome[None]] = loop.create_future()
        self._stop = trio.Event()
        self.driver = TickDriver(loop)
        self.linger = Linger(self.driver)
        #: Runs each node's task (one worker per open node, so they run side by side).
        self.pool = Pool(loop, self.linger)
        self._ready: asyncio.Future[None] = loop.create_future()
        try:
            trio.lowlevel.start_guest_run(
                self._main,
                run_sync_soon_threadsafe=loop.call_soon_threadsafe,
                run_sync_soon_not_threadsafe=self.driver.soon,
                done_callback=self._done,
                # asyncio (and uvloop) own signal.set_wakeup_fd; trio must not take it.
                host_uses_signal_set_wakeup_fd=True,
            )
        except RuntimeError as exc:  # a trio run is already active in this thread
            raise LocalError(
                ErrorCode.INVALID_ARGUMENT, f"cannot start trio in this thread: {exc}"
            ) from None

    @classmethod
    async def acquire(cls, loop: asyncio.AbstractEventLoop) -> Guest:
        """The loop's running guest (started if there is none), with one more user."""
        guest = _GUESTS.get(loop)
        if guest is not None and guest.state is not _GuestState.RUNNING:
            # The previous run is ending; a new one may start only after it.
            await settle(guest.finished, CLOSE_TIMEOUT)
            guest = _GUESTS.get(loop)
            if guest is not None:
                raise LocalError(ErrorCode.TIMEOUT, "the loop's last trio guest run did not end")
        if guest is None:
            guest = _GUESTS[loop] = cls(loop)
        guest.users += 1
        try:
            await settle(guest._ready, CLOSE_TIMEOUT)
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
        if not await settle(self.finished, CLOSE_TIMEOUT):
            raise LocalError(ErrorCode.TIMEOUT, "the trio guest run did not end")
        result = self.finished.result()
        if isinstance(result, outcome.Error):
            result.unwrap()

    async def _main(self) -> None:
        async with trio.open_nursery() as nursery:
            self.pool.start(nursery)
            nursery.start_soon(self.linger.run)
            resolve(self._ready, None)
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
        reject(self._ready, failure or LocalError(ErrorCode.INTERNAL, "the trio run ended"))
        resolve(self.finished, result)

    # -- trio -> asyncio: handlers ----------------------------------------------------------

    async def handle_in_asyncio(
        self,
        definition: Agent,
        envelope: Envelope,
        context: contextvars.Context,
        caller: Caller | None = None,
    ) -> Reply | None:
        """Run ``definition.handle(envelope, caller)`` as an asyncio task and await it
        (trio side). The task's first step runs here (see :func:`start_eagerly`): a
        handler that answers without waiting is answered in this tick."""
        started = start_eagerly(self.loop, definition.handle(envelope, caller), context)
        if isinstance(started, outcome.Outcome):
            if isinstance(started, outcome.Error) and isinstance(
                started.error, asyncio.CancelledError
            ):
                return _cancelled(definition, envelope)
            return started.unwrap()
        task = started
        self.driver.yield_to_host()  # the handler goes on in the loop: its turn
        done = trio.Event()
        try:
            # A quick handler ends within a pass or two of the loop: look at each tick
            # rather than park and be woken through trio's I/O thread (see Linger);
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
        if task.cancelled():
            return _cancelled(definition, envelope)
        return task.result()


def _cancelled(definition: Agent, envelope: Envelope) -> Reply | None:
    """A handler's task cancelled from outside: answered as a failed handler would be."""
    logger.error("%s: the handler's asyncio task was cancelled", definition.id)
    if envelope.type is not MessageType.REQUEST:
        return None
    failed = f"the handler of agent {definition.id!r} failed"
    return Reply(MessageType.ERROR, RemoteError(ErrorCode.HANDLER_FAILED, failed).to_dict())


class InAsyncio(Agent):
    """An agent definition whose handlers run in the asyncio loop (see :mod:`p2pnode.hosting.aio`).

    The node accepts only :class:`Agent` definitions, so this is one: the same id, card
    fields and capabilities as ``definition``, with a dispatch that crosses to asyncio.
    """

    def __init__(self, definition: Agent, guest: Guest, context: contextvars.Context) -> None:
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

    def card_offers(self) -> dict[str, tuple[str, ...]]:
        return self.definition.card_offers()

    def tool_deadline(self, envelope: Envelope) -> float | None:
        return self.definition.tool_deadline(envelope)

    async def handle(self, envelope: Envelope, caller: Caller | None = None) -> Reply | None:
        return await self._guest.handle_in_asyncio(self.definition, envelope, self._context, caller)


__all__ = [
    "CANCEL_GRACE",
    "CLOSE_TIMEOUT",
    "LINGER_ROUNDS",
    "MAX_PENDING_CALLS",
    "MAX_WORKERS",
    "SPARE_WORKERS",
    "Call",
    "Guest",
    "InAsyncio",
    "Linger",
    "Pool",
    "reject",
    "resolve",
    "settle",
]
