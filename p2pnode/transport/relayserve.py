"""Circuit relays on trio: the relay server and its two clients.

Theory of operation (the rules are :mod:`p2pnode.transport.relay`, the contract
docs/protocol/relay.md). Everything runs on a :class:`~p2pnode.transport.net.Network`,
so the same code serves real sockets (:class:`~p2pnode.transport.net.TrioNetwork`)
and the simulator (:class:`p2pnode.simnet.SimNetwork`).

* :class:`RelayServer` accepts streams and reads each one's first control frame
  within ``control_timeout``: RESERVE makes the stream a reservation's control
  stream (one writer task sends its INCOMING notices and renewal replies; the
  reservation ends when the stream closes, when a newer stream of the same peer
  replaces it, or at its expiry unless renewed); CONNECT waits up to
  ``pending_timeout`` for the target's ACCEPT and then splices the two streams;
  ACCEPT hands its stream to the waiting CONNECT. The splice forwards bytes as
  they come (never parsing them), metered per direction
  (:class:`~p2pnode.transport.relay.CircuitMeter`), inside a cancel scope at the
  circuit's duration limit. Between two TCP streams (TrioNetwork's) each direction
  moves bytes with the socket calls themselves, one buffer, no yield after a write
  (``_pump_sockets``); other streams (the simulator's) go through
  ``receive_some``/``send_all``. Both keep every limit.
* :func:`connect_via_relay` is the dialer: CONNECT, wait for OK, and return the
  relayed stream, on which the caller runs the ordinary secure-channel handshake.
* :func:`reserve` is the target: an async context manager holding a reservation
  (renewed at half its lifetime) whose :meth:`RelayReservation.accept` yields the
  relayed inbound streams, as a listener would.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import trio

from p2pnode.core.errors import ErrorCode, RemoteError
from p2pnode.core.identity import Identity, PeerId
from p2pnode.transport.net import Address, Network, StreamListener
from p2pnode.transport.relay import (
    Accept,
    CircuitEnd,
    CircuitMeter,
    Connect,
    ControlMessage,
    ControlReader,
    Incoming,
    Ok,
    Refused,
    RelayAddress,
    RelayCore,
    RelayError,
    RelayLimits,
    RelayRefusal,
    RelayRefusedError,
    RelayStatistics,
    Reserve,
    encode_message,
    reserve_message,
)
from p2pnode.transport.tcpstream import TcpStream

__all__ = [
    "RelayListener",
    "RelayReservation",
    "RelayServer",
    "RelayedStream",
    "connect_via_relay",
    "reserve",
]

_log = logging.getLogger("p2pnode.transport.relay")
#: Bytes read per receive while a control frame is expected (frames are < 514 bytes).
_CONTROL_READ = 1024
#: Bytes read per receive while splicing.
_SPLICE_READ = 64 * 1024
#: Chunks a socket splice forwards in a row without waiting before it yields once.
_EAGER_CHUNKS = 16


class RelayedStream(trio.abc.Stream):
    """A stream through a relay: the bytes that came with the relay's OK first, then
    the relay connection's. Run the secure-channel handshake on it."""

    def __init__(self, inner: trio.abc.Stream, rest: bytes, relay: Address) -> None:
        self._inner = inner
        self._rest = rest
        #: The relay this stream goes through (not the peer's address).
        self.relay_address = relay

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self._rest:
            size = len(self._rest) if max_bytes is None else max_bytes
            data, self._rest = self._rest[:size], self._rest[size:]
            await trio.lowlevel.checkpoint()
            return data
        return await self._inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self._inner.aclose()


async def _read_message(stream: trio.abc.Stream, reader: ControlReader) -> ControlMessage:
    """The next control frame. Raises RelayError (also CHANNEL_CLOSED at end of stream)."""
    while True:
        message = reader.next_message_untrusted()
        if message is not None:
            return message
        data = await stream.receive_some(_CONTROL_READ)
        if not data:
            raise RelayError(ErrorCode.CHANNEL_CLOSED, "relay stream closed")
        reader.receive_data_untrusted(data)


def _remote_host(stream: trio.abc.Stream) -> str:
    address = getattr(stream, "remote_address", None)  # TcpStream, simulated streams
    if isinstance(address, tuple) and address and isinstance(address[0], str):
        return address[0]
    return "?"


# --- the server ----------------------------------------------------------------------


@dataclass(slots=True)
class _Slot:
    """Where an ACCEPT hands its stream to the CONNECT waiting for it."""

    arrived: trio.Event = field(default_factory=trio.Event)
    done: trio.Event = field(default_factory=trio.Event)
    stream: trio.abc.Stream | None = None
    rest: bytes = b""


@dataclass(slots=True)
class _Control:
    """A reservation's control stream as the server holds it."""

    generation: int
    frames: trio.MemorySendChannel[bytes]
    scope: trio.CancelScope


class RelayServer:
    """A blind relay: reservations, and circuits spliced to targets that hold one."""

    def __init__(
        self,
        network: Network,
        relay_id: PeerId,
        limits: RelayLimits | None = None,
        *,
        wall_clock: Callable[[], float] = time.time,
        token_bytes: Callable[[int], bytes] | None = None,
    ) -> None:
        """``relay_id`` is the peer id RESERVE signatures name (the relaying node's)."""
        self.limits = limits if limits is not None else RelayLimits()
        extra = {} if token_bytes is None else {"token_bytes": token_bytes}
        self.core = RelayCore(relay_id, self.limits, **extra)
        self._network = network
        self._wall_clock = wall_clock
        self._controls: dict[PeerId, _Control] = {}
        self._slots: dict[bytes, _Slot] = {}
        self._connections = 0
        self._max_connections = self.limits.max_reservations + 2 * self.limits.max_circuits + 64
        self._handlers: dict[type, Callable[..., Awaitable[None]]] = {
            Reserve: self._serve_reservation,
            Connect: self._serve_connect,
            Accept: self._serve_accept,
        }

    def statistics(self) -> RelayStatistics:
        """What the relay holds and has relayed."""
        return self.core.statistics()

    async def serve(
        self, address: Address, *, task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Listen at ``address`` and relay until cancelled; ``started`` gives the bound
        address. Raises OSError if the address cannot be bound."""
        listener = await self._network.listen_stream(address)
        await self.serve_listener(listener, task_status=task_status)

    async def serve_listener(
        self,
        listener: StreamListener,
        *,
        task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Relay on the streams ``listener`` accepts until cancelled (then close it)."""
        try:
            async with trio.open_nursery() as nursery:
                task_status.started(listener.local_address)
                while True:
                    stream = await listener.accept()
                    if self._connections >= self._max_connections:
                        await trio.aclose_forcefully(stream)
                        continue
                    self._connections += 1
                    nursery.start_soon(self._handle, stream)
        finally:
            with trio.CancelScope(shield=True):
                await listener.aclose()

    async def _handle(self, stream: trio.abc.Stream) -> None:
        source = _remote_host(stream)
        reader = ControlReader()
        try:
            first: ControlMessage | None = None
            with trio.move_on_after(self.limits.control_timeout):
                first = await _read_message(stream, reader)
            if first is None:
                return  # silent past control_timeout: not worth a reply
            handler = self._handlers.get(type(first))
            if handler is None:
                raise self.core.refused(RelayRefusal.MALFORMED, "not a request")
            await handler(stream, reader, first, source)
        except RelayRefusedError as exc:
            _log.info("relay refused %s: %s", source, exc)
            await _send_quietly(stream, Refused(exc.reason, exc.retry_after))
        except RelayError as exc:
            _log.info("relay: bad control frame from %s: %s", source, exc)
            if exc.code is not ErrorCode.CHANNEL_CLOSED:
                self.core.refused(RelayRefusal.MALFORMED, exc.message)
                await _send_quietly(stream, Refused(RelayRefusal.MALFORMED))
        except RemoteError as exc:  # an invalid peer id in CONNECT
            _log.info("relay: bad request from %s: %s", source, exc)
            self.core.refused(RelayRefusal.MALFORMED, exc.message)
            await _send_quietly(stream, Refused(RelayRefusal.MALFORMED))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception:  # a defect: contained to this connection, never the relay
            _log.exception("relay: connection from %s failed", source)
        finally:
            self._connections -= 1
            await trio.aclose_forcefully(stream)

    # --- reservations --------------------------------------------------------------

    def _wall_ms(self) -> int:
        return int(self._wall_clock() * 1000)

    async def _serve_reservation(
        self, stream: trio.abc.Stream, reader: ControlReader, first: Reserve, source: str
    ) -> None:
        now = trio.current_time()
        granted = self.core.reserve_untrusted(first, source, now, self._wall_ms(), generation=None)
        peer_id, generation = granted.peer_id, granted.generation
        send, receive = trio.open_memory_channel[bytes](self.limits.max_circuits_per_reservation)
        try:
            async with trio.open_nursery() as nursery:
                nursery.cancel_scope.deadline = granted.expires
                replaced = self._controls.get(peer_id)
                if replaced is not None:
                    replaced.scope.cancel()
                self._controls[peer_id] = _Control(generation, send, nursery.cancel_scope)
                send.send_nowait(encode_message(Ok(ttl=int(self.limits.reservation_ttl))))
                nursery.start_soon(_write_frames, stream, receive)
                await self._renewals(stream, reader, peer_id, generation, nursery.cancel_scope)
                send.close()  # the writer sends what is queued (a REFUSED), then ends
        finally:
            send.close()
            self.core.release(peer_id, generation)
            held = self._controls.get(peer_id)
            if held is not None and held.generation == generation:
                del self._controls[peer_id]

    async def _renewals(
        self,
        stream: trio.abc.Stream,
        reader: ControlReader,
        peer_id: PeerId,
        generation: int,
        scope: trio.CancelScope,
    ) -> None:
        """Read renewals until the stream ends or a renewal is refused."""
        frames = self._controls[peer_id].frames
        while True:
            try:
                message = await _read_message(stream, reader)
            except RelayError as exc:  # the target left, or sent a bad frame
                if exc.code is not ErrorCode.CHANNEL_CLOSED:
                    _log.info("relay: bad frame on %s's control stream: %s", peer_id, exc)
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not isinstance(message, Reserve) or message.peer_id != peer_id:
                _log.info("relay: %s sent a control frame other than RESERVE", peer_id)
                return
            try:
                granted = self.core.reserve_untrusted(
                    message, _remote_host(stream), trio.current_time(), self._wall_ms(),
                    generation=generation,
                )  # fmt: skip
            except RelayRefusedError as exc:
                _log.info("relay refused a renewal of %s: %s", peer_id, exc)
                reply: ControlMessage = Refused(exc.reason, exc.retry_after)
            else:
                scope.deadline = granted.expires
                reply = Ok(ttl=int(self.limits.reservation_ttl))
            try:
                frames.send_nowait(encode_message(reply))
            except trio.WouldBlock:  # the target does not read its notices: let it go
                _log.info("relay: %s's control stream is not read; closing it", peer_id)
                return
            if isinstance(reply, Refused):
                return

    # --- circuits --------------------------------------------------------------------

    async def _serve_connect(
        self, stream: trio.abc.Stream, reader: ControlReader, first: Connect, source: str
    ) -> None:
        pending = self.core.connect(first.target, source, trio.current_time())
        slot = _Slot()
        self._slots[pending.token] = slot
        try:
            self._notify(first.target, pending.token)
            with trio.move_on_at(pending.deadline):
                await slot.arrived.wait()
        finally:
            del self._slots[pending.token]
            if not slot.arrived.is_set():
                self.core.abandon(pending.token)
        if slot.stream is None:
            raise self.core.refused(RelayRefusal.ACCEPT_TIMEOUT, "target did not accept")
        end = CircuitEnd.CLOSED
        try:
            limits = self.core.circuit_limits()
            await stream.send_all(encode_message(limits))
            await slot.stream.send_all(encode_message(limits))
            end = await self._splice(stream, reader.take_rest(), slot.stream, slot.rest)
        finally:
            self.core.circuit_closed(first.target, end)
            slot.done.set()

    def _notify(self, target: PeerId, token: bytes) -> None:
        """Queue INCOMING on the target's control stream. Raises RelayRefusedError."""
        control = self._controls.get(target)
        if control is None:
            raise self.core.refused(RelayRefusal.NO_RESERVATION, "target's control stream gone")
        try:
            control.frames.send_nowait(encode_message(Incoming(token)))
        except trio.WouldBlock:
            refusal = self.core.refused(RelayRefusal.CONNECTION_LIMIT, "target has a backlog")
            raise refusal from None
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            refusal = self.core.refused(RelayRefusal.NO_RESERVATION, "target's reservation ended")
            raise refusal from None

    async def _serve_accept(
        self, stream: trio.abc.Stream, reader: ControlReader, first: Accept, source: str
    ) -> None:
        slot = self._slots.get(first.token)
        self.core.accept(first.token, trio.current_time())  # UNKNOWN_TOKEN when not pending
        if slot is None:  # cannot happen: a pending token always has its slot
            raise RelayError(ErrorCode.INTERNAL, "pending circuit without a slot")
        slot.stream, slot.rest = stream, reader.take_rest()
        slot.arrived.set()
        await slot.done.wait()  # the CONNECT's task splices; this task keeps the stream open

    async def _splice(
        self, a: trio.abc.Stream, a_rest: bytes, b: trio.abc.Stream, b_rest: bytes
    ) -> CircuitEnd:
        """Forward bytes both ways until one side ends or a limit is reached."""
        ends: list[CircuitEnd] = []
        with trio.move_on_after(self.limits.circuit_duration) as timer:
            async with trio.open_nursery() as nursery:
                scope = nursery.cancel_scope
                if isinstance(a, TcpStream) and isinstance(b, TcpStream):  # TrioNetwork's
                    sa, sb = a.socket, b.socket
                    nursery.start_soon(self._pump_sockets, sa, sb, a_rest, scope, ends)
                    nursery.start_soon(self._pump_sockets, sb, sa, b_rest, scope, ends)
                else:
                    nursery.start_soon(self._pump, a, b, a_rest, scope, ends)
                    nursery.start_soon(self._pump, b, a, b_rest, scope, ends)
        if timer.cancelled_caught:
            return CircuitEnd.DURATION_LIMIT
        return ends[0] if ends else CircuitEnd.CLOSED

    async def _pump(
        self,
        source: trio.abc.Stream,
        sink: trio.abc.Stream,
        data: bytes | bytearray,
        scope: trio.CancelScope,
        ends: list[CircuitEnd],
    ) -> None:
        """One direction between two streams of any kind (the simulator's)."""
        meter = CircuitMeter(self.limits, trio.current_time())
        try:
            while True:
                if not data:
                    data = await source.receive_some(_SPLICE_READ)
                    if not data:
                        break
                delay = meter.admit(len(data), trio.current_time() if meter.paced else 0.0)
                if delay and not await self._paced(delay, ends):
                    break
                await sink.send_all(data)
                self.core.count_bytes(len(data))
                data = b""
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            scope.cancel()  # one direction over: the circuit is over

    @staticmethod
    async def _paced(delay: float, ends: list[CircuitEnd]) -> bool:
        """What a meter's nonzero answer means: wait out the pacing, or False (and the
        circuit's end) when the bytes would cross the byte budget."""
        if delay < 0:
            ends.append(CircuitEnd.DATA_LIMIT)
            return False
        await trio.sleep(delay)
        return True

    async def _pump_sockets(
        self,
        source: socket.socket,
        sink: socket.socket,
        data: bytes,
        scope: trio.CancelScope,
        ends: list[CircuitEnd],
    ) -> None:
        """One direction between two TCP sockets: read into one buffer and write it out
        with the socket calls themselves. A stream's ``send_all`` yields after every
        write and its ``receive_some`` returns a fresh object; a splice needs neither.
        A read that did not fill the buffer took all there was, so the next one waits
        for the socket first instead of trying a read that fails: a relayed round trip
        crosses the splice twice, and that failed read was a system call and an
        exception each time. The task waits only in trio (``wait_readable``,
        ``wait_writable``) and yields after :data:`_EAGER_CHUNKS` chunks in a row that
        did not wait, so a full pipe cannot keep other tasks (or the circuit's deadline)
        from running."""
        meter = CircuitMeter(self.limits, trio.current_time())
        buffer = bytearray(_SPLICE_READ)
        view = memoryview(buffer)
        eager = 0
        drained = False  # the last read took all there was
        try:
            while True:
                if data:
                    chunk, data = memoryview(data), b""
                else:
                    if drained:
                        eager = 0
                        await trio.lowlevel.wait_readable(source)
                    try:
                        n = source.recv_into(buffer)
                    except BlockingIOError:
                        drained = True
                        continue
                    if not n:
                        break
                    drained = n < _SPLICE_READ
                    chunk = view[:n]
                delay = meter.admit(len(chunk), trio.current_time() if meter.paced else 0.0)
                if delay and not await self._paced(delay, ends):
                    break
                try:
                    sent = sink.send(chunk)
                except BlockingIOError:
                    sent = 0
                if sent < len(chunk):
                    await _send_rest(sink, chunk, sent)
                self.core.count_bytes(len(chunk))
                eager += 1
                if eager >= _EAGER_CHUNKS:
                    eager = 0
                    await trio.lowlevel.checkpoint()
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # a reset, or the other direction closed the socket: the circuit is over
        finally:
            scope.cancel()


async def _send_rest(sink: socket.socket, chunk: memoryview, sent: int) -> None:
    """Write ``chunk`` from ``sent`` on, waiting in trio while the socket's buffer is
    full. Raises OSError (the connection broke) or trio.ClosedResourceError."""
    while sent < len(chunk):
        await trio.lowlevel.wait_writable(sink)
        try:
            sent += sink.send(chunk[sent:])
        except BlockingIOError:
            pass


async def _write_frames(stream: trio.abc.Stream, frames: trio.MemoryReceiveChannel[bytes]) -> None:
    """The one writer of a control stream: send queued frames until the queue closes."""
    async with frames:
        async for frame in frames:
            await stream.send_all(frame)


async def _send_quietly(stream: trio.abc.Stream, message: ControlMessage) -> None:
    """Best effort: a refusal to a peer that is already gone is nobody's problem."""
    with trio.move_on_after(1.0):
        try:
            await stream.send_all(encode_message(message))
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            pass


# --- the clients ---------------------------------------------------------------------


def _refusal(reply: Refused) -> RelayRefusedError:
    return RelayRefusedError(reply.reason, f"relay refused: {reply.reason}", reply.retry_after)


async def _request(
    stream: trio.abc.Stream, request: ControlMessage, reply_within: float
) -> tuple[Ok, bytes]:
    """Send ``request``, wait for OK: it and the bytes after it. Raises RelayRefusedError,
    RelayError (MALFORMED_MESSAGE, CHANNEL_CLOSED, TIMEOUT)."""
    reader = ControlReader()
    reply: ControlMessage | None = None
    with trio.move_on_after(reply_within):
        await stream.send_all(encode_message(request))
        reply = await _read_message(stream, reader)
    if reply is None:
        raise RelayError(ErrorCode.TIMEOUT, "relay did not answer in time")
    if isinstance(reply, Refused):
        raise _refusal(reply)
    if not isinstance(reply, Ok):
        raise RelayError(ErrorCode.MALFORMED_MESSAGE, "relay answered with a request")
    return reply, reader.take_rest()


async def connect_via_relay(
    network: Network, relay: RelayAddress, target: PeerId, *, reply_within: float = 15.0
) -> RelayedStream:
    """A stream to ``target`` through ``relay`` (run ``connect_secure`` on it, expecting
    ``target``). Raises RelayRefusedError with the relay's reason, RelayError (TIMEOUT,
    CHANNEL_CLOSED, MALFORMED_MESSAGE), OSError when the relay cannot be reached."""
    stream = await network.connect_stream(relay.address)
    try:
        _, rest = await _request(stream, Connect(target), reply_within)
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return RelayedStream(stream, rest, relay.address)


#: What makes one ACCEPT fail (the reservation holds on).
_ACCEPT_FAILURES = (
    RemoteError,
    trio.WouldBlock,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
)


class RelayReservation:
    """A reservation held on a relay (from :func:`reserve`): relayed inbound streams."""

    def __init__(
        self,
        network: Network,
        relay: RelayAddress,
        identity: Identity,
        stream: trio.abc.Stream,
        *,
        wall_clock: Callable[[], float],
        reply_within: float,
        backlog: int,
    ) -> None:
        self.relay = relay
        self._network = network
        self._identity = identity
        self._stream = stream
        self._wall_clock = wall_clock
        self._timeout = reply_within
        self._backlog = backlog
        self._accepting = 0
        self._last_ms = 0
        self._renewed = trio.Event()
        self._reader = ControlReader()
        #: The reservation's lifetime as the relay last granted it (seconds).
        self.ttl = 0
        #: Why the reservation ended, once it has.
        self.failure: RemoteError | None = None
        self._send, self._receive = trio.open_memory_channel[RelayedStream](backlog)

    def _reserve_frame(self) -> bytes:
        wall_ms = max(int(self._wall_clock() * 1000), self._last_ms + 1)
        self._last_ms = wall_ms
        return encode_message(reserve_message(self._identity, self.relay.relay_id, wall_ms))

    async def accept(self) -> trio.abc.Stream:
        """The next relayed inbound stream (run ``accept_secure`` on it). Raises
        RelayError(CHANNEL_CLOSED) once the reservation has ended (``failure`` says why)."""
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise RelayError(ErrorCode.CHANNEL_CLOSED, "reservation ended") from self.failure

    async def _open(self) -> None:
        reader = self._reader
        reply: ControlMessage | None = None
        with trio.move_on_after(self._timeout):
            await self._stream.send_all(self._reserve_frame())
            reply = await _read_message(self._stream, reader)
        if reply is None:
            raise RelayError(ErrorCode.TIMEOUT, "relay did not answer in time")
        self._handle_reply(reply)

    def _handle_reply(self, reply: ControlMessage) -> None:
        if isinstance(reply, Refused):
            raise _refusal(reply)
        if not isinstance(reply, Ok) or reply.ttl <= 0:
            raise RelayError(ErrorCode.MALFORMED_MESSAGE, "expected OK with a lifetime")
        self.ttl = reply.ttl
        self._renewed.set()

    async def _run(self) -> None:
        """Read notices and renew until the control stream ends; then close accept()."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._renew, nursery.cancel_scope)
                await self._guarded(self._read_notices, nursery)
                nursery.cancel_scope.cancel()
        finally:
            self._send.close()

    async def _guarded(self, work: Callable[..., Awaitable[None]], *args: object) -> None:
        """Run ``work``; a relay fault or a lost connection ends the reservation."""
        try:
            await work(*args)
        except RemoteError as exc:
            self.failure = exc
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self.failure = RelayError(ErrorCode.CHANNEL_CLOSED, f"relay connection lost: {exc}")
        if self.failure is not None:
            _log.info("reservation on %s ended: %s", self.relay, self.failure)

    async def _read_notices(self, nursery: trio.Nursery) -> None:
        while True:
            message = await _read_message(self._stream, self._reader)
            if isinstance(message, Incoming):
                self._take_incoming(nursery, message.token)
            else:
                self._handle_reply(message)

    async def _renew(self, scope: trio.CancelScope) -> None:
        """Send a fresh RESERVE at half the granted lifetime; end the reservation if no
        OK follows in time."""
        await self._guarded(self._renew_forever)
        scope.cancel()

    async def _renew_forever(self) -> None:
        while True:
            await trio.sleep(max(self.ttl / 2, 0.5))
            self._renewed = trio.Event()
            await self._stream.send_all(self._reserve_frame())
            with trio.move_on_after(self._timeout):
                await self._renewed.wait()
            if not self._renewed.is_set():
                raise RelayError(ErrorCode.TIMEOUT, "relay did not renew the reservation")

    def _take_incoming(self, nursery: trio.Nursery, token: bytes) -> None:
        if self._accepting >= self._backlog:
            _log.info("reservation on %s: INCOMING dropped (backlog full)", self.relay)
            return
        self._accepting += 1
        nursery.start_soon(self._accept_incoming, token)

    async def _accept_incoming(self, token: bytes) -> None:
        try:
            stream = await self._network.connect_stream(self.relay.address)
        except OSError as exc:
            _log.info("reservation on %s: cannot reach the relay to accept: %s", self.relay, exc)
            self._accepting -= 1
            return
        handed = False
        try:
            _, rest = await _request(stream, Accept(token), self._timeout)
            self._send.send_nowait(RelayedStream(stream, rest, self.relay.address))
            handed = True
        except _ACCEPT_FAILURES as exc:
            _log.info("reservation on %s: accept failed: %s", self.relay, exc)
        finally:
            self._accepting -= 1
            if not handed:
                await trio.aclose_forcefully(stream)


@asynccontextmanager
async def reserve(
    network: Network,
    relay: RelayAddress,
    identity: Identity,
    *,
    wall_clock: Callable[[], float] = time.time,
    reply_within: float = 10.0,
    backlog: int = 16,
) -> AsyncIterator[RelayReservation]:
    """Hold a reservation of ``identity`` on ``relay`` for the block's duration.

    Raises RelayRefusedError (the relay's reason), RelayError (TIMEOUT,
    CHANNEL_CLOSED, MALFORMED_MESSAGE) or OSError if it cannot be made.
    """
    stream = await network.connect_stream(relay.address)
    try:
        reservation = RelayReservation(
            network, relay, identity, stream,
            wall_clock=wall_clock, reply_within=reply_within, backlog=backlog,
        )  # fmt: skip
        await reservation._open()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(reservation._run)
                try:
                    yield reservation
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            # _run contains its own failures: what escapes is the block's own exception,
            # which the caller should see as raised, not wrapped by our nursery.
            if len(group.exceptions) == 1:
                raise group.exceptions[0] from None
            raise
    finally:
        await trio.aclose_forcefully(stream)



class RelayListener(StreamListener):
    """A listener whose inbound streams come through a relay: :meth:`keep` holds a
    reservation there (made again after it is lost, at most every ``retry_max``
    seconds), and :meth:`accept` returns the relayed streams, so a node's accept loop
    takes relayed channels as it takes direct ones."""

    def __init__(
        self,
        network: Network,
        relay: RelayAddress,
        identity: Identity,
        *,
        wall_clock: Callable[[], float] = time.time,
        backlog: int = 16,
        retry_min: float = 1.0,
        retry_max: float = 60.0,
    ) -> None:
        self.relay = relay
        self._network = network
        self._identity = identity
        self._wall_clock = wall_clock
        self._backlog = backlog
        self._retry = (retry_min, retry_max)
        self._send, self._receive = trio.open_memory_channel[trio.abc.Stream](backlog)
        #: The reservation held now (None between a loss and the next reservation).
        self.reservation: RelayReservation | None = None
        #: Why the last reservation could not be made or ended.
        self.failure: BaseException | None = None

    @property
    def local_address(self) -> Address:
        """The relay's address (where dialers connect to reach this node)."""
        return self.relay.address

    async def accept(self) -> trio.abc.Stream:
        """The next relayed inbound stream. Raises trio.ClosedResourceError once closed."""
        try:
            return await self._receive.receive()
        except trio.EndOfChannel:
            raise trio.ClosedResourceError("relay listener closed") from None

    async def aclose(self) -> None:
        """Stop taking streams (the reservation ends when :meth:`keep` is cancelled)."""
        self._send.close()
        await trio.lowlevel.checkpoint()

    async def keep(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold a reservation until cancelled, reserving again after each loss."""
        task_status.started()
        delay = self._retry[0]
        while True:
            try:
                async with reserve(
                    self._network, self.relay, self._identity,
                    wall_clock=self._wall_clock, backlog=self._backlog,
                ) as reservation:  # fmt: skip
                    self.reservation, delay = reservation, self._retry[0]
                    await self._forward(reservation)
            except (RemoteError, OSError) as exc:
                self.failure = exc
                _log.info("reservation on %s failed: %s", self.relay, exc)
            self.reservation = None
            await trio.sleep(delay)
            delay = min(delay * 2, self._retry[1])

    async def _forward(self, reservation: RelayReservation) -> None:
        while True:
            stream = await reservation.accept()  # RelayError once the reservation ends
            try:
                self._send.send_nowait(stream)
            except (trio.WouldBlock, trio.ClosedResourceError):
                await trio.aclose_forcefully(stream)  # nobody takes it now
