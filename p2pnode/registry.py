"""The registry of Agent Cards a node knows: its own agents' and remote ones.

Rules (seed Requirement 1, Properties 1-5):

* ``register`` stores a local card; registering the same agent id again
  replaces the card and sets its revision to the previous revision + 1. When
  the registry holds the owner's identity, stored local cards are re-signed.
* ``merge_remote`` accepts a peer's card only if the owner's signature checks;
  it is stored with origin ``remote``. An older revision never replaces a
  newer one, a remote card never replaces a local agent, and an agent id held
  by one owner cannot be taken over by another owner's card until the first
  expires (first come, first served; ids are not globally unique otherwise).
* ``prune_expired(now_ms)`` drops remote cards past their expiry.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from p2pnode.card import AgentCard, Origin
from p2pnode.errors import ErrorCode, LocalError, RemoteError
from p2pnode.identity import Identity
from p2pnode.wire import WireLimits, pack, unpack_untrusted

DEFAULT_MAX_CARDS = 100_000


class Registry:
    """Known Agent Cards by agent id. Time comes in as ``now_ms``; nothing here reads a clock."""

    def __init__(
        self, identity: Identity | None = None, max_cards: int = DEFAULT_MAX_CARDS
    ) -> None:
        self._identity = identity
        self._cards: dict[str, AgentCard] = {}
        self._by_capability: dict[str, set[str]] = {}
        self._max_cards = max_cards

    # -- writes -----------------------------------------------------------------------------

    def register(self, card: AgentCard, now_ms: int | None = None) -> AgentCard:
        """Store a local agent's card; returns the stored card (revision bumped on re-register).

        Raises LocalError(INVALID_CARD) when the id belongs to a remote agent.
        """
        existing = self._cards.get(card.id)
        if existing is not None and existing.origin is Origin.REMOTE:
            raise LocalError(
                ErrorCode.INVALID_CARD, f"agent id {card.id!r} belongs to a remote agent"
            )
        revision = existing.revision + 1 if existing is not None else card.revision
        stored = dataclasses.replace(
            card,
            origin=Origin.LOCAL,
            revision=revision,
            last_seen_at=now_ms if now_ms is not None else card.last_seen_at,
        )
        if self._identity is not None and self._identity.public_key == stored.public_key:
            stored = stored.signed(self._identity)
        self._put(stored)
        return stored

    def merge_remote(self, card: AgentCard, now_ms: int) -> bool:
        """Merge a peer's card. Returns True when it was stored (new or newer revision).

        Raises RemoteError(INVALID_SIGNATURE) for a card whose signature, key or
        peer id do not match, RemoteError(INVALID_CARD) for an expired card or one
        that claims another owner's agent id.
        """
        card.verify()
        if card.is_expired(now_ms):
            raise RemoteError(ErrorCode.INVALID_CARD, f"card {card.id!r} has expired")
        existing = self._cards.get(card.id)
        if existing is not None:
            if existing.origin is Origin.LOCAL:
                raise RemoteError(
                    ErrorCode.INVALID_CARD,
                    f"agent id {card.id!r} of peer {card.peer_id} collides with the local "
                    f"agent of this node (peer {existing.peer_id}); one of them needs another id",
                    holder=str(existing.peer_id),
                    claimant=str(card.peer_id),
                )
            if existing.public_key != card.public_key and not existing.is_expired(now_ms):
                raise RemoteError(
                    ErrorCode.INVALID_CARD,
                    f"agent id {card.id!r} of peer {card.peer_id} is refused: peer "
                    f"{existing.peer_id} holds it (first come, first served until its card "
                    "expires); one of them needs another id",
                    holder=str(existing.peer_id),
                    claimant=str(card.peer_id),
                )
            if existing.public_key == card.public_key and card.revision <= existing.revision:
                if card.revision == existing.revision:
                    self._cards[card.id] = dataclasses.replace(existing, last_seen_at=now_ms)
                return False
        if existing is None and len(self._cards) >= self._max_cards:
            self.prune_expired(now_ms)
            if len(self._cards) >= self._max_cards:
                raise RemoteError(ErrorCode.INVALID_CARD, "registry full")
        self._put(dataclasses.replace(card, origin=Origin.REMOTE, last_seen_at=now_ms))
        return True

    def unregister(self, agent_id: str) -> bool:
        """Remove a card; False when there was none."""
        card = self._cards.pop(agent_id, None)
        if card is None:
            return False
        for cap in card.provider_keys():
            ids = self._by_capability.get(cap)
            if ids is not None:
                ids.discard(agent_id)
                if not ids:
                    del self._by_capability[cap]
        return True

    def prune_expired(self, now_ms: int) -> list[str]:
        """Drop remote cards whose expiry has passed; returns their ids."""
        expired = [
            c.id for c in self._cards.values() if c.origin is Origin.REMOTE and c.is_expired(now_ms)
        ]
        for agent_id in expired:
            self.unregister(agent_id)
        return expired

    def _put(self, card: AgentCard) -> None:
        self.unregister(card.id)
        self._cards[card.id] = card
        for cap in card.provider_keys():
            self._by_capability.setdefault(cap, set()).add(card.id)

    # -- reads ------------------------------------------------------------------------------

    def get(self, agent_id: str) -> AgentCard:
        """The card of ``agent_id``. Raises LocalError(AGENT_NOT_FOUND)."""
        card = self._cards.get(agent_id)
        if card is None:
            raise LocalError(ErrorCode.AGENT_NOT_FOUND, f"no agent {agent_id!r}", agent_id=agent_id)
        return card

    def find(self, agent_id: str) -> AgentCard | None:
        """The card of ``agent_id`` or None."""
        return self._cards.get(agent_id)

    def find_by_capability(self, capability_id: str) -> list[AgentCard]:
        """Cards offering ``capability_id``, local ones first, then by agent id."""
        ids = self._by_capability.get(capability_id, ())
        return sorted((self._cards[i] for i in ids), key=_local_first)

    def find_by_tier(self, tier: int) -> list[AgentCard]:
        return sorted((c for c in self._cards.values() if c.tier == tier), key=_local_first)

    def list_local(self) -> list[AgentCard]:
        return sorted((c for c in self._cards.values() if c.origin is Origin.LOCAL), key=_by_id)

    def list_remote(self) -> list[AgentCard]:
        return sorted((c for c in self._cards.values() if c.origin is Origin.REMOTE), key=_by_id)

    def __iter__(self) -> Iterator[AgentCard]:
        return iter(sorted(self._cards.values(), key=_by_id))

    def __len__(self) -> int:
        return len(self._cards)

    def __contains__(self, agent_id: object) -> bool:
        return agent_id in self._cards

    # -- persistence ------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """All cards as msgpack (a list of plain forms)."""
        return pack([c.to_dict() for c in self])

    @classmethod
    def from_bytes_untrusted(
        cls, data: bytes, identity: Identity | None = None, max_cards: int = DEFAULT_MAX_CARDS
    ) -> Registry:
        """Rebuild a registry from :meth:`to_bytes`. Raises RemoteError on malformed data."""
        plain = unpack_untrusted(
            data, WireLimits(max_size=256 * 1024 * 1024, max_array_len=max_cards)
        )
        if not isinstance(plain, list):
            raise RemoteError(ErrorCode.MALFORMED_MESSAGE, "registry snapshot must be a list")
        registry = cls(identity, max_cards)
        for item in plain:
            registry._put(AgentCard.from_dict_untrusted(item))
        return registry


def _local_first(card: AgentCard) -> tuple[int, str]:
    return (0 if card.origin is Origin.LOCAL else 1, card.id)


def _by_id(card: AgentCard) -> str:
    return card.id
