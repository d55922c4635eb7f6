"""Transport framing (sans-IO): split, coalesce, reassemble; tampered, truncated, oversized."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.transport import aead
from p2pnode.transport.framing import CodecState, TransportCodec
from p2pnode.transport.noise import (
    MAX_PLAINTEXT_LEN,
    NN,
    CipherState,
    HandshakeState,
    NoiseTransport,
)
from p2pnode.transport.secure import SecureChannelError


def transports() -> tuple[NoiseTransport, NoiseTransport]:
    initiator = HandshakeState(NN, initiator=True)
    responder = HandshakeState(NN, initiator=False)
    responder.read_message_untrusted(initiator.write_message(b""))
    initiator.read_message_untrusted(responder.write_message(b""))
    return initiator.transport(), responder.transport()


def codecs(
    max_message_size: int = 1 << 20,
    *,
    idle_timeout: float | None = None,
    frame_timeout: float = 30.0,
) -> tuple[TransportCodec, TransportCodec]:
    a, b = transports()
    return (
        TransportCodec(
            a,
            now=0.0,
            max_message_size=max_message_size,
            idle_timeout=idle_timeout,
            frame_timeout=frame_timeout,
        ),
        TransportCodec(
            b,
            now=0.0,
            max_message_size=max_message_size,
            idle_timeout=idle_timeout,
            frame_timeout=frame_timeout,
        ),
    )


def drain(codec: TransportCodec) -> list[bytes]:
    out = []
    while (message := codec.next_message()) is not None:
        out.append(message)
    return out


# Big messages are a short random head and a long fill (hypothesis draws big binaries slowly).
big = st.builds(
    lambda head, n: head + bytes([len(head)]) * n,
    st.binary(max_size=50),
    st.integers(60000, 140000),
)
messages_st = st.lists(st.one_of(st.binary(max_size=300), big), max_size=6)


@settings(max_examples=60, deadline=None)
@given(messages_st, st.booleans(), st.lists(st.integers(1, 70000), min_size=1, max_size=8))
@example([b"a" * 70, b"", b"b" * 5], False, [1])  # byte by byte
def test_round_trip_any_chunking(messages: list[bytes], many: bool, cuts: list[int]) -> None:
    sender, receiver = codecs()
    if many:
        wire = bytes(sender.encode_many(messages))
    else:
        wire = b"".join(bytes(sender.encode(m)) for m in messages)
    pos, i = 0, 0
    while pos < len(wire):
        # Tiny steps only while small, so the test stays fast.
        step = cuts[i % len(cuts)] if len(wire) < 2000 else max(cuts[i % len(cuts)], 3000)
        receiver.receive_data_untrusted(wire[pos : pos + step], 1.0)
        pos += step
        i += 1
    assert drain(receiver) == messages
    assert receiver.next_deadline() == float("inf")  # nothing partial is left


def test_frame_layout() -> None:
    sender, _ = codecs()
    one = bytes(sender.encode(b"abc"))
    assert int.from_bytes(one[:2], "big") == len(one) - 2 == 4 + 3 + 16
    batch = bytes(sender.encode_many([b"a", b"bb", b""]))
    assert int.from_bytes(batch[:2], "big") == len(batch) - 2 == (4 + 1) + (4 + 2) + 4 + 16
    big = bytes(sender.encode(b"x" * (2 * MAX_PLAINTEXT_LEN)))
    first = int.from_bytes(big[:2], "big")
    assert first == 65535  # full frames first
    assert len(big) == 2 * MAX_PLAINTEXT_LEN + 4 + 3 * (2 + 16)
    assert sender.encode_many([]) == b""


def test_frames_match_the_noise_cipherstate() -> None:
    # Frame bodies are exactly Noise transport messages (Noise §5.1 EncryptWithAd, ad="").
    a, b = transports()
    codec = TransportCodec(a, now=0.0)
    reference = CipherState(a.send.key)
    wire = bytes(codec.encode(b"hello"))
    assert wire[2:] == reference.encrypt_with_ad(b"", b"\x00\x00\x00\x05hello")
    assert CipherState(b.receive.key).decrypt_with_ad_untrusted(b"", wire[2:]).endswith(b"hello")


def test_portable_and_fast_aead_agree() -> None:
    key, nonce = bytes(range(32)), bytes(12)
    for size in (0, 1, 300, MAX_PLAINTEXT_LEN):
        body = bytes(i % 251 for i in range(size))
        fast = bytearray(2 + size + 16)
        fast[2 : 2 + size] = body
        slow = bytearray(fast)
        aead.seal_in_place(key, nonce, fast, 0, size)
        aead.seal_in_place_portable(key, nonce, slow, 0, size)
        assert fast == slow
        for opener in (aead.open_into, aead.open_into_portable):
            out = bytearray(size)
            assert opener(key, nonce, bytes(fast), 2, size + 16, out, 0)
            assert out == body
            tampered = bytearray(fast)
            tampered[-1] ^= 1
            assert not opener(key, nonce, bytes(tampered), 2, size + 16, bytearray(size), 0)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.binary(max_size=200), min_size=1, max_size=5), st.data())
def test_any_flipped_bit_is_decrypt_failed(messages: list[bytes], data: st.DataObject) -> None:
    sender, receiver = codecs()
    wire = bytearray(sender.encode_many(messages))
    pos = data.draw(st.integers(2, len(wire) - 1))  # inside the ciphertext or tag
    wire[pos] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(SecureChannelError) as info:
        receiver.receive_data_untrusted(bytes(wire), 0.0)
    assert info.value.code is ErrorCode.DECRYPT_FAILED
    assert receiver.state is CodecState.FAILED
    assert drain(receiver) == []
    with pytest.raises(LocalError):
        receiver.receive_data_untrusted(b"\x00", 0.0)


def test_replayed_reordered_and_dropped_frames_fail() -> None:
    for order in ([0, 0], [1]):  # replayed; dropped or reordered
        sender, receiver = codecs()
        frames = [bytes(sender.encode(b"one")), bytes(sender.encode(b"two"))]
        for i in order[:-1]:
            receiver.receive_data_untrusted(frames[i], 0.0)
        with pytest.raises(SecureChannelError) as info:
            receiver.receive_data_untrusted(frames[order[-1]], 0.0)
        assert info.value.code is ErrorCode.DECRYPT_FAILED


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=500))
def test_random_bytes_raise_only_remote_errors(junk: bytes) -> None:
    _, receiver = codecs()
    try:
        receiver.receive_data_untrusted(junk, 0.0)
        receiver.receive_eof_untrusted()
    except RemoteError as exc:
        assert isinstance(exc, SecureChannelError)
    assert drain(receiver) == []


def test_short_frame_length_is_malformed() -> None:
    _, receiver = codecs()
    with pytest.raises(SecureChannelError) as info:
        receiver.receive_data_untrusted(b"\x00\x0f" + b"x" * 15, 0.0)
    assert info.value.code is ErrorCode.MALFORMED_MESSAGE


def test_truncated_frame_at_eof_is_malformed() -> None:
    sender, receiver = codecs()
    wire = bytes(sender.encode(b"hello"))
    receiver.receive_data_untrusted(wire[:-1], 0.0)
    assert drain(receiver) == []
    with pytest.raises(SecureChannelError) as info:
        receiver.receive_eof_untrusted()
    assert info.value.code is ErrorCode.MALFORMED_MESSAGE


def test_clean_eof_is_channel_closed() -> None:
    _, receiver = codecs()
    with pytest.raises(SecureChannelError) as info:
        receiver.receive_eof_untrusted()
    assert info.value.code is ErrorCode.CHANNEL_CLOSED


def test_truncated_message_across_frames_at_eof_is_malformed() -> None:
    sender, receiver = codecs()
    wire = bytes(sender.encode(b"x" * 100000))
    first = int.from_bytes(wire[:2], "big") + 2
    receiver.receive_data_untrusted(wire[:first], 0.0)  # one whole frame, message incomplete
    assert drain(receiver) == []
    with pytest.raises(SecureChannelError) as info:
        receiver.receive_eof_untrusted()
    assert info.value.code is ErrorCode.MALFORMED_MESSAGE


def test_peer_announcing_too_much_is_rejected_from_the_header() -> None:
    a, b = transports()
    big_sender = TransportCodec(a, now=0.0, max_message_size=1 << 20)
    receiver = TransportCodec(b, now=0.0, max_message_size=1000)
    wire = bytes(big_sender.encode(b"x" * 5000))
    with pytest.raises(SecureChannelError) as info:
        receiver.receive_data_untrusted(wire, 0.0)
    assert info.value.code is ErrorCode.MESSAGE_TOO_LARGE
    # Announcing a huge size in a tiny frame fails the same way, without allocating it.
    a, b = transports()
    receiver = TransportCodec(b, now=0.0, max_message_size=1000)
    plaintext_frame = bytearray(2 + 4 + 16)
    plaintext_frame[2:6] = (2**32 - 1).to_bytes(4, "big")
    aead.seal_in_place(a.send.key or b"", bytes(12), plaintext_frame, 0, 4)
    with pytest.raises(SecureChannelError) as info:
        receiver.receive_data_untrusted(bytes(plaintext_frame), 0.0)
    assert info.value.code is ErrorCode.MESSAGE_TOO_LARGE


def test_sending_too_much_is_local_error() -> None:
    sender, _ = codecs(max_message_size=1000)
    with pytest.raises(LocalError) as info:
        sender.encode(b"x" * 1001)
    assert info.value.code is ErrorCode.MESSAGE_TOO_LARGE
    with pytest.raises(LocalError):
        sender.encode_many([b"ok", b"x" * 1001])
    # Nothing was consumed: the next message still decodes on the peer.
    assert sender.encode(b"x" * 1000)


def test_record_header_cut_across_frames() -> None:
    a, b = transports()
    receiver = TransportCodec(b, now=0.0)
    stream = (3).to_bytes(4, "big") + b"abc" + (2).to_bytes(4, "big") + b"de"
    # Cut the stream inside the second header, then inside the body.
    pieces = [stream[:9], stream[9:12], stream[12:]]
    for i, piece in enumerate(pieces):
        frame = bytearray(2 + len(piece) + 16)
        frame[2 : 2 + len(piece)] = piece
        nonce = b"\0" * 4 + i.to_bytes(8, "little")
        aead.seal_in_place(a.send.key or b"", nonce, frame, 0, len(piece))
        receiver.receive_data_untrusted(bytes(frame), 0.0)
    assert drain(receiver) == [b"abc", b"de"]


def test_deadlines() -> None:
    sender, receiver = codecs(idle_timeout=100.0, frame_timeout=5.0)
    assert receiver.next_deadline() == 100.0
    receiver.start_wait(50.0)
    assert receiver.next_deadline() == 150.0
    wire = bytes(sender.encode(b"hello"))
    receiver.receive_data_untrusted(wire[:3], 60.0)
    assert receiver.next_deadline() == 65.0  # a frame has started: it must finish in 5 s
    receiver.receive_data_untrusted(wire[3:4], 64.0)
    assert receiver.next_deadline() == 65.0  # trickling does not extend it
    receiver.handle_timer(64.9)
    with pytest.raises(SecureChannelError) as info:
        receiver.handle_timer(65.0)
    assert info.value.code is ErrorCode.TIMEOUT
    assert receiver.state is CodecState.FAILED


def test_idle_timer_fires() -> None:
    _, receiver = codecs(idle_timeout=10.0)
    receiver.start_wait(5.0)
    receiver.handle_timer(14.0)
    with pytest.raises(SecureChannelError) as info:
        receiver.handle_timer(15.0)
    assert info.value.code is ErrorCode.TIMEOUT


def test_bad_construction() -> None:
    a, _ = transports()
    with pytest.raises(LocalError):
        TransportCodec(a, now=0.0, max_message_size=0)
    with pytest.raises(LocalError):
        TransportCodec(a, now=0.0, idle_timeout=-1)
    with pytest.raises(LocalError):
        TransportCodec(a, now=0.0, max_message_size=2**32)
