"""A TCP connection as a trio stream, for the node's channels.

Theory of operation: :class:`trio.SocketStream` makes every ``receive_some``
and ``send_all`` a full checkpoint: it yields to the scheduler even when the
socket call succeeded at once, and it goes through several layers of
wrappers to get there. A node's read loop reads a frame, handles it and
reads again, so one round trip paid two needless scheduler passes and the
wrappers four times over.

:class:`TcpStream` calls the socket directly:

* ``receive_some`` returns data already in the kernel's buffer without
  yielding, and waits (a checkpoint) only when there is none. It still
  raises if the task was cancelled, and it yields after every
  :data:`EAGER_RECEIVES` reads in a row that did not wait, so a peer that
  keeps the buffer full cannot keep other tasks from running.
* ``send_all`` yields once after the write, as trio's does: a channel's
  writer holds its send lock across that pass, which is when other senders
  queue their messages to go out together in the next write.

Errors follow :class:`trio.abc.HalfCloseableStream`: a failed socket call is
``trio.BrokenResourceError``, use after :meth:`TcpStream.aclose` is
``trio.ClosedResourceError``, and two tasks sending (or receiving) at once
is ``trio.BusyResourceError``.
"""

from __future__ import annotations

import errno
import socket
from typing import Any

import trio

#: Reads in a row that found data waiting, after which ``receive_some`` yields once.
EAGER_RECEIVES = 16


class TcpStream(trio.abc.HalfCloseableStream):
    """A connected TCP socket as a trio stream (module docstring)."""

    __slots__ = (
        "_closed", "_eager", "_eager_receives", "_receiving", "_sending", "_shut", "_sock"
    )  # fmt: skip

    def __init__(self, sock: socket.socket, *, eager_receives: int = EAGER_RECEIVES) -> None:
        """Take ownership of the connected ``sock``: it is made non-blocking, with
        Nagle's algorithm off, and closed by :meth:`aclose`. ``eager_receives`` = 1
        makes every ``receive_some`` a full checkpoint, as trio's streams are."""
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # What trio.SocketStream sets too: the kernel reports the socket writable only
            # while less than this is unsent, so a writer does not queue megabytes there.
            if hasattr(socket, "TCP_NOTSENT_LOWAT"):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, 2**14)
        except OSError:  # not a TCP socket (a socketpair in tests)
            pass
        self._sock = sock
        self._sending = False
        self._receiving = False
        self._closed = False
        self._shut = False
        self._eager = 0
        self._eager_receives = max(1, eager_receives)

    @classmethod
    def adopt(cls, stream: trio.SocketStream) -> TcpStream:
        """The connection of ``stream``, which is left closed (it gives up its socket)."""
        return cls(socket.socket(fileno=stream.socket.detach()))

    @property
    def socket(self) -> socket.socket:
        """The connected socket, for code that moves bytes between two sockets itself (a
        relay's splice). It stays owned by this stream: do not close it."""
        return self._sock

    @property
    def remote_address(self) -> tuple[Any, ...] | None:
        """The peer's address, as :meth:`socket.socket.getpeername` gives it (None once
        it cannot be read)."""
        try:
            address: tuple[Any, ...] = self._sock.getpeername()
        except OSError:
            return None
        return address

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._begin_send(after_eof=False)
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            sock = self._sock
            try:
                sent = sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                raise self._broken(exc) from exc
            with memoryview(data) as view:
                total = view.nbytes
                while sent < total:
                    await trio.lowlevel.wait_writable(sock)
                    try:
                        sent += sock.send(view[sent:])
                    except BlockingIOError:
                        pass
                    except OSError as exc:
                        raise self._broken(exc) from exc
            await trio.lowlevel.cancel_shielded_checkpoint()
        finally:
            self._sending = False

    async def wait_send_all_might_not_block(self) -> None:
        await self._begin_send(after_eof=True)
        try:
            await trio.lowlevel.wait_writable(self._sock)
        finally:
            self._sending = False

    async def send_eof(self) -> None:
        await self._begin_send(after_eof=True)
        try:
            await trio.lowlevel.checkpoint()
            if self._shut:
                return
            self._shut = True
            try:
                self._sock.shutdown(socket.SHUT_WR)
            except OSError as exc:
                raise self._broken(exc) from exc
        finally:
            self._sending = False

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._receiving:
            raise trio.BusyResourceError("another task is receiving on this stream")
        if self._closed:
            await self._closed_error()
        size = 65536 if max_bytes is None else max_bytes
        if size < 1:
            raise ValueError("max_bytes must be >= 1")
        self._receiving = True
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
            sock = self._sock
            while True:
                try:
                    data = sock.recv(size)
                except BlockingIOError:
                    self._eager = 0
                    await trio.lowlevel.wait_readable(sock)
                    continue
                except OSError as exc:
                    raise self._broken(exc) from exc
                break
            self._eager += 1
            if self._eager >= self._eager_receives:
                self._eager = 0
                await trio.lowlevel.cancel_shielded_checkpoint()
            return data
        finally:
            self._receiving = False

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            trio.lowlevel.notify_closing(self._sock)
            self._sock.close()
        await trio.lowlevel.checkpoint()

    async def _begin_send(self, *, after_eof: bool) -> None:
        """Take the sending side, or raise: BusyResourceError while another task has it,
        ClosedResourceError once closed (or, unless ``after_eof``, after send_eof)."""
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this stream")
        if self._closed or (self._shut and not after_eof):
            await self._closed_error()
        self._sending = True

    @staticmethod
    async def _closed_error() -> None:
        await trio.lowlevel.checkpoint()
        raise trio.ClosedResourceError("the stream was closed")

    def _broken(self, exc: OSError) -> Exception:
        if self._closed or exc.errno == errno.EBADF:
            return trio.ClosedResourceError("the stream was closed")
        return trio.BrokenResourceError(f"socket error: {exc}")


__all__ = ["EAGER_RECEIVES", "TcpStream"]
