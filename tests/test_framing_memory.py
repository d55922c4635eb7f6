"""A record's buffer grows as its bytes arrive; an incomplete record has its own deadline.

The attack: many peers each announce a 4 MiB record and send a couple of hundred
bytes of it. A receiver that allocates the announced size up front holds
4 MiB per peer until a timeout; ours holds what arrived.
"""

from __future__ import annotations

import struct
import tracemalloc

import pytest

from p2pnode.core.errors import ErrorCode
from p2pnode.transport.framing import DEFAULT_MAX_MESSAGE_SIZE, CodecState, TransportCodec
from p2pnode.transport.noise import NN, CipherState, HandshakeState, NoiseTransport
from p2pnode.transport.secure import SecureChannelError

ANNOUNCED = DEFAULT_MAX_MESSAGE_SIZE  # 4 MiB
PEERS = 200


def transports() -> tuple[NoiseTransport, NoiseTransport]:
    initiator = HandshakeState(NN, initiator=True)
    responder = HandshakeState(NN, initiator=False)
    responder.read_message_untrusted(initiator.write_message(b""))
    initiator.read_message_untrusted(responder.write_message(b""))
    return initiator.transport(), responder.transport()


def frame(cipher: CipherState, plaintext: bytes) -> bytes:
    body = cipher.encrypt_with_ad(b"", plaintext)
    return struct.pack(">H", len(body)) + body


def test_announced_size_is_not_allocated() -> None:
    # 200 peers, each announcing a 4 MiB message and sending ~200 bytes of it.
    pairs = []
    for _ in range(PEERS):
        sender, receiver = transports()
        pairs.append((CipherState(sender.send.key), receiver))
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        codecs = []
        for cipher, receiver in pairs:
            codec = TransportCodec(receiver, now=0.0)
            codec.receive_data_untrusted(
                frame(cipher, struct.pack(">I", ANNOUNCED) + b"x" * 196), 0.0
            )
            codecs.append(codec)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    buffered = sum(codec.buffered_bytes() for codec in codecs)
    assert buffered == PEERS * 196  # what arrived, not 200 x 4 MiB
    assert all(codec.next_message() is None for codec in codecs)
    # Everything the 200 codecs hold, objects included: kilobytes (up front it was 800 MiB).
    assert grown < 1024 * 1024, grown


def test_large_message_still_reassembles_frame_by_frame() -> None:
    a, b = transports()
    sender = TransportCodec(a, now=0.0)
    receiver = TransportCodec(b, now=0.0)
    message = bytes(range(256)) * (3 * 1024 * 1024 // 256)
    wire = bytes(sender.encode(message))
    step = 50_000
    for pos in range(0, len(wire), step):
        receiver.receive_data_untrusted(wire[pos : pos + step], 0.0)
        if pos + step < len(wire):
            assert receiver.buffered_bytes() <= pos + step
    assert receiver.next_message() == message
    assert receiver.buffered_bytes() == 0


def test_incomplete_record_times_out() -> None:
    a, b = transports()
    cipher = CipherState(a.send.key)
    codec = TransportCodec(b, now=0.0, frame_timeout=5.0, record_timeout=20.0)
    assert codec.next_deadline() == float("inf")
    codec.receive_data_untrusted(frame(cipher, struct.pack(">I", 1000) + b"a" * 10), 1.0)
    assert codec.next_deadline() == 21.0  # the record must finish 20 s after its header
    # One small complete frame of it every few seconds keeps each frame within its
    # timeout, but not the record.
    for t in (4.0, 8.0, 12.0, 16.0, 20.0):
        codec.receive_data_untrusted(frame(cipher, b"b" * 10), t)
        codec.handle_timer(t)
        assert codec.next_deadline() == 21.0
    with pytest.raises(SecureChannelError) as info:
        codec.handle_timer(21.0)
    assert info.value.code is ErrorCode.TIMEOUT
    assert "message" in info.value.message
    assert codec.state is CodecState.FAILED
    assert codec.buffered_bytes() == 0


def test_record_deadline_ends_with_the_record() -> None:
    a, b = transports()
    cipher = CipherState(a.send.key)
    codec = TransportCodec(b, now=0.0, record_timeout=20.0)
    codec.receive_data_untrusted(frame(cipher, struct.pack(">I", 20) + b"a" * 10), 1.0)
    codec.receive_data_untrusted(frame(cipher, b"b" * 10 + struct.pack(">I", 30) + b"c"), 15.0)
    assert codec.next_message() == b"a" * 10 + b"b" * 10
    assert codec.next_deadline() == 35.0  # the next record's own deadline
    codec.receive_data_untrusted(frame(cipher, b"c" * 29), 16.0)
    assert codec.next_message() == b"c" * 30
    assert codec.next_deadline() == float("inf")
