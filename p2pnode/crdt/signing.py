"""Origin signatures on CRDT deltas (docs/protocol/gossip.md §3.1 and §7).

Theory of operation
-------------------
The channel authenticates the peer that *sends* a gossip frame, not the replica
that *made* the delta inside it: deltas are forwarded, and served again by
anti-entropy, by nodes other than their origin. So every delta travels
**sealed**: its encoded body, the origin's Ed25519 public key and the origin's
signature (RFC 8032, pure Ed25519) over a context string followed by the
body. A receiver accepts a delta only when

1. the key is the origin's: the origin's replica id is the peer id text of
   the key (BLAKE2b-160, :class:`p2pnode.core.identity.PeerId`), so a replica id
   cannot be claimed without the private key that it names;
2. the signature verifies over exactly the body bytes received (no
   re-encoding, so forwarders pass the bytes on unchanged); and
3. the body writes only in its origin's name (:func:`check_authorship`):
   every dot in the delta's state, every G-Counter slot and every written
   LWW register names the origin. Without this, a replica could sign, as
   itself, a delta that raises another replica's counter slot or adds an
   element under another replica's dot. (The causal context may name any
   replica: a remove or overwrite lists the dots it observed.)

A failure raises :class:`ForgedDeltaError` (``INVALID_SIGNATURE`` or
``PEER_ID_MISMATCH``), which the gossip core records like any bad delta and the
node reports as a security event naming the peer that sent it.

Signing happens once per local operation (and once per checkpoint), verifying
once per delta a node did not have: duplicates are dropped on their clear-text
ids before any signature is checked.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol

from p2pnode.core.errors import ErrorCode, RemoteError
from p2pnode.core.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, PeerId, verify_signature
from p2pnode.core.wire import WireError, WireLimits, pack, unpack_untrusted
from p2pnode.crdt.clock import CRDTError
from p2pnode.crdt.types import CRDT, DocState, GCounter, LWWRegister, ORMap, ORSet, PNCounter

#: Prefix of every signed message: a delta signature cannot be replayed as any other
#: signature of the same key (cards, handshakes), nor the other way round.
DELTA_SIGNATURE_CONTEXT = b"p2pnode-crdt-delta-v1\x00"
#: A sealed delta: the body (at most 1 MiB) plus key, signature and map overhead.
SEALED_LIMITS = WireLimits(max_size=1024 * 1024 + 256, max_depth=2)
_SEALED_KEYS = frozenset({"b", "k", "g"})


class Signer(Protocol):
    """What signs a replica's deltas (:class:`p2pnode.core.identity.Identity` is one)."""

    @property
    def public_key(self) -> bytes:
        """The 32-byte Ed25519 public key."""

    def sign(self, message: bytes) -> bytes:
        """The 64-byte Ed25519 signature of ``message``."""


class ForgedDeltaError(CRDTError):
    """A delta its origin did not sign, or one that writes in another replica's name.

    ``code`` is ``INVALID_SIGNATURE`` (bad or missing signature, tampered body, a
    write in another replica's name) or ``PEER_ID_MISMATCH`` (the key is not the
    origin's).
    """

    def __init__(self, code: ErrorCode, message: str, **details: Any) -> None:
        RemoteError.__init__(self, code, message, **details)


@functools.lru_cache(maxsize=4096)
def replica_id_of(public_key: bytes) -> str:
    """The replica id bound to an Ed25519 public key: its peer id text."""
    return str(PeerId.from_public_key(public_key))


def seal(body: bytes, signer: Signer | None) -> bytes:
    """The sealed form of an encoded delta: ``{"b": body, "k": key, "g": signature}``.

    Without a signer the key and signature are empty: such a delta is only for
    local use (storage, tests), and every peer refuses it.
    """
    if signer is None:
        return pack({"b": body, "k": b"", "g": b""})
    signature = signer.sign(DELTA_SIGNATURE_CONTEXT + body)
    return pack({"b": body, "k": signer.public_key, "g": signature})


@dataclass(frozen=True, slots=True)
class Sealed:
    """A sealed delta taken apart, not yet verified."""

    #: The encoded delta body, exactly as signed.
    body: bytes
    #: The claimed origin's public key (empty when unsigned).
    key: bytes
    #: The signature (empty when unsigned).
    signature: bytes

    @classmethod
    def decode_untrusted(cls, data: bytes) -> Sealed:
        """Take a peer's sealed delta apart. Raises CRDTError (malformed)."""
        try:
            obj = unpack_untrusted(data, SEALED_LIMITS)
        except WireError as exc:
            raise CRDTError(f"undecodable sealed delta: {exc.message}") from exc
        if not isinstance(obj, dict) or set(obj) != _SEALED_KEYS:
            raise CRDTError("sealed delta does not have exactly the fields b, k, g")
        body, key, signature = obj["b"], obj["k"], obj["g"]
        if not all(isinstance(x, bytes) for x in (body, key, signature)):
            raise CRDTError("sealed delta fields are not bin")
        return cls(body, key, signature)

    def verify(self, origin: str) -> None:
        """Check that ``origin`` signed the body. Raises ForgedDeltaError."""
        if len(self.key) != PUBLIC_KEY_BYTES or len(self.signature) != SIGNATURE_BYTES:
            raise ForgedDeltaError(
                ErrorCode.INVALID_SIGNATURE, f"delta claiming origin {origin} is not signed"
            )
        if replica_id_of(self.key) != origin:
            raise ForgedDeltaError(
                ErrorCode.PEER_ID_MISMATCH,
                f"delta claiming origin {origin} is signed by another key "
                f"({replica_id_of(self.key)})",
                origin=origin,
            )
        if not verify_signature(self.key, DELTA_SIGNATURE_CONTEXT + self.body, self.signature):
            raise ForgedDeltaError(
                ErrorCode.INVALID_SIGNATURE,
                f"delta claiming origin {origin} has a bad signature",
                origin=origin,
            )


def check_authorship(state: DocState, origin: str) -> None:
    """Check that a delta's state writes only as ``origin`` (module docstring, rule 3).

    Raises ForgedDeltaError(INVALID_SIGNATURE) naming the first place it writes as
    another replica.
    """
    _check_map(state.root, origin, ())


def _forged(origin: str, other: str, path: tuple[str, ...]) -> ForgedDeltaError:
    where = "/".join(path) or "the root"
    return ForgedDeltaError(
        ErrorCode.INVALID_SIGNATURE,
        f"delta of {origin} writes as {other!r:.80} at {where!s:.200}",
        origin=origin,
    )


def _check_map(m: ORMap, origin: str, path: tuple[str, ...]) -> None:
    for key, entry in m.entries.items():
        here = (*path, key)
        for replica, _ in entry.dots:
            if replica != origin:
                raise _forged(origin, replica, here)
        _check_value(entry.value, origin, here)


def _check_value(v: CRDT, origin: str, path: tuple[str, ...]) -> None:
    if isinstance(v, ORMap):
        _check_map(v, origin, path)
    elif isinstance(v, ORSet):
        for dots in v.entries.values():
            for replica, _ in dots:
                if replica != origin:
                    raise _forged(origin, replica, path)
    elif isinstance(v, GCounter):
        _check_counts(v, origin, path)
    elif isinstance(v, PNCounter):
        _check_counts(v.p, origin, path)
        _check_counts(v.n, origin, path)
    elif isinstance(v, LWWRegister) and v.timestamp != 0 and v.replica != origin:
        raise _forged(origin, v.replica, path)


def _check_counts(c: GCounter, origin: str, path: tuple[str, ...]) -> None:
    for replica in c.counts:
        if replica != origin:
            raise _forged(origin, replica, path)


__all__ = [
    "DELTA_SIGNATURE_CONTEXT",
    "SEALED_LIMITS",
    "ForgedDeltaError",
    "Sealed",
    "Signer",
    "check_authorship",
    "replica_id_of",
    "seal",
]
