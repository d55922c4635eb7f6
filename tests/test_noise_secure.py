"""Identity-bound handshakes, sans-IO: both sides back to back, attackers, bad input, timers."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.identity import Identity, verify_signature
from p2pnode.core.wire import canonical_pack, unpack_untrusted
from p2pnode.transport.noise import KeyPair
from p2pnode.transport.secure import (
    BINDING_CONTEXT,
    MAX_HANDSHAKE_FRAME,
    PROLOGUE,
    HandshakeStage,
    SecureChannelError,
    SecureHandshake,
    SecureIdentity,
    binding_message,
    derive_static_keypair,
)

ALICE = SecureIdentity(Identity(b"\x01" * 32))
BOB = SecureIdentity(Identity(b"\x02" * 32))
MALLORY = SecureIdentity(Identity(b"\x03" * 32))


def pair(
    *, ik: bool = False, expected: SecureIdentity | None = None, responder: SecureIdentity = BOB
) -> tuple[SecureHandshake, SecureHandshake]:
    client = SecureHandshake(
        ALICE,
        initiator=True,
        now=0.0,
        timeout=10.0,
        expected_peer_id=expected.peer_id if expected else None,
        remote_static=responder.static_public if ik else None,
    )
    server = SecureHandshake(responder, initiator=False, now=0.0, timeout=10.0)
    return client, server


def pump(a: SecureHandshake, b: SecureHandshake, chunk: int = 1 << 20) -> None:
    """Move bytes both ways until neither side has output, in ``chunk``-byte pieces."""
    for _ in range(20):
        moved = False
        for src, dst in ((a, b), (b, a)):
            out = src.data_to_send()
            for i in range(0, len(out), chunk):
                dst.receive_data_untrusted(out[i : i + chunk], 1.0)
                moved = True
        if not moved:
            return
    raise AssertionError("handshake did not settle")


@settings(max_examples=30, deadline=None)
@given(st.booleans(), st.integers(1, 300))
def test_handshake_in_any_chunking(ik: bool, chunk: int) -> None:
    client, server = pair(ik=ik, expected=BOB)
    pump(client, server, chunk)
    assert client.stage is HandshakeStage.DONE
    assert server.stage is HandshakeStage.DONE
    c, s = client.result(), server.result()
    assert c.remote.peer_id == BOB.peer_id
    assert s.remote.peer_id == ALICE.peer_id
    assert c.remote.public_key == BOB.identity.public_key
    assert s.remote.static_public == ALICE.static_public
    assert c.transport.handshake_hash == s.transport.handshake_hash
    assert c.pattern == s.pattern == ("IK" if ik else "XX")
    assert c.leftover == s.leftover == b""


def test_preamble_and_first_message_bytes() -> None:
    client, _ = pair()
    out = client.data_to_send()
    assert out[:2] == b"\x01X"
    assert int.from_bytes(out[2:4], "big") == len(out) - 4 == 32  # XX: "e" only, empty payload
    client_ik, _ = pair(ik=True)
    out = client_ik.data_to_send()
    assert out[:2] == b"\x01I"
    assert int.from_bytes(out[2:4], "big") == len(out) - 4


def test_identity_is_never_sent_in_clear() -> None:
    for ik in (False, True):
        client, server = pair(ik=ik)
        seen = client.data_to_send()
        server.receive_data_untrusted(seen, 0.0)
        reply = server.data_to_send()
        client.receive_data_untrusted(reply, 0.0)
        seen += reply + client.data_to_send()
        for who in (ALICE, BOB):
            assert who.identity.public_key not in seen


def test_payload_layout_and_signature_input() -> None:
    fields = unpack_untrusted(ALICE.payload)
    assert set(fields) == {"v", "id", "sig"}
    assert fields["v"] == 1
    assert fields["id"] == ALICE.identity.public_key
    assert binding_message(ALICE.static_public) == BINDING_CONTEXT + ALICE.static_public
    assert verify_signature(
        ALICE.identity.public_key, BINDING_CONTEXT + ALICE.static_public, fields["sig"]
    )
    assert ALICE.payload == canonical_pack(fields)
    assert PROLOGUE == b"p2pnode/noise/1"


def test_static_key_derivation_is_deterministic_and_separate() -> None:
    identity = Identity(b"\x07" * 32)
    one, two = derive_static_keypair(identity), derive_static_keypair(Identity(b"\x07" * 32))
    assert one == two
    assert one.public != identity.public_key
    assert derive_static_keypair(Identity(b"\x08" * 32)).public != one.public
    custom = KeyPair.generate()
    assert SecureIdentity(identity, custom).static_public == custom.public


@pytest.mark.parametrize("ik", [False, True])
def test_dialing_the_wrong_peer_is_peer_id_mismatch(ik: bool) -> None:
    # The network delivers us to Mallory (her own, valid identity) instead of Bob.
    client = SecureHandshake(
        ALICE,
        initiator=True,
        now=0.0,
        timeout=10.0,
        expected_peer_id=BOB.peer_id,
        remote_static=MALLORY.static_public if ik else None,
    )
    server = SecureHandshake(MALLORY, initiator=False, now=0.0, timeout=10.0)
    with pytest.raises(SecureChannelError) as info:
        pump(client, server)
    assert info.value.code is ErrorCode.PEER_ID_MISMATCH
    assert client.stage is HandshakeStage.FAILED
    assert server.stage is not HandshakeStage.DONE or ik  # XX: Alice never sends msg 3


def test_replayed_identity_payload_fails_signature() -> None:
    # Mallory replays Bob's signed payload with her own static key.
    impostor = SecureIdentity(MALLORY.identity, MALLORY.static)
    impostor.payload = BOB.payload
    client, server = pair(expected=BOB, responder=impostor)
    with pytest.raises(SecureChannelError) as info:
        pump(client, server)
    assert info.value.code is ErrorCode.INVALID_SIGNATURE


def test_ik_with_wrong_static_key_fails() -> None:
    client = SecureHandshake(
        ALICE, initiator=True, now=0.0, timeout=10.0, remote_static=MALLORY.static_public
    )
    server = SecureHandshake(BOB, initiator=False, now=0.0, timeout=10.0)
    with pytest.raises(SecureChannelError) as info:
        pump(client, server)
    assert info.value.code is ErrorCode.HANDSHAKE_FAILED
    assert server.stage is HandshakeStage.FAILED


@pytest.mark.parametrize(
    ("preamble", "code"),
    [
        (b"\x02X", ErrorCode.PROTOCOL_VERSION_MISMATCH),
        (b"\x00I", ErrorCode.PROTOCOL_VERSION_MISMATCH),
        (b"\x01N", ErrorCode.HANDSHAKE_FAILED),
        (b"GE", ErrorCode.PROTOCOL_VERSION_MISMATCH),
    ],
)
def test_bad_preamble_gets_reject_record(preamble: bytes, code: ErrorCode) -> None:
    server = SecureHandshake(BOB, initiator=False, now=0.0, timeout=10.0)
    with pytest.raises(SecureChannelError) as info:
        server.receive_data_untrusted(preamble + b"\x00\x20" + b"e" * 32, 0.0)
    assert info.value.code is code
    assert server.data_to_send() == b"\x00\x00\x01"
    assert server.stage is HandshakeStage.FAILED


def test_initiator_reports_reject_record_as_version_mismatch() -> None:
    client, _ = pair()
    client.data_to_send()
    with pytest.raises(SecureChannelError) as info:
        client.receive_data_untrusted(b"\x00\x00\x02", 0.0)
    assert info.value.code is ErrorCode.PROTOCOL_VERSION_MISMATCH
    assert info.value.details["peer_version"] == 2


def test_oversized_handshake_frame_rejected_from_its_header() -> None:
    server = SecureHandshake(BOB, initiator=False, now=0.0, timeout=10.0)
    with pytest.raises(SecureChannelError) as info:
        server.receive_data_untrusted(b"\x01X" + (MAX_HANDSHAKE_FRAME + 1).to_bytes(2, "big"), 0.0)
    assert info.value.code is ErrorCode.MESSAGE_TOO_LARGE


def test_xx_first_message_must_have_empty_payload() -> None:
    server = SecureHandshake(BOB, initiator=False, now=0.0, timeout=10.0)
    message = KeyPair.generate().public + b"hello"
    with pytest.raises(SecureChannelError) as info:
        server.receive_data_untrusted(b"\x01X" + len(message).to_bytes(2, "big") + message, 0.0)
    assert info.value.code is ErrorCode.HANDSHAKE_FAILED


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.booleans())
def test_garbage_raises_only_remote_errors(junk: bytes, as_initiator: bool) -> None:
    if as_initiator:
        side, _ = pair()
        side.data_to_send()
    else:
        side = SecureHandshake(BOB, initiator=False, now=0.0, timeout=10.0)
    try:
        side.receive_data_untrusted(junk, 0.0)
    except RemoteError:
        assert side.stage is HandshakeStage.FAILED
        with pytest.raises(LocalError):
            side.receive_data_untrusted(b"x", 0.0)
    else:
        assert side.stage is not HandshakeStage.DONE


@settings(max_examples=60, deadline=None)
@given(st.booleans(), st.data())
def test_tampered_handshake_byte_never_authenticates(ik: bool, data: st.DataObject) -> None:
    client, server = pair(ik=ik, expected=BOB)
    flows = [(client, server), (server, client), (client, server)]
    target = data.draw(st.integers(0, 1 if ik else 2))
    for i, (src, dst) in enumerate(flows):
        out = bytearray(src.data_to_send())
        if not out:
            break
        if i == target:
            pos = data.draw(st.integers(0, len(out) - 1))
            out[pos] ^= data.draw(st.integers(1, 255))
        try:
            dst.receive_data_untrusted(bytes(out), 1.0)
        except RemoteError:
            return
    # A flipped length byte can leave a side waiting for more: never "done" on both.
    assert not (client.stage is HandshakeStage.DONE and server.stage is HandshakeStage.DONE)


def test_timer_and_eof() -> None:
    client, server = pair()
    assert server.next_deadline() == 10.0
    server.handle_timer(9.9)  # not yet
    with pytest.raises(SecureChannelError) as info:
        server.handle_timer(10.0)
    assert info.value.code is ErrorCode.TIMEOUT
    assert server.stage is HandshakeStage.FAILED
    assert server.failure is info.value
    with pytest.raises(LocalError, match="did not complete in time"):
        server.receive_data_untrusted(b"late", 11.0)
    with pytest.raises(SecureChannelError) as info:
        client.receive_data_untrusted(b"", 1.0)
    assert info.value.code is ErrorCode.HANDSHAKE_FAILED


def test_late_bytes_time_out() -> None:
    _, server = pair()
    with pytest.raises(SecureChannelError) as info:
        server.receive_data_untrusted(b"\x01", 11.0)
    assert info.value.code is ErrorCode.TIMEOUT


def test_leftover_transport_bytes_are_handed_over() -> None:
    client, server = pair()
    server.receive_data_untrusted(client.data_to_send(), 0.0)
    client.receive_data_untrusted(server.data_to_send(), 0.0)
    server.receive_data_untrusted(client.data_to_send() + b"\x00\x10early", 0.0)
    assert server.result().leftover == b"\x00\x10early"


def test_misuse_is_local_error() -> None:
    with pytest.raises(LocalError):
        SecureHandshake(BOB, initiator=False, now=0.0, timeout=1.0, expected_peer_id=BOB.peer_id)
    with pytest.raises(LocalError):
        SecureHandshake(BOB, initiator=True, now=0.0, timeout=0.0)
    client, _ = pair()
    with pytest.raises(LocalError):
        client.result()
    with pytest.raises(LocalError):
        SecureIdentity(ALICE.identity, verified_cache=-1)


def test_verified_binding_cache_is_bounded_and_exact() -> None:
    local = SecureIdentity(Identity(b"\x09" * 32), verified_cache=2)
    peers = [SecureIdentity(Identity(bytes([i]) * 32)) for i in range(10, 14)]
    for peer in peers:
        assert local.verify_payload_untrusted(peer.payload, peer.static_public).peer_id == (
            peer.peer_id
        )
    assert len(local._verified) == 2
    # A cached payload presented with another static key is verified afresh (and fails).
    with pytest.raises(SecureChannelError):
        local.verify_payload_untrusted(peers[-1].payload, peers[0].static_public)


@pytest.mark.parametrize(
    ("fields", "code"),
    [
        ({"v": 2, "id": b"x" * 32, "sig": b"s" * 64}, ErrorCode.PROTOCOL_VERSION_MISMATCH),
        ({"v": 1, "id": b"x" * 31, "sig": b"s" * 64}, ErrorCode.MALFORMED_MESSAGE),
        ({"v": 1, "id": b"x" * 32, "sig": "text"}, ErrorCode.INVALID_SIGNATURE),
        ({"v": 1, "id": b"x" * 32, "sig": b"s" * 64}, ErrorCode.INVALID_SIGNATURE),
        ([1, 2], ErrorCode.MALFORMED_MESSAGE),
    ],
)
def test_bad_payloads(fields: object, code: ErrorCode) -> None:
    with pytest.raises(SecureChannelError) as info:
        BOB.verify_payload_untrusted(canonical_pack(fields), ALICE.static_public)
    assert info.value.code is code


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_random_payload_bytes_raise_only_channel_errors(junk: bytes) -> None:
    with pytest.raises(SecureChannelError):
        BOB.verify_payload_untrusted(junk, ALICE.static_public)


@pytest.mark.parametrize(
    ("ik", "sizes"), [(False, [2 + 2 + 32, 2 + 207, 2 + 175]), (True, [2 + 2 + 207, 2 + 159])]
)
def test_documented_wire_sizes(ik: bool, sizes: list[int]) -> None:
    """docs/protocol/noise.md §4.2 gives these byte counts; keep them true."""
    client, server = pair(ik=ik)
    flows = [(client, server), (server, client), (client, server)][: len(sizes)]
    for (src, dst), size in zip(flows, sizes, strict=True):
        out = src.data_to_send()
        assert len(out) == size
        dst.receive_data_untrusted(out, 0.0)
    assert len(ALICE.payload) == 111
    assert ALICE.payload[:9] == bytes.fromhex("83a17601a26964c420")
    assert BINDING_CONTEXT.hex() == "7032706e6f64652f6e6f6973652f31207374617469632d6b657900"


def test_replayed_ik_first_message_never_yields_a_usable_channel() -> None:
    """docs §4.2: a replayed IK message 1 completes the responder but nothing decrypts."""
    from p2pnode.transport.framing import TransportCodec

    client, _ = pair(ik=True)
    recorded = client.data_to_send()
    replay_target = SecureHandshake(BOB, initiator=False, now=0.0, timeout=10.0)
    replay_target.receive_data_untrusted(recorded, 0.0)
    assert replay_target.stage is HandshakeStage.DONE
    assert replay_target.result().remote.peer_id == ALICE.peer_id
    # The replayer has no ephemeral private key: any frame it makes is rejected.
    codec = TransportCodec(replay_target.result().transport, now=0.0)
    with pytest.raises(SecureChannelError) as info:
        codec.receive_data_untrusted(b"\x00\x14" + b"\x00" * 20, 0.0)
    assert info.value.code is ErrorCode.DECRYPT_FAILED
