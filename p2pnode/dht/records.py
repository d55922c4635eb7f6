"""Signed DHT records, the DHT value format, and the bounded record store.

Theory of operation (docs/protocol/dht.md §4):

* A :class:`SignedRecord` is one publisher's claim under one DHT key: kind
  (``provider`` or ``card``), key, the publisher's Ed25519 public key, a
  revision, an expiry (unix ms) and an opaque payload, signed by that key over
  :func:`signing_input`. The publisher's peer id is derived from the key, so
  nobody can publish for someone else.
* Keys are derived as stock ``kademlia`` derives them,
  ``sha1(name.encode("utf-8"))``, from documented names
  (:func:`capability_key`, :func:`card_key`), so a stock node's
  ``get(name)`` reaches the same key.
* A DHT *value* is a msgpack bin: the msgpack array of the encoded records
  (each a bin). Stock nodes store and return it as opaque bytes (their
  ``store`` overwrites); our nodes merge on store and on read. The encoding is
  deterministic (records sorted by publisher key) so equal sets give equal
  bytes.
* Merge rule, per key and publisher: higher ``(revision, expires_at)`` wins;
  an older or equal pair never displaces the one held (replays lose). Bad
  records (forged, expired, key not bound to the payload, oversized,
  unsigned) are dropped one by one and never stored or served.
* :class:`RecordStore` bounds everything: records per key, keys, total bytes,
  and a token bucket of stores per source host. Time (``now_ms`` for expiry,
  ``now`` for rate limits) is always a parameter.
"""

from __future__ import annotations

import enum
import hashlib
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from p2pnode.core.errors import ErrorCode, RemoteError
from p2pnode.core.identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    PeerId,
    verify_signature,
)
from p2pnode.core.wire import WireError, WireLimits, canonical_pack, pack, unpack_untrusted

RECORD_FORMAT = 1
SIGNING_CONTEXT = "p2pnode-dht-record-v1"
MAX_VALUE_BYTES = 8128  # a store request stays under the stock 8192-byte body limit
MAX_RECORD_BYTES = MAX_VALUE_BYTES - 8  # one record alone must fit a value
MAX_TTL_MS = 24 * 3600 * 1000  # records claiming a longer life are refused
CAPABILITY_PREFIX = "p2pnode:cap:"
CARD_PREFIX = "p2pnode:card:"
MAX_CAPABILITY_CHARS = 256
MAX_AGENT_ID_CHARS = 256
MAX_ADDRESSES = 8

_VALUE_LIMITS = WireLimits(
    max_size=MAX_VALUE_BYTES + 8,
    max_str_len=0,
    max_bin_len=MAX_RECORD_BYTES,
    max_array_len=256,
    max_map_len=0,
    max_depth=2,
)
_RECORD_LIMITS = WireLimits(
    max_size=MAX_RECORD_BYTES,
    max_str_len=64,
    max_bin_len=MAX_RECORD_BYTES,
    max_array_len=8,
    max_map_len=0,
    max_depth=2,
)
_CARD_PAYLOAD_LIMITS = WireLimits(max_size=MAX_RECORD_BYTES)
_PAYLOAD_LIMITS = WireLimits(
    max_size=MAX_RECORD_BYTES,
    max_str_len=MAX_CAPABILITY_CHARS,
    max_bin_len=64,
    max_array_len=16,
    max_map_len=8,
    max_depth=4,
)


class RecordError(RemoteError):
    """A record or DHT value that is malformed, forged, expired or unbound."""


class RecordKind(enum.StrEnum):
    """What a record says."""

    PROVIDER = "provider"  # "this agent offers capability X at these addresses"
    CARD = "card"  # the agent's signed Agent Card


def capability_key(capability: str) -> bytes:
    """DHT key of a capability: ``sha1("p2pnode:cap:" + capability)``."""
    return hashlib.sha1((CAPABILITY_PREFIX + capability).encode("utf-8")).digest()


def card_key(peer_id: PeerId, agent_id: str) -> bytes:
    """DHT key of an agent's card: ``sha1("p2pnode:card:" + str(peer_id) + "/" + agent_id)``.

    One key per (owner, agent), so a node hosting several agents publishes
    each card without one displacing another.
    """
    return hashlib.sha1(f"{CARD_PREFIX}{peer_id}/{agent_id}".encode()).digest()


AGENT_CAPABILITY_PREFIX = "agent:"


def agent_capability(agent_id: str) -> str:
    """The pseudo-capability under which an agent is findable by its id."""
    return AGENT_CAPABILITY_PREFIX + agent_id


def card_agent_id_untrusted(payload: bytes) -> str:
    """The ``id`` field of a card record's payload (the card's msgpack plain form).

    Raises RecordError; the full card is verified by readers, this only lets
    the record's key be checked.
    """
    try:
        plain = unpack_untrusted(payload, _CARD_PAYLOAD_LIMITS)
    except WireError as exc:
        raise RecordError(ErrorCode.INVALID_RECORD, f"card payload: {exc.message}") from None
    agent_id = plain.get("id") if isinstance(plain, dict) else None
    if not isinstance(agent_id, str) or not 0 < len(agent_id) <= MAX_AGENT_ID_CHARS:
        raise RecordError(ErrorCode.INVALID_RECORD, "card payload has no agent id")
    return agent_id


def signing_input(
    kind: str, key: bytes, public_key: bytes, revision: int, expires_at: int, payload: bytes
) -> bytes:
    """The bytes a record signature covers (canonical msgpack, domain-separated)."""
    return canonical_pack([SIGNING_CONTEXT, kind, key, public_key, revision, expires_at, payload])


@dataclass(frozen=True, slots=True)
class ProviderInfo:
    """Payload of a provider record: who offers ``capability`` and where."""

    capability: str
    agent_id: str
    addresses: tuple[tuple[str, int], ...]

    def to_bytes(self) -> bytes:
        """Canonical msgpack map ``{"addrs", "agent", "cap"}``."""
        return canonical_pack(
            {
                "cap": self.capability,
                "agent": self.agent_id,
                "addrs": [[h, p] for h, p in self.addresses],
            }
        )

    @classmethod
    def from_bytes_untrusted(cls, data: bytes) -> ProviderInfo:
        """Parse a provider payload. Raises RecordError."""
        try:
            obj = unpack_untrusted(data, _PAYLOAD_LIMITS)
        except WireError as exc:
            raise RecordError(
                ErrorCode.INVALID_RECORD, f"provider payload: {exc.message}"
            ) from None
        if not isinstance(obj, dict) or set(obj) != {"cap", "agent", "addrs"}:
            raise RecordError(ErrorCode.INVALID_RECORD, "provider payload fields")
        cap, agent, addrs = obj["cap"], obj["agent"], obj["addrs"]
        if not isinstance(cap, str) or not 0 < len(cap) <= MAX_CAPABILITY_CHARS:
            raise RecordError(ErrorCode.INVALID_RECORD, "provider capability")
        if not isinstance(agent, str) or len(agent) > MAX_AGENT_ID_CHARS:
            raise RecordError(ErrorCode.INVALID_RECORD, "provider agent id")
        if not isinstance(addrs, list) or len(addrs) > MAX_ADDRESSES:
            raise RecordError(ErrorCode.INVALID_RECORD, "provider addresses")
        out = []
        for a in addrs:
            if (
                not isinstance(a, list)
                or len(a) != 2
                or not isinstance(a[0], str)
                or not 0 < len(a[0]) <= 64
                or type(a[1]) is not int
                or not 0 < a[1] < 65536
            ):
                raise RecordError(ErrorCode.INVALID_RECORD, "provider address")
            out.append((a[0], a[1]))
        return cls(cap, agent, tuple(out))


@dataclass(frozen=True, slots=True, weakref_slot=True)
class SignedRecord:
    """One publisher's signed record under one DHT key."""

    kind: RecordKind
    key: bytes
    public_key: bytes
    revision: int
    expires_at: int  # unix milliseconds
    payload: bytes
    signature: bytes
    encoded: bytes = field(default=b"", compare=False, repr=False)

    @property
    def publisher(self) -> PeerId:
        """Peer id of the signer."""
        return PeerId.from_public_key(self.public_key)

    @classmethod
    def create(
        cls,
        identity: Identity,
        kind: RecordKind,
        key: bytes,
        revision: int,
        expires_at: int,
        payload: bytes,
    ) -> SignedRecord:
        """Sign a new record with ``identity``."""
        sig = identity.sign(
            signing_input(kind.value, key, identity.public_key, revision, expires_at, payload)
        )
        enc = pack(
            [
                RECORD_FORMAT,
                kind.value,
                key,
                identity.public_key,
                revision,
                expires_at,
                payload,
                sig,
            ]
        )
        return cls(kind, key, identity.public_key, revision, expires_at, payload, sig, enc)

    def to_bytes(self) -> bytes:
        """``[1, kind, key, public_key, revision, expires_at, payload, signature]``."""
        return self.encoded

    @classmethod
    def from_bytes_untrusted(cls, data: bytes, *, now_ms: int) -> SignedRecord:
        """Parse and verify a record: signature, expiry, key binding. Raises RecordError.

        Bytes this process verified before (and a record still holds) give that
        record again: everything but the expiry depends on the bytes alone.
        """
        if not isinstance(data, bytes) or len(data) > MAX_RECORD_BYTES:
            raise RecordError(ErrorCode.MESSAGE_TOO_LARGE, "record too large")
        ref = _VERIFIED.get(data)
        held = None if ref is None else ref()
        if held is not None:
            _check_expiry(held.expires_at, now_ms)
            return held
        try:
            obj = unpack_untrusted(data, _RECORD_LIMITS)
        except WireError as exc:
            raise RecordError(ErrorCode.INVALID_RECORD, f"record: {exc.message}") from None
        if not isinstance(obj, list) or len(obj) != 8 or obj[0] != RECORD_FORMAT:
            raise RecordError(ErrorCode.INVALID_RECORD, "not a version-1 record")
        _, kind, key, pk, rev, exp, payload, sig = obj
        if kind not in (RecordKind.PROVIDER.value, RecordKind.CARD.value):
            raise RecordError(ErrorCode.INVALID_RECORD, "unknown record kind")
        if not isinstance(key, bytes) or len(key) != 20:
            raise RecordError(ErrorCode.INVALID_RECORD, "record key is not 20 bytes")
        if not isinstance(pk, bytes) or len(pk) != PUBLIC_KEY_BYTES:
            raise RecordError(ErrorCode.INVALID_RECORD, "bad public key")
        if type(rev) is not int or not 0 <= rev < 2**63:
            raise RecordError(ErrorCode.INVALID_RECORD, "bad revision")
        if type(exp) is not int or not 0 <= exp < 2**63:
            raise RecordError(ErrorCode.INVALID_RECORD, "bad expiry")
        if not isinstance(payload, bytes) or not isinstance(sig, bytes):
            raise RecordError(ErrorCode.INVALID_RECORD, "payload and signature are bin")
        if len(sig) != SIGNATURE_BYTES or not verify_signature(
            pk, signing_input(kind, key, pk, rev, exp, payload), sig
        ):
            raise RecordError(ErrorCode.INVALID_SIGNATURE, "record signature does not verify")
        _check_expiry(exp, now_ms)
        rec = cls(RecordKind(kind), key, pk, rev, exp, payload, sig, bytes(data))
        if rec.kind is RecordKind.CARD:
            if key != card_key(rec.publisher, card_agent_id_untrusted(payload)):
                raise RecordError(ErrorCode.INVALID_RECORD, "card record under a foreign key")
        elif key != capability_key(ProviderInfo.from_bytes_untrusted(payload).capability):
            raise RecordError(ErrorCode.INVALID_RECORD, "provider record key does not match")
        _VERIFIED[rec.encoded] = weakref.KeyedRef(rec, _forget_verified, rec.encoded)
        return rec

    def newer_than(self, other: SignedRecord) -> bool:
        """The merge order: revision, then expiry, then bytes (deterministic)."""
        return (self.revision, self.expires_at, self.encoded) > (
            other.revision,
            other.expires_at,
            other.encoded,
        )


def encode_value(records: list[SignedRecord], limit: int = MAX_VALUE_BYTES) -> bytes:
    """The DHT value carrying ``records``: as many as fit ``limit`` bytes.

    Newest expiries are kept first when not all fit; the output is sorted by
    publisher key so equal sets encode to equal bytes.
    """
    chosen: list[SignedRecord] = []
    size = 3  # array header
    for r in sorted(records, key=lambda r: -r.expires_at):
        add = len(r.encoded) + 3
        if size + add <= limit:
            chosen.append(r)
            size += add
    chosen.sort(key=lambda r: (r.public_key, r.kind.value))
    return pack([r.encoded for r in chosen])


# Records verified in this process, by their exact bytes: the nodes that store or
# read one record (twenty of a simulated swarm, say) share one object and one
# signature check. Weak: a record lives as long as some store or lookup holds it. A
# plain map of weak references, as WeakValueDictionary keeps one, read without its
# Python-level get (a store of a full value asks for each of its 64 records).
_VERIFIED: dict[bytes, weakref.KeyedRef[bytes, SignedRecord]] = {}


def _forget_verified(ref: weakref.KeyedRef[bytes, SignedRecord]) -> None:
    """A verified record died: drop its entry, unless another took its bytes since."""
    if _VERIFIED.get(ref.key) is ref:
        del _VERIFIED[ref.key]


def _check_expiry(expires_at: int, now_ms: int) -> None:
    if expires_at <= now_ms:
        raise RecordError(ErrorCode.INVALID_RECORD, "record expired")
    if expires_at > now_ms + MAX_TTL_MS:
        raise RecordError(ErrorCode.INVALID_RECORD, "record expiry too far ahead")


def decode_value_untrusted(
    value: Any,
    key: bytes,
    *,
    now_ms: int,
    known: Callable[[bytes], SignedRecord | None] | None = None,
) -> tuple[list[SignedRecord], int]:
    """Records in a DHT value for ``key``: (valid records, number rejected).

    Raises RecordError when the value as a whole is not a record list (for
    example a stock node's plain string). Individual bad records are counted
    and skipped, so one forged record cannot hide valid ones. ``known`` maps
    exact record bytes verified earlier to their record, so a record seen
    again is not verified again (its expiry still is checked).
    """
    if not isinstance(value, bytes):
        raise RecordError(ErrorCode.INVALID_RECORD, "value is not a signed-record list")
    if len(value) > MAX_VALUE_BYTES:
        raise RecordError(ErrorCode.MESSAGE_TOO_LARGE, "value larger than 8128 bytes")
    try:
        items = unpack_untrusted(value, _VALUE_LIMITS)
    except WireError as exc:
        raise RecordError(ErrorCode.INVALID_RECORD, f"value: {exc.message}") from None
    if not isinstance(items, list):
        raise RecordError(ErrorCode.INVALID_RECORD, "value is not a signed-record list")
    good: dict[tuple[bytes, str], SignedRecord] = {}
    rejected = 0
    for item in items:
        cached = known(item) if known is not None and isinstance(item, bytes) else None
        if cached is not None and cached.expires_at > now_ms:
            rec = cached
        else:
            try:
                rec = SignedRecord.from_bytes_untrusted(item, now_ms=now_ms)
            except RecordError:
                rejected += 1
                continue
        if rec.key != key:
            rejected += 1
            continue
        slot = (rec.public_key, rec.kind.value)
        held = good.get(slot)
        if held is None or rec.newer_than(held):
            good[slot] = rec
    return list(good.values()), rejected


@dataclass(slots=True)
class _Bucket:
    tokens: float
    stamp: float


class RecordStore:
    """Bounded storage of verified records, merged per key and publisher (sans-IO)."""

    def __init__(
        self,
        *,
        max_keys: int = 4096,
        max_records_per_key: int = 64,
        max_bytes: int = 8 * 1024 * 1024,
        source_burst: float = 64.0,
        source_rate: float = 2.0,
        max_sources: int = 4096,
    ) -> None:
        self.max_keys = max_keys
        self.max_records_per_key = max_records_per_key
        self.max_bytes = max_bytes
        self.source_burst = source_burst
        self.source_rate = source_rate
        self.max_sources = max_sources
        self._data: dict[bytes, dict[tuple[bytes, str], SignedRecord]] = {}
        self._by_bytes: dict[bytes, SignedRecord] = {}  # verified records by their exact bytes
        self._bytes = 0
        self._sources: OrderedDict[str, _Bucket] = OrderedDict()

    def __len__(self) -> int:
        return sum(len(v) for v in self._data.values())

    @property
    def total_bytes(self) -> int:
        """Bytes of encoded records held."""
        return self._bytes

    def known(self, encoded: bytes) -> SignedRecord | None:
        """The held record whose bytes are exactly ``encoded`` (already verified)."""
        return self._by_bytes.get(encoded)

    def keys(self) -> list[bytes]:
        """Keys with at least one record."""
        return list(self._data)

    def allow_store(self, source_host: str, now: float) -> bool:
        """Token bucket per source host: may it store one more value now?"""
        b = self._sources.pop(source_host, None)
        if b is None:
            b = _Bucket(self.source_burst, now)
            while len(self._sources) >= self.max_sources:
                self._sources.popitem(last=False)
        b.tokens = min(self.source_burst, b.tokens + (now - b.stamp) * self.source_rate)
        b.stamp = now
        self._sources[source_host] = b
        if b.tokens < 1.0:
            return False
        b.tokens -= 1.0
        return True

    def put(self, key: bytes, records: list[SignedRecord], now_ms: int) -> int:
        """Merge verified ``records`` under ``key``; returns how many were taken."""
        taken = 0
        for rec in records:
            if rec.key != key or rec.expires_at <= now_ms:
                continue
            slots = self._data.get(key)
            if slots is None:
                if len(self._data) >= self.max_keys:
                    self.expire(now_ms)
                    if len(self._data) >= self.max_keys:
                        continue
                slots = self._data[key] = {}
            slot = (rec.public_key, rec.kind.value)
            held = slots.get(slot)
            if held is not None and not rec.newer_than(held):
                continue
            size_after = self._bytes + len(rec.encoded) - (len(held.encoded) if held else 0)
            if size_after > self.max_bytes:
                continue
            if held is None and len(slots) >= self.max_records_per_key:
                # Full: a longer-lived newcomer replaces the soonest to expire.
                victim_slot = min(slots, key=lambda s: slots[s].expires_at)
                victim = slots[victim_slot]
                if victim.expires_at >= rec.expires_at:
                    continue
                del slots[victim_slot]
                self._forget(victim)
            if held is not None:
                self._forget(held)
            slots[slot] = rec
            self._by_bytes[rec.encoded] = rec
            self._bytes += len(rec.encoded)
            taken += 1
        if key in self._data and not self._data[key]:
            del self._data[key]
        return taken

    def get(self, key: bytes, now_ms: int) -> list[SignedRecord]:
        """Unexpired records under ``key``."""
        slots = self._data.get(key)
        if not slots:
            return []
        live = [r for r in slots.values() if r.expires_at > now_ms]
        if len(live) != len(slots):
            self._drop_expired(key, now_ms)
        return live

    def expire(self, now_ms: int) -> int:
        """Drop every expired record; returns how many."""
        dropped = 0
        for key in list(self._data):
            dropped += self._drop_expired(key, now_ms)
        return dropped

    def _forget(self, rec: SignedRecord) -> None:
        self._bytes -= len(rec.encoded)
        self._by_bytes.pop(rec.encoded, None)

    def _drop_expired(self, key: bytes, now_ms: int) -> int:
        slots = self._data[key]
        dead = [s for s, r in slots.items() if r.expires_at <= now_ms]
        for s in dead:
            self._forget(slots.pop(s))
        if not slots:
            del self._data[key]
        return len(dead)
