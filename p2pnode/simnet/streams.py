"""Simulated TCP for :mod:`p2pnode.simnet`: listeners and streams honouring latency,
partitions and kills.

Theory of operation: a connection is two :class:`Pipe` objects, one per
direction, each an ordered queue of ``(delivery time, chunk)`` (delivery
times never decrease, so bytes stay in order as TCP keeps them). A sender
pushes and wakes the reader's parking lot; the reader sleeps until the head
chunk is due. While :meth:`p2pnode.simnet.SimNetwork.drive` runs, the driver
keeps the due times instead (rounded up to its ``tick``, as datagrams are) and
wakes the reader when its chunk is due: the reader parks without a cancel
scope of its own, and chunks due in one tick are handed over in one pass with
the datagrams due then. At most ``_STREAM_WINDOW`` bytes are in flight per direction
before ``send_all`` waits. A partition or a kill breaks every stream that
crosses it (:meth:`p2pnode.simnet.SimNetwork.kill`).
"""

from __future__ import annotations

import math
import operator
from collections import deque
from typing import TYPE_CHECKING

import trio

from p2pnode.transport.net import Address, StreamListener

if TYPE_CHECKING:
    from p2pnode.simnet.network import SimNetwork

_STREAM_WINDOW = 256 * 1024  # bytes in flight per stream direction before send_all waits


class SimListener(StreamListener):
    __slots__ = ("_address", "_backlog", "_closed", "_lot", "_sim")

    def __init__(self, sim: SimNetwork, address: Address) -> None:
        self._sim = sim
        self._address = address
        self._backlog: deque[SimStream] = deque()
        self._lot = trio.lowlevel.ParkingLot()
        self._closed = False

    @property
    def local_address(self) -> Address:
        return self._address

    async def accept(self) -> trio.abc.Stream:
        while True:
            if self._closed:
                raise trio.ClosedResourceError("listener closed")
            if self._backlog:
                await trio.lowlevel.checkpoint()
                return self._backlog.popleft()
            await self._lot.park()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            if self._sim._listeners.get(self._address) is self:
                del self._sim._listeners[self._address]
            for s in self._backlog:
                s._break()
            self._backlog.clear()
            self._lot.unpark_all()
        await trio.lowlevel.checkpoint()


class Pipe:
    """One direction of a stream: chunks with delivery times, kept in order."""

    __slots__ = ("broken", "buffered", "chunks", "eof", "last_due", "lot", "released")

    def __init__(self) -> None:
        self.chunks: deque[tuple[float, bytes]] = deque()  # b"" marks EOF
        self.buffered = 0
        self.last_due = 0.0
        # Chunks due by this time were handed over by the driver: readable even if the
        # clock it jumped to reads an ulp short of their due time.
        self.released = -math.inf
        self.broken = False
        self.eof = False  # EOF already handed to the reader
        self.lot = trio.lowlevel.ParkingLot()


class SimStream(trio.abc.HalfCloseableStream):
    """A simulated TCP connection end honouring latency, partitions and kills."""

    def __init__(
        self, sim: SimNetwork, local: Address, remote: Address, *, send: Pipe, recv: Pipe
    ) -> None:
        self._sim = sim
        self.local_address = local
        self.remote_address = remote
        self._send = send
        self._recv = recv
        self._peer: SimStream | None = None
        self._closed = False
        self._send_eof = False
        self._sending = False
        self._receiving = False

    @property
    def local_host(self) -> str:
        return self.local_address[0]

    @property
    def remote_host(self) -> str:
        return self.remote_address[0]

    def _break(self) -> None:
        for s in (self, self._peer):
            if s is not None:
                self._sim._streams.discard(s)
        for p in (self._send, self._recv):
            p.broken = True
            p.lot.unpark_all()

    def _push(self, chunk: bytes) -> None:
        sim, pipe = self._sim, self._send
        due = trio.current_time() + sim._stream_delay(self.local_host, self.remote_host)
        if sim._driven and sim.tick:
            due = math.ceil(due / sim.tick) * sim.tick
        due = max(due, pipe.last_due)
        new_due = due != pipe.last_due
        pipe.last_due = due
        pipe.chunks.append((due, chunk))
        pipe.buffered += len(chunk)
        if sim._driven:
            if due <= pipe.released:  # its time was handed over already
                pipe.lot.unpark_all()
            elif new_due:  # chunks due at one time share one wake-up
                sim._stream_due(pipe, due)
        else:
            pipe.lot.unpark_all()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this stream")
        self._sending = True
        try:
            if self._closed:
                raise trio.ClosedResourceError("stream closed")
            if self._send_eof:
                raise trio.ClosedResourceError("send side already closed")
            while self._send.buffered >= _STREAM_WINDOW and not self._send.broken:
                await self._send.lot.park()
                if self._closed:
                    raise trio.ClosedResourceError("stream closed")
            if self._send.broken or not self._sim.reachable(self.local_host, self.remote_host):
                self._break()
                raise trio.BrokenResourceError("connection lost")
            if data:
                self._push(bytes(data))
            await trio.lowlevel.checkpoint()
        finally:
            self._sending = False

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()
        while True:
            if self._closed:
                raise trio.ClosedResourceError("stream closed")
            if self._send.buffered < _STREAM_WINDOW or self._send.broken:
                return
            await self._send.lot.park()

    async def send_eof(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("stream closed")
        await trio.lowlevel.checkpoint()
        if not self._send_eof:
            self._send_eof = True
            if not self._send.broken:
                self._push(b"")

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if max_bytes is not None:
            max_bytes = operator.index(max_bytes)
            if max_bytes < 1:
                raise ValueError("max_bytes must be >= 1")
        if self._receiving:
            raise trio.BusyResourceError("another task is receiving on this stream")
        self._receiving = True
        try:
            pipe = self._recv
            while True:
                if self._closed:
                    raise trio.ClosedResourceError("stream closed")
                if pipe.broken:
                    raise trio.BrokenResourceError("connection lost")
                if pipe.eof:
                    await trio.lowlevel.checkpoint()
                    return b""
                if pipe.chunks:
                    due, chunk = pipe.chunks[0]
                    if due <= pipe.released or due <= trio.current_time():
                        await trio.lowlevel.checkpoint_if_cancelled()
                        if not chunk:
                            pipe.chunks.popleft()
                            pipe.eof = True
                            continue
                        n = len(chunk) if max_bytes is None else min(max_bytes, len(chunk))
                        if n < len(chunk):
                            pipe.chunks[0] = (due, chunk[n:])
                        else:
                            pipe.chunks.popleft()
                        pipe.buffered -= n
                        pipe.lot.unpark_all()  # a blocked sender may proceed
                        await trio.lowlevel.cancel_shielded_checkpoint()
                        return chunk[:n]
                    if self._sim._driven:
                        await pipe.lot.park()  # the driver wakes it when due
                    else:
                        with trio.move_on_at(due):
                            await pipe.lot.park()
                else:
                    await pipe.lot.park()
        finally:
            self._receiving = False

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._sim._streams.discard(self)
            if not self._send_eof and not self._send.broken:
                self._send_eof = True
                self._push(b"")
            # Like a TCP RST: the peer's later sends fail.
            self._recv.broken = True
            self._recv.lot.unpark_all()
            self._send.lot.unpark_all()
        await trio.lowlevel.checkpoint()


__all__ = ["Pipe", "SimListener", "SimStream"]
