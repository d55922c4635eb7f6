"""An asyncio loop in a thread of its own, holding an async context open for a test
module (a swarm and its servers cost more to start and close than all the checks)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Generic, TypeVar

T = TypeVar("T")


class LoopThread(Generic[T]):
    """Enters ``opener()`` on its own loop and thread; checks run there with a bound of
    ``limit`` seconds (start and stop get three times as long)."""

    def __init__(self, opener: Callable[[], AbstractAsyncContextManager[T]], limit: float) -> None:
        self.loop = asyncio.new_event_loop()
        self.value: T | None = None
        self.limit = limit
        self._opener = opener
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._failure: BaseException | None = None
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def hold() -> None:
            self._stop = asyncio.Event()
            async with self._opener() as value:
                self.value = value
                self._ready.set()
                await self._stop.wait()

        try:
            self.loop.run_until_complete(hold())
        except BaseException as exc:
            self._failure = exc
        finally:
            self._ready.set()
            # What servers leave behind (sse-starlette's shutdown watchers) ends here.
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            if pending:
                done = asyncio.gather(*pending, return_exceptions=True)
                self.loop.run_until_complete(done)
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    def start(self) -> T:
        self.thread.start()
        assert self._ready.wait(self.limit * 3), "the loop's context did not open"
        if self.value is None:
            raise AssertionError(f"the loop's context did not open: {self._failure!r}")
        return self.value

    def run(self, check: Callable[[T], Awaitable[None]]) -> None:
        """Run ``check(value)`` on the loop; its failure is raised here."""
        assert self.value is not None
        value = self.value

        async def bounded() -> None:
            async with asyncio.timeout(self.limit * 2):
                await check(value)

        asyncio.run_coroutine_threadsafe(bounded(), self.loop).result(self.limit * 3)

    def stop(self) -> None:
        stop = self._stop
        if stop is not None:
            self.loop.call_soon_threadsafe(stop.set)
        self.thread.join(self.limit * 3)
        assert not self.thread.is_alive(), "the loop's context did not close"
        if self._failure is not None:
            raise self._failure
