"""ChaCha20-Poly1305 (IETF) for transport frames: two backends, one wire format.

Theory of operation. A transport frame is ``len:u16be || ciphertext || tag``
with the 12-byte ChaChaPoly nonce of Noise §12.3 and empty associated data
(Noise §5.2 ``Split``: transport messages carry none). Two implementations
produce the same bytes:

* **libsodium** through PyNaCl (always installed). The public
  ``nacl.bindings`` AEAD functions accept only ``bytes``, zero a fresh output
  buffer and copy it again; when PyNaCl's compiled cffi binding
  (``nacl._sodium``) is importable, :class:`SodiumBackend` instead encrypts a
  frame inside the caller's buffer (libsodium allows ciphertext and plaintext
  to overlap exactly) and decrypts straight into the destination. That binding
  is PyNaCl's private module, so it sits behind a guard (:data:`FAST`, false
  when the import fails) with the public bindings as the fallback
  (:data:`SODIUM_PORTABLE`; the tests run both): sealing and opening a 200-byte
  frame costs about a third as much through it (11.9 µs against 37.0 µs, and
  12.3 against 43.2 at 1,200 bytes, min of 7 × 20,000 on a loaded 2-core machine).
* **OpenSSL** through the ``cryptography`` package (``pip install
  'p2pnode[fast]'``), whose ``ChaCha20Poly1305.encrypt_into`` /
  ``decrypt_into`` (cryptography >= 47) write into a caller's buffer; it
  encrypts in place too (OpenSSL's EVP interface allows input and output to
  be the same bytes; the backend checks this once when it is built and copies
  the plaintext otherwise). OpenSSL's vectorised ChaCha20 is two to three
  times faster per byte than libsodium's here, but each call costs a little
  more, so below :data:`SMALL_FRAME`
  plaintext bytes :class:`OpenSSLBackend` hands the frame to libsodium (the
  node's envelopes travel in frames of a few hundred bytes).

A backend is chosen once at import (:data:`DEFAULT_BACKEND`: OpenSSL when a
recent enough ``cryptography`` is importable, else libsodium) and can be
injected instead (``TransportCodec(..., aead=...)``), as the tests do to
check each backend against the Noise vectors and against the other. A
backend turns each direction's key into a :class:`FrameCipher` once, so the
per-frame calls do no key setup.

The plain functions :func:`seal_in_place` and :func:`open_into` (and their
``_portable`` twins) are the libsodium path without a cipher object, for
tools that forge frames with a given key.
"""

from __future__ import annotations

from typing import Any, Protocol

from nacl.bindings import (
    crypto_aead_chacha20poly1305_ietf_decrypt,
    crypto_aead_chacha20poly1305_ietf_encrypt,
)

from p2pnode.core.errors import ErrorCode, LocalError

__all__ = [
    "DEFAULT_BACKEND",
    "FAST",
    "FRAME_HEADER",
    "OPENSSL",
    "OPENSSL_AVAILABLE",
    "SMALL_FRAME",
    "SODIUM",
    "SODIUM_PORTABLE",
    "TAGLEN",
    "AeadBackend",
    "FrameCipher",
    "OpenSSLBackend",
    "SodiumBackend",
    "open_into",
    "open_into_portable",
    "seal_in_place",
    "seal_in_place_portable",
]

TAGLEN = 16
FRAME_HEADER = 2
#: Frames with fewer plaintext bytes go to libsodium even on the OpenSSL
#: backend. Measured through TransportCodec (encode + decode, CPU time) on the
#: reference machine: libsodium is ~1 µs a message cheaper at 1.2 KiB (OpenSSL's
#: call costs more), the two are even near 2 KiB, OpenSSL is ~1.7x faster at
#: 16 and 64 KiB.
SMALL_FRAME = 2048

try:  # PyNaCl's own cffi binding of libsodium.
    from nacl._sodium import ffi as _ffi  # type: ignore[import-not-found]
    from nacl._sodium import lib as _lib

    _encrypt: Any = _lib.crypto_aead_chacha20poly1305_ietf_encrypt
    _decrypt: Any = _lib.crypto_aead_chacha20poly1305_ietf_decrypt
    _NULL: Any = _ffi.NULL
    _from_buffer: Any = _ffi.from_buffer
    FAST = True
except (ImportError, AttributeError):  # pragma: no cover - depends on the PyNaCl build
    FAST = False

try:  # Optional: the [fast] extra. encrypt_into/decrypt_into need cryptography >= 47.
    from cryptography.exceptions import InvalidTag as _InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305 as _ChaCha

    OPENSSL_AVAILABLE = hasattr(_ChaCha, "encrypt_into") and hasattr(_ChaCha, "decrypt_into")
except ImportError:  # pragma: no cover - depends on what is installed
    OPENSSL_AVAILABLE = False


class FrameCipher(Protocol):
    """One direction's key, ready to seal or open frames."""

    def seal_in_place(self, nonce: bytes, buf: bytearray, start: int, size: int) -> None:
        """Make ``buf[start:start+2+size+16]`` a frame: length, ciphertext, tag.

        The ``size`` plaintext bytes are expected at ``buf[start+2:]`` and are
        encrypted in place; the 16 bytes after them receive the tag.
        """
        ...

    def open_into(
        self,
        nonce: bytes,
        src: bytes | bytearray,
        start: int,
        size: int,
        dst: bytearray,
        dst_start: int,
    ) -> bool:
        """Decrypt the ``size`` bytes (ciphertext and tag) at ``src[start:]``.

        The plaintext (``size - 16`` bytes) goes to ``dst[dst_start:]``, which
        must have room. Returns False, writing nothing usable, on a bad tag.
        """
        ...


class AeadBackend(Protocol):
    """An implementation of ChaCha20-Poly1305 for transport frames."""

    @property
    def name(self) -> str:
        """What runs the cipher, for logs and benchmarks."""
        ...

    def cipher(self, key: bytes) -> FrameCipher:
        """A cipher for one direction's 32-byte key."""
        ...


def _write_length(buf: bytearray, start: int, size: int) -> None:
    buf[start] = (size + TAGLEN) >> 8
    buf[start + 1] = (size + TAGLEN) & 0xFF


# --- libsodium ---------------------------------------------------------------


def seal_in_place_portable(key: bytes, nonce: bytes, buf: bytearray, start: int, size: int) -> None:
    """Like :func:`seal_in_place`, through the public bindings."""
    view = memoryview(buf)
    plaintext = bytes(view[start + FRAME_HEADER : start + FRAME_HEADER + size])
    view.release()
    ciphertext = crypto_aead_chacha20poly1305_ietf_encrypt(plaintext, None, nonce, key)
    _write_length(buf, start, size)
    buf[start + FRAME_HEADER : start + FRAME_HEADER + size + TAGLEN] = ciphertext


def open_into_portable(
    key: bytes,
    nonce: bytes,
    src: bytes | bytearray,
    start: int,
    size: int,
    dst: bytearray,
    dst_start: int,
) -> bool:
    """Like :func:`open_into`, through the public bindings."""
    view = memoryview(src)
    ciphertext = bytes(view[start : start + size])
    view.release()
    try:
        plaintext = crypto_aead_chacha20poly1305_ietf_decrypt(ciphertext, None, nonce, key)
    except Exception:  # nacl CryptoError on a bad tag
        return False
    dst[dst_start : dst_start + len(plaintext)] = plaintext
    return True


if FAST:

    def seal_in_place(key: bytes, nonce: bytes, buf: bytearray, start: int, size: int) -> None:
        """:meth:`FrameCipher.seal_in_place` with libsodium and an explicit key."""
        _write_length(buf, start, size)
        with _from_buffer(buf) as p:
            q = p + start + FRAME_HEADER
            _encrypt(q, _NULL, q, size, _NULL, 0, _NULL, nonce, key)

    def open_into(
        key: bytes,
        nonce: bytes,
        src: bytes | bytearray,
        start: int,
        size: int,
        dst: bytearray,
        dst_start: int,
    ) -> bool:
        """:meth:`FrameCipher.open_into` with libsodium and an explicit key."""
        with _from_buffer(src) as c, _from_buffer(dst) as p:
            rc = _decrypt(p + dst_start, _NULL, _NULL, c + start, size, _NULL, 0, nonce, key)
        return bool(rc == 0)

else:  # pragma: no cover
    seal_in_place = seal_in_place_portable
    open_into = open_into_portable


class _SodiumCipher:
    """libsodium in place, through PyNaCl's cffi binding."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        self._key = key

    def seal_in_place(self, nonce: bytes, buf: bytearray, start: int, size: int) -> None:
        buf[start] = (size + TAGLEN) >> 8
        buf[start + 1] = (size + TAGLEN) & 0xFF
        with _from_buffer(buf) as p:
            q = p + start + FRAME_HEADER
            _encrypt(q, _NULL, q, size, _NULL, 0, _NULL, nonce, self._key)

    def open_into(
        self,
        nonce: bytes,
        src: bytes | bytearray,
        start: int,
        size: int,
        dst: bytearray,
        dst_start: int,
    ) -> bool:
        with _from_buffer(src) as c, _from_buffer(dst) as p:
            rc = _decrypt(p + dst_start, _NULL, _NULL, c + start, size, _NULL, 0, nonce, self._key)
        return bool(rc == 0)


class _PortableCipher:
    """libsodium through PyNaCl's public bindings (copies, but needs no private module)."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        self._key = key

    def seal_in_place(self, nonce: bytes, buf: bytearray, start: int, size: int) -> None:
        seal_in_place_portable(self._key, nonce, buf, start, size)

    def open_into(
        self,
        nonce: bytes,
        src: bytes | bytearray,
        start: int,
        size: int,
        dst: bytearray,
        dst_start: int,
    ) -> bool:
        return open_into_portable(self._key, nonce, src, start, size, dst, dst_start)


def _check_key(key: bytes) -> None:
    # libsodium reads 32 bytes from the pointer it is given: a short key must never reach it.
    if len(key) != 32:
        raise LocalError(
            ErrorCode.INVALID_ARGUMENT, f"a ChaCha20-Poly1305 key has 32 bytes, not {len(key)}"
        )


class SodiumBackend:
    """libsodium through PyNaCl: in place when PyNaCl's cffi binding is importable."""

    __slots__ = ("_in_place",)

    def __init__(self, *, in_place: bool = FAST) -> None:
        """``in_place=False`` uses only PyNaCl's public bindings.

        Raises LocalError(CONFIG_ERROR) for ``in_place=True`` when this PyNaCl
        build has no importable cffi binding.
        """
        if in_place and not FAST:  # pragma: no cover - depends on the PyNaCl build
            raise LocalError(ErrorCode.CONFIG_ERROR, "this PyNaCl build has no cffi binding")
        self._in_place = in_place

    @property
    def name(self) -> str:
        """``libsodium`` or ``libsodium (public bindings)``."""
        return "libsodium" if self._in_place else "libsodium (public bindings)"

    def cipher(self, key: bytes) -> FrameCipher:
        """A cipher for ``key``; raises LocalError(INVALID_ARGUMENT) unless it has 32 bytes."""
        _check_key(key)
        return _SodiumCipher(key) if self._in_place else _PortableCipher(key)

    def __repr__(self) -> str:
        return f"SodiumBackend(in_place={self._in_place})"


# --- OpenSSL -----------------------------------------------------------------


class _OpenSSLCipher:
    """OpenSSL through cryptography's ChaCha20Poly1305, writing into the caller's buffers.

    Frames under ``below`` plaintext bytes take libsodium's in-place path,
    inlined here rather than delegated so a small frame costs no more Python
    calls than it does on :class:`SodiumBackend`.
    """

    __slots__ = ("_below", "_decrypt_into", "_encrypt_into", "_in_place", "_key")

    def __init__(self, key: bytes, below: int, in_place: bool) -> None:
        aead = _ChaCha(key)  # the key schedule object, built once per direction
        self._encrypt_into: Any = aead.encrypt_into
        self._decrypt_into: Any = aead.decrypt_into
        self._key = key
        self._below = below
        self._in_place = in_place

    def seal_in_place(self, nonce: bytes, buf: bytearray, start: int, size: int) -> None:
        buf[start] = (size + TAGLEN) >> 8
        buf[start + 1] = (size + TAGLEN) & 0xFF
        body = start + FRAME_HEADER
        if size < self._below:
            with _from_buffer(buf) as p:
                q = p + body
                _encrypt(q, _NULL, q, size, _NULL, 0, _NULL, nonce, self._key)
            return
        # Temporary views, released as the call returns (no ``with``: it costs a quarter
        # of a microsecond a frame, and nothing here outlives the call).
        view = memoryview(buf)
        plaintext = view[body : body + size] if self._in_place else buf[body : body + size]
        self._encrypt_into(nonce, plaintext, None, view[body : body + size + TAGLEN])

    def open_into(
        self,
        nonce: bytes,
        src: bytes | bytearray,
        start: int,
        size: int,
        dst: bytearray,
        dst_start: int,
    ) -> bool:
        length = size - TAGLEN
        if length < self._below:
            with _from_buffer(src) as c, _from_buffer(dst) as p:
                rc = _decrypt(
                    p + dst_start, _NULL, _NULL, c + start, size, _NULL, 0, nonce, self._key
                )
            return bool(rc == 0)
        try:
            self._decrypt_into(
                nonce,
                memoryview(src)[start : start + size],
                None,
                memoryview(dst)[dst_start : dst_start + length],
            )
        except _InvalidTag:
            return False
        return True


_PROBE = bytes(range(256)) * 16


def _in_place_works() -> bool:
    """Whether encrypt_into may read and write the same bytes (OpenSSL's EVP allows it)."""
    key, nonce = bytes(range(32)), bytes(12)
    aead = _ChaCha(key)
    buf = bytearray(_PROBE) + bytes(TAGLEN)
    try:
        with memoryview(buf) as view:
            aead.encrypt_into(nonce, view[: len(_PROBE)], None, view)
    except Exception:  # pragma: no cover - a cryptography that refuses overlapping buffers
        return False
    return buf == aead.encrypt(nonce, _PROBE, None)


class OpenSSLBackend:
    """OpenSSL through ``cryptography``; frames under ``small_below`` bytes go to libsodium."""

    __slots__ = ("_below", "_in_place")

    def __init__(self, *, small_below: int = SMALL_FRAME, in_place: bool | None = None) -> None:
        """``small_below=0`` sends every frame to OpenSSL.

        ``in_place`` (default: whether an encryption at construction shows it
        works) encrypts the plaintext where it lies; False copies it first.
        Raises LocalError(CONFIG_ERROR) if cryptography >= 47 is not installed,
        LocalError(INVALID_ARGUMENT) for a negative ``small_below``.
        """
        if not OPENSSL_AVAILABLE:
            raise LocalError(
                ErrorCode.CONFIG_ERROR,
                "cryptography >= 47 is not installed (pip install 'p2pnode[fast]')",
            )
        if small_below < 0:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "small_below must not be negative")
        # Without PyNaCl's cffi binding libsodium has no cheap path to hand small frames to.
        self._below = small_below if FAST else 0
        self._in_place = _in_place_works() if in_place is None else in_place

    @property
    def name(self) -> str:
        """E.g. ``OpenSSL 3.5.0 8 Apr 2025 (cryptography 47.0.0), libsodium under 2048 B``."""
        from cryptography import __version__ as version
        from cryptography.hazmat.backends.openssl import backend

        name = f"{backend.openssl_version_text()} (cryptography {version})"
        if not self._in_place:
            name += ", copying"
        if self._below:
            name += f", libsodium under {self._below} B"
        return name

    def cipher(self, key: bytes) -> FrameCipher:
        """A cipher for ``key``; raises LocalError(INVALID_ARGUMENT) unless it has 32 bytes."""
        _check_key(key)
        return _OpenSSLCipher(key, self._below, self._in_place)

    def __repr__(self) -> str:
        return f"OpenSSLBackend(small_below={self._below}, in_place={self._in_place})"


#: libsodium, in place when possible (PyNaCl is always installed).
SODIUM: AeadBackend = SodiumBackend()
#: libsodium through the public bindings only.
SODIUM_PORTABLE: AeadBackend = SodiumBackend(in_place=False)
#: OpenSSL for frames of SMALL_FRAME bytes and more, libsodium below; None without cryptography.
OPENSSL: AeadBackend | None = OpenSSLBackend() if OPENSSL_AVAILABLE else None
#: What transport codecs use unless given another backend.
DEFAULT_BACKEND: AeadBackend = OPENSSL if OPENSSL is not None else SODIUM
