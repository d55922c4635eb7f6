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
  The other owner's card is still kept, as a *rival*: an agent id with two
  live owners is ambiguous (:meth:`Registry.owners`), and routing refuses it
  unless the sender names the owner (``agent@peer``, docs/protocol/node.md
  "Agent ids and owners"). Envelopes are authenticated against the card of
  the owner that sent them (:meth:`Registry.find_owned`), so the real owner
  of a squatted id is not refused.
* Bounds against a flood of cards: at most ``max_cards_per_peer`` cards
  (held and rival) per owning peer, and no card whose expiry lies more than
  ``max_lifetime_ms`` ahead; both refusals are ``INVALID_CARD``.
* ``prune_expired(now_ms)`` drops remote cards past their expiry; a rival
  takes the place of an expired holder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from p2pnode.card import AgentCard, Origin
from p2pnode.errors import ErrorCode, LocalError, RemoteError
from p2pnode.identity import Identity, PeerId
from p2pnode.wire import WireLimits, pack, unpack_untrusted

DEFAULT_MAX_CARDS = 100_000
#: Cards one peer may have in the registry (a node's HELLO carries at most 64).
DEFAULT_MAX_CARDS_PER_PEER = 256
#: How far ahead a card's expiry may lie: the longest lifetime a node issues (30 days,
#: NodeConfig.card_ttl_seconds) plus 5 minutes of clock skew.
DEFAULT_MAX_LIFETIME_MS = (30 * 86400 + 300) * 1000


class Registry:
    """Known Agent Cards by agent id. Time comes in as ``now_ms``; nothing here reads a clock."""

    def __init__(
        self,
        identity: Identity | None = None,
        max_cards: int = DEFAULT_MAX_CARDS,
        *,
        max_cards_per_peer: int = DEFAULT_MAX_CARDS_PER_PEER,
        max_lifetime_ms: int = DEFAULT_MAX_LIFETIME_MS,
    ) -> None:
        self._identity = identity
        self._cards: dict[str, AgentCard] = {}
        #: Live cards of other owners claiming a held agent id, by id and owner.
        self._rivals: dict[str, dict[PeerId, AgentCard]] = {}
        #: Remote cards (held and rival) per owning peer.
        self._per_peer: dict[PeerId, int] = {}
        self._by_capability: dict[str, set[str]] = {}
        self._max_cards = max_cards
        self._max_per_peer = max_cards_per_peer
        self._max_lifetime_ms = max_lifetime_ms

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
        """Merge a peer's card. Returns True when it was stored (new or newer revision),
        as the held card of its id or as a rival (another owner holds the id).

        Raises RemoteError(INVALID_SIGNATURE) for a card whose signature, key or
        peer id do not match, RemoteError(INVALID_CARD) for an expired card, one
        whose expiry lies too far ahead, one over its peer's quota, or one that
        claims the id of a local agent (details ``holder`` and ``claimant``).
        """
        card.verify()
        if card.is_expired(now_ms):
            raise RemoteError(ErrorCode.INVALID_CARD, f"card {card.id!r} has expired")
        if card.expires_at > now_ms + self._max_lifetime_ms:
            raise RemoteError(
                ErrorCode.INVALID_CARD,
                f"card {card.id!r} of peer {card.peer_id} expires too far ahead (more than "
                f"{self._max_lifetime_ms // 1000} s)",
                max_lifetime_s=self._max_lifetime_ms // 1000,
            )
        existing = self._cards.get(card.id)
        if existing is not None and existing.origin is Origin.LOCAL:
            raise RemoteError(
                ErrorCode.INVALID_CARD,
                f"agent id {card.id!r} of peer {card.peer_id} collides with the local "
                f"agent of this node (peer {existing.peer_id}); one of them needs another id",
                holder=str(existing.peer_id),
                claimant=str(card.peer_id),
            )
        if existing is not None and existing.public_key != card.public_key:
            if existing.is_expired(now_ms):
                self._drop(card.id)
                return self.merge_remote(card, now_ms)
            return self._merge_rival(card, now_ms)
        if existing is not None:
            if card.revision <= existing.revision:
                if card.revision == existing.revision:
                    self._cards[card.id] = dataclasses.replace(existing, last_seen_at=now_ms)
                return False
        else:
            self._admit(card, now_ms)
        self._put(dataclasses.replace(card, origin=Origin.REMOTE, last_seen_at=now_ms))
        return True

    def _admit(self, card: AgentCard, now_ms: int) -> None:
        """Refuse a new remote card over its peer's quota or the total."""
        peer = card.peer_id
        if self._per_peer.get(peer, 0) >= self._max_per_peer:
            self.prune_expired(now_ms)
            if self._per_peer.get(peer, 0) >= self._max_per_peer:
                raise RemoteError(
                    ErrorCode.INVALID_CARD,
                    f"card {card.id!r} refused: peer {peer} has {self._max_per_peer} cards "
                    "here, its quota",
                    quota=self._max_per_peer,
                )
        if len(self._cards) + self.rival_count() >= self._max_cards:
            self.prune_expired(now_ms)
            if len(self._cards) + self.rival_count() >= self._max_cards:
                raise RemoteError(ErrorCode.INVALID_CARD, "registry full")

    def is_contested(self, agent_id: str) -> bool:
        """True when another owner also holds a live card for ``agent_id`` (a rival)."""
        return agent_id in self._rivals

    def _merge_rival(self, card: AgentCard, now_ms: int) -> bool:
        rivals = self._rivals.get(card.id, {})
        held = rivals.get(card.peer_id)
        if held is not None and card.revision <= held.revision:
            return False
        if held is None:
            self._admit(card, now_ms)
            self._per_peer[card.peer_id] = self._per_peer.get(card.peer_id, 0) + 1
        self._rivals.setdefault(card.id, {})[card.peer_id] = dataclasses.replace(
            card, origin=Origin.REMOTE, last_seen_at=now_ms
        )
        return True

    def _uncount(self, card: AgentCard) -> None:
        if card.origin is not Origin.REMOTE:
            return
        left = self._per_peer.get(card.peer_id, 0) - 1
        if left > 0:
            self._per_peer[card.peer_id] = left
        else:
            self._per_peer.pop(card.peer_id, None)

    def _drop(self, agent_id: str) -> None:
        """Remove the held card of ``agent_id``, keeping its rivals."""
        card = self._cards.pop(agent_id, None)
        if card is None:
            return
        self._uncount(card)
        for cap in card.provider_keys():
            ids = self._by_capability.get(cap)
            if ids is not None:
                ids.discard(agent_id)
                if not ids:
                    del self._by_capability[cap]

    def unregister(self, agent_id: str) -> bool:
        """Remove a card (and its rivals); False when there was none."""
        for rival in self._rivals.pop(agent_id, {}).values():
            self._uncount(rival)
        if agent_id not in self._cards:
            return False
        self._drop(agent_id)
        return True

    def prune_expired(self, now_ms: int) -> list[str]:
        """Drop remote cards whose expiry has passed; returns their ids. A live rival of
        an expired holder takes its place (the one that expires last)."""
        expired = [
            c.id for c in self._cards.values() if c.origin is Origin.REMOTE and c.is_expired(now_ms)
        ]
        for agent_id in expired:
            self._drop(agent_id)
        for agent_id in list(self._rivals):
            rivals = self._rivals[agent_id]
            for peer, rival in list(rivals.items()):
                if rival.is_expired(now_ms):
                    del rivals[peer]
                    self._uncount(rival)
            if rivals and agent_id not in self._cards:
                heir = max(rivals.values(), key=lambda c: c.expires_at)
                del rivals[heir.peer_id]
                self._uncount(heir)
                self._put(heir)
            if not rivals:
                del self._rivals[agent_id]
        return expired

    def _put(self, card: AgentCard) -> None:
        self._drop(card.id)
        self._cards[card.id] = card
        if card.origin is Origin.REMOTE:
            self._per_peer[card.peer_id] = self._per_peer.get(card.peer_id, 0) + 1
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

    def find_owned(self, agent_id: str, peer_id: PeerId) -> AgentCard | None:
        """The card of ``agent_id`` owned by ``peer_id`` (held or rival), or None."""
        card = self._cards.get(agent_id)
        if card is not None and card.peer_id.raw == peer_id.raw:  # bytes: no __eq__ call
            return card
        return self._rivals.get(agent_id, {}).get(peer_id)

    def owners(self, agent_id: str, now_ms: int | None = None) -> list[AgentCard]:
        """Every card claiming ``agent_id`` (live at ``now_ms`` when given), the held one
        first: more than one means the id is ambiguous."""
        cards = []
        held = self._cards.get(agent_id)
        if held is not None:
            cards.append(held)
        cards.extend(self._rivals.get(agent_id, {}).values())
        if now_ms is not None:
            cards = [c for c in cards if not c.is_expired(now_ms)]
        return cards

    def rival_count(self) -> int:
        """Cards kept as rivals (another owner holds their id)."""
        return sum(len(r) for r in self._rivals.values())

    def cards_of(self, peer_id: PeerId) -> int:
        """Remote cards (held and rival) owned by ``peer_id``: what counts against its quota."""
        return self._per_peer.get(peer_id, 0)

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
