"""p2pnode.hosting.aiohandoff: trio ticks chained in one loop callback, handler tasks
started eagerly."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import Any

import outcome
import pytest
import sniffio

from p2pnode.hosting import aiohandoff
from p2pnode.hosting.aiohandoff import MAX_CHAINED_TICKS, TickDriver, start_eagerly

# -- the tick driver, on a loop we step by hand --------------------------------------------------


class FakeLoop:
    """Only what TickDriver uses: call_soon, run by hand one pass at a time."""

    def __init__(self) -> None:
        self.ready: list[tuple[Callable[..., object], tuple[Any, ...]]] = []

    def call_soon(self, fn: Callable[..., object], *args: Any) -> None:
        self.ready.append((fn, args))

    def run_pass(self) -> int:
        """Run what was ready at the start of the pass; returns how many callbacks ran."""
        todo, self.ready = self.ready, []
        for fn, args in todo:
            fn(*args)
        return len(todo)


class Trio:
    """A stand-in for trio's guest run: each tick asks for the next while work is left."""

    def __init__(self, driver: TickDriver, ticks: int, yield_at: frozenset[int] = frozenset()):
        self.driver = driver
        self.left = ticks
        self.ran = 0
        self.yield_at = yield_at

    def tick(self) -> None:
        self.ran += 1
        self.left -= 1
        if self.ran in self.yield_at:
            self.driver.yield_to_host()
        if self.left > 0:
            self.driver.soon(self.tick)


def drive(ticks: int, yield_at: frozenset[int] = frozenset()) -> list[int]:
    """Ticks run in each pass of the loop until trio has no work left."""
    loop = FakeLoop()
    driver = TickDriver(loop)  # type: ignore[arg-type]
    trio_run = Trio(driver, ticks, yield_at)
    driver.soon(trio_run.tick)
    per_pass = []
    for _ in range(ticks + 1):  # at least one tick a pass: bounded
        before = trio_run.ran
        if not loop.run_pass():
            break
        per_pass.append(trio_run.ran - before)
    assert trio_run.left == 0
    return per_pass


def test_ticks_chain_in_one_loop_pass_up_to_the_bound() -> None:
    assert drive(3) == [3]
    assert drive(MAX_CHAINED_TICKS) == [MAX_CHAINED_TICKS]
    assert drive(2 * MAX_CHAINED_TICKS + 1) == [MAX_CHAINED_TICKS, MAX_CHAINED_TICKS, 1]


def test_the_loop_gets_its_turn_once_trio_handed_it_work() -> None:
    assert drive(5, frozenset({2})) == [2, 3]
    assert drive(4, frozenset({1, 2, 3})) == [1, 1, 1, 1]


def test_a_tick_that_raises_leaves_the_next_one_scheduled() -> None:
    loop = FakeLoop()
    driver = TickDriver(loop)  # type: ignore[arg-type]
    ran: list[str] = []

    def failing() -> None:
        driver.soon(lambda: ran.append("next"))
        raise RuntimeError("a defect in a tick")

    driver.soon(failing)
    with pytest.raises(RuntimeError):
        loop.run_pass()
    assert loop.run_pass() == 1
    assert ran == ["next"]


# -- eager starts, on a real loop -----------------------------------------------------------------

who: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="nobody")


def in_a_callback(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a loop callback (no task current), as trio's ticks run, and return
    what it returned."""

    async def main() -> Any:
        loop = asyncio.get_running_loop()
        result = loop.create_future()
        loop.call_soon(lambda: result.set_result(fn()))
        return await (await result)

    return asyncio.run(main())


def test_a_coroutine_that_does_not_wait_ends_in_the_eager_step() -> None:
    seen: dict[str, Any] = {}

    async def handler() -> str:
        seen["task"] = asyncio.current_task()
        seen["library"] = sniffio.current_async_library()
        seen["who"] = who.get()
        who.set("handler")  # in the task's own context, not the opener's
        return "answer"

    def start() -> Any:
        loop = asyncio.get_running_loop()
        context = contextvars.copy_context()
        context.run(who.set, "opener")
        started = start_eagerly(loop, handler(), context)
        assert isinstance(started, outcome.Value)
        assert started.unwrap() == "answer"
        assert context.run(who.get) == "opener"
        assert asyncio.current_task() is None  # left again
        assert isinstance(seen["task"], asyncio.Task)
        return asyncio.wait({seen["task"]})  # its task ends at the loop's next pass

    in_a_callback(start)
    assert seen["task"].done() and seen["task"].result() is None  # the answer went to trio
    assert seen["library"] == "asyncio" and seen["who"] == "opener"


def test_a_coroutine_that_waits_goes_on_as_its_task() -> None:
    steps: list[str] = []

    async def handler() -> int:
        steps.append("first step")
        first = asyncio.current_task()
        await asyncio.sleep(0.001)
        async with asyncio.timeout(5):  # needs the current task: the same one
            await asyncio.sleep(0)
        assert asyncio.current_task() is first
        steps.append("resumed")
        return 7

    def start() -> Any:
        started = start_eagerly(asyncio.get_running_loop(), handler(), contextvars.Context())
        assert steps == ["first step"]
        assert isinstance(started, asyncio.Task)
        return started

    assert in_a_callback(start) == 7
    assert steps == ["first step", "resumed"]


def test_errors_of_the_eager_step_are_its_outcome() -> None:
    raised = KeyError("exactly this")

    async def handler() -> None:
        raise raised

    def start() -> Any:
        started = start_eagerly(asyncio.get_running_loop(), handler(), contextvars.Context())
        assert isinstance(started, outcome.Error)
        assert started.error is raised
        return asyncio.sleep(0)

    in_a_callback(start)


def test_a_task_cancelled_before_its_loop_step_cancels_the_coroutine_where_it_waits() -> None:
    seen: list[str] = []

    async def handler() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            seen.append("cancelled while waiting")
            raise

    def start() -> Any:
        started = start_eagerly(asyncio.get_running_loop(), handler(), contextvars.Context())
        assert isinstance(started, asyncio.Task)
        started.cancel()  # before the loop ran the task at all
        return asyncio.wait({started})

    in_a_callback(start)
    assert seen == ["cancelled while waiting"]


def test_inside_a_running_task_the_task_starts_as_usual() -> None:
    steps: list[str] = []

    async def handler() -> str:
        steps.append("ran")
        return "late"

    async def main() -> None:
        started = start_eagerly(asyncio.get_running_loop(), handler(), contextvars.Context())
        assert isinstance(started, asyncio.Task)
        assert steps == []  # not on this task's stack
        assert await started == "late"

    asyncio.run(main())


def test_without_the_eager_path_the_task_starts_at_the_loops_next_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(aiohandoff, "EAGER", False)
    steps: list[str] = []

    async def handler() -> str:
        steps.append(who.get())
        who.set("handler")  # in the task's own copy of the context
        return "answer"

    def start() -> Any:
        context = contextvars.copy_context()
        context.run(who.set, "opener")
        started = start_eagerly(asyncio.get_running_loop(), handler(), context)
        assert isinstance(started, asyncio.Task)
        assert steps == []  # nothing ran on the caller's stack
        assert context.run(who.get) == "opener"
        return started

    assert in_a_callback(start) == "answer"
    assert steps == ["opener"]
