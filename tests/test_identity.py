"""Identity: peer ids, text form, key files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.identity import (
    Identity,
    PeerId,
    load_identity,
    load_or_create_identity,
    save_identity,
    verify_signature,
)

seeds = st.binary(min_size=32, max_size=32)


@given(seeds)
def test_peer_id_text_round_trips(seed: bytes) -> None:
    peer_id = Identity(seed).peer_id
    text = str(peer_id)
    assert len(text) == 32
    assert text == text.lower()
    assert PeerId.parse(text) == peer_id
    assert PeerId.parse(text.upper()) == peer_id


@given(st.text(max_size=40))
def test_parse_rejects_garbage_with_typed_error(text: str) -> None:
    try:
        PeerId.parse(text)
    except LocalError as exc:
        assert exc.code is ErrorCode.INVALID_PEER_ID
    with pytest.raises(RemoteError):
        PeerId.parse_untrusted(text + "!")


@given(st.one_of(st.binary(max_size=40), st.integers(), st.none()))
def test_from_bytes_untrusted_only_accepts_20_bytes(raw: object) -> None:
    if isinstance(raw, bytes) and len(raw) == 20:
        assert PeerId.from_bytes_untrusted(raw).raw == raw
    else:
        with pytest.raises(RemoteError):
            PeerId.from_bytes_untrusted(raw)


def test_peer_id_is_blake2b_160_of_public_key() -> None:
    import hashlib

    identity = Identity(bytes(range(32)))
    expected = hashlib.blake2b(
        identity.public_key, digest_size=20, person=b"p2pnode-peerid"
    ).digest()
    assert identity.peer_id.raw == expected


@given(seeds, st.binary(max_size=200))
def test_sign_and_verify(seed: bytes, message: bytes) -> None:
    identity = Identity(seed)
    signature = identity.sign(message)
    assert verify_signature(identity.public_key, message, signature)
    assert not verify_signature(identity.public_key, message + b"x", signature)
    forged = bytes([signature[0] ^ 1]) + signature[1:]
    assert not verify_signature(identity.public_key, message, forged)
    assert not verify_signature(b"short", message, signature)


def test_xor_distance() -> None:
    a = PeerId(b"\x00" * 19 + b"\x05")
    b = PeerId(b"\x00" * 19 + b"\x03")
    assert a.distance(b) == 6
    assert a.distance(a) == 0


def test_key_file_round_trip_and_mode(tmp_path: Path) -> None:
    identity = Identity.generate()
    path = tmp_path / "sub" / "identity.key"
    save_identity(identity, path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert load_identity(path).peer_id == identity.peer_id
    with pytest.raises(LocalError) as info:
        save_identity(Identity.generate(), path)
    assert info.value.code is ErrorCode.KEY_FILE_ERROR
    assert load_identity(path).peer_id == identity.peer_id


def test_key_file_readable_by_others_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "identity.key"
    save_identity(Identity.generate(), path)
    os.chmod(path, 0o644)
    with pytest.raises(LocalError, match="other users") as info:
        load_identity(path)
    assert info.value.code is ErrorCode.KEY_FILE_ERROR


@pytest.mark.parametrize(
    "content",
    [b"", b"garbage", b"p2pnode-identity-v1\nzz\n", b"p2pnode-identity-v1\n00\n", b"\xff\xfe"],
)
def test_corrupt_key_file_is_refused(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "identity.key"
    path.write_bytes(content)
    os.chmod(path, 0o600)
    with pytest.raises(LocalError, match="corrupt"):
        load_identity(path)


def test_missing_key_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(LocalError, match="cannot read"):
        load_identity(tmp_path / "nope.key")


def test_load_or_create_is_stable(tmp_path: Path) -> None:
    first = load_or_create_identity(tmp_path)
    assert load_or_create_identity(tmp_path).peer_id == first.peer_id


def test_injected_randomness_is_deterministic() -> None:
    def rng(n: int) -> bytes:
        return b"\x07" * n

    assert Identity.generate(rng).peer_id == Identity.generate(rng).peer_id
