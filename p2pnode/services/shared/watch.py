"""Change notifications for a shared document (see :mod:`p2pnode.services.shared.service`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio


class Watch:
    """Change notifications for one document: ``async for value in watch`` yields the
    document's value after each change. Coalescing (bounded): a slow reader gets the
    latest value, never a backlog. Close it (``with`` block) to stop.

    Made by :meth:`p2pnode.services.shared.service.SharedState.watch`, which passes how to read
    the document and what to call when the watch closes.
    """

    def __init__(
        self,
        doc: str,
        read: Callable[[str], dict[str, Any]],
        on_close: Callable[[Watch], None],
    ) -> None:
        self.doc = doc
        self._read = read
        self._on_close = on_close
        self._event = trio.Event()
        self._closed = False

    def notify(self) -> None:
        """Mark the document changed (called by the shared-state service)."""
        self._event.set()

    def close(self) -> None:
        """Stop: a pending or later ``__anext__`` ends the iteration."""
        self._closed = True
        self._event.set()
        self._on_close(self)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if not self._closed:
            await self._event.wait()
        if self._closed:
            raise StopAsyncIteration
        self._event = trio.Event()
        return self._read(self.doc)


__all__ = ["Watch"]
