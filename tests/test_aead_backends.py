"""The AEAD backends (p2pnode/transport/aead.py) are interchangeable on the wire.

libsodium (PyNaCl) and OpenSSL (cryptography) must produce the same frames
byte for byte, each must open the other's, and a tampered frame must fail with
the framing layer's DECRYPT_FAILED whichever backend receives it. The known
answers are the Noise vectors' transport messages (tests/test_noise_vectors.py
runs every backend over them); here backends are checked against each other,
directly and through a pair of TransportCodecs with one backend on each side.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.transport import aead
from p2pnode.transport.aead import AeadBackend, OpenSSLBackend, SodiumBackend
from p2pnode.transport.framing import RECORD_HEADER, CodecState, TransportCodec
from p2pnode.transport.noise import MAX_PLAINTEXT_LEN, NN, HandshakeState, NoiseTransport
from p2pnode.transport.secure import SecureChannelError

# cryptography >= 47 is in the test extra: the OpenSSL backend must be testable here.
assert aead.OPENSSL_AVAILABLE, "the test extra installs cryptography >= 47"

OPENSSL_ONLY = OpenSSLBackend(small_below=0)  # every frame on OpenSSL, small ones too
OPENSSL_COPYING = OpenSSLBackend(small_below=0, in_place=False)
BACKENDS: dict[str, AeadBackend] = {
    "sodium": aead.SODIUM,
    "sodium-portable": aead.SODIUM_PORTABLE,
    "openssl-default": OpenSSLBackend(),
    "openssl-only": OPENSSL_ONLY,
    "openssl-copying": OPENSSL_COPYING,
}
NAMES = list(BACKENDS)
PAIRS = [(a, b) for a in NAMES for b in NAMES if a != b]

# Message sizes around every boundary a frame or a backend choice has: empty, one byte,
# the libsodium/OpenSSL split (frame plaintext = record header + message), a frame
# exactly full (65519 plaintext bytes = 65535 on the wire), one byte over, 64 KiB,
# and two full frames.
FULL = MAX_PLAINTEXT_LEN - RECORD_HEADER
SIZES = [
    0,
    1,
    300,
    aead.SMALL_FRAME - RECORD_HEADER - 1,
    aead.SMALL_FRAME - RECORD_HEADER,
    FULL - 1,
    FULL,
    FULL + 1,
    MAX_PLAINTEXT_LEN,
    65535,
    65536,
    2 * MAX_PLAINTEXT_LEN - RECORD_HEADER,
    2 * MAX_PLAINTEXT_LEN,
]


def _transports() -> tuple[NoiseTransport, NoiseTransport]:
    initiator = HandshakeState(NN, initiator=True)
    responder = HandshakeState(NN, initiator=False)
    responder.read_message_untrusted(initiator.write_message(b""))
    initiator.read_message_untrusted(responder.write_message(b""))
    return initiator.transport(), responder.transport()


def _codec_pair(left: AeadBackend, right: AeadBackend) -> tuple[TransportCodec, TransportCodec]:
    a, b = _transports()
    return (
        TransportCodec(a, now=0.0, aead=left),
        TransportCodec(b, now=0.0, aead=right),
    )


def _message(size: int) -> bytes:
    return bytes(i * 7 % 251 for i in range(size))


def _drain(codec: TransportCodec) -> list[bytes]:
    out = []
    while (message := codec.next_message()) is not None:
        out.append(message)
    return out


def _seal(backend: AeadBackend, key: bytes, nonce: bytes, plaintext: bytes) -> bytes:
    frame = bytearray(aead.FRAME_HEADER + len(plaintext) + aead.TAGLEN)
    frame[aead.FRAME_HEADER : aead.FRAME_HEADER + len(plaintext)] = plaintext
    backend.cipher(key).seal_in_place(nonce, frame, 0, len(plaintext))
    return bytes(frame)


def _open(backend: AeadBackend, key: bytes, nonce: bytes, frame: bytes) -> bytes | None:
    size = len(frame) - aead.FRAME_HEADER
    out = bytearray(b"?" * (size - aead.TAGLEN + 3))  # room past the plaintext stays untouched
    if not backend.cipher(key).open_into(nonce, frame, aead.FRAME_HEADER, size, out, 3):
        return None
    assert out[:3] == b"???"
    return bytes(out[3:])


# --- the ciphers directly -----------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    key=st.binary(min_size=32, max_size=32),
    nonce=st.binary(min_size=12, max_size=12),
    plaintext=st.one_of(
        st.binary(max_size=3000),
        st.builds(
            lambda head, n: head * n, st.binary(min_size=1, max_size=8), st.integers(0, 9000)
        ),
    ),
)
def test_backends_agree_byte_for_byte(key: bytes, nonce: bytes, plaintext: bytes) -> None:
    plaintext = plaintext[:MAX_PLAINTEXT_LEN]
    frames = {name: _seal(backend, key, nonce, plaintext) for name, backend in BACKENDS.items()}
    reference = frames["sodium"]
    assert int.from_bytes(reference[:2], "big") == len(plaintext) + aead.TAGLEN
    assert all(frame == reference for frame in frames.values()), frames.keys()
    for name, backend in BACKENDS.items():
        assert _open(backend, key, nonce, reference) == plaintext, name


@settings(max_examples=100, deadline=None)
@given(
    key=st.binary(min_size=32, max_size=32),
    plaintext=st.binary(max_size=2500),
    data=st.data(),
)
def test_every_backend_rejects_a_flipped_bit(
    key: bytes, plaintext: bytes, data: st.DataObject
) -> None:
    frame = bytearray(_seal(aead.SODIUM, key, bytes(12), plaintext))
    pos = data.draw(st.integers(aead.FRAME_HEADER, len(frame) - 1), label="pos")
    frame[pos] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    for name, backend in BACKENDS.items():
        assert _open(backend, key, bytes(12), bytes(frame)) is None, name
    # And a right frame under the wrong nonce.
    good = _seal(aead.SODIUM, key, bytes(12), plaintext)
    for name, backend in BACKENDS.items():
        assert _open(backend, key, bytes(11) + b"\x01", good) is None, name


def test_open_reads_only_its_frame_in_a_larger_buffer() -> None:
    key, nonce = bytes(range(32)), bytes(12)
    for size in (5, aead.SMALL_FRAME, 40000):
        plaintext = _message(size)
        frame = _seal(aead.SODIUM, key, nonce, plaintext)
        wire = b"junk" + frame[aead.FRAME_HEADER :] + b"more junk"
        for name, backend in BACKENDS.items():
            out = bytearray(size)
            assert backend.cipher(key).open_into(nonce, wire, 4, size + aead.TAGLEN, out, 0)
            assert out == plaintext, name


# --- two codecs, one backend on each side -------------------------------------------


@pytest.mark.parametrize(("left", "right"), PAIRS)
def test_codecs_on_different_backends_talk_both_ways(left: str, right: str) -> None:
    a, b = _codec_pair(BACKENDS[left], BACKENDS[right])
    messages = [_message(size) for size in SIZES]
    for sender, receiver in ((a, b), (b, a)):
        for message in messages:
            receiver.receive_data_untrusted(bytes(sender.encode(message)), 1.0)
        assert _drain(receiver) == messages
        receiver.receive_data_untrusted(bytes(sender.encode_many(messages)), 1.0)
        assert _drain(receiver) == messages


@pytest.mark.parametrize(("left", "right"), PAIRS)
@pytest.mark.parametrize("size", [0, 300, aead.SMALL_FRAME, FULL, 65536])
def test_tampered_frame_is_decrypt_failed_on_either_side(left: str, right: str, size: int) -> None:
    a, b = _codec_pair(BACKENDS[left], BACKENDS[right])
    for sender, receiver in ((a, b), (b, a)):
        wire = bytearray(sender.encode(_message(size)))
        wire[-1] ^= 0x80  # the last frame's tag
        with pytest.raises(SecureChannelError) as info:
            receiver.receive_data_untrusted(bytes(wire), 1.0)
        assert info.value.code is ErrorCode.DECRYPT_FAILED
        assert receiver.state is CodecState.FAILED


def test_tampered_first_of_two_frames_is_decrypt_failed() -> None:
    # The first frame of a 64 KiB message is a full one: OpenSSL's path on that side.
    for backend in BACKENDS.values():
        a, b = _codec_pair(aead.SODIUM, backend)
        wire = bytearray(a.encode(_message(65536)))
        wire[100] ^= 1
        with pytest.raises(SecureChannelError) as info:
            b.receive_data_untrusted(bytes(wire), 1.0)
        assert info.value.code is ErrorCode.DECRYPT_FAILED


# --- choosing and building backends -------------------------------------------------


def test_default_backend_is_openssl_when_installed() -> None:
    assert aead.DEFAULT_BACKEND is aead.OPENSSL
    assert isinstance(aead.OPENSSL, OpenSSLBackend)
    # OpenSSL's EVP interface encrypts in place; the probe at import found it so here.
    assert "copying" not in aead.OPENSSL.name
    assert f"libsodium under {aead.SMALL_FRAME} B" in aead.OPENSSL.name
    assert aead.SODIUM.name == "libsodium"
    assert aead.SODIUM_PORTABLE.name == "libsodium (public bindings)"
    assert ", copying" in OPENSSL_COPYING.name
    assert "libsodium" not in OPENSSL_ONLY.name


def test_a_codec_uses_the_backend_it_is_given() -> None:
    class Counting:
        """The libsodium backend, counting the ciphers a codec asks for."""

        name = "counting"

        def __init__(self) -> None:
            self.keys: list[bytes] = []

        def cipher(self, key: bytes) -> aead.FrameCipher:
            self.keys.append(key)
            return aead.SODIUM.cipher(key)

    counting = Counting()
    a, _ = _transports()
    TransportCodec(a, now=0.0, aead=counting)
    assert counting.keys == [a.send.key, a.receive.key]


@pytest.mark.parametrize("backend", list(BACKENDS.values()), ids=NAMES)
@pytest.mark.parametrize("length", [0, 16, 31, 33])
def test_wrong_key_length_is_refused(backend: AeadBackend, length: int) -> None:
    with pytest.raises(LocalError) as info:
        backend.cipher(bytes(length))
    assert info.value.code is ErrorCode.INVALID_ARGUMENT


def test_bad_openssl_backend_arguments() -> None:
    with pytest.raises(LocalError) as info:
        OpenSSLBackend(small_below=-1)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert "small_below=0" in repr(OpenSSLBackend(small_below=0))
    assert repr(SodiumBackend(in_place=False)) == "SodiumBackend(in_place=False)"
