"""Signed withdrawals: the codec, the owner-only and no-replay rules, the registry's
memory of them, HELLO frames that carry them, and the DHT records that replace a card."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.card import AgentCard, Capability, Origin
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.identity import Identity
from p2pnode.core.registry import Registry
from p2pnode.core.wire import canonical_pack, unpack_untrusted
from p2pnode.core.withdrawal import Withdrawal, WithdrawalError, is_withdrawal_untrusted
from p2pnode.node.frames import Hello, decode_frame_untrusted, encode_hello

NOW = 1_700_000_000_000
OWNER = Identity(b"\x01" * 32)
OTHER = Identity(b"\x02" * 32)


def card(identity: Identity = OWNER, agent_id: str = "notes", revision: int = 5) -> AgentCard:
    return AgentCard(
        id=agent_id,
        name=agent_id,
        version="1.0.0",
        public_key=identity.public_key,
        capabilities=(Capability("notes.add", "Add"),),
        revision=revision,
        issued_at=NOW,
        expires_at=NOW + 600_000,
        origin=Origin.REMOTE,
    ).signed(identity)


# -- the codec ---------------------------------------------------------------------------


@given(
    agent_id=st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,40}", fullmatch=True),
    revision=st.integers(0, 2**62),
    at=st.integers(0, 2**50),
)
def test_a_withdrawal_round_trips_and_verifies(agent_id: str, revision: int, at: int) -> None:
    held = dataclasses.replace(card(agent_id="x"), id=agent_id, revision=revision).signed(OWNER)
    withdrawal = Withdrawal.of(held, OWNER, at)
    again = Withdrawal.from_bytes_untrusted(withdrawal.to_bytes())
    assert again == withdrawal
    assert again.peer_id == OWNER.peer_id
    assert again.revision == revision + 1 and again.expires_at == held.expires_at
    assert is_withdrawal_untrusted(withdrawal.to_bytes())
    assert not is_withdrawal_untrusted(held.to_bytes())


@settings(max_examples=200)
@given(data=st.data())
def test_any_change_to_a_signed_withdrawal_is_refused(data: st.DataObject) -> None:
    plain = Withdrawal.of(card(), OWNER, NOW).to_dict()
    key = data.draw(st.sampled_from(sorted(plain)))
    value = plain[key]
    if isinstance(value, bool):
        return  # the marker: changing it makes it no withdrawal (checked below)
    if isinstance(value, int):
        changed: object = value + data.draw(st.integers(1, 1000))
    elif isinstance(value, bytes):
        changed = bytes([value[0] ^ 1]) + value[1:]
    else:
        changed = value + "x"
    with pytest.raises(WithdrawalError) as info:
        Withdrawal.from_bytes_untrusted(canonical_pack({**plain, key: changed}))
    assert info.value.code is ErrorCode.INVALID_SIGNATURE


@given(garbage=st.binary(max_size=300))
def test_garbage_is_a_typed_refusal(garbage: bytes) -> None:
    try:
        Withdrawal.from_bytes_untrusted(garbage)
    except WithdrawalError as exc:
        assert exc.code in {
            ErrorCode.MALFORMED_MESSAGE,
            ErrorCode.INVALID_SIGNATURE,
            ErrorCode.MESSAGE_TOO_LARGE,
            ErrorCode.TOO_MANY_ITEMS,
            ErrorCode.NESTING_TOO_DEEP,
        }


@pytest.mark.parametrize(
    "change",
    [
        {"withdrawn": False},
        {"revision": -1},
        {"revision": "5"},
        {"publicKey": b"short"},
        {"signature": b""},
        {"id": ""},
        {"extra": 1},
    ],
)
def test_malformed_withdrawals_are_refused(change: dict[str, object]) -> None:
    plain = {**Withdrawal.of(card(), OWNER, NOW).to_dict(), **change}
    with pytest.raises(WithdrawalError) as info:
        Withdrawal.from_bytes_untrusted(canonical_pack(plain))
    assert info.value.code is ErrorCode.MALFORMED_MESSAGE


def test_only_the_owner_withdraws() -> None:
    with pytest.raises(LocalError) as info:
        Withdrawal.of(card(), OTHER, NOW)
    assert info.value.code is ErrorCode.INVALID_SIGNATURE
    # Another key signing the owner's fields does not verify.
    forged = Withdrawal.of(card(), OWNER, NOW)
    plain = forged.to_dict() | {"signature": OTHER.sign(forged.signing_bytes())}
    with pytest.raises(WithdrawalError):
        Withdrawal.from_bytes_untrusted(canonical_pack(plain))


@given(older=st.integers(0, 100), newer=st.integers(0, 100))
def test_a_withdrawal_ends_older_cards_only(older: int, newer: int) -> None:
    withdrawal = Withdrawal.of(card(revision=older), OWNER, NOW)
    later = card(revision=newer)
    assert withdrawal.ends(later) == (newer <= older)
    assert not withdrawal.ends(card(OTHER, revision=0))
    assert not withdrawal.ends(card(agent_id="other", revision=0))


# -- the registry --------------------------------------------------------------------------


def test_a_withdrawal_drops_the_card_and_a_replayed_old_card_stays_out() -> None:
    registry = Registry()
    old = card(revision=5)
    assert registry.merge_remote(old, NOW)
    withdrawal = Withdrawal.of(old, OWNER, NOW + 1)
    assert registry.withdraw(withdrawal, NOW + 1)
    assert registry.find("notes") is None and registry.find_by_capability("notes.add") == []
    assert not registry.merge_remote(old, NOW + 2)  # a stale DHT read or late HELLO
    assert registry.find("notes") is None
    # The agent back (a restarted node issues its card at a later revision): taken.
    back = card(revision=6)
    assert registry.merge_remote(back, NOW + 3)
    assert registry.find("notes") == dataclasses.replace(back, last_seen_at=NOW + 3)
    # The old withdrawal replayed cannot take the later card down.
    assert not registry.withdraw(withdrawal, NOW + 4)
    assert registry.find("notes") is not None


def test_a_withdrawal_of_a_holder_hands_the_id_to_its_rival() -> None:
    registry = Registry()
    first, second = card(revision=1), card(OTHER, revision=1)
    registry.merge_remote(first, NOW)
    registry.merge_remote(second, NOW)
    assert len(registry.resolve("notes", NOW)) == 1  # the pinned first owner
    registry.withdraw(Withdrawal.of(first, OWNER, NOW), NOW)
    assert [c.peer_id for c in registry.resolve("notes", NOW)] == [OTHER.peer_id]
    assert not registry.is_contested("notes")


def test_expired_withdrawals_change_nothing_and_are_forgotten() -> None:
    registry = Registry()
    held = card()
    registry.merge_remote(held, NOW)
    late = held.expires_at + 1
    assert not registry.withdraw(Withdrawal.of(held, OWNER, NOW), late)
    registry.withdraw(Withdrawal.of(card(agent_id="b"), OWNER, NOW), NOW)
    assert registry.withdrawn_count() == 1
    registry.prune_expired(late)
    assert registry.withdrawn_count() == 0


@settings(max_examples=30, deadline=None)
@given(count=st.integers(1, 40), owners=st.integers(1, 4))
def test_withdrawals_remembered_are_bounded(count: int, owners: int) -> None:
    registry = Registry(max_cards=10, max_cards_per_peer=4)
    identities = [Identity(bytes([10 + i]) * 32) for i in range(owners)]
    for n in range(count):
        identity = identities[n % owners]
        registry.withdraw(Withdrawal.of(card(identity, f"a{n}"), identity, NOW), NOW)
        assert registry.withdrawn_count() <= 10
    assert registry.withdrawn_count() == min(count, 4 * owners, 10)


# -- frames ---------------------------------------------------------------------------------


def test_a_hello_carries_withdrawals_and_reads_as_before_without() -> None:
    withdrawal = Withdrawal.of(card(), OWNER, NOW)
    frame = decode_frame_untrusted(encode_hello([], ["127.0.0.1:1"], [withdrawal]))
    assert isinstance(frame, Hello) and frame.withdrawals == (withdrawal,)
    plain = encode_hello([card(agent_id="b")], [])
    assert "withdrawn" not in unpack_untrusted(plain)[1]
    frame = decode_frame_untrusted(plain)
    assert isinstance(frame, Hello) and frame.withdrawals == ()


# -- the registry's capability index over claims, withdrawals and expiry ----------------------

CAPS = ("c0", "c1", "c2")
IDS = ("x", "y")
OWNERS = tuple(Identity(bytes([60 + i]) * 32) for i in range(3))

operations = st.lists(
    st.tuples(
        st.sampled_from(["merge", "withdraw", "expire"]),
        st.integers(0, len(OWNERS) - 1),
        st.sampled_from(IDS),
        st.sets(st.sampled_from(CAPS), max_size=3),
        st.integers(1, 5),
    ),
    max_size=25,
)


@settings(max_examples=150, deadline=None)
@given(steps=operations)
def test_find_by_capability_lists_exactly_the_claims_offering_it(
    steps: list[tuple[str, int, str, set[str], int]],
) -> None:
    registry = Registry()
    now = NOW
    revisions: dict[tuple[int, str], int] = {}
    for kind, owner, agent_id, caps, step in steps:
        now += step * 1000
        identity = OWNERS[owner]
        revision = revisions.get((owner, agent_id), 0) + 1
        held = AgentCard(
            id=agent_id,
            name=agent_id,
            version="1.0.0",
            public_key=identity.public_key,
            capabilities=tuple(Capability(c, c) for c in sorted(caps)),
            revision=revision,
            issued_at=now,
            expires_at=now + 8000,
            origin=Origin.REMOTE,
        ).signed(identity)
        if kind == "merge":
            revisions[(owner, agent_id)] = revision
            registry.merge_remote(held, now)
        elif kind == "withdraw":
            previous = dataclasses.replace(held, revision=revision - 1)
            registry.withdraw(Withdrawal.of(previous, identity, now), now)
        else:
            registry.prune_expired(now)
        for cap in CAPS:
            expected = {
                (c.id, c.peer_id)
                for agent in IDS
                for c in registry.owners(agent)
                if c.has_capability(cap)
            }
            listed = registry.find_by_capability(cap)
            assert {(c.id, c.peer_id) for c in listed} == expected
            assert len(listed) == len(expected)
