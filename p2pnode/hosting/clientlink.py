"""The connection under :class:`p2pnode.hosting.client.AgentClient` (private): bytes to and from
``agent.sock``.

Two implementations of one small interface (:class:`Link`):

* :class:`ProtocolLink`, on asyncio (the usual host of an agent process): an
  :class:`asyncio.Protocol`. The loop hands it what the socket received in the
  same pass that saw the socket readable, and every complete line of it is
  handled there, before anything is awaited; a line is written with
  ``transport.write``, which sends at once when nothing is queued (the kernel
  takes it in the caller's pass), and a writer waits only when the transport
  asks it to pause (its buffer past the high-water mark: back-pressure). So an
  envelope costs one pass of the loop to reach the handler task and none to
  leave: the portable path below costs six.
* :class:`StreamLink`, on anyio's socket streams: the path for trio (and any
  anyio backend); a reader task and a write lock.

Either hands received bytes to ``on_data`` (the client's line handler): it returns the
lines to write back at once (refusals of envelopes that do not fit), or None when the
node sent something unreadable, which ends the connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, cast

import anyio
import anyio.abc

from p2pnode.core.errors import ErrorCode, LocalError

#: What a link hands received bytes to (see the module docstring).
OnData = Callable[[bytes], list[bytes] | None]
READ_SIZE = 65536
#: Seconds closing waits for the transport to report the connection lost.
CLOSE_TIMEOUT = 1.0


def _gone(exc: BaseException | None = None) -> LocalError:
    why = f": {exc}" if exc is not None else ""
    return LocalError(ErrorCode.CHANNEL_CLOSED, f"the node is gone{why}")


class Link(Protocol):
    async def send(self, line: bytes) -> None:
        """Write ``line``. Raises LocalError(CHANNEL_CLOSED) once the connection is gone."""

    async def serve(self) -> None:
        """Hand what is received to ``on_data`` until the connection ends."""

    async def aclose(self) -> None: ...


class ProtocolLink(asyncio.Protocol):
    """A :class:`Link` on an asyncio transport (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_data: OnData) -> None:
        self._on_data = on_data
        self._transport: asyncio.Transport | None = None
        self._lost: asyncio.Future[None] = loop.create_future()
        self._writable = asyncio.Event()  # cleared while the transport asks us to pause
        self._writable.set()

    @classmethod
    async def connect(cls, path: Path, on_data: OnData) -> ProtocolLink:
        """Raises OSError when nothing listens at ``path``."""
        loop = asyncio.get_running_loop()
        _, link = await loop.create_unix_connection(lambda: cls(loop, on_data), str(path))
        return link

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not a subclass of asyncio.Transport: duck-typed).
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        assert self._transport is not None
        replies = self._on_data(data)
        if replies is None:
            self._transport.close()
            return
        for line in replies:
            self._transport.write(line)

    def eof_received(self) -> bool:
        return False  # the node closed its side: so do we

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._lost.done():
            self._lost.set_result(None)
        self._writable.set()  # writers waiting for room learn that the connection is gone

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # -- Link ---------------------------------------------------------------------------------

    async def send(self, line: bytes) -> None:
        transport = self._transport
        if transport is None or self._lost.done() or transport.is_closing():
            raise _gone()
        transport.write(line)
        if not self._writable.is_set():
            await self._writable.wait()  # back-pressure: until the buffer drains (or the end)
            if self._lost.done():
                raise _gone()

    async def serve(self) -> None:
        # The protocol's callbacks do the reading; this waits for the end. Shielded: a
        # cancelled waiter must not cancel the future connection_lost settles.
        await asyncio.shield(self._lost)

    async def aclose(self) -> None:
        if self._transport is None:
            return
        self._transport.close()
        # connection_lost comes at the loop's next pass; bounded all the same.
        await asyncio.wait({self._lost}, timeout=CLOSE_TIMEOUT)


class StreamLink:
    """A :class:`Link` on an anyio socket stream (see the module docstring)."""

    def __init__(self, stream: anyio.abc.SocketStream, on_data: OnData) -> None:
        self._stream = stream
        self._on_data = on_data
        self._write_lock = anyio.Lock()

    @classmethod
    async def connect(cls, path: Path, on_data: OnData) -> StreamLink:
        """Raises OSError when nothing listens at ``path``."""
        return cls(await anyio.connect_unix(path), on_data)

    async def send(self, line: bytes) -> None:
        try:
            async with self._write_lock:
                await self._stream.send(line)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise _gone(exc) from None

    async def serve(self) -> None:
        while True:  # until the node closes the connection or sends a bad line
            try:
                data = await self._stream.receive(READ_SIZE)
            except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                return
            replies = self._on_data(data)
            if replies is None:
                return
            try:
                for line in replies:
                    await self.send(line)
            except LocalError:  # gone: the next read says so
                continue

    async def aclose(self) -> None:
        await self._stream.aclose()


__all__ = ["READ_SIZE", "Link", "OnData", "ProtocolLink", "StreamLink"]
