"""Secure channels: the trio driver of :mod:`~p2pnode.transport.secure` and
:mod:`~p2pnode.transport.framing`.

Theory of operation. :func:`connect_secure` and :func:`accept_secure` run a
:class:`~p2pnode.transport.secure.SecureHandshake` over any :class:`trio.abc.Stream`
inside one cancel scope at the handshake deadline, then wrap the stream in a
:class:`SecureChannel` that moves application messages through a
:class:`~p2pnode.transport.framing.TransportCodec`.

Sending: one task writes at a time (a FIFO lock), so frames are never
interleaved. A message sent while another task is writing is queued; the
writing task, before releasing the lock, writes everything queued meanwhile
as one coalesced batch (few Noise frames, one ``send_all``) and wakes the
senders it carried. :meth:`SecureChannel.send_message_nowait` queues without
writing and :meth:`SecureChannel.flush` writes the queue. Receiving: one
task at a time (:class:`trio.BusyResourceError` otherwise); the codec's
deadlines become ``trio.move_on_at`` scopes, entered only while a timer is
armed. Any peer fault closes the stream and raises a
:class:`~p2pnode.core.errors.RemoteError` subclass; every later call raises
CHANNEL_CLOSED. Cancelling a send leaves the channel broken (trio's rule for
``send_all``); cancelling a receive loses nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from math import inf
from types import TracebackType
from typing import Any

import trio

from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.identity import PeerId
from p2pnode.transport.framing import (
    DEFAULT_MAX_MESSAGE_SIZE,
    DEFAULT_RECORD_TIMEOUT,
    TransportCodec,
)
from p2pnode.transport.noise import KeyPair
from p2pnode.transport.secure import (
    HandshakeResult,
    HandshakeStage,
    SecureChannelError,
    SecureHandshake,
    SecureIdentity,
)

__all__ = [
    "DEFAULT_CONFIG",
    "ChannelConfig",
    "ChannelState",
    "ChannelStatistics",
    "SecureChannel",
    "accept_secure",
    "connect_secure",
]


@dataclass(frozen=True, slots=True)
class ChannelConfig:
    """Limits and timeouts of a secure channel (seconds, bytes)."""

    #: The whole handshake must finish within this time.
    handshake_timeout: float = 10.0
    #: ``receive_message`` fails when no byte arrives for this long (None: wait
    #: forever). Arming it costs one trio cancel scope per blocking receive. A node's
    #: links check it themselves and send a keepalive after a third of it without
    #: sending, so a peer that vanished is noticed within this plus a quarter of it.
    idle_timeout: float | None = 12.0
    #: A frame whose first byte arrived must be complete within this time.
    frame_timeout: float = 30.0
    #: A message whose header arrived must be complete within this time.
    record_timeout: float = DEFAULT_RECORD_TIMEOUT
    #: Largest application message, both directions.
    max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE
    #: Bound on bytes queued by ``send_message_nowait`` before a flush.
    max_pending_bytes: int = 1024 * 1024
    #: ``max_bytes`` for each ``receive_some``.
    receive_size: int = 256 * 1024

    def __post_init__(self) -> None:
        for name in (
            "handshake_timeout",
            "frame_timeout",
            "record_timeout",
            "max_message_size",
            "receive_size",
        ):
            if getattr(self, name) <= 0:
                raise LocalError(ErrorCode.CONFIG_ERROR, f"{name} must be positive")
        if self.idle_timeout is not None and self.idle_timeout <= 0:
            raise LocalError(ErrorCode.CONFIG_ERROR, "idle_timeout must be positive or None")
        if self.max_pending_bytes < 0:
            raise LocalError(ErrorCode.CONFIG_ERROR, "max_pending_bytes must be >= 0")


DEFAULT_CONFIG = ChannelConfig()


class ChannelState(enum.Enum):
    """Lifecycle of a :class:`SecureChannel`."""

    OPEN = "open"
    BROKEN = "broken"  # a peer fault, a failed or cancelled write: the stream is closed
    CLOSED = "closed"  # closed locally with aclose()


@dataclass(frozen=True, slots=True)
class ChannelStatistics:
    """Counters of one channel."""

    state: ChannelState
    pending_send_bytes: int
    queued_messages: int
    messages_sent: int
    writes: int


class _Batch:
    """Completion of one coalesced write, awaited by the senders whose messages it carries."""

    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.error: BaseException | None = None


class SecureChannel:
    """An authenticated, encrypted, message-oriented channel over a trio stream.

    Built by :func:`connect_secure` / :func:`accept_secure`. Usable as an
    async context manager (closes on exit).
    """

    def __init__(
        self, stream: trio.abc.Stream, result: HandshakeResult, config: ChannelConfig
    ) -> None:
        """Wrap ``stream`` after a completed handshake (prefer the connect/accept functions)."""
        self._stream = stream
        self._config = config
        self._codec = TransportCodec(
            result.transport,
            now=trio.current_time(),
            max_message_size=config.max_message_size,
            idle_timeout=config.idle_timeout,
            frame_timeout=config.frame_timeout,
            record_timeout=config.record_timeout,
        )
        self._inbox = self._codec.messages
        #: The peer's proven identity.
        self.remote_peer_id: PeerId = result.remote.peer_id
        #: The peer's Ed25519 public key.
        self.remote_public_key: bytes = result.remote.public_key
        #: The peer's Noise (X25519) static public key.
        self.remote_static: bytes = result.remote.static_public
        #: The final Noise handshake hash, equal on both sides (channel binding).
        self.handshake_hash: bytes = result.transport.handshake_hash
        #: ``"XX"`` or ``"IK"``.
        self.pattern: str = result.pattern
        self._state = ChannelState.OPEN
        self._failure: BaseException | None = None
        self._send_lock = trio.StrictFIFOLock()
        self._batch = _Batch()  # completion of the messages now in _pending
        self._inflight = _Batch()  # completion of the batch being written
        self._inflight.done.set()
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._receiving = False
        self._messages_sent = 0
        self._writes = 0
        self._leftover: bytes | bytearray = result.leftover
        self._max_message_size = config.max_message_size

    @property
    def state(self) -> ChannelState:
        """OPEN, BROKEN or CLOSED."""
        return self._state

    @property
    def remote_address(self) -> tuple[Any, ...] | None:
        """Where the underlying connection comes from, as its stream tells it (None
        when the stream cannot say)."""
        address = getattr(self._stream, "remote_address", None)
        return address if isinstance(address, tuple) else None

    @property
    def relayed(self) -> bool:
        """True when the connection goes through a circuit relay (its stream names the
        relay, docs/protocol/relay.md); False for a direct connection."""
        return getattr(self._stream, "relay_address", None) is not None

    def statistics(self) -> ChannelStatistics:
        """Queue sizes and counters."""
        return ChannelStatistics(
            self._state,
            self._pending_bytes,
            self._codec.pending_messages(),
            self._messages_sent,
            self._writes,
        )

    def _check_open(self) -> None:
        if self._state is ChannelState.OPEN:
            return
        if self._state is ChannelState.CLOSED:
            raise trio.ClosedResourceError("the channel was closed")
        raise SecureChannelError(
            ErrorCode.CHANNEL_CLOSED, f"the channel is broken: {self._failure!r}"
        ) from self._failure

    async def _break(self, exc: BaseException) -> None:
        if self._state is ChannelState.OPEN:
            self._state = ChannelState.BROKEN
            self._failure = exc
        await trio.aclose_forcefully(self._stream)

    # --- sending -------------------------------------------------------------

    def _check_size(self, message: bytes) -> None:
        limit = self._codec.max_message_size
        if len(message) > limit:
            raise LocalError(
                ErrorCode.MESSAGE_TOO_LARGE,
                f"message of {len(message)} bytes exceeds the {limit}-byte limit",
                size=len(message),
                limit=limit,
            )

    async def send_message(self, message: bytes) -> None:
        """Send one message; returns when it is handed to the stream.

        If another task is writing, the message is queued and written by that
        task right after its current write, together with everything else
        queued meanwhile (one frame and one write for many messages). If the
        caller is cancelled while its message is queued, the message may
        still be sent.

        Raises LocalError(MESSAGE_TOO_LARGE) above ``max_message_size``,
        SecureChannelError(CHANNEL_CLOSED) if the stream breaks,
        trio.ClosedResourceError after :meth:`aclose`.
        """
        if self._state is not ChannelState.OPEN:
            self._check_open()
        if len(message) > self._max_message_size:
            self._check_size(message)
        lock = self._send_lock
        if lock.locked():
            self._pending.append(message)
            self._pending_bytes += len(message)
            await self._wait_batch(self._batch)
            return
        # Uncontended: take the lock without the scheduling round trip of
        # ``async with lock`` (send_all checkpoints anyway).
        lock.acquire_nowait()
        try:
            if self._pending:  # messages queued with send_message_nowait go first
                self._pending.append(message)
                self._pending_bytes += len(message)
            else:
                await self._write(self._codec.encode(message), 1)
            await self._drain()
        except BaseException as exc:
            self._fail_waiters(exc)
            raise
        finally:
            lock.release()

    async def send_many(self, messages: Iterable[bytes]) -> None:
        """Send several messages coalesced into as few frames and writes as possible."""
        self._check_open()
        batch = list(messages)
        sizes = list(map(len, batch))
        if sizes and max(sizes) > self._max_message_size:
            for message in batch:
                self._check_size(message)
        self._pending.extend(batch)
        self._pending_bytes += sum(sizes)
        await self.flush()

    def send_message_nowait(self, message: bytes) -> None:
        """Queue a message for the next :meth:`flush` or write.

        Raises trio.WouldBlock when ``max_pending_bytes`` would be exceeded,
        LocalError(MESSAGE_TOO_LARGE) above ``max_message_size``.
        """
        self._check_open()
        self._check_size(message)
        if self._pending_bytes + len(message) > self._config.max_pending_bytes:
            raise trio.WouldBlock
        self._pending.append(message)
        self._pending_bytes += len(message)

    async def flush(self) -> None:
        """Return once every message queued so far has been handed to the stream."""
        self._check_open()
        lock = self._send_lock
        if lock.locked():
            # The active writer drains the queue before it releases the lock.
            await self._wait_batch(self._batch if self._pending else self._inflight)
            return
        lock.acquire_nowait()
        try:
            await self._drain()
        except BaseException as exc:
            self._fail_waiters(exc)
            raise
        finally:
            lock.release()
        await trio.lowlevel.checkpoint()

    async def _drain(self) -> None:
        # Called with the send lock held: write queued messages until none are left.
        while self._pending:
            batch, self._pending, self._pending_bytes = self._pending, [], 0
            record, self._batch = self._batch, _Batch()
            self._inflight = record
            try:
                await self._write(self._codec.encode_many(batch), len(batch))
            except BaseException as exc:
                record.error = exc
                raise
            finally:
                record.done.set()

    def _fail_waiters(self, exc: BaseException) -> None:
        # A write failed: messages still queued will never be written.
        record, self._batch = self._batch, _Batch()
        self._pending, self._pending_bytes = [], 0
        record.error = exc
        record.done.set()

    async def _wait_batch(self, record: _Batch) -> None:
        await record.done.wait()
        if record.error is not None:
            if self._state is ChannelState.CLOSED:
                raise trio.ClosedResourceError("the channel was closed") from record.error
            raise SecureChannelError(
                ErrorCode.CHANNEL_CLOSED, "the write carrying this message failed"
            ) from record.error

    async def _write(self, data: bytes | bytearray, count: int) -> None:
        try:
            await self._stream.send_all(data)
        except trio.BrokenResourceError as exc:
            await self._break(exc)
            raise SecureChannelError(ErrorCode.CHANNEL_CLOSED, "peer closed the channel") from exc
        except BaseException as exc:  # cancelled mid-write: the stream state is unknown
            if self._state is ChannelState.OPEN:
                with trio.CancelScope(shield=True):
                    await self._break(exc)
            raise
        self._messages_sent += count
        self._writes += 1

    # --- receiving -----------------------------------------------------------

    async def receive_message(self) -> bytes:
        """The next message from the peer.

        Raises SecureChannelError (a RemoteError) on a peer fault, a timeout
        (TIMEOUT) or the peer closing (CHANNEL_CLOSED) — the channel is then
        broken; trio.BusyResourceError if another task is receiving;
        trio.ClosedResourceError after :meth:`aclose`.
        """
        if self._receiving:
            raise trio.BusyResourceError("another task is receiving on this channel")
        if self._state is not ChannelState.OPEN:
            self._check_open()
        inbox = self._inbox
        if inbox:  # already decrypted: no I/O, but still honour cancellation
            await trio.lowlevel.checkpoint_if_cancelled()
            return inbox.popleft()
        self._receiving = True
        try:
            return await self._receive_slow(self._codec)
        finally:
            self._receiving = False

    async def _receive_slow(self, codec: TransportCodec) -> bytes:
        stream = self._stream
        size = self._config.receive_size
        current_time = trio.current_time
        try:
            if self._leftover:
                data, self._leftover = self._leftover, b""
                codec.receive_data_untrusted(data, current_time())
                message = codec.next_message()
                if message is not None:
                    await trio.lowlevel.checkpoint()
                    return message
            codec.start_wait(current_time())
            while True:
                deadline = codec.next_deadline()
                if deadline == inf:
                    # No timer armed: skip the cancel scope (it costs ~10 us in trio).
                    data = await stream.receive_some(size)
                else:
                    with trio.move_on_at(deadline) as scope:
                        data = await stream.receive_some(size)
                    if scope.cancelled_caught:
                        codec.handle_timer(current_time())
                        continue
                if not data:
                    codec.receive_eof_untrusted()
                codec.receive_data_untrusted(data, current_time())
                message = codec.next_message()
                if message is not None:
                    return message
        except RemoteError as exc:
            await self._break(exc)
            raise
        except trio.BrokenResourceError as exc:
            await self._break(exc)
            raise SecureChannelError(ErrorCode.CHANNEL_CLOSED, "connection lost") from exc
        except trio.ClosedResourceError as exc:
            if self._state is ChannelState.BROKEN:  # a failed send closed the stream
                raise SecureChannelError(ErrorCode.CHANNEL_CLOSED, "connection lost") from exc
            raise

    # --- closing -------------------------------------------------------------

    async def aclose(self) -> None:
        """Close the channel and the underlying stream (idempotent)."""
        if self._state is ChannelState.OPEN:
            self._state = ChannelState.CLOSED
        await self._stream.aclose()

    async def __aenter__(self) -> SecureChannel:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"SecureChannel(peer={self.remote_peer_id}, {self.pattern}, {self._state.value})"


# --- establishing channels -----------------------------------------------------


#: ``max_bytes`` of each read during the handshake. Handshake messages are at most
#: 1026 bytes framed; a large read buffer per unauthenticated connection is what let a
#: flood of junk connections grow the process by megabytes (CPython allocates the
#: whole ``max_bytes`` for every ``recv`` and the allocator keeps the pages).
HANDSHAKE_RECEIVE_SIZE = 4096


def _default_keygen() -> KeyPair:
    return KeyPair.generate()


async def _handshake(
    stream: trio.abc.Stream, handshake: SecureHandshake, config: ChannelConfig
) -> SecureChannel:
    async def flush_output() -> None:
        out = handshake.data_to_send()
        if out:
            await stream.send_all(out)

    try:
        with trio.move_on_at(handshake.next_deadline()) as scope:
            await flush_output()
            while handshake.stage is not HandshakeStage.DONE:
                data = await stream.receive_some(HANDSHAKE_RECEIVE_SIZE)
                try:
                    handshake.receive_data_untrusted(data, trio.current_time())
                except RemoteError:
                    # Best effort: a reject record tells the peer why; the
                    # protocol error, not a failed write, is what we report.
                    try:
                        await flush_output()
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass
                    raise
                await flush_output()
        if scope.cancelled_caught:
            handshake.handle_timer(trio.current_time())
            raise SecureChannelError(ErrorCode.TIMEOUT, "handshake did not complete in time")
    except RemoteError:
        await trio.aclose_forcefully(stream)
        raise
    except trio.BrokenResourceError as exc:
        await trio.aclose_forcefully(stream)
        raise SecureChannelError(
            ErrorCode.HANDSHAKE_FAILED, "connection lost during the handshake"
        ) from exc
    except BaseException:
        await trio.aclose_forcefully(stream)
        raise
    return SecureChannel(stream, handshake.result(), config)


async def connect_secure(
    stream: trio.abc.Stream,
    local: SecureIdentity,
    *,
    expected_peer_id: PeerId | None = None,
    remote_static: bytes | None = None,
    config: ChannelConfig = DEFAULT_CONFIG,
    generate_keypair: Callable[[], KeyPair] = _default_keygen,
) -> SecureChannel:
    """Run the initiator handshake on ``stream`` and return the channel.

    IK when ``remote_static`` (the responder's published X25519 key) is
    given, XX otherwise. With ``expected_peer_id`` a responder proving
    another identity aborts the handshake. On failure the stream is closed
    and SecureChannelError is raised: PEER_ID_MISMATCH, HANDSHAKE_FAILED,
    PROTOCOL_VERSION_MISMATCH, INVALID_SIGNATURE, MALFORMED_MESSAGE,
    MESSAGE_TOO_LARGE or TIMEOUT. LocalError on bad arguments.
    """
    handshake = SecureHandshake(
        local,
        initiator=True,
        now=trio.current_time(),
        timeout=config.handshake_timeout,
        expected_peer_id=expected_peer_id,
        remote_static=remote_static,
        generate_keypair=generate_keypair,
    )
    return await _handshake(stream, handshake, config)


async def accept_secure(
    stream: trio.abc.Stream,
    local: SecureIdentity,
    *,
    config: ChannelConfig = DEFAULT_CONFIG,
    generate_keypair: Callable[[], KeyPair] = _default_keygen,
) -> SecureChannel:
    """Run the responder handshake (XX or IK, chosen by the peer) on ``stream``.

    Raises like :func:`connect_secure` (without PEER_ID_MISMATCH).
    """
    handshake = SecureHandshake(
        local,
        initiator=False,
        now=trio.current_time(),
        timeout=config.handshake_timeout,
        generate_keypair=generate_keypair,
    )
    return await _handshake(stream, handshake, config)
