"""Hand-offs between trio's guest run and the asyncio loop that cost no loop pass (private,
under :mod:`p2pnode.hosting.aio`).

Theory of operation. In guest mode every trio scheduling pass (a *tick*) is a callback
of the asyncio loop, and every result trio hands asyncio wakes an asyncio task at the
loop's next pass. A request from an asyncio program to an agent of the same node
crosses several trio tasks (the requester, the agent, the reply writer) and, for an
asyncio-hosted agent, the agent's handler task too; paid one loop pass each, the
crossings cost more than the request. Two things remove most of them:

* :class:`TickDriver` runs trio's ticks several in one loop callback while only trio
  has work, and gives the loop its turn as soon as trio hands asyncio something (a
  call's result, a handler task that waits) or has nothing left to run. Bounded:
  after :data:`MAX_CHAINED_TICKS` ticks the loop runs anyway, so its I/O and tasks
  wait at most that many trio passes.
* :func:`start_eagerly` starts a handler's asyncio task at once, inside the trio tick
  that delivers the envelope, and runs it up to its first real wait, as Python 3.12's
  eager tasks do (``asyncio.eager_task_factory``): the task is created first and is
  the current task while its first step runs, in the task's own context, with
  ``sniffio`` saying asyncio. A handler that answers without waiting (most do) is
  answered in that same tick; one that waits goes on as the task, which the loop
  resumes where it stopped.

  The eager step marks the task current with asyncio's ``_enter_task`` and
  ``_leave_task``, which Python 3.11 keeps private (3.12 uses the same pair for its
  public eager tasks). :data:`EAGER` guards that path: where the pair is missing, or
  with ``P2PNODE_EAGER_TASKS=0`` in the environment, :func:`start_eagerly` creates the
  task with the public ``loop.create_task`` and it starts at the loop's next pass.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
from collections.abc import Callable, Coroutine, Generator
from typing import Any, TypeVar

import outcome
import sniffio

T = TypeVar("T")

#: Trio ticks run in one loop callback at most (see :class:`TickDriver`).
MAX_CHAINED_TICKS = 8

_enter_task: Callable[[asyncio.AbstractEventLoop, asyncio.Task[Any]], None] | None = getattr(
    asyncio.tasks, "_enter_task", None
)
_leave_task: Callable[[asyncio.AbstractEventLoop, asyncio.Task[Any]], None] | None = getattr(
    asyncio.tasks, "_leave_task", None
)

#: Whether :func:`start_eagerly` runs a handler's first step inside the trio tick (asyncio's
#: private ``_enter_task``/``_leave_task``; see the module docstring). Measured: a request
#: from an asyncio program to an asyncio-hosted agent of the same node takes 232 us with it
#: and 383 us with the public ``loop.create_task`` (medians of 3 runs of 5 x 2,000 requests
#: each way, back to back on one machine). False: the public ``loop.create_task``.
EAGER = (
    _enter_task is not None
    and _leave_task is not None
    and os.environ.get("P2PNODE_EAGER_TASKS", "1") != "0"
)


class TickDriver:
    """Runs trio's guest ticks for one loop: pass :meth:`soon` as trio's
    ``run_sync_soon_not_threadsafe`` (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._next: Callable[[], object] | None = None
        self._driving = False
        self._yield = False

    def soon(self, tick: Callable[[], object]) -> None:
        """Run ``tick`` soon: after the current one when a drive is on, else from the loop."""
        if self._driving:
            self._next = tick
        else:
            self._loop.call_soon(self._drive, tick)

    def yield_to_host(self) -> None:
        """Trio handed asyncio work, or has none of its own: the next tick waits for the
        loop's next pass."""
        self._yield = True

    def _drive(self, tick: Callable[[], object]) -> None:
        self._driving = True
        self._yield = False
        following: Callable[[], object] | None = None
        try:
            for _ in range(MAX_CHAINED_TICKS):  # bounded: the loop gets its turn after
                following = None
                tick()
                following, self._next = self._next, None
                if following is None or self._yield:
                    break
                tick = following
        finally:
            self._driving = False
            if self._next is not None:  # a tick raised after asking for the next one
                following, self._next = self._next, None
            if following is not None:
                self._loop.call_soon(self._drive, following)


class _Continuation(Coroutine[Any, Any, T]):
    """What the task of an eagerly started coroutine runs: its first step hands the task
    what the coroutine waits on after the inline step (or ends at once when it ended
    there); then it is the coroutine itself."""

    __slots__ = ("_coro", "_first", "ended", "started", "waiting_on")

    def __init__(self, coro: Coroutine[Any, Any, T]) -> None:
        self._coro = coro
        self._first = True
        self.started = False  # the inline step ran
        self.ended = False  # ... and the coroutine ended in it
        self.waiting_on: Any = None  # ... else what it yielded (a future, or None)

    def send(self, value: Any) -> Any:
        if self._first and self.started:
            self._first = False
            if self.ended:
                raise StopIteration(None)  # the result went to trio already
            return self.waiting_on
        self._first = False
        return self._coro.send(value)

    def __next__(self) -> Any:
        return self.send(None)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        # A cancellation before the task's first step reaches the coroutine where it waits,
        # as it would had the task run the first step itself.
        self._first = False
        if self.ended:
            raise typ if val is None else val
        if val is None and tb is None:
            return self._coro.throw(typ)
        return self._coro.throw(typ, val, tb)

    def close(self) -> None:
        if not self.ended:
            self._coro.close()

    def __iter__(self) -> _Continuation[T]:
        return self

    def __await__(self) -> Generator[Any, None, T]:
        return self


def start_eagerly(
    loop: asyncio.AbstractEventLoop,
    coro: Coroutine[Any, Any, T],
    context: contextvars.Context,
) -> asyncio.Task[T] | outcome.Outcome[T]:
    """Run ``coro`` as a new asyncio task (in a copy of ``context``) whose first step runs
    now, on the caller's stack: the outcome when it ended in that step, else the task,
    which goes on from the loop. Called from a trio tick (a loop callback, no task
    current); elsewhere, or when :data:`EAGER` is false, the task starts as usual, at the
    loop's next pass."""
    task_context = context.copy()
    if not EAGER or _enter_task is None or _leave_task is None:
        return loop.create_task(coro, context=task_context)
    continuation = _Continuation(coro)
    task: asyncio.Task[T] = loop.create_task(continuation, context=task_context)
    try:
        _enter_task(loop, task)
    except RuntimeError:  # another task is running: it is not our turn to step this one
        return task
    previous = sniffio.thread_local.name
    sniffio.thread_local.name = "asyncio"  # the tick set it to trio
    continuation.started = True
    try:
        continuation.waiting_on = task_context.run(coro.send, None)
    except StopIteration as stop:
        continuation.ended = True
        return outcome.Value(stop.value)
    except BaseException as exc:
        continuation.ended = True
        return outcome.Error(exc)
    finally:
        sniffio.thread_local.name = previous
        _leave_task(loop, task)
    return task


__all__ = ["EAGER", "MAX_CHAINED_TICKS", "TickDriver", "start_eagerly"]
