"""Transport framing of a secure channel after the Noise handshake (sans-IO).

Theory of operation (bytes in docs/protocol/noise.md, "Transport").

Two layers, so that one application message may span several Noise messages
and several small ones may share one:

* **Frames.** Each Noise transport message travels as ``len:u16be || ciphertext``
  (Noise §13 recommends the 2-byte prefix); ``16 <= len <= 65535``, the last
  16 bytes being the Poly1305 tag. Nonces count from 0 in each direction
  (Noise §5.1).
* **Records.** Concatenated frame plaintexts form one byte stream of records
  ``size:u32be || message``. Frame boundaries carry no meaning: a sender may
  put many records in one frame (coalescing) or cut one record across frames
  (splitting). A record announcing more than ``max_message_size`` bytes is a
  protocol violation detected from its header alone, so a peer can never
  make us buffer more than ``max_message_size + 65539`` bytes. The buffer of
  an incomplete record grows as its bytes arrive and is never allocated at
  the announced size: a peer that announces 4 MiB and sends 200 bytes costs
  about 200 bytes, not 4 MiB (many such peers would otherwise be an easy way
  to exhaust memory).

Time is a parameter. ``next_deadline()`` is the soonest of the *frame*
deadline (a frame whose first byte has arrived must complete within
``frame_timeout``: this bounds a peer that trickles bytes), the *record*
deadline (a record whose header has arrived must complete within
``record_timeout``: this bounds a peer that sends one small frame of a large
record now and then) and the *idle* deadline (no byte for ``idle_timeout``
while the application waits, counted from :meth:`TransportCodec.start_wait`).
``handle_timer(now)`` raises TIMEOUT.
"""

from __future__ import annotations

import enum
import math
import struct
from collections import deque
from collections.abc import Sequence

from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.transport.aead import DEFAULT_BACKEND, AeadBackend
from p2pnode.transport.noise import MAX_NONCE, MAX_PLAINTEXT_LEN, TAGLEN, NoiseTransport
from p2pnode.transport.secure import SecureChannelError

__all__ = [
    "DEFAULT_MAX_MESSAGE_SIZE",
    "DEFAULT_RECORD_TIMEOUT",
    "FRAME_HEADER",
    "RECORD_HEADER",
    "CodecState",
    "TransportCodec",
]

DEFAULT_MAX_MESSAGE_SIZE = 4 * 1024 * 1024
DEFAULT_RECORD_TIMEOUT = 60.0
RECORD_HEADER = 4
FRAME_HEADER = 2

_u32 = struct.Struct(">I")
_nonce = struct.Struct("<4xQ").pack  # 32 zero bits || 64-bit little-endian counter
_FRAME_SLOT = bytes(FRAME_HEADER)  # filled in by seal_in_place
_TAG_SLOT = bytes(TAGLEN)
_ZEROS = memoryview(bytes(MAX_PLAINTEXT_LEN))  # room appended to a record before decrypting


class CodecState(enum.Enum):
    """Whether the receive side still accepts bytes."""

    OPEN = "open"
    FAILED = "failed"  # the peer broke the protocol; close the connection


class TransportCodec:
    """Encrypts outgoing messages into frames and reassembles incoming ones.

    Copies are kept to one per direction: the sender lays records out in the
    final frame buffer and encrypts in place; the receiver decrypts straight
    from the bytes it was given into the message being assembled.
    """

    __slots__ = (
        "_buf",
        "_frame_since",
        "_frame_timeout",
        "_hdr",
        "_idle_from",
        "_idle_timeout",
        "_max",
        "_msg",
        "_need",
        "_now",
        "_open",
        "_record_since",
        "_record_timeout",
        "_recv_n",
        "_seal",
        "_send_n",
        "messages",
        "state",
    )

    def __init__(
        self,
        transport: NoiseTransport,
        *,
        now: float,
        max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE,
        idle_timeout: float | None = None,
        frame_timeout: float = 30.0,
        record_timeout: float = DEFAULT_RECORD_TIMEOUT,
        aead: AeadBackend = DEFAULT_BACKEND,
    ) -> None:
        """Wrap the CipherStates of a finished handshake.

        ``aead`` runs ChaCha20-Poly1305 (the bytes are the same with any
        backend; see p2pnode.transport.aead). Raises LocalError(INVALID_ARGUMENT) on
        non-positive limits.
        """
        if max_message_size <= 0 or frame_timeout <= 0 or record_timeout <= 0:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "limits and timeouts must be positive")
        if max_message_size > 2**32 - 1:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "max_message_size must fit in 32 bits")
        if idle_timeout is not None and idle_timeout <= 0:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "idle_timeout must be positive or None")
        send_key, recv_key = transport.send.key, transport.receive.key
        if send_key is None or recv_key is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "transport CipherStates need keys")
        # Each direction's key becomes a cipher once; frames then call its bound methods.
        self._seal = aead.cipher(send_key).seal_in_place
        self._open = aead.cipher(recv_key).open_into
        self._send_n = transport.send.nonce
        self._recv_n = transport.receive.nonce
        self._max = max_message_size
        self._idle_timeout = idle_timeout
        self._frame_timeout = frame_timeout
        self._record_timeout = record_timeout
        self._buf = bytearray()  # bytes of an incomplete frame
        self._hdr = bytearray()  # first bytes of a record header cut by a frame boundary
        # Body of an incomplete record, grown as its bytes arrive (never allocated at the
        # announced size, which costs the peer nothing to claim), and its announced size.
        self._msg: bytearray | None = None
        self._need = 0
        self._record_since = 0.0  # when the incomplete record's header arrived
        self._now = now  # the time of the bytes being processed
        #: Complete messages in arrival order (consumers ``popleft``).
        self.messages: deque[bytes] = deque()
        self._frame_since: float | None = None
        self._idle_from = now
        self.state = CodecState.OPEN

    @property
    def max_message_size(self) -> int:
        """The largest application message either side may send."""
        return self._max

    # --- sending ------------------------------------------------------------

    def _nonces(self, count: int) -> int:
        n = self._send_n
        if n + count > MAX_NONCE:
            raise LocalError(ErrorCode.INTERNAL, "cipher nonce space exhausted")
        self._send_n = n + count
        return n

    def encode(self, message: bytes) -> bytes | bytearray:
        """Wire bytes carrying one application message.

        Raises LocalError(MESSAGE_TOO_LARGE) above ``max_message_size``.
        """
        size = len(message)
        if size > MAX_PLAINTEXT_LEN - RECORD_HEADER or size > self._max:
            return self.encode_many((message,))
        out = bytearray(FRAME_HEADER + RECORD_HEADER + size + TAGLEN)
        _u32.pack_into(out, FRAME_HEADER, size)
        out[FRAME_HEADER + RECORD_HEADER : FRAME_HEADER + RECORD_HEADER + size] = message
        self._seal(_nonce(self._nonces(1)), out, 0, RECORD_HEADER + size)
        return out

    def encode_many(self, messages: Sequence[bytes]) -> bytes | bytearray:
        """Wire bytes carrying ``messages`` in order, packed into as few frames as fit.

        Raises LocalError(MESSAGE_TOO_LARGE) if any message is above
        ``max_message_size`` (then nothing is encoded).
        """
        total = _record_stream_size(messages, self._max)
        if not total:
            return b""
        if total <= MAX_PLAINTEXT_LEN:
            # One frame: let bytearray.join lay it out in C.
            out = _one_frame(messages)
            self._seal(_nonce(self._nonces(1)), out, 0, total)
            return out
        frames = -(-total // MAX_PLAINTEXT_LEN)
        out = _frame_bodies(messages, total, frames)
        n = self._nonces(frames)
        seal = self._seal
        stride = FRAME_HEADER + MAX_PLAINTEXT_LEN + TAGLEN
        for i in range(frames):
            size = min(MAX_PLAINTEXT_LEN, total - i * MAX_PLAINTEXT_LEN)
            seal(_nonce(n + i), out, i * stride, size)
        return out

    # --- receiving ------------------------------------------------------------

    def next_message(self) -> bytes | None:
        """The next complete application message, or None."""
        messages = self.messages
        return messages.popleft() if messages else None

    def pending_messages(self) -> int:
        """How many complete messages wait in the receive queue."""
        return len(self.messages)

    def buffered_bytes(self) -> int:
        """Bytes held for incomplete frames and records (not complete messages)."""
        msg = self._msg
        return len(self._buf) + len(self._hdr) + (len(msg) if msg is not None else 0)

    def start_wait(self, now: float) -> None:
        """The application starts waiting for a message: the idle clock restarts."""
        self._idle_from = now

    def next_deadline(self) -> float:
        """When :meth:`handle_timer` must be called (``inf`` if never)."""
        deadline = math.inf
        if self._idle_timeout is not None:
            deadline = self._idle_from + self._idle_timeout
        if self._frame_since is not None:
            deadline = min(deadline, self._frame_since + self._frame_timeout)
        if self._msg is not None:
            deadline = min(deadline, self._record_since + self._record_timeout)
        return deadline

    def handle_timer(self, now: float) -> None:
        """Raise SecureChannelError(TIMEOUT) if a deadline has passed."""
        if now >= self.next_deadline():
            if self._frame_since is not None and now >= self._frame_since + self._frame_timeout:
                why = "peer did not complete a frame in time"
            elif self._msg is not None and now >= self._record_since + self._record_timeout:
                why = "peer did not complete a message in time"
            else:
                why = "channel idle too long"
            self._fail(SecureChannelError(ErrorCode.TIMEOUT, why))

    def _fail(self, exc: RemoteError) -> None:
        self.state = CodecState.FAILED
        self._buf = bytearray()
        self._msg = None
        self._hdr.clear()
        raise exc

    def receive_eof_untrusted(self) -> None:
        """The peer closed its side: raise CHANNEL_CLOSED, or MALFORMED_MESSAGE if mid-record."""
        if self._buf or self._hdr or self._msg is not None:
            self._fail(
                SecureChannelError(
                    ErrorCode.MALFORMED_MESSAGE, "peer closed the channel inside a message"
                )
            )
        self._fail(SecureChannelError(ErrorCode.CHANNEL_CLOSED, "peer closed the channel"))

    def receive_data_untrusted(self, data: bytes | bytearray, now: float) -> None:
        """Feed transport bytes from the peer.

        Complete messages become available through :meth:`next_message`.
        Raises SecureChannelError with DECRYPT_FAILED, MALFORMED_MESSAGE or
        MESSAGE_TOO_LARGE; the codec is then FAILED. LocalError if already FAILED.
        """
        if self.state is not CodecState.OPEN:
            raise LocalError(ErrorCode.CHANNEL_CLOSED, "the channel failed earlier")
        if not data:
            return
        self._idle_from = self._now = now
        pos = 0
        try:
            if self._buf:
                # Complete the pending frame with only the bytes it still needs,
                # so the rest of ``data`` is decrypted in place, never copied.
                pos = self._complete_partial_untrusted(data)
                if self._buf:
                    return  # still incomplete: its deadline keeps running
            end = len(data)
            while end - pos >= FRAME_HEADER:
                size = (data[pos] << 8) | data[pos + 1]
                if size < TAGLEN:
                    raise SecureChannelError(
                        ErrorCode.MALFORMED_MESSAGE, f"frame of {size} bytes is shorter than a tag"
                    )
                stop = pos + FRAME_HEADER + size
                if stop > end:
                    break
                self._open_frame_untrusted(self._next_recv_nonce(), data, pos + FRAME_HEADER, size)
                pos = stop
        except RemoteError as exc:
            self._fail(exc)
        if pos == len(data):
            self._frame_since = None
        else:
            self._buf = bytearray(memoryview(data)[pos:])
            self._frame_since = now

    def _next_recv_nonce(self) -> bytes:
        n = self._recv_n
        if n >= MAX_NONCE:
            raise SecureChannelError(ErrorCode.DECRYPT_FAILED, "nonce space exhausted")
        self._recv_n = n + 1
        return _nonce(n)

    def _complete_partial_untrusted(self, data: bytes | bytearray) -> int:
        """Move bytes of ``data`` into the partial frame; returns how many were used."""
        buf = self._buf
        pos = 0
        if len(buf) < FRAME_HEADER:
            pos = FRAME_HEADER - len(buf)
            buf += data[:pos]
            if len(buf) < FRAME_HEADER:
                return len(data)
        size = (buf[0] << 8) | buf[1]
        if size < TAGLEN:
            raise SecureChannelError(
                ErrorCode.MALFORMED_MESSAGE, f"frame of {size} bytes is shorter than a tag"
            )
        take = FRAME_HEADER + size - len(buf)
        view = memoryview(data)
        buf += view[pos : pos + take]
        view.release()
        pos = min(len(data), pos + take)
        if len(buf) == FRAME_HEADER + size:
            self._buf = bytearray()
            self._open_frame_untrusted(
                nonce=self._next_recv_nonce(),
                src=buf,
                start=FRAME_HEADER,
                size=size,
            )
        return pos

    def _open_frame_untrusted(
        self, nonce: bytes, src: bytes | bytearray, start: int, size: int
    ) -> None:
        length = size - TAGLEN
        msg = self._msg
        if msg is not None and length <= self._need - len(msg):
            # The whole frame continues the message being assembled: grow it by the
            # frame's plaintext and decrypt straight into the new room.
            filled = len(msg)
            msg += _ZEROS[:length]
            if not self._open(nonce, src, start, size, msg, filled):
                raise SecureChannelError(ErrorCode.DECRYPT_FAILED, "frame authentication failed")
            if len(msg) == self._need:
                self.messages.append(bytes(msg))
                self._msg = None
            return
        plaintext = bytearray(length)
        if not self._open(nonce, src, start, size, plaintext, 0):
            raise SecureChannelError(ErrorCode.DECRYPT_FAILED, "frame authentication failed")
        self._records_untrusted(plaintext)

    def _records_untrusted(self, plaintext: bytearray) -> None:
        view = memoryview(plaintext)
        end = len(plaintext)
        off = 0
        msg = self._msg
        if msg is not None:  # finish the message being assembled
            off = self._need - len(msg)
            msg += view[:off]
            self.messages.append(bytes(msg))
            self._msg = None
        hdr = self._hdr
        if hdr:  # complete a record header cut by the previous frame
            take = min(RECORD_HEADER - len(hdr), end - off)
            hdr += view[off : off + take]
            off += take
            if len(hdr) < RECORD_HEADER:
                return
            if self._start_record_untrusted(_u32.unpack(hdr)[0], view, off, end):
                hdr.clear()
                return
            off += _u32.unpack(hdr)[0]
            hdr.clear()
        limit = self._max
        unpack = _u32.unpack_from
        append = self.messages.append
        while end - off >= RECORD_HEADER:
            size = unpack(plaintext, off)[0]
            off += RECORD_HEADER
            if size > limit or off + size > end:
                self._start_record_untrusted(size, view, off, end)
                return
            append(bytes(view[off : off + size]))
            off += size
        if off < end:
            hdr += view[off:end]
        view.release()

    def _start_record_untrusted(self, size: int, view: memoryview, off: int, end: int) -> bool:
        """Begin a record of ``size``; True if it continues past this plaintext."""
        if size > self._max:
            raise SecureChannelError(
                ErrorCode.MESSAGE_TOO_LARGE,
                f"peer announced a {size}-byte message (limit {self._max})",
                size=size,
                limit=self._max,
            )
        if off + size <= end:
            self.messages.append(bytes(view[off : off + size]))
            return False
        self._msg = bytearray(view[off:end])
        self._need = size
        self._record_since = self._now
        return True


def _record_stream_size(messages: Sequence[bytes], limit: int) -> int:
    """Bytes of the record stream carrying ``messages`` (each with its length header).

    Raises LocalError(MESSAGE_TOO_LARGE) if any message is above ``limit``.
    """
    total = 0
    for message in messages:
        if len(message) > limit:
            raise LocalError(
                ErrorCode.MESSAGE_TOO_LARGE,
                f"message of {len(message)} bytes exceeds the {limit}-byte limit",
                size=len(message),
                limit=limit,
            )
        total += RECORD_HEADER + len(message)
    return total


def _one_frame(messages: Sequence[bytes]) -> bytearray:
    """One frame's bytes for ``messages``: header and tag slots around the records."""
    pack = _u32.pack
    parts = [_FRAME_SLOT]
    for message in messages:
        parts.append(pack(len(message)))
        parts.append(message)
    parts.append(_TAG_SLOT)
    return bytearray().join(parts)


def _frame_bodies(messages: Sequence[bytes], total: int, frames: int) -> bytearray:
    """``frames`` frames' bytes, the record stream (``total`` bytes) laid out in their
    bodies, skipping each frame's length prefix and tag slot (sealed afterwards)."""
    pack = _u32.pack
    out = bytearray(total + frames * (FRAME_HEADER + TAGLEN))
    pos = FRAME_HEADER
    room = MAX_PLAINTEXT_LEN
    for message in messages:
        # Small records as one piece; large ones without copying the body twice.
        pieces = (
            (pack(len(message)) + message,)
            if len(message) < 4096
            else (pack(len(message)), message)
        )
        for piece in pieces:
            length = len(piece)
            if length <= room:
                out[pos : pos + length] = piece
                pos += length
                room -= length
                continue
            view = memoryview(piece)
            offset = 0
            while offset < length:
                if not room:
                    pos += TAGLEN + FRAME_HEADER
                    room = MAX_PLAINTEXT_LEN
                take = min(room, length - offset)
                out[pos : pos + take] = view[offset : offset + take]
                pos += take
                offset += take
                room -= take
            view.release()
    return out
