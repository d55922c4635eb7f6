"""Known answers: the published Noise test vectors must reproduce byte for byte.

Vectors (copied into tests/vectors/noise/, provenance in its README.md):
cacophony https://github.com/haskell-cryptography/cacophony/blob/master/vectors/cacophony.txt
and snow https://github.com/mcginty/snow/blob/main/tests/vectors/snow.txt, for the
Noise spec revision 34 https://noiseprotocol.org/noise.html.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from p2pnode.transport import aead
from p2pnode.transport.noise import (
    PATTERNS,
    HandshakeState,
    HandshakeStatus,
    KeyPair,
    NoiseTransport,
)

VECTOR_DIR = Path(__file__).parent / "vectors" / "noise"
SUPPORTED = {f"Noise_{name}_25519_ChaChaPoly_BLAKE2b" for name in ("XX", "IK", "NN")}


def _load() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for file in ("vectors.json", "vectors_snow.json"):
        for vector in json.loads((VECTOR_DIR / file).read_text())["vectors"]:
            if vector["protocol_name"] in SUPPORTED:
                out.append((f"{file}:{vector['protocol_name']}", vector))
    return out


VECTORS = _load()
# libsodium in place and through its public bindings; OpenSSL for every frame size and
# as configured by default (libsodium under aead.SMALL_FRAME bytes), in place and copying.
AEAD_BACKENDS = [
    aead.SODIUM,
    aead.SODIUM_PORTABLE,
    aead.OpenSSLBackend(small_below=0),
    aead.OpenSSLBackend(small_below=0, in_place=False),
    aead.OpenSSLBackend(),
]


def test_every_supported_vector_is_present() -> None:
    # Three patterns in each of the two files: a missing file must not pass silently.
    assert len(VECTORS) == 6


def _side(vector: dict[str, Any], prefix: str, initiator: bool) -> HandshakeState:
    pattern = PATTERNS[vector["protocol_name"].split("_")[1]]
    static = vector.get(f"{prefix}_static")
    remote = vector.get(f"{prefix}_remote_static")
    ephemeral = KeyPair.from_private(bytes.fromhex(vector[f"{prefix}_ephemeral"]))
    return HandshakeState(
        pattern,
        initiator=initiator,
        prologue=bytes.fromhex(vector[f"{prefix}_prologue"]),
        static=KeyPair.from_private(bytes.fromhex(static)) if static else None,
        remote_static=bytes.fromhex(remote) if remote else None,
        generate_keypair=lambda: ephemeral,
    )


@pytest.mark.parametrize(("name", "vector"), VECTORS, ids=[n for n, _ in VECTORS])
def test_vector(name: str, vector: dict[str, Any]) -> None:
    initiator = _side(vector, "init", True)
    responder = _side(vector, "resp", False)
    messages = vector["messages"]
    handshake_len = len(initiator.pattern.messages)
    sides = (initiator, responder)
    transports: list[NoiseTransport] = []
    for i, message in enumerate(messages):
        payload = bytes.fromhex(message["payload"])
        expected = bytes.fromhex(message["ciphertext"])
        sender, receiver = (0, 1) if i % 2 == 0 else (1, 0)
        if i < handshake_len:
            assert sides[sender].status is HandshakeStatus.WRITE_MESSAGE
            wire = sides[sender].write_message(payload)
            assert wire == expected, f"message {i}"
            assert sides[receiver].read_message_untrusted(wire) == payload
            if i == handshake_len - 1:
                assert initiator.status is HandshakeStatus.COMPLETE
                assert responder.status is HandshakeStatus.COMPLETE
                transports = [initiator.transport(), responder.transport()]
                if "handshake_hash" in vector:
                    expected_hash = bytes.fromhex(vector["handshake_hash"])
                    assert transports[0].handshake_hash == expected_hash
                    assert transports[1].handshake_hash == expected_hash
        else:
            # Every AEAD backend of the transport codec must give the same bytes.
            send = transports[sender].send
            nonce = bytes(4) + send.nonce.to_bytes(8, "little")
            for backend in AEAD_BACKENDS:
                frame = bytearray(2 + len(payload) + 16)
                frame[2 : 2 + len(payload)] = payload
                backend.cipher(send.key or b"").seal_in_place(nonce, frame, 0, len(payload))
                assert bytes(frame[2:]) == expected, f"transport message {i} ({backend!r})"
                opened = bytearray(len(payload))
                key = transports[receiver].receive.key or b""
                assert backend.cipher(key).open_into(nonce, frame, 2, len(expected), opened, 0)
                assert opened == payload
            frame = bytearray(2 + len(payload) + 16)
            frame[2 : 2 + len(payload)] = payload
            aead.seal_in_place(send.key or b"", nonce, frame, 0, len(payload))
            assert bytes(frame[2:]) == expected, f"transport message {i} (plain function)"
            wire = send.encrypt_with_ad(b"", payload)
            assert wire == expected, f"transport message {i}"
            assert transports[receiver].receive.decrypt_with_ad_untrusted(b"", wire) == payload
    assert len(messages) > handshake_len  # the vectors do cover transport messages


@pytest.mark.parametrize(("name", "vector"), VECTORS, ids=[n for n, _ in VECTORS])
def test_vector_remote_static_learned(name: str, vector: dict[str, Any]) -> None:
    """Each side ends up holding the other's static public key (None when absent)."""
    initiator = _side(vector, "init", True)
    responder = _side(vector, "resp", False)
    order = [(initiator, responder), (responder, initiator)]
    for i in range(len(initiator.pattern.messages)):
        a, b = order[i % 2]
        b.read_message_untrusted(a.write_message(b""))
    for me, other_prefix in ((initiator, "resp"), (responder, "init")):
        static = vector.get(f"{other_prefix}_static")
        expected = KeyPair.from_private(bytes.fromhex(static)).public if static else None
        assert me.transport().remote_static == expected
