"""Noise Protocol Framework (revision 34) core: 25519, ChaChaPoly, BLAKE2b.

Theory of operation. This module is sans-IO: it turns handshake payloads
into handshake messages and back, and finally yields a :class:`NoiseTransport`
holding the two transport :class:`CipherState` objects. It never touches a
socket or a clock; framing, timeouts and identity live in
:mod:`p2pnode.transport.secure` and :mod:`p2pnode.transport.channel`.

The objects follow the spec one to one:

* :class:`CipherState` (§5.1): a key ``k`` (or none) and a 64-bit nonce ``n``.
  ChaChaPoly's nonce is 32 zero bits followed by ``n`` little-endian (§12.3).
  Without a key, encryption is the identity function (§5.1 "if k is empty").
  ``n = 2**64 - 1`` is reserved, so that nonce is never used (§5.1).
* :class:`SymmetricState` (§5.2): chaining key ``ck`` and handshake hash ``h``;
  ``MixKey``, ``MixHash``, ``EncryptAndHash``, ``DecryptAndHash`` and ``Split``.
  ``HKDF`` is the spec's (§4.3): ``temp = HMAC(ck, ikm)``,
  ``out_i = HMAC(temp, out_{i-1} || i)``, with HMAC-BLAKE2b (HASHLEN 64,
  BLOCKLEN 128); cipher keys are the first 32 bytes of a 64-byte output (§5.2).
* :class:`HandshakeState` (§5.3): processes the message patterns of a
  :class:`HandshakePattern` (plain data; :data:`XX`, :data:`IK`, :data:`NN`).
  Its :class:`HandshakeStatus` says what it waits for next; an operation in
  the wrong status raises :class:`~p2pnode.core.errors.LocalError` and changes
  nothing; any failure on peer bytes moves it to ``ERROR`` for good (§5.3
  "abort the handshake").

Keys are injected: the static key pair and the remote static public key are
constructor arguments, and ephemeral keys come from a ``generate_keypair``
callable (test vectors pass one that returns the vector's fixed key).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

from nacl.bindings import (
    crypto_aead_chacha20poly1305_ietf_decrypt,
    crypto_aead_chacha20poly1305_ietf_encrypt,
    crypto_scalarmult,
    crypto_scalarmult_base,
)

from p2pnode.core.errors import ErrorCode, LocalError, RemoteError

__all__ = [
    "BLOCKLEN",
    "DHLEN",
    "HASHLEN",
    "IK",
    "KEYLEN",
    "MAX_MESSAGE_LEN",
    "MAX_NONCE",
    "MAX_PLAINTEXT_LEN",
    "NN",
    "PATTERNS",
    "SUITE",
    "TAGLEN",
    "XX",
    "CipherState",
    "HandshakePattern",
    "HandshakeState",
    "HandshakeStatus",
    "KeyPair",
    "NoiseError",
    "NoiseTransport",
    "SymmetricState",
    "Token",
    "dh",
    "hash_bytes",
    "hkdf",
    "hmac_hash",
]

DHLEN = 32
HASHLEN = 64
BLOCKLEN = 128
KEYLEN = 32
TAGLEN = 16
#: Largest Noise message, handshake or transport (§3).
MAX_MESSAGE_LEN = 65535
#: Largest transport plaintext: one maximal message minus the AEAD tag.
MAX_PLAINTEXT_LEN = MAX_MESSAGE_LEN - TAGLEN
#: ``2**64 - 1`` is reserved (§5.1): a CipherState refuses to use it.
MAX_NONCE = 2**64 - 1
SUITE = "25519_ChaChaPoly_BLAKE2b"

# 32 zero bits || 64-bit little-endian counter (§12.3, ChaChaPoly).
_nonce_bytes = struct.Struct("<4xQ").pack


class NoiseError(RemoteError):
    """Peer bytes failed the Noise handshake or transport decryption."""


# --- crypto functions (§4) -------------------------------------------------


@dataclass(frozen=True, slots=True)
class KeyPair:
    """An X25519 key pair; ``private`` is the 32-byte scalar, ``public`` its point."""

    private: bytes
    public: bytes

    @classmethod
    def from_private(cls, private: bytes) -> KeyPair:
        """The key pair of a 32-byte X25519 private key. Raises LocalError on bad input."""
        if not isinstance(private, bytes) or len(private) != DHLEN:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "an X25519 private key is 32 bytes")
        return cls(private, crypto_scalarmult_base(private))

    @classmethod
    def generate(cls, random_bytes: Callable[[int], bytes] = os.urandom) -> KeyPair:
        """A fresh key pair from ``random_bytes`` (``GENERATE_KEYPAIR``, §4.1)."""
        return cls.from_private(random_bytes(DHLEN))

    def __repr__(self) -> str:  # never print the private key
        return f"KeyPair(public={self.public.hex()})"


def dh(key_pair: KeyPair, public_key: bytes) -> bytes:
    """X25519 ``DH(key_pair, public_key)`` (§4.1, §12.1).

    Raises NoiseError(HANDSHAKE_FAILED) when the peer's point is of low order
    (libsodium reports an all-zero shared secret as an error).
    """
    try:
        return crypto_scalarmult(key_pair.private, public_key)
    except Exception as exc:  # nacl raises its own RuntimeError/TypeError family
        raise NoiseError(ErrorCode.HANDSHAKE_FAILED, "invalid X25519 public key") from exc


def hash_bytes(data: bytes) -> bytes:
    """``HASH(data)``: BLAKE2b-512 (§12.8)."""
    return hashlib.blake2b(data).digest()


def hmac_hash(key: bytes, data: bytes) -> bytes:
    """``HMAC-HASH(key, data)`` with BLAKE2b (RFC 2104, BLOCKLEN 128; §4.3)."""
    return hmac.digest(key, data, "blake2b")


def hkdf(chaining_key: bytes, input_key_material: bytes, num_outputs: int) -> tuple[bytes, ...]:
    """The spec's ``HKDF`` (§4.3) with 2 or 3 outputs of HASHLEN bytes."""
    temp_key = hmac_hash(chaining_key, input_key_material)
    output1 = hmac_hash(temp_key, b"\x01")
    output2 = hmac_hash(temp_key, output1 + b"\x02")
    if num_outputs == 2:
        return output1, output2
    return output1, output2, hmac_hash(temp_key, output2 + b"\x03")


# --- CipherState (§5.1) ------------------------------------------------------


class CipherState:
    """A cipher key (possibly empty) and a nonce counter (§5.1)."""

    __slots__ = ("_key", "_n")

    def __init__(self, key: bytes | None = None) -> None:
        """``InitializeKey(key)``; ``None`` is the spec's empty key."""
        if key is not None and (not isinstance(key, bytes) or len(key) != KEYLEN):
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "a cipher key is 32 bytes")
        self._key = key
        self._n = 0

    def has_key(self) -> bool:
        """``HasKey()``."""
        return self._key is not None

    @property
    def nonce(self) -> int:
        """The next nonce to be used."""
        return self._n

    @property
    def key(self) -> bytes | None:
        """The cipher key, for transport codecs that inline the AEAD call."""
        return self._key

    def _next_nonce(self) -> bytes:
        n = self._n
        if n >= MAX_NONCE:
            # Reusing a nonce would be catastrophic; rekeying is out of scope.
            raise LocalError(ErrorCode.INTERNAL, "cipher nonce space exhausted")
        self._n = n + 1
        return _nonce_bytes(n)

    def encrypt_with_ad(self, ad: bytes, plaintext: bytes) -> bytes:
        """``EncryptWithAd``: AEAD ciphertext||tag, or ``plaintext`` when keyless."""
        if self._key is None:
            return plaintext
        return crypto_aead_chacha20poly1305_ietf_encrypt(
            plaintext, ad or None, self._next_nonce(), self._key
        )

    def decrypt_with_ad_untrusted(self, ad: bytes, ciphertext: bytes) -> bytes:
        """``DecryptWithAd``. Raises NoiseError(DECRYPT_FAILED) on a bad tag.

        On failure the nonce is not advanced (§5.1), but callers treat any
        failure as fatal for the session.
        """
        key = self._key
        if key is None:
            return ciphertext
        n = self._n
        if n >= MAX_NONCE:
            raise NoiseError(ErrorCode.DECRYPT_FAILED, "cipher nonce space exhausted")
        try:
            plaintext = crypto_aead_chacha20poly1305_ietf_decrypt(
                ciphertext, ad or None, _nonce_bytes(n), key
            )
        except Exception as exc:  # CryptoError on a bad tag, TypeError on short input
            raise NoiseError(ErrorCode.DECRYPT_FAILED, "message authentication failed") from exc
        self._n = n + 1
        return plaintext


# --- SymmetricState (§5.2) ---------------------------------------------------


class SymmetricState:
    """Chaining key, handshake hash and the handshake CipherState (§5.2)."""

    __slots__ = ("_ck", "_h", "cipher")

    def __init__(self, protocol_name: bytes) -> None:
        """``InitializeSymmetric(protocol_name)``."""
        if len(protocol_name) <= HASHLEN:
            h = protocol_name.ljust(HASHLEN, b"\0")
        else:
            h = hash_bytes(protocol_name)
        self._h = h
        self._ck = h
        self.cipher = CipherState()

    @property
    def handshake_hash(self) -> bytes:
        """``GetHandshakeHash()``: the current ``h``."""
        return self._h

    def mix_key(self, input_key_material: bytes) -> None:
        """``MixKey``: new ``ck`` and a new cipher key (truncated to 32 bytes)."""
        self._ck, temp_k = hkdf(self._ck, input_key_material, 2)
        self.cipher = CipherState(temp_k[:KEYLEN])

    def mix_hash(self, data: bytes) -> None:
        """``MixHash``: ``h = HASH(h || data)``."""
        self._h = hash_bytes(self._h + data)

    def encrypt_and_hash(self, plaintext: bytes) -> bytes:
        """``EncryptAndHash``: encrypt with ``h`` as associated data, then mix it."""
        ciphertext = self.cipher.encrypt_with_ad(self._h, plaintext)
        self.mix_hash(ciphertext)
        return ciphertext

    def decrypt_and_hash_untrusted(self, ciphertext: bytes) -> bytes:
        """``DecryptAndHash``. Raises NoiseError(DECRYPT_FAILED)."""
        plaintext = self.cipher.decrypt_with_ad_untrusted(self._h, ciphertext)
        self.mix_hash(ciphertext)
        return plaintext

    def split(self) -> tuple[CipherState, CipherState]:
        """``Split()``: the initiator's sending and receiving CipherStates."""
        temp_k1, temp_k2 = hkdf(self._ck, b"", 2)
        return CipherState(temp_k1[:KEYLEN]), CipherState(temp_k2[:KEYLEN])


# --- patterns (§7) -----------------------------------------------------------


class Token(enum.Enum):
    """Message-pattern tokens (§7.1)."""

    E = "e"
    S = "s"
    EE = "ee"
    ES = "es"
    SE = "se"
    SS = "ss"


@dataclass(frozen=True, slots=True)
class HandshakePattern:
    """A handshake pattern as data (§7.1).

    ``messages[i]`` is sent by the initiator for even ``i`` and by the
    responder for odd ``i``. Pre-messages list the keys known in advance.
    """

    name: str
    initiator_pre: tuple[Token, ...]
    responder_pre: tuple[Token, ...]
    messages: tuple[tuple[Token, ...], ...]

    def protocol_name(self) -> bytes:
        """The full protocol name, e.g. ``Noise_XX_25519_ChaChaPoly_BLAKE2b``."""
        return f"Noise_{self.name}_{SUITE}".encode("ascii")

    def sends_static(self, initiator: bool) -> bool:
        """True when that side transmits or pre-shares a static key."""
        pre = self.initiator_pre if initiator else self.responder_pre
        own = self.messages[0 if initiator else 1 :: 2]
        return Token.S in pre or any(Token.S in m for m in own)


E, S, EE, ES, SE, SS = Token.E, Token.S, Token.EE, Token.ES, Token.SE, Token.SS
#: ``-> e / <- e, ee``: anonymous (used here only for known-answer tests).
NN = HandshakePattern("NN", (), (), ((E,), (E, EE)))
#: ``-> e / <- e, ee, s, es / -> s, se``: mutual authentication on first contact.
XX = HandshakePattern("XX", (), (), ((E,), (E, EE, S, ES), (S, SE)))
#: ``<- s ... / -> e, es, s, ss / <- e, ee, se``: the initiator knows the responder's key.
IK = HandshakePattern("IK", (), (S,), ((E, ES, S, SS), (E, EE, SE)))
PATTERNS: dict[str, HandshakePattern] = {p.name: p for p in (NN, XX, IK)}


# --- HandshakeState (§5.3) ---------------------------------------------------


class HandshakeStatus(enum.Enum):
    """What a :class:`HandshakeState` waits for."""

    WRITE_MESSAGE = "write_message"  # our turn to send the next handshake message
    READ_MESSAGE = "read_message"  # waiting for the peer's next handshake message
    COMPLETE = "complete"  # Split() done; take the transport
    ERROR = "error"  # aborted; every later call raises


_S = HandshakeStatus
#: Legal transitions; every other one is a bug (§5.3: messages alternate, the
#: last one completes the handshake, any failure aborts it).
_TRANSITIONS: dict[HandshakeStatus, frozenset[HandshakeStatus]] = {
    _S.WRITE_MESSAGE: frozenset({_S.READ_MESSAGE, _S.WRITE_MESSAGE, _S.COMPLETE, _S.ERROR}),
    _S.READ_MESSAGE: frozenset({_S.WRITE_MESSAGE, _S.READ_MESSAGE, _S.COMPLETE, _S.ERROR}),
    _S.COMPLETE: frozenset(),
    _S.ERROR: frozenset(),
}


@dataclass(frozen=True, slots=True)
class NoiseTransport:
    """The result of a completed handshake (§5.3 ``Split``).

    ``send`` encrypts our messages, ``receive`` decrypts the peer's;
    ``handshake_hash`` is the final ``h`` (channel binding, §11.2);
    ``remote_static`` the peer's static public key (``None`` for NN).
    """

    send: CipherState
    receive: CipherState
    handshake_hash: bytes
    remote_static: bytes | None


def _generate_default() -> KeyPair:
    return KeyPair.generate()


class HandshakeState:
    """One side of a Noise handshake (§5.3), driven by payloads and messages."""

    __slots__ = (
        "_e",
        "_gen",
        "_index",
        "_initiator",
        "_pattern",
        "_re",
        "_rs",
        "_s",
        "_ss",
        "_status",
        "_transport",
    )

    def __init__(
        self,
        pattern: HandshakePattern,
        *,
        initiator: bool,
        prologue: bytes = b"",
        static: KeyPair | None = None,
        remote_static: bytes | None = None,
        generate_keypair: Callable[[], KeyPair] = _generate_default,
    ) -> None:
        """``Initialize`` (§5.3).

        ``static`` is required when this side sends a static key; the
        initiator of a pattern with ``<- s`` pre-message (IK) needs
        ``remote_static``. ``generate_keypair`` makes the ephemeral key.
        Raises LocalError(INVALID_ARGUMENT) on a missing or malformed key.
        """
        if pattern.sends_static(initiator) and static is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"{pattern.name} needs a static key")
        peer_pre = pattern.responder_pre if initiator else pattern.initiator_pre
        if Token.S in peer_pre:
            if not isinstance(remote_static, bytes) or len(remote_static) != DHLEN:
                raise LocalError(
                    ErrorCode.INVALID_ARGUMENT, f"{pattern.name} needs the remote static key"
                )
        elif remote_static is not None:
            raise LocalError(
                ErrorCode.INVALID_ARGUMENT, f"{pattern.name} learns the remote static key itself"
            )
        self._pattern = pattern
        self._initiator = initiator
        self._s = static
        self._rs = remote_static
        self._e: KeyPair | None = None
        self._re: bytes | None = None
        self._gen = generate_keypair
        self._index = 0
        self._transport: NoiseTransport | None = None
        self._ss = SymmetricState(pattern.protocol_name())
        self._ss.mix_hash(prologue)
        # Pre-messages (§5.3): initiator's first, then the responder's.
        pre = ((pattern.initiator_pre, True), (pattern.responder_pre, False))
        for tokens, from_initiator in pre:
            for token in tokens:
                if token is not Token.S:  # only "s" pre-messages are used here
                    raise LocalError(ErrorCode.INVALID_ARGUMENT, "unsupported pre-message")
                key = self._s if from_initiator == initiator else self._rs
                assert key is not None
                self._ss.mix_hash(key.public if isinstance(key, KeyPair) else key)
        self._status = HandshakeStatus.WRITE_MESSAGE if initiator else HandshakeStatus.READ_MESSAGE

    @property
    def status(self) -> HandshakeStatus:
        """What this handshake waits for."""
        return self._status

    @property
    def pattern(self) -> HandshakePattern:
        """The pattern being run."""
        return self._pattern

    @property
    def handshake_hash(self) -> bytes:
        """The current handshake hash ``h``."""
        return self._ss.handshake_hash

    @property
    def message_index(self) -> int:
        """Index of the next handshake message in the pattern (0 = first)."""
        return self._index

    @property
    def remote_static(self) -> bytes | None:
        """The peer's static public key once known."""
        return self._rs

    def _require(self, status: HandshakeStatus, op: str) -> None:
        if self._status is not status:
            raise LocalError(
                ErrorCode.INVALID_ARGUMENT,
                f"cannot {op} while the handshake is {self._status.value}",
            )

    def _set_status(self, status: HandshakeStatus) -> None:
        if status not in _TRANSITIONS[self._status]:
            raise LocalError(ErrorCode.INTERNAL, f"illegal transition {self._status} -> {status}")
        self._status = status

    def _advance(self) -> None:
        # Transition table: messages alternate; the last one completes (§5.3).
        self._index += 1
        if self._index == len(self._pattern.messages):
            send, receive = self._ss.split()
            if not self._initiator:
                send, receive = receive, send
            self._transport = NoiseTransport(send, receive, self._ss.handshake_hash, self._rs)
            self._set_status(HandshakeStatus.COMPLETE)
        elif (self._index % 2 == 0) == self._initiator:
            self._set_status(HandshakeStatus.WRITE_MESSAGE)
        else:
            self._set_status(HandshakeStatus.READ_MESSAGE)

    def _dh_token(self, token: Token) -> bytes:
        # es: initiator's e with responder's s; se: initiator's s with responder's e.
        e, s, re, rs = self._e, self._s, self._re, self._rs
        if token is Token.EE:
            local, remote = e, re
        elif token is Token.SS:
            local, remote = s, rs
        elif (token is Token.ES) == self._initiator:
            local, remote = e, rs
        else:
            local, remote = s, re
        assert local is not None
        assert remote is not None
        return dh(local, remote)

    def write_message(self, payload: bytes) -> bytes:
        """``WriteMessage(payload)``: the next handshake message to send.

        Raises LocalError if it is not our turn or the message would exceed
        65535 bytes.
        """
        self._require(HandshakeStatus.WRITE_MESSAGE, "write a message")
        tokens = self._pattern.messages[self._index]
        if len(payload) + len(tokens) * (DHLEN + TAGLEN) + TAGLEN > MAX_MESSAGE_LEN:
            raise LocalError(ErrorCode.MESSAGE_TOO_LARGE, "handshake payload too large")
        ss = self._ss
        out: list[bytes] = []
        try:
            for token in tokens:
                if token is Token.E:
                    self._e = self._gen()
                    out.append(self._e.public)
                    ss.mix_hash(self._e.public)
                elif token is Token.S:
                    assert self._s is not None
                    out.append(ss.encrypt_and_hash(self._s.public))
                else:
                    ss.mix_key(self._dh_token(token))
            out.append(ss.encrypt_and_hash(payload))
        except Exception:
            self._set_status(HandshakeStatus.ERROR)
            raise
        self._advance()
        return b"".join(out)

    def read_message_untrusted(self, message: bytes) -> bytes:
        """``ReadMessage(message)``: the peer's payload.

        Raises NoiseError(HANDSHAKE_FAILED) on a truncated, oversized or
        forged message (the handshake is then in ERROR), LocalError if it is
        not the peer's turn.
        """
        self._require(HandshakeStatus.READ_MESSAGE, "read a message")
        try:
            payload = self._read_untrusted(bytes(message))
        except NoiseError as exc:
            self._set_status(HandshakeStatus.ERROR)
            raise NoiseError(ErrorCode.HANDSHAKE_FAILED, exc.message) from None
        except Exception:
            self._set_status(HandshakeStatus.ERROR)
            raise
        self._advance()
        return payload

    def _read_untrusted(self, message: bytes) -> bytes:
        if len(message) > MAX_MESSAGE_LEN:
            raise NoiseError(ErrorCode.HANDSHAKE_FAILED, "handshake message over 65535 bytes")
        ss = self._ss
        pos = 0
        for token in self._pattern.messages[self._index]:
            if token is Token.E:
                if len(message) - pos < DHLEN:
                    raise NoiseError(ErrorCode.HANDSHAKE_FAILED, "truncated ephemeral key")
                self._re = message[pos : pos + DHLEN]
                pos += DHLEN
                ss.mix_hash(self._re)
            elif token is Token.S:
                size = DHLEN + TAGLEN if ss.cipher.has_key() else DHLEN
                if len(message) - pos < size:
                    raise NoiseError(ErrorCode.HANDSHAKE_FAILED, "truncated static key")
                self._rs = ss.decrypt_and_hash_untrusted(message[pos : pos + size])
                pos += size
            else:
                ss.mix_key(self._dh_token(token))
        rest = message[pos:]
        if ss.cipher.has_key() and len(rest) < TAGLEN:
            raise NoiseError(ErrorCode.HANDSHAKE_FAILED, "truncated payload")
        return ss.decrypt_and_hash_untrusted(rest)

    def transport(self) -> NoiseTransport:
        """The transport CipherStates. Raises LocalError before COMPLETE."""
        self._require(HandshakeStatus.COMPLETE, "take the transport")
        assert self._transport is not None
        return self._transport
