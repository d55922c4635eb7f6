"""ChaCha20-Poly1305 (IETF) for transport frames, without intermediate copies.

The public ``nacl.bindings`` AEAD functions accept only ``bytes``, zero a
fresh output buffer and copy it again into ``bytes``; on the hot path that
doubles the cost of a small message and adds copies to a large one. When
PyNaCl's compiled libsodium binding (``nacl._sodium``) is importable,
:func:`seal_in_place` encrypts a frame inside the caller's output buffer
(libsodium allows ciphertext and plaintext to overlap) and
:func:`open_into` decrypts straight from the receive buffer into the
destination. Otherwise both fall back to the public bindings; the bytes are
identical either way (the tests check both against each other).

Both take the 12-byte ChaChaPoly nonce (Noise §12.3) and use empty
associated data, as Noise transport messages do (§5.2 ``Split``).
"""

from __future__ import annotations

from typing import Any

from nacl.bindings import (
    crypto_aead_chacha20poly1305_ietf_decrypt,
    crypto_aead_chacha20poly1305_ietf_encrypt,
)

__all__ = [
    "FAST",
    "FRAME_HEADER",
    "TAGLEN",
    "open_into",
    "open_into_portable",
    "seal_in_place",
    "seal_in_place_portable",
]

TAGLEN = 16
FRAME_HEADER = 2

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


def seal_in_place_portable(key: bytes, nonce: bytes, buf: bytearray, start: int, size: int) -> None:
    """Like :func:`seal_in_place`, through the public bindings."""
    view = memoryview(buf)
    plaintext = bytes(view[start + FRAME_HEADER : start + FRAME_HEADER + size])
    view.release()
    ciphertext = crypto_aead_chacha20poly1305_ietf_encrypt(plaintext, None, nonce, key)
    buf[start] = (size + TAGLEN) >> 8
    buf[start + 1] = (size + TAGLEN) & 0xFF
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
        """Make ``buf[start:start+2+size+16]`` a frame: length, ciphertext, tag.

        The ``size`` plaintext bytes are expected at ``buf[start+2:]`` and are
        encrypted in place; the 16 bytes after them receive the tag.
        """
        buf[start] = (size + TAGLEN) >> 8
        buf[start + 1] = (size + TAGLEN) & 0xFF
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
        """Decrypt the ``size`` bytes (ciphertext and tag) at ``src[start:]``.

        The plaintext (``size - 16`` bytes) goes to ``dst[dst_start:]``, which
        must have room. Returns False, writing nothing usable, on a bad tag.
        """
        with _from_buffer(src) as c, _from_buffer(dst) as p:
            rc = _decrypt(p + dst_start, _NULL, _NULL, c + start, size, _NULL, 0, nonce, key)
        return bool(rc == 0)

else:  # pragma: no cover
    seal_in_place = seal_in_place_portable
    open_into = open_into_portable
