"""Ed25519 identities, peer ids and key files.

A node's identity is an Ed25519 key pair. Its **peer id** is 160 bits, so it
lives in the Kademlia id space::

    peer_id = BLAKE2b(public_key, digest_size=20, person=b"p2pnode-peerid")

The textual form of a peer id is its 20 bytes in lowercase RFC 4648 base32
without padding: exactly 32 characters (160 / 5), which round-trips.

The key file holds the 32-byte Ed25519 seed as two ASCII lines,
``p2pnode-identity-v1`` and the seed in hex. It is written atomically
(temporary file, fsync, rename, fsync of the directory) with mode 0600, and
loading refuses a file that other users can read.
"""

from __future__ import annotations

import base64
import binascii
import functools
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nacl.exceptions
import nacl.signing
from nacl.bindings import crypto_generichash_blake2b_salt_personal

from p2pnode.core.errors import ErrorCode, LocalError, RemoteError

PEER_ID_BYTES = 20
PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
SEED_BYTES = 32
KEY_FILE_NAME = "identity.key"
_KEY_FILE_MAGIC = "p2pnode-identity-v1"
_PEER_ID_PERSON = b"p2pnode-peerid".ljust(16, b"\0")


#: Peer ids kept by :meth:`PeerId._interned` (a cache: clearing it changes nothing but speed).
_MAX_INTERNED = 65_536
_INTERNED: dict[bytes, PeerId] = {}


@dataclass(frozen=True, slots=True, order=True)
class PeerId:
    """A 160-bit peer id derived from an Ed25519 public key."""

    raw: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes) or len(self.raw) != PEER_ID_BYTES:
            raise LocalError(ErrorCode.INVALID_PEER_ID, "a peer id is exactly 20 bytes")

    @classmethod
    def from_public_key(cls, public_key: bytes) -> PeerId:
        """The peer id of an Ed25519 public key (see the module docstring)."""
        digest = crypto_generichash_blake2b_salt_personal(
            public_key, digest_size=PEER_ID_BYTES, person=_PEER_ID_PERSON
        )
        return cls._interned(digest)

    @classmethod
    def _interned(cls, raw: bytes) -> PeerId:
        # Equal ids made from the handshake, cards and hellos share one object, so the
        # dict lookups keyed by peer id on every envelope match by identity at once
        # instead of calling the generated __eq__. Bounded: cleared when full.
        peer_id = _INTERNED.get(raw)
        if peer_id is None:
            peer_id = cls(raw)
            if len(_INTERNED) >= _MAX_INTERNED:
                _INTERNED.clear()
            _INTERNED[raw] = peer_id
        return peer_id

    @classmethod
    def from_bytes_untrusted(cls, raw: object) -> PeerId:
        """A peer id from peer-supplied bytes. Raises RemoteError(INVALID_PEER_ID)."""
        if not isinstance(raw, bytes) or len(raw) != PEER_ID_BYTES:
            raise RemoteError(ErrorCode.INVALID_PEER_ID, "a peer id is exactly 20 bytes")
        return cls._interned(raw)

    @classmethod
    def parse(cls, text: str) -> PeerId:
        """Parse the 32-character base32 form. Raises LocalError(INVALID_PEER_ID)."""
        if not isinstance(text, str) or len(text) != 32:
            raise LocalError(ErrorCode.INVALID_PEER_ID, f"not a peer id: {text!r}")
        try:
            raw = base64.b32decode(text.upper(), casefold=False)
        except (binascii.Error, ValueError) as exc:
            raise LocalError(ErrorCode.INVALID_PEER_ID, f"not a peer id: {text!r}") from exc
        return cls._interned(raw)

    @classmethod
    def parse_untrusted(cls, text: object) -> PeerId:
        """Like :meth:`parse` for peer-supplied text; raises RemoteError(INVALID_PEER_ID)."""
        try:
            return cls.parse(text)  # type: ignore[arg-type]
        except LocalError as exc:
            raise RemoteError(exc.code, exc.message) from None

    def __str__(self) -> str:
        return _peer_id_text(self.raw)

    def __repr__(self) -> str:
        return f"PeerId({self})"

    def as_int(self) -> int:
        """The id as a big-endian integer, for XOR distance."""
        return int.from_bytes(self.raw, "big")

    def distance(self, other: PeerId | bytes) -> int:
        """Kademlia XOR distance to another id."""
        other_raw = other.raw if isinstance(other, PeerId) else other
        return self.as_int() ^ int.from_bytes(other_raw, "big")


@functools.lru_cache(maxsize=4096)
def _peer_id_text(raw: bytes) -> str:
    # Peer ids are printed on every routing event: cache the base32 form.
    return base64.b32encode(raw).decode("ascii").lower()


def verify_signature(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """True when ``signature`` is a valid Ed25519 signature of ``message`` by ``public_key``.

    Never raises: malformed keys or signatures verify as False.
    """
    if (
        not isinstance(public_key, bytes)
        or len(public_key) != PUBLIC_KEY_BYTES
        or not isinstance(signature, bytes)
        or len(signature) != SIGNATURE_BYTES
    ):
        return False
    try:
        nacl.signing.VerifyKey(public_key).verify(message, signature)
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.CryptoError, ValueError, TypeError):
        return False
    return True


class Identity:
    """An Ed25519 key pair and the peer id derived from it."""

    __slots__ = ("_signing_key", "peer_id", "public_key")

    def __init__(self, seed: bytes) -> None:
        """Build an identity from a 32-byte Ed25519 seed."""
        if not isinstance(seed, bytes) or len(seed) != SEED_BYTES:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "an Ed25519 seed is exactly 32 bytes")
        self._signing_key = nacl.signing.SigningKey(seed)
        self.public_key: bytes = bytes(self._signing_key.verify_key)
        self.peer_id: PeerId = PeerId.from_public_key(self.public_key)

    @classmethod
    def generate(cls, random_bytes: Callable[[int], bytes] = os.urandom) -> Identity:
        """A fresh identity; ``random_bytes`` is injectable for deterministic tests."""
        return cls(random_bytes(SEED_BYTES))

    @property
    def seed(self) -> bytes:
        """The private seed. Handle with care."""
        return bytes(self._signing_key)

    def sign(self, message: bytes) -> bytes:
        """The 64-byte Ed25519 signature of ``message``."""
        return self._signing_key.sign(message).signature

    def __repr__(self) -> str:
        return f"Identity({self.peer_id})"


def default_data_dir() -> Path:
    """``$P2PNODE_HOME``, else ``$XDG_DATA_HOME/p2pnode``, else ``~/.local/share/p2pnode``."""
    explicit = os.environ.get("P2PNODE_HOME")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "share"
    return base / "p2pnode"


def write_private_file(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically with mode 0600 (temp file, fsync, rename)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_identity(identity: Identity, path: Path, *, overwrite: bool = False) -> None:
    """Write the key file. Raises LocalError(KEY_FILE_ERROR) if it exists and not ``overwrite``."""
    if path.exists() and not overwrite:
        raise LocalError(ErrorCode.KEY_FILE_ERROR, f"{path} already exists", path=str(path))
    text = f"{_KEY_FILE_MAGIC}\n{identity.seed.hex()}\n"
    write_private_file(path, text.encode("ascii"))


def load_identity(path: Path) -> Identity:
    """Read a key file written by :func:`save_identity`.

    Raises LocalError(KEY_FILE_ERROR) when the file is missing, unreadable,
    corrupt, or readable or writable by group or others.
    """
    try:
        st = path.stat()
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise LocalError(
                ErrorCode.KEY_FILE_ERROR,
                f"{path} is accessible by other users (mode {stat.S_IMODE(st.st_mode):o});"
                " run: chmod 600 " + str(path),
                path=str(path),
            )
        text = path.read_text(encoding="ascii")
    except OSError as exc:
        raise LocalError(
            ErrorCode.KEY_FILE_ERROR, f"cannot read {path}: {exc.strerror}", path=str(path)
        ) from exc
    except UnicodeDecodeError as exc:
        raise LocalError(ErrorCode.KEY_FILE_ERROR, f"{path} is corrupt", path=str(path)) from exc
    lines = text.split("\n")
    try:
        if lines[0] != _KEY_FILE_MAGIC:
            raise ValueError("bad header")
        seed = bytes.fromhex(lines[1])
        if len(seed) != SEED_BYTES:
            raise ValueError("bad seed length")
    except (IndexError, ValueError) as exc:
        raise LocalError(ErrorCode.KEY_FILE_ERROR, f"{path} is corrupt", path=str(path)) from exc
    return Identity(seed)


def load_or_create_identity(data_dir: Path) -> Identity:
    """The identity stored in ``data_dir``, created on first use."""
    path = data_dir / KEY_FILE_NAME
    if path.exists():
        return load_identity(path)
    identity = Identity.generate()
    save_identity(identity, path)
    return identity
