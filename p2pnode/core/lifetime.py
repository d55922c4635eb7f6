"""Objects that own their background tasks: one nursery, opened by ``async with``.

Structured concurrency (trio's design): whoever starts a task owns the nursery
it runs in. A :class:`TaskOwner` opens its nursery in ``__aenter__``, starts
its long-lived tasks in :meth:`TaskOwner._start`, and on exit runs
:meth:`TaskOwner._stop` (shielded), then cancels and awaits every task it
started. An exception from the ``async with`` body is handed on unwrapped,
never inside an ExceptionGroup of the owner's nursery.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, Self

import trio

from p2pnode.core.errors import ErrorCode, LocalError


class TaskOwner:
    """Base of an object with a nursery of its own (see the module docstring)."""

    _task_nursery: trio.Nursery | None = None
    _task_nursery_cm: Any = None
    _stopping: bool = False

    @property
    def nursery(self) -> trio.Nursery:
        """The owner's nursery. Raises LocalError(INVALID_ARGUMENT) when not open."""
        if self._task_nursery is None or self._stopping:
            what = type(self).__name__
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"the {what} is not open: `async with` it")
        return self._task_nursery

    @property
    def is_open(self) -> bool:
        return self._task_nursery is not None and not self._stopping

    async def _start(self, nursery: trio.Nursery) -> None:
        """Start the owner's tasks (override); an exception aborts ``__aenter__``."""

    async def _stop(self) -> None:
        """Release what tasks hold before they are cancelled (override; runs shielded)."""

    async def __aenter__(self) -> Self:
        cm = trio.open_nursery()
        nursery = await cm.__aenter__()
        self._task_nursery, self._task_nursery_cm, self._stopping = nursery, cm, False
        try:
            await self._start(nursery)
        except BaseException as exc:
            await self._close(exc)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        return await self._close(exc)

    async def _close(self, exc: BaseException | None) -> bool | None:
        if self._task_nursery is None or self._stopping:
            return None
        self._stopping = True
        try:
            with trio.CancelScope(shield=True):
                await self._stop()
        finally:
            self._task_nursery.cancel_scope.cancel()
        # A Cancelled may be the nursery's own (a task crashed while the body ran): the
        # nursery must see it to absorb it. Any other exception of the body is the
        # caller's: it is re-raised by `async with` as it is, not inside an
        # ExceptionGroup of the owner's tasks.
        if isinstance(exc, trio.Cancelled):
            result: bool | None = await self._task_nursery_cm.__aexit__(
                type(exc), exc, exc.__traceback__
            )
            return result
        await self._task_nursery_cm.__aexit__(None, None, None)
        return None
