"""The sans-IO Noise core: both sides back to back, tampering, misuse, spec rules."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.transport.noise import (
    IK,
    NN,
    XX,
    CipherState,
    HandshakePattern,
    HandshakeState,
    HandshakeStatus,
    KeyPair,
    NoiseError,
    NoiseTransport,
    SymmetricState,
    hkdf,
    hmac_hash,
)

keys = st.binary(min_size=32, max_size=32).map(KeyPair.from_private)
payloads = st.binary(max_size=300)
patterns = st.sampled_from([XX, IK, NN])


def make_pair(
    pattern: HandshakePattern, i_static: KeyPair, r_static: KeyPair, prologue: bytes = b"p"
) -> tuple[HandshakeState, HandshakeState]:
    initiator = HandshakeState(
        pattern,
        initiator=True,
        prologue=prologue,
        static=i_static if pattern.sends_static(True) else None,
        remote_static=r_static.public if pattern is IK else None,
    )
    responder = HandshakeState(
        pattern,
        initiator=False,
        prologue=prologue,
        static=r_static if pattern.sends_static(False) else None,
    )
    return initiator, responder


def run(initiator: HandshakeState, responder: HandshakeState, payloads: list[bytes]) -> list[bytes]:
    """Drive the handshake; returns the wire messages."""
    sides = (initiator, responder)
    wire = []
    for i in range(len(initiator.pattern.messages)):
        sender, receiver = sides[i % 2], sides[1 - i % 2]
        message = sender.write_message(payloads[i])
        wire.append(message)
        assert receiver.read_message_untrusted(message) == payloads[i]
    return wire


@settings(max_examples=60, deadline=None)
@given(patterns, keys, keys, st.lists(payloads, min_size=3, max_size=3), st.lists(payloads))
def test_initiator_against_responder(
    pattern: HandshakePattern,
    i_static: KeyPair,
    r_static: KeyPair,
    hs_payloads: list[bytes],
    transport_payloads: list[bytes],
) -> None:
    initiator, responder = make_pair(pattern, i_static, r_static)
    run(initiator, responder, hs_payloads)
    assert initiator.status is HandshakeStatus.COMPLETE
    assert responder.status is HandshakeStatus.COMPLETE
    ti, tr = initiator.transport(), responder.transport()
    assert ti.handshake_hash == tr.handshake_hash
    if pattern is not NN:
        assert ti.remote_static == r_static.public
        assert tr.remote_static == i_static.public
    for i, payload in enumerate(transport_payloads):
        a, b = (ti, tr) if i % 2 == 0 else (tr, ti)
        ciphertext = a.send.encrypt_with_ad(b"", payload)
        assert len(ciphertext) == len(payload) + 16
        assert payload == b"" or payload not in ciphertext or len(payload) < 8
        assert b.receive.decrypt_with_ad_untrusted(b"", ciphertext) == payload


@settings(max_examples=80, deadline=None)
@given(patterns, keys, keys, st.data())
def test_any_tampered_handshake_byte_fails(
    pattern: HandshakePattern, i_static: KeyPair, r_static: KeyPair, data: st.DataObject
) -> None:
    initiator, responder = make_pair(pattern, i_static, r_static)
    sides = (initiator, responder)
    target = data.draw(st.integers(0, len(pattern.messages) - 1))
    for i in range(len(pattern.messages)):
        sender, receiver = sides[i % 2], sides[1 - i % 2]
        message = sender.write_message(b"payload")
        if i != target:
            receiver.read_message_untrusted(message)
            continue
        pos = data.draw(st.integers(0, len(message) - 1))
        tampered = bytearray(message)
        tampered[pos] ^= data.draw(st.integers(1, 255))
        try:
            got = receiver.read_message_untrusted(bytes(tampered))
        except NoiseError as exc:
            assert exc.code is ErrorCode.HANDSHAKE_FAILED
            assert receiver.status is HandshakeStatus.ERROR
            with pytest.raises(LocalError):
                receiver.read_message_untrusted(message)
            return
        # Only unauthenticated bytes (a plaintext payload before any key) may change silently;
        # then the two sides' handshake hashes differ and the next message fails.
        assert got != b"payload" or pattern is NN or i == 0
        return


@settings(max_examples=60, deadline=None)
@given(patterns, keys, keys, st.data())
def test_truncated_handshake_message_fails(
    pattern: HandshakePattern, i_static: KeyPair, r_static: KeyPair, data: st.DataObject
) -> None:
    initiator, responder = make_pair(pattern, i_static, r_static)
    message = initiator.write_message(b"")
    cut = data.draw(st.integers(0, len(message) - 1))
    with pytest.raises(NoiseError):
        responder.read_message_untrusted(message[:cut])
    assert responder.status is HandshakeStatus.ERROR


@settings(max_examples=100, deadline=None)
@given(patterns, keys, st.binary(max_size=200))
def test_random_bytes_as_first_message_raise_only_remote_errors(
    pattern: HandshakePattern, r_static: KeyPair, junk: bytes
) -> None:
    responder = HandshakeState(
        pattern, initiator=False, static=r_static if pattern.sends_static(False) else None
    )
    try:
        responder.read_message_untrusted(junk)
    except RemoteError:
        assert responder.status is HandshakeStatus.ERROR
    else:
        # NN's first message is "e" then a plaintext payload: any 32+ bytes parse.
        assert pattern is NN or pattern is XX
        assert len(junk) >= 32


def test_mismatched_prologue_fails_at_first_authenticated_payload() -> None:
    s1, s2 = KeyPair.generate(), KeyPair.generate()
    initiator = HandshakeState(XX, initiator=True, prologue=b"p2pnode/noise/1", static=s1)
    responder = HandshakeState(XX, initiator=False, prologue=b"p2pnode/noise/2", static=s2)
    responder.read_message_untrusted(initiator.write_message(b""))
    with pytest.raises(NoiseError):
        initiator.read_message_untrusted(responder.write_message(b""))


def test_wrong_turn_is_local_error_and_changes_nothing() -> None:
    initiator, responder = make_pair(XX, KeyPair.generate(), KeyPair.generate())
    with pytest.raises(LocalError):
        initiator.read_message_untrusted(b"x" * 32)
    assert initiator.status is HandshakeStatus.WRITE_MESSAGE
    with pytest.raises(LocalError):
        responder.write_message(b"")
    assert responder.status is HandshakeStatus.READ_MESSAGE
    with pytest.raises(LocalError):
        initiator.transport()
    run(initiator, responder, [b"", b"", b""])
    with pytest.raises(LocalError):
        initiator.write_message(b"")


def test_constructor_validates_keys() -> None:
    with pytest.raises(LocalError):
        HandshakeState(XX, initiator=True)  # XX initiator sends s
    with pytest.raises(LocalError):
        HandshakeState(IK, initiator=True, static=KeyPair.generate())  # no remote static
    with pytest.raises(LocalError):
        HandshakeState(XX, initiator=True, static=KeyPair.generate(), remote_static=b"\x01" * 32)
    with pytest.raises(LocalError):
        KeyPair.from_private(b"short")


def test_low_order_point_is_rejected() -> None:
    initiator, responder = make_pair(NN, KeyPair.generate(), KeyPair.generate())
    responder.read_message_untrusted(initiator.write_message(b""))
    reply = bytearray(responder.write_message(b""))
    reply[:32] = bytes(32)  # the identity point: DH output is all zero
    with pytest.raises(NoiseError):
        initiator.read_message_untrusted(bytes(reply))


def test_handshake_payload_size_limit() -> None:
    initiator, _ = make_pair(NN, KeyPair.generate(), KeyPair.generate())
    with pytest.raises(LocalError) as info:
        initiator.write_message(b"x" * 65535)
    assert info.value.code is ErrorCode.MESSAGE_TOO_LARGE
    assert initiator.status is HandshakeStatus.WRITE_MESSAGE


def test_cipherstate_empty_key_is_identity_and_nonce_format() -> None:
    empty = CipherState()
    assert not empty.has_key()
    assert empty.encrypt_with_ad(b"ad", b"plain") == b"plain"
    assert empty.decrypt_with_ad_untrusted(b"ad", b"plain") == b"plain"
    key = bytes(range(32))
    a, b = CipherState(key), CipherState(key)
    first = a.encrypt_with_ad(b"", b"m")
    second = a.encrypt_with_ad(b"", b"m")
    assert first != second  # the nonce advanced
    assert a.nonce == 2
    with pytest.raises(NoiseError):  # out of order: nonce 0 expected
        b.decrypt_with_ad_untrusted(b"", second)
    assert b.nonce == 0  # a failed decryption does not advance the nonce (§5.1)
    assert b.decrypt_with_ad_untrusted(b"", first) == b"m"
    # Nonce 1 is 32 zero bits then 1 as 64-bit little endian (§12.3).
    from nacl.bindings import crypto_aead_chacha20poly1305_ietf_encrypt

    nonce1 = b"\x00" * 4 + (1).to_bytes(8, "little")
    assert second == crypto_aead_chacha20poly1305_ietf_encrypt(b"m", None, nonce1, key)


def test_hkdf_matches_spec_definition() -> None:
    ck, ikm = b"\x01" * 64, b"\x02" * 32
    temp = hmac_hash(ck, ikm)
    o1 = hmac_hash(temp, b"\x01")
    o2 = hmac_hash(temp, o1 + b"\x02")
    o3 = hmac_hash(temp, o2 + b"\x03")
    assert hkdf(ck, ikm, 2) == (o1, o2)
    assert hkdf(ck, ikm, 3) == (o1, o2, o3)


def test_long_protocol_name_is_hashed() -> None:
    long_name = b"N" * 65
    import hashlib

    assert SymmetricState(long_name).handshake_hash == hashlib.blake2b(long_name).digest()
    assert SymmetricState(b"short").handshake_hash == b"short".ljust(64, b"\0")


def test_keypair_repr_hides_private_key() -> None:
    pair = KeyPair.from_private(bytes(range(32)))
    assert bytes(range(32)).hex() not in repr(pair)
    assert pair.public.hex() in repr(pair)


def test_transport_is_frozen() -> None:
    initiator, responder = make_pair(NN, KeyPair.generate(), KeyPair.generate())
    run(initiator, responder, [b"", b""])
    transport: NoiseTransport = initiator.transport()
    with pytest.raises(AttributeError):
        transport.handshake_hash = b""  # type: ignore[misc]
