"""The card registry (Properties 1, 3, 5; remote merge rules; persistence)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.card import AgentCard, Capability, Origin
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.identity import Identity
from p2pnode.core.registry import Registry
from tests.strategies import cards

NOW = 10_000


def card_for(owner: Identity, agent_id: str, revision: int = 0, **kw: object) -> AgentCard:
    base = AgentCard(
        id=agent_id,
        name=agent_id.upper(),
        version="1.0",
        public_key=owner.public_key,
        capabilities=(Capability("cap.a", "A"),),
        revision=revision,
        issued_at=0,
        expires_at=NOW * 10,
    )
    return dataclasses.replace(base, **kw).signed(owner)  # type: ignore[arg-type]


@settings(max_examples=100)
@given(cards())
def test_register_then_get_and_find_by_capability(card: AgentCard) -> None:
    registry = Registry()
    stored = registry.register(card)
    assert registry.get(card.id) == stored
    assert dataclasses.replace(stored, origin=card.origin, last_seen_at=card.last_seen_at) == card
    for cap in card.capability_ids():
        assert stored in registry.find_by_capability(cap)
    assert stored in registry.find_by_tier(card.tier)


@settings(max_examples=100)
@given(cards(), cards())
def test_duplicate_registration_replaces_and_bumps_revision(
    first: AgentCard, second: AgentCard
) -> None:
    registry = Registry()
    old = registry.register(first)
    update = dataclasses.replace(second, id=first.id)
    new = registry.register(update)
    assert len(registry) == 1
    assert new.revision == old.revision + 1
    assert new.name == update.name and new.capabilities == update.capabilities
    for cap in first.capability_ids() - second.capability_ids():
        assert registry.find_by_capability(cap) == []


def test_registry_with_identity_resigns_local_cards() -> None:
    owner = Identity.generate()
    registry = Registry(owner)
    registry.register(card_for(owner, "sun"))
    again = registry.register(card_for(owner, "sun", name="SUN II"))
    assert again.revision == 1
    assert again.is_signed_by_owner()


def test_get_unknown_raises_agent_not_found() -> None:
    with pytest.raises(LocalError) as info:
        Registry().get("nobody")
    assert info.value.code is ErrorCode.AGENT_NOT_FOUND
    assert Registry().find("nobody") is None


@settings(max_examples=100)
@given(cards())
def test_merge_remote_marks_origin_and_preserves_fields(card: AgentCard) -> None:
    registry = Registry()
    now = card.issued_at
    assert registry.merge_remote(card, now_ms=now)
    stored = registry.get(card.id)
    assert stored.origin is Origin.REMOTE
    assert stored.last_seen_at == now
    assert dataclasses.replace(stored, origin=card.origin, last_seen_at=card.last_seen_at) == card
    assert registry.list_remote() == [stored]
    assert registry.list_local() == []


def test_older_revision_never_replaces_newer() -> None:
    owner = Identity.generate()
    registry = Registry()
    assert registry.merge_remote(card_for(owner, "mars", revision=5), NOW)
    assert not registry.merge_remote(card_for(owner, "mars", revision=4, name="OLD"), NOW)
    assert not registry.merge_remote(card_for(owner, "mars", revision=5, name="SAME"), NOW + 1)
    assert registry.get("mars").name == "MARS"
    assert registry.get("mars").last_seen_at == NOW + 1
    assert registry.merge_remote(card_for(owner, "mars", revision=6, name="NEW"), NOW)
    assert registry.get("mars").name == "NEW"


def test_forged_remote_card_is_rejected_and_not_stored() -> None:
    owner, thief = Identity.generate(), Identity.generate()
    card = card_for(owner, "earth")
    forged = dataclasses.replace(card, tier=0)
    registry = Registry()
    with pytest.raises(RemoteError) as info:
        registry.merge_remote(forged, NOW)
    assert info.value.code is ErrorCode.INVALID_SIGNATURE
    assert "earth" not in registry
    registry.merge_remote(card, NOW)
    # Another owner's claim does not replace the held card: it is kept as a rival, and
    # the id has two owners (routing refuses it unless the owner is named).
    assert registry.merge_remote(card_for(thief, "earth", revision=9), NOW)
    assert registry.get("earth").public_key == owner.public_key
    assert [c.peer_id for c in registry.owners("earth")] == [owner.peer_id, thief.peer_id]
    assert registry.find_owned("earth", thief.peer_id) is not None


def test_remote_card_cannot_replace_a_local_agent() -> None:
    owner = Identity.generate()
    registry = Registry(owner)
    registry.register(card_for(owner, "sun"))
    with pytest.raises(RemoteError):
        registry.merge_remote(card_for(Identity.generate(), "sun", revision=99), NOW)
    other = Registry()
    other.merge_remote(card_for(Identity.generate(), "x"), NOW)
    with pytest.raises(LocalError):
        other.register(card_for(owner, "x"))


def test_expired_cards_rejected_and_pruned() -> None:
    owner = Identity.generate()
    registry = Registry()
    card = card_for(owner, "io", expires_at=NOW + 5)
    with pytest.raises(RemoteError, match="expired"):
        registry.merge_remote(card, NOW + 5)
    registry.merge_remote(card, NOW)
    registry.register(card_for(Identity.generate(), "local", expires_at=NOW + 1))
    assert registry.prune_expired(NOW + 100) == ["io"]
    assert "io" not in registry
    assert "local" in registry  # the node refreshes its own cards; pruning is for remote ones
    assert registry.find_by_capability("cap.a") == [registry.get("local")]


def test_unregister() -> None:
    registry = Registry()
    registry.register(card_for(Identity.generate(), "a"))
    assert registry.unregister("a")
    assert not registry.unregister("a")
    assert registry.find_by_capability("cap.a") == []


def test_bounded() -> None:
    registry = Registry(max_cards=3)
    for i in range(3):
        registry.merge_remote(card_for(Identity.generate(), f"a{i}"), NOW)
    with pytest.raises(RemoteError, match="full"):
        registry.merge_remote(card_for(Identity.generate(), "a9"), NOW)


@settings(max_examples=30)
@given(st.lists(cards(), max_size=6, unique_by=lambda c: c.id))
def test_serialize_round_trip(all_cards: list[AgentCard]) -> None:
    registry = Registry()
    for i, card in enumerate(all_cards):
        if i % 2:
            registry.register(card)
        else:
            registry.merge_remote(card, card.issued_at)
    restored = Registry.from_bytes_untrusted(registry.to_bytes())
    assert list(restored) == list(registry)
    with pytest.raises(RemoteError):
        Registry.from_bytes_untrusted(b"\x01garbage")
