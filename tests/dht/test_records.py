"""Signed records and the record store: forged, replayed, expired, oversized, floods."""

from __future__ import annotations

import gc
import hashlib
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode
from p2pnode.core.identity import Identity
from p2pnode.core.wire import pack
from p2pnode.dht.records import (
    MAX_TTL_MS,
    MAX_VALUE_BYTES,
    ProviderInfo,
    RecordError,
    RecordKind,
    RecordStore,
    SignedRecord,
    capability_key,
    card_key,
    decode_value_untrusted,
    encode_value,
)

NOW = 1_800_000_000_000
RNG = random.Random(11)
ALICE = Identity(RNG.randbytes(32))
BOB = Identity(RNG.randbytes(32))


def provider(
    who: Identity = ALICE, cap: str = "translate", rev: int = 1, exp: int = NOW + 60_000
) -> SignedRecord:
    info = ProviderInfo(cap, "agent-1", (("10.0.0.1", 7000),)).to_bytes()
    return SignedRecord.create(who, RecordKind.PROVIDER, capability_key(cap), rev, exp, info)


def test_keys_match_stock_digest() -> None:
    # kademlia.utils.digest(s) == sha1(str(s).encode("utf8")).digest()
    assert capability_key("translate") == hashlib.sha1(b"p2pnode:cap:translate").digest()
    name = f"p2pnode:card:{ALICE.peer_id}/venus"
    assert card_key(ALICE.peer_id, "venus") == hashlib.sha1(name.encode()).digest()


def test_round_trip_and_value() -> None:
    r1, r2 = provider(ALICE), provider(BOB)
    assert SignedRecord.from_bytes_untrusted(r1.to_bytes(), now_ms=NOW) == r1
    value = encode_value([r2, r1])
    assert value == encode_value([r1, r2])  # deterministic
    recs, rejected = decode_value_untrusted(value, r1.key, now_ms=NOW)
    assert rejected == 0
    assert {r.publisher for r in recs} == {ALICE.peer_id, BOB.peer_id}


def _tamper(rec: SignedRecord, index: int, value: Any) -> bytes:
    fields: list[Any] = [1, rec.kind.value, rec.key, rec.public_key, rec.revision]
    fields += [rec.expires_at, rec.payload, rec.signature]
    fields[index] = value
    return pack(fields)


@pytest.mark.parametrize(
    ("index", "value", "code"),
    [
        (4, 2, ErrorCode.INVALID_SIGNATURE),  # revision bumped without re-signing
        (5, NOW + 120_000, ErrorCode.INVALID_SIGNATURE),  # expiry extended
        (3, BOB.public_key, ErrorCode.INVALID_SIGNATURE),  # claims another publisher
        (7, b"\x00" * 64, ErrorCode.INVALID_SIGNATURE),
        (7, b"", ErrorCode.INVALID_SIGNATURE),  # unsigned
        (1, "other", ErrorCode.INVALID_RECORD),
        (0, 2, ErrorCode.INVALID_RECORD),
        (2, b"\x01" * 20, ErrorCode.INVALID_SIGNATURE),
    ],
)
def test_forged_records_rejected(index: int, value: Any, code: ErrorCode) -> None:
    with pytest.raises(RecordError) as info:
        SignedRecord.from_bytes_untrusted(_tamper(provider(), index, value), now_ms=NOW)
    assert info.value.code == code


def test_key_binding() -> None:
    info = ProviderInfo("translate", "a", ()).to_bytes()
    wrong_key = SignedRecord.create(
        ALICE, RecordKind.PROVIDER, capability_key("other"), 1, NOW + 1000, info
    )
    with pytest.raises(RecordError, match="key does not match"):
        SignedRecord.from_bytes_untrusted(wrong_key.to_bytes(), now_ms=NOW)
    payload = pack({"id": "venus"})
    for key in (card_key(BOB.peer_id, "venus"), card_key(ALICE.peer_id, "mars")):
        foreign_card = SignedRecord.create(ALICE, RecordKind.CARD, key, 1, NOW + 1000, payload)
        with pytest.raises(RecordError, match="foreign key"):
            SignedRecord.from_bytes_untrusted(foreign_card.to_bytes(), now_ms=NOW)
    own = SignedRecord.create(
        ALICE, RecordKind.CARD, card_key(ALICE.peer_id, "venus"), 1, NOW + 1000, payload
    )
    assert SignedRecord.from_bytes_untrusted(own.to_bytes(), now_ms=NOW).key == own.key
    no_id = SignedRecord.create(
        ALICE, RecordKind.CARD, card_key(ALICE.peer_id, "venus"), 1, NOW + 1000, b"card"
    )
    with pytest.raises(RecordError, match="card payload"):
        SignedRecord.from_bytes_untrusted(no_id.to_bytes(), now_ms=NOW)


def test_expired_and_far_future_rejected() -> None:
    with pytest.raises(RecordError, match="expired"):
        SignedRecord.from_bytes_untrusted(provider(exp=NOW).to_bytes(), now_ms=NOW)
    far = provider(exp=NOW + MAX_TTL_MS + 1)
    with pytest.raises(RecordError, match="too far"):
        SignedRecord.from_bytes_untrusted(far.to_bytes(), now_ms=NOW)


def test_oversized_value_and_record_rejected() -> None:
    with pytest.raises(RecordError):
        decode_value_untrusted(b"\x90" + b"\x00" * MAX_VALUE_BYTES, capability_key("x"), now_ms=NOW)
    big = SignedRecord.create(
        ALICE, RecordKind.CARD, card_key(ALICE.peer_id, "a"), 1, NOW + 1000, b"x" * 9000
    )
    with pytest.raises(RecordError):
        SignedRecord.from_bytes_untrusted(big.to_bytes(), now_ms=NOW)
    # encode_value never produces more than the limit.
    many = [provider(Identity(RNG.randbytes(32))) for _ in range(60)]
    assert len(encode_value(many)) <= MAX_VALUE_BYTES


def test_unsigned_values_rejected_whole() -> None:
    for value in ("hello", b"hello", 5, None, [b"x"], pack({"a": 1})):
        with pytest.raises(RecordError):
            decode_value_untrusted(value, capability_key("x"), now_ms=NOW)


def test_one_bad_record_does_not_hide_good_ones() -> None:
    good = provider()
    value = pack([_tamper(provider(BOB), 7, b"\x00" * 64), good.to_bytes(), b"junk"])
    recs, rejected = decode_value_untrusted(value, good.key, now_ms=NOW)
    assert recs == [good]
    assert rejected == 2


def test_store_merge_newest_revision_wins_and_replays_lose() -> None:
    store = RecordStore()
    key = capability_key("translate")
    v1, v2 = provider(rev=1), provider(rev=2)
    assert store.put(key, [v2], NOW) == 1
    assert store.put(key, [v1], NOW) == 0  # replayed older revision
    assert store.put(key, [v2], NOW) == 0  # same again: no change
    refreshed = provider(rev=2, exp=NOW + 120_000)
    assert store.put(key, [refreshed], NOW) == 1  # same revision, later expiry: refresh
    assert store.put(key, [provider(BOB)], NOW) == 1
    got = store.get(key, NOW)
    assert sorted(r.revision for r in got) == [1, 2]
    assert refreshed in got
    assert v2 not in got


def test_store_expires_records() -> None:
    store = RecordStore()
    key = capability_key("translate")
    store.put(key, [provider(exp=NOW + 10)], NOW)
    assert store.get(key, NOW + 10) == []
    assert store.total_bytes == 0
    assert store.keys() == []


def test_store_bounds() -> None:
    store = RecordStore(max_keys=3, max_records_per_key=4, max_bytes=10_000)
    ids = [Identity(RNG.randbytes(32)) for _ in range(10)]
    key = capability_key("translate")
    for i, who in enumerate(ids):
        store.put(key, [provider(who, exp=NOW + 1000 + i)], NOW)
    assert len(store.get(key, NOW)) == 4
    # The longest-lived ones were kept.
    assert min(r.expires_at for r in store.get(key, NOW)) == NOW + 1006
    for cap in ("a", "b", "c", "d", "e"):
        store.put(capability_key(cap), [provider(ALICE, cap)], NOW)
    assert len(store.keys()) == 3
    assert store.total_bytes <= 10_000


def test_rate_limit_per_source() -> None:
    store = RecordStore(source_burst=10, source_rate=1.0)
    assert sum(store.allow_store("10.0.0.1", 0.0) for _ in range(100)) == 10
    assert store.allow_store("10.0.0.2", 0.0)
    assert sum(store.allow_store("10.0.0.1", 5.0) for _ in range(100)) == 5


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_random_bytes_only_raise_record_error(data: bytes) -> None:
    for fn in (
        lambda: SignedRecord.from_bytes_untrusted(data, now_ms=NOW),
        lambda: decode_value_untrusted(data, capability_key("x"), now_ms=NOW),
        lambda: ProviderInfo.from_bytes_untrusted(data),
    ):
        try:
            fn()
        except RecordError:
            pass


@settings(max_examples=100)
@given(st.integers(0, 200), st.integers(0, 255))
def test_bit_flips_never_verify(pos: int, flip: int) -> None:
    enc = bytearray(provider().to_bytes())
    pos %= len(enc)
    if flip == 0 or enc[pos] ^ flip == enc[pos]:
        return
    enc[pos] ^= flip
    try:
        rec = SignedRecord.from_bytes_untrusted(bytes(enc), now_ms=NOW)
    except RecordError:
        return
    # A flip that still decodes must decode to the very same record (e.g. in msgpack padding).
    assert rec == provider()


def test_verification_cache_keeps_expiry_and_follows_the_store() -> None:
    store = RecordStore()
    key = capability_key("translate")
    v1 = provider(rev=1, exp=NOW + 1000)
    store.put(key, [v1], NOW)
    assert store.known(v1.encoded) == v1
    recs, rejected = decode_value_untrusted(encode_value([v1]), key, now_ms=NOW, known=store.known)
    assert (recs, rejected) == ([v1], 0)
    # A cached record past its expiry is re-checked, and rejected.
    recs, rejected = decode_value_untrusted(
        encode_value([v1]), key, now_ms=NOW + 1000, known=store.known
    )
    assert (recs, rejected) == ([], 1)
    # Replaced records leave the cache.
    v2 = provider(rev=2, exp=NOW + 1000)
    store.put(key, [v2], NOW)
    assert store.known(v1.encoded) is None
    assert store.known(v2.encoded) == v2
    store.expire(NOW + 1000)
    assert store.known(v2.encoded) is None


def test_bytes_verified_once_per_process_while_a_record_holds_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import p2pnode.dht.records as records
    from p2pnode.core.identity import verify_signature as real

    checks: list[bytes] = []

    def counting(pk: bytes, message: bytes, sig: bytes) -> bool:
        checks.append(sig)
        return real(pk, message, sig)

    monkeypatch.setattr(records, "verify_signature", counting)
    data = provider(BOB, cap="cached", exp=NOW + 60_000).to_bytes()
    first = SignedRecord.from_bytes_untrusted(bytes(data), now_ms=NOW)
    # Equal bytes (another object, as another node would parse them): the same record.
    again = SignedRecord.from_bytes_untrusted(bytes(bytearray(data)), now_ms=NOW + 1)
    assert again is first
    assert len(checks) == 1
    # Its expiry is still checked against the time asked about.
    with pytest.raises(RecordError, match="expired"):
        SignedRecord.from_bytes_untrusted(data, now_ms=NOW + 60_000)
    # Other bytes are verified: a tampered copy never borrows the record's check.
    with pytest.raises(RecordError):
        SignedRecord.from_bytes_untrusted(_tamper(first, 4, 2), now_ms=NOW)
    assert len(checks) == 2
    # Once no record holds them, the bytes are verified afresh.
    del first, again
    gc.collect()
    SignedRecord.from_bytes_untrusted(data, now_ms=NOW)
    assert len(checks) == 3
