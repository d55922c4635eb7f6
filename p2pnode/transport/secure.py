"""Identity-bound Noise handshakes for p2pnode channels (sans-IO).

Theory of operation (the byte-level contract is docs/protocol/noise.md).

* **Static key.** Each node has an X25519 static key for Noise. By default it
  is derived from the Ed25519 identity seed with a domain-separated KDF
  (:func:`derive_static_keypair`), so nothing extra is stored and it
  survives restarts with the identity; its public half is what a node
  publishes in its signed card so dialers can use IK.
* **Binding.** A handshake payload is canonical msgpack
  ``{"v": 1, "id": <Ed25519 public key>, "sig": <signature>}`` where ``sig``
  signs ``BINDING_CONTEXT || noise_static_public``. The receiver checks the
  signature against the static key that Noise authenticated (the ``s``
  token, proven by ``es``/``se``/``ss``), so after the handshake the peer id
  derived from ``id`` is certain.
* **Preamble.** The initiator opens with two bytes, the protocol version
  (``0x01``) and the pattern tag (``X`` for XX, ``I`` for IK), so one
  listener accepts both patterns. An unsupported preamble is answered with
  a reject record ``00 00 <our version>`` and the connection is closed.
  The prologue ``p2pnode/noise/1`` is mixed into ``h`` (Noise §6), so peers
  that disagree on it fail at the first authenticated payload.
* **Frames.** Each handshake message is a Noise message behind a 2-byte
  big-endian length (Noise §13); during the handshake frames are limited
  to :data:`MAX_HANDSHAKE_FRAME` bytes.

:class:`SecureHandshake` is the sans-IO state machine: feed it peer bytes
with ``receive_data_untrusted(data, now)``, send what ``data_to_send()``
returns, and once ``state`` is ``DONE`` take :meth:`SecureHandshake.result`.
Time is a parameter: ``next_deadline()`` and ``handle_timer(now)``.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from nacl.bindings import crypto_generichash_blake2b_salt_personal

from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.identity import PUBLIC_KEY_BYTES, Identity, PeerId, verify_signature
from p2pnode.core.wire import WireError, WireLimits, canonical_pack, unpack_untrusted
from p2pnode.transport.noise import (
    IK,
    XX,
    HandshakePattern,
    HandshakeState,
    HandshakeStatus,
    KeyPair,
    NoiseError,
    NoiseTransport,
)

__all__ = [
    "BINDING_CONTEXT",
    "MAX_HANDSHAKE_FRAME",
    "PATTERN_TAGS",
    "PREAMBLE_LEN",
    "PROLOGUE",
    "PROTOCOL_VERSION",
    "REJECT_PREFIX",
    "HandshakeResult",
    "HandshakeStage",
    "RemoteIdentity",
    "SecureChannelError",
    "SecureHandshake",
    "SecureIdentity",
    "binding_message",
    "derive_static_keypair",
]

PROTOCOL_VERSION = 1
#: Mixed into the handshake hash by both sides (Noise §6).
PROLOGUE = b"p2pnode/noise/1"
#: Prefix of the Ed25519-signed bytes that bind an identity to a static key.
BINDING_CONTEXT = b"p2pnode/noise/1 static-key\x00"
#: Pattern tag byte (second preamble byte) per pattern.
PATTERN_TAGS: dict[bytes, HandshakePattern] = {b"X": XX, b"I": IK}
_TAG_OF = {p.name: tag for tag, p in PATTERN_TAGS.items()}
PREAMBLE_LEN = 2
#: Largest handshake frame body we accept (our messages are ~250 bytes).
MAX_HANDSHAKE_FRAME = 1024
#: Reject record: a zero frame length, then the responder's version byte.
REJECT_PREFIX = b"\x00\x00"
_STATIC_KDF_PERSON = b"p2pnode-noise-sk"  # exactly 16 bytes (BLAKE2b personal)
_PAYLOAD_LIMITS = WireLimits(
    max_size=512, max_str_len=64, max_bin_len=64, max_array_len=8, max_map_len=8, max_depth=2
)


class SecureChannelError(RemoteError):
    """The peer broke the secure-channel protocol (handshake, framing, identity)."""


# --- static key and identity binding ----------------------------------------


def derive_static_keypair(identity: Identity) -> KeyPair:
    """The node's X25519 static key, derived from its Ed25519 seed.

    ``private = BLAKE2b-256(seed, key="", salt=0^16, person="p2pnode-noise-sk")``
    (libsodium ``crypto_generichash_blake2b_salt_personal``); X25519 clamps it.
    One-way, so the Noise key reveals nothing about the signing key.
    """
    private = crypto_generichash_blake2b_salt_personal(
        identity.seed, digest_size=32, person=_STATIC_KDF_PERSON
    )
    return KeyPair.from_private(private)


def binding_message(static_public: bytes) -> bytes:
    """The bytes an identity signs to vouch for a Noise static public key."""
    return BINDING_CONTEXT + static_public


@dataclass(frozen=True, slots=True)
class RemoteIdentity:
    """What a completed handshake proved about the peer."""

    peer_id: PeerId
    public_key: bytes  # Ed25519
    static_public: bytes  # X25519, authenticated by Noise


class SecureIdentity:
    """A node's credentials for secure channels, shared by all its connections.

    Holds the Ed25519 identity, the X25519 static key pair, the signed
    handshake payload (computed once), and a bounded cache of peer bindings
    already verified (same bytes, same static key) so reconnects skip the
    Ed25519 verification.
    """

    __slots__ = ("_verified", "_verified_max", "identity", "payload", "static")

    def __init__(
        self, identity: Identity, static: KeyPair | None = None, *, verified_cache: int = 1024
    ) -> None:
        """``static`` defaults to :func:`derive_static_keypair` of ``identity``."""
        if verified_cache < 0:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "verified_cache must be >= 0")
        self.identity = identity
        self.static = static if static is not None else derive_static_keypair(identity)
        signature = identity.sign(binding_message(self.static.public))
        self.payload: bytes = canonical_pack(
            {"v": PROTOCOL_VERSION, "id": identity.public_key, "sig": signature}
        )
        self._verified: OrderedDict[tuple[bytes, bytes], RemoteIdentity] = OrderedDict()
        self._verified_max = verified_cache

    @property
    def peer_id(self) -> PeerId:
        """This node's peer id."""
        return self.identity.peer_id

    @property
    def static_public(self) -> bytes:
        """The X25519 public key to publish (in the node's card) for IK dialers."""
        return self.static.public

    def verify_payload_untrusted(self, payload: bytes, static_public: bytes) -> RemoteIdentity:
        """Check a peer's handshake payload against its Noise-authenticated static key.

        Raises SecureChannelError with PROTOCOL_VERSION_MISMATCH, MALFORMED_MESSAGE
        or INVALID_SIGNATURE.
        """
        key = (payload, static_public)
        cached = self._verified.get(key)
        if cached is not None:
            self._verified.move_to_end(key)
            return cached
        try:
            obj = unpack_untrusted(payload, _PAYLOAD_LIMITS)
        except WireError as exc:
            raise SecureChannelError(exc.code, f"handshake payload: {exc.message}") from None
        if not isinstance(obj, dict):
            raise SecureChannelError(ErrorCode.MALFORMED_MESSAGE, "handshake payload not a map")
        version = obj.get("v")
        if version != PROTOCOL_VERSION:
            raise SecureChannelError(
                ErrorCode.PROTOCOL_VERSION_MISMATCH,
                "peer speaks another channel protocol version",
                expected=PROTOCOL_VERSION,
                actual=repr(version),
            )
        public_key, signature = obj.get("id"), obj.get("sig")
        if not isinstance(public_key, bytes) or len(public_key) != PUBLIC_KEY_BYTES:
            raise SecureChannelError(ErrorCode.MALFORMED_MESSAGE, "bad identity key in payload")
        if not isinstance(signature, bytes) or not verify_signature(
            public_key, binding_message(static_public), signature
        ):
            raise SecureChannelError(
                ErrorCode.INVALID_SIGNATURE, "identity does not sign the Noise static key"
            )
        remote = RemoteIdentity(PeerId.from_public_key(public_key), public_key, static_public)
        if self._verified_max:
            self._verified[key] = remote
            if len(self._verified) > self._verified_max:
                self._verified.popitem(last=False)
        return remote


# --- the handshake state machine --------------------------------------------


class HandshakeStage(enum.Enum):
    """What a :class:`SecureHandshake` waits for."""

    EXPECT_PREAMBLE = "expect_preamble"  # responder: version and pattern bytes
    EXPECT_FRAME = "expect_frame"  # a length-prefixed handshake message
    DONE = "done"  # authenticated; take result()
    FAILED = "failed"  # aborted; the connection must be closed


_TRANSITIONS: dict[HandshakeStage, frozenset[HandshakeStage]] = {
    HandshakeStage.EXPECT_PREAMBLE: frozenset({HandshakeStage.EXPECT_FRAME, HandshakeStage.FAILED}),
    HandshakeStage.EXPECT_FRAME: frozenset(
        {HandshakeStage.EXPECT_FRAME, HandshakeStage.DONE, HandshakeStage.FAILED}
    ),
    HandshakeStage.DONE: frozenset(),
    HandshakeStage.FAILED: frozenset(),
}


@dataclass(frozen=True, slots=True)
class HandshakeResult:
    """A completed, authenticated handshake."""

    transport: NoiseTransport
    remote: RemoteIdentity
    pattern: str
    #: Peer bytes that arrived after the last handshake frame (transport frames).
    leftover: bytes = field(repr=False)


def _default_keygen() -> KeyPair:
    return KeyPair.generate()


class SecureHandshake:
    """Sans-IO driver: preamble, framing, Noise and identity checks for one side."""

    __slots__ = (
        "_buffer",
        "_deadline",
        "_expected",
        "_failure",
        "_gen",
        "_initiator",
        "_local",
        "_noise",
        "_out",
        "_remote",
        "_result",
        "_stage",
    )

    def __init__(
        self,
        local: SecureIdentity,
        *,
        initiator: bool,
        now: float,
        timeout: float,
        expected_peer_id: PeerId | None = None,
        remote_static: bytes | None = None,
        generate_keypair: Callable[[], KeyPair] = _default_keygen,
    ) -> None:
        """Start one side of the handshake at time ``now``.

        The initiator uses IK when ``remote_static`` (the responder's
        published X25519 key) is given, else XX. ``expected_peer_id`` makes
        the initiator abort with PEER_ID_MISMATCH if the responder proves a
        different identity. Raises LocalError(INVALID_ARGUMENT) on misuse.
        """
        if not initiator and (expected_peer_id is not None or remote_static is not None):
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "a responder learns the peer itself")
        if timeout <= 0:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "handshake timeout must be positive")
        self._local = local
        self._initiator = initiator
        self._expected = expected_peer_id
        self._gen = generate_keypair
        self._deadline = now + timeout
        self._buffer = bytearray()
        self._out: list[bytes] = []
        self._noise: HandshakeState | None = None
        self._remote: RemoteIdentity | None = None
        self._result: HandshakeResult | None = None
        self._failure: RemoteError | None = None
        if initiator:
            pattern = IK if remote_static is not None else XX
            self._noise = HandshakeState(
                pattern,
                initiator=True,
                prologue=PROLOGUE,
                static=local.static,
                remote_static=remote_static,
                generate_keypair=generate_keypair,
            )
            self._out.append(bytes([PROTOCOL_VERSION]) + _TAG_OF[pattern.name])
            # XX's first message carries no identity (it would go in clear).
            self._write(local.payload if pattern is IK else b"")
            self._stage = HandshakeStage.EXPECT_FRAME
        else:
            self._stage = HandshakeStage.EXPECT_PREAMBLE

    # --- queries ----------------------------------------------------------

    @property
    def stage(self) -> HandshakeStage:
        """What the handshake waits for."""
        return self._stage

    @property
    def failure(self) -> RemoteError | None:
        """Why the handshake FAILED, else None."""
        return self._failure

    def next_deadline(self) -> float:
        """The time by which the handshake must be DONE."""
        return self._deadline

    def data_to_send(self) -> bytes:
        """Bytes to write to the peer now (possibly empty); clears the queue."""
        out = b"".join(self._out)
        self._out.clear()
        return out

    def result(self) -> HandshakeResult:
        """The authenticated session. Raises LocalError unless DONE."""
        if self._result is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"handshake is {self._stage.value}")
        return self._result

    # --- inputs -----------------------------------------------------------

    def handle_timer(self, now: float) -> None:
        """Fail with TIMEOUT if the deadline has passed and the handshake is not done."""
        if now >= self._deadline and self._stage not in (HandshakeStage.DONE,):
            self._fail(SecureChannelError(ErrorCode.TIMEOUT, "handshake did not complete in time"))

    def receive_data_untrusted(self, data: bytes | bytearray, now: float) -> None:
        """Feed peer bytes (``b""`` means end of stream).

        Raises SecureChannelError/NoiseError (RemoteError) on any protocol
        violation; the stage is then FAILED. Raises LocalError if called after
        DONE or FAILED.
        """
        if self._stage in (HandshakeStage.DONE, HandshakeStage.FAILED):
            raise LocalError(
                ErrorCode.INVALID_ARGUMENT,
                f"handshake is {self._stage.value}"
                + (f" ({self._failure.message})" if self._failure else ""),
            )
        if now >= self._deadline:
            self.handle_timer(now)
        if not data:
            self._fail(
                SecureChannelError(
                    ErrorCode.HANDSHAKE_FAILED, "peer closed the connection during the handshake"
                )
            )
        self._buffer += data
        try:
            self._process_untrusted()
        except RemoteError as exc:
            self._fail(exc)

    def _fail(self, exc: RemoteError) -> None:
        if self._stage is not HandshakeStage.FAILED:
            self._set_stage(HandshakeStage.FAILED)
            self._failure = exc
        raise exc

    def _set_stage(self, stage: HandshakeStage) -> None:
        if stage not in _TRANSITIONS[self._stage]:
            raise LocalError(ErrorCode.INTERNAL, f"illegal transition {self._stage} -> {stage}")
        self._stage = stage

    def _write(self, payload: bytes) -> None:
        assert self._noise is not None
        message = self._noise.write_message(payload)
        self._out.append(len(message).to_bytes(2, "big") + message)

    def _process_untrusted(self) -> None:
        buf = self._buffer
        if self._stage is HandshakeStage.EXPECT_PREAMBLE:
            if len(buf) < PREAMBLE_LEN:
                return
            self._accept_preamble_untrusted(bytes(buf[:PREAMBLE_LEN]))
            del buf[:PREAMBLE_LEN]
        while self._stage is HandshakeStage.EXPECT_FRAME and len(buf) >= 2:
            length = int.from_bytes(buf[:2], "big")
            if length == 0 and self._initiator:
                if len(buf) < 3:
                    return
                raise SecureChannelError(
                    ErrorCode.PROTOCOL_VERSION_MISMATCH,
                    "responder rejected our protocol version or pattern",
                    peer_version=buf[2],
                )
            if length > MAX_HANDSHAKE_FRAME:
                raise SecureChannelError(
                    ErrorCode.MESSAGE_TOO_LARGE,
                    f"handshake frame of {length} bytes (limit {MAX_HANDSHAKE_FRAME})",
                )
            if len(buf) < 2 + length:
                return
            message = bytes(buf[2 : 2 + length])
            del buf[: 2 + length]
            self._on_message_untrusted(message)

    def _accept_preamble_untrusted(self, preamble: bytes) -> None:
        version, tag = preamble[0], preamble[1:2]
        pattern = PATTERN_TAGS.get(tag)
        if version != PROTOCOL_VERSION or pattern is None:
            # Tell the peer what we speak before closing, so it fails cleanly.
            self._out.append(REJECT_PREFIX + bytes([PROTOCOL_VERSION]))
            code = (
                ErrorCode.PROTOCOL_VERSION_MISMATCH
                if version != PROTOCOL_VERSION
                else ErrorCode.HANDSHAKE_FAILED
            )
            raise SecureChannelError(
                code, "unsupported preamble", version=version, pattern=tag.hex()
            )
        self._noise = HandshakeState(
            pattern,
            initiator=False,
            prologue=PROLOGUE,
            static=self._local.static,
            generate_keypair=self._gen,
        )
        self._set_stage(HandshakeStage.EXPECT_FRAME)

    def _on_message_untrusted(self, message: bytes) -> None:
        noise = self._noise
        assert noise is not None
        first_xx = noise.pattern is XX and noise.message_index == 0
        try:
            payload = noise.read_message_untrusted(message)
        except NoiseError as exc:
            raise SecureChannelError(ErrorCode.HANDSHAKE_FAILED, exc.message) from None
        if first_xx:
            if payload:
                raise SecureChannelError(
                    ErrorCode.HANDSHAKE_FAILED, "XX first message must have an empty payload"
                )
        else:
            assert noise.remote_static is not None
            self._remote = self._local.verify_payload_untrusted(payload, noise.remote_static)
            if self._expected is not None and self._remote.peer_id != self._expected:
                raise SecureChannelError(
                    ErrorCode.PEER_ID_MISMATCH,
                    "peer proved a different identity than the one dialed",
                    expected=str(self._expected),
                    actual=str(self._remote.peer_id),
                )
        if noise.status is HandshakeStatus.WRITE_MESSAGE:
            # Every message after XX's first carries our signed identity.
            self._write(self._local.payload)
        if noise.status is HandshakeStatus.COMPLETE:
            assert self._remote is not None
            leftover = bytes(self._buffer)
            self._buffer.clear()
            self._result = HandshakeResult(
                noise.transport(), self._remote, noise.pattern.name, leftover
            )
            self._set_stage(HandshakeStage.DONE)
