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
  make us buffer more than ``max_message_size + 65539`` bytes.

Time is a parameter. ``next_deadline()`` is the sooner of the *frame* deadline
(a frame whose first byte has arrived must complete within ``frame_timeout``:
this bounds a peer that trickles bytes) and the *idle* deadline (no byte for
``idle_timeout`` while the application waits, counted from
:meth:`TransportCodec.start_wait`). ``handle_timer(now)`` raises TIMEOUT.
"""

from __future__ import annotations

import enum
import math
import struct
from collections import deque
from collections.abc import Sequence

from nacl.bindings import (
    crypto_aead_chacha20poly1305_ietf_decrypt,
    crypto_aead_chacha20poly1305_ietf_encrypt,
)

from p2pnode.errors import ErrorCode, LocalError, RemoteError
from p2pnode.noise import MAX_NONCE, MAX_PLAINTEXT_LEN, TAGLEN, NoiseTransport
from p2pnode.secure import SecureChannelError

DEFAULT_MAX_MESSAGE_SIZE = 4 * 1024 * 1024
RECORD_HEADER = 4
FRAME_HEADER = 2

_u16 = struct.Struct(">H")
_u32 = struct.Struct(">I")
_nonce = struct.Struct("<4xQ").pack  # 32 zero bits || 64-bit little-endian counter


class CodecState(enum.Enum):
    """Whether the receive side still accepts bytes."""

    OPEN = "open"
    FAILED = "failed"  # the peer broke the protocol; close the connection


class TransportCodec:
    """Encrypts outgoing messages into frames and reassembles incoming ones.

    The hot paths bind keys, nonces and nacl functions in local variables:
    a 256-byte message costs one AEAD call and two small copies per side.
    """

    __slots__ = (
        "_buf",
        "_frame_since",
        "_frame_timeout",
        "_idle_from",
        "_idle_timeout",
        "_max",
        "_messages",
        "_rbuf",
        "_recv_key",
        "_recv_n",
        "_rneed",
        "_send_key",
        "_send_n",
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
    ) -> None:
        """Wrap the CipherStates of a finished handshake.

        Raises LocalError(INVALID_ARGUMENT) on non-positive limits.
        """
        if max_message_size <= 0 or frame_timeout <= 0:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "limits and timeouts must be positive")
        if idle_timeout is not None and idle_timeout <= 0:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "idle_timeout must be positive or None")
        send_key, recv_key = transport.send.key, transport.receive.key
        if send_key is None or recv_key is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "transport CipherStates need keys")
        self._send_key: bytes = send_key
        self._recv_key: bytes = recv_key
        self._send_n = transport.send.nonce
        self._recv_n = transport.receive.nonce
        self._max = max_message_size
        self._idle_timeout = idle_timeout
        self._frame_timeout = frame_timeout
        self._buf = bytearray()  # undecrypted frame bytes
        self._rbuf = bytearray()  # plaintext of an incomplete record
        self._rneed = 0  # bytes _rbuf must hold to complete its record (0: header unknown)
        self._messages: deque[bytes] = deque()
        self._frame_since: float | None = None
        self._idle_from = now
        self.state = CodecState.OPEN

    @property
    def max_message_size(self) -> int:
        """The largest application message either side may send."""
        return self._max

    # --- sending ------------------------------------------------------------

    def _seal(self, plaintext: bytes) -> bytes:
        n = self._send_n
        if n >= MAX_NONCE:
            raise LocalError(ErrorCode.INTERNAL, "cipher nonce space exhausted")
        self._send_n = n + 1
        ciphertext = crypto_aead_chacha20poly1305_ietf_encrypt(
            plaintext, None, _nonce(n), self._send_key
        )
        return _u16.pack(len(ciphertext)) + ciphertext

    def encode(self, message: bytes) -> bytes:
        """Wire bytes carrying one application message.

        Raises LocalError(MESSAGE_TOO_LARGE) above ``max_message_size``.
        """
        size = len(message)
        if size <= MAX_PLAINTEXT_LEN - RECORD_HEADER:
            return self._seal(_u32.pack(size) + message)
        return self.encode_many((message,))

    def encode_many(self, messages: Sequence[bytes]) -> bytes:
        """Wire bytes carrying ``messages`` in order, packed into as few frames as fit.

        Raises LocalError(MESSAGE_TOO_LARGE) if any message is above
        ``max_message_size`` (then nothing is encoded).
        """
        parts: list[bytes] = []
        pack = _u32.pack
        limit = self._max
        for message in messages:
            if len(message) > limit:
                raise LocalError(
                    ErrorCode.MESSAGE_TOO_LARGE,
                    f"message of {len(message)} bytes exceeds the {limit}-byte limit",
                    size=len(message),
                    limit=limit,
                )
            parts.append(pack(len(message)))
            parts.append(message)
        stream = b"".join(parts)
        if len(stream) <= MAX_PLAINTEXT_LEN:
            return self._seal(stream)
        seal = self._seal
        view = memoryview(stream)
        frames = [
            seal(bytes(view[off : off + MAX_PLAINTEXT_LEN]))
            for off in range(0, len(stream), MAX_PLAINTEXT_LEN)
        ]
        return b"".join(frames)

    # --- receiving ------------------------------------------------------------

    def next_message(self) -> bytes | None:
        """The next complete application message, or None."""
        messages = self._messages
        return messages.popleft() if messages else None

    def pending_messages(self) -> int:
        """How many complete messages wait in the receive queue."""
        return len(self._messages)

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
        return deadline

    def handle_timer(self, now: float) -> None:
        """Raise SecureChannelError(TIMEOUT) if a deadline has passed."""
        if now >= self.next_deadline():
            slow = self._frame_since is not None and now >= self._frame_since + self._frame_timeout
            self._fail(
                SecureChannelError(
                    ErrorCode.TIMEOUT,
                    "peer did not complete a frame in time" if slow else "channel idle too long",
                )
            )

    def _fail(self, exc: RemoteError) -> None:
        self.state = CodecState.FAILED
        self._buf.clear()
        self._rbuf.clear()
        raise exc

    def receive_eof_untrusted(self) -> None:
        """The peer closed its side: raise CHANNEL_CLOSED, or MALFORMED_MESSAGE if mid-record."""
        if self._buf or self._rbuf:
            self._fail(
                SecureChannelError(
                    ErrorCode.MALFORMED_MESSAGE, "peer closed the channel inside a frame"
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
        self._idle_from = now
        buf = self._buf
        had_partial = bool(buf)
        buf += data
        end = len(buf)
        pos = 0
        key = self._recv_key
        decrypt = crypto_aead_chacha20poly1305_ietf_decrypt
        view = memoryview(buf)
        try:
            while end - pos >= FRAME_HEADER:
                size = (buf[pos] << 8) | buf[pos + 1]
                if size < TAGLEN:
                    raise SecureChannelError(
                        ErrorCode.MALFORMED_MESSAGE, f"frame of {size} bytes is shorter than a tag"
                    )
                stop = pos + FRAME_HEADER + size
                if stop > end:
                    break
                n = self._recv_n
                if n >= MAX_NONCE:
                    raise SecureChannelError(ErrorCode.DECRYPT_FAILED, "nonce space exhausted")
                try:
                    ciphertext = bytes(view[pos + FRAME_HEADER : stop])
                    plaintext = decrypt(ciphertext, None, _nonce(n), key)
                except Exception:  # nacl CryptoError: forged, corrupted or replayed frame
                    raise SecureChannelError(
                        ErrorCode.DECRYPT_FAILED, "frame authentication failed"
                    ) from None
                self._recv_n = n + 1
                pos = stop
                self._records_untrusted(plaintext)
        except RemoteError as exc:
            view.release()
            self._fail(exc)
        view.release()
        if pos == end:
            buf.clear()
            self._frame_since = None
        else:
            if pos:
                del buf[:pos]
            if pos or not had_partial:
                self._frame_since = now

    def _records_untrusted(self, plaintext: bytes) -> None:
        limit = self._max
        rbuf = self._rbuf
        if rbuf:
            rbuf += plaintext
            if self._rneed and len(rbuf) < self._rneed:
                return
            plaintext = bytes(rbuf)
            rbuf.clear()
            self._rneed = 0
        end = len(plaintext)
        off = 0
        unpack = _u32.unpack_from
        append = self._messages.append
        while end - off >= RECORD_HEADER:
            size = unpack(plaintext, off)[0]
            if size > limit:
                raise SecureChannelError(
                    ErrorCode.MESSAGE_TOO_LARGE,
                    f"peer announced a {size}-byte message (limit {limit})",
                    size=size,
                    limit=limit,
                )
            stop = off + RECORD_HEADER + size
            if stop > end:
                self._rneed = stop - off
                break
            append(plaintext[off + RECORD_HEADER : stop])
            off = stop
        if off < end:
            rbuf += plaintext[off:] if off else plaintext
