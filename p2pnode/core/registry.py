"""The registry of Agent Cards a node knows: its own agents' and remote ones.

Rules (seed Requirement 1, Properties 1-5):

* ``register`` stores a local card; registering the same agent id again
  replaces the card and sets its revision to the previous revision + 1. When
  the registry holds the owner's identity, stored local cards are re-signed.
* ``merge_remote`` accepts a peer's card only if the owner's signature checks;
  it is stored with origin ``remote``. An older revision never replaces a
  newer one, and a remote card never replaces a local agent. Agent ids are
  names, not identities, so an id may have several owners: the card of the
  first owner learned is the *holder* (first seen, pinned like SSH's known
  hosts), the others are *rivals* (docs/protocol/node.md "Agent ids and
  owners"). Envelopes are authenticated against the card of the owner that
  sent them (:meth:`Registry.find_owned`), so no owner is refused.
* Which owner a bare id resolves to (:meth:`Registry.resolve`): among the
  *live* owners (card not expired, owner not known unreachable), the ones
  the swarm authority endorsed when there are any; then the one this node's
  agents named (``agent@peer``); then the pinned holder; one live owner is
  always the answer; several with none of those preferred is ambiguous.
* Liveness is told, not read: :meth:`note_unreachable` when the node's link
  to a peer closed for good (its redials failed), :meth:`note_reachable`
  when a channel to it opens. A claim is withdrawn (:meth:`withdraw_missing`)
  when its owner's HELLO no longer lists it.
* When a holder's claim ends (expired, withdrawn) the one live rival takes
  the id, pinned; with several live rivals the first learned holds it
  *unpinned* (ambiguous until one is left). Claims learned together with no
  earlier owner (one discovery answer) are unpinned too (:meth:`unpin`).
* Bounds against a flood of cards: at most ``max_cards_per_peer`` cards
  (held and rival) per owning peer, and no card whose expiry lies more than
  ``max_lifetime_ms`` ahead; both refusals are ``INVALID_CARD``.
* ``prune_expired(now_ms)`` drops remote cards past their expiry, as above.
* A signed withdrawal (:mod:`p2pnode.core.withdrawal`) ends its owner's claim at
  once (:meth:`withdraw`) and is remembered until the withdrawn card would have
  expired, so an older card of that owner met again is not taken back
  (:meth:`merge_remote` returns False for it). At most ``max_cards_per_peer``
  withdrawals are remembered per owner and ``max_cards`` in all (the ones
  expiring soonest are forgotten first).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

from p2pnode.core.card import AgentCard, Origin
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.identity import Identity, PeerId
from p2pnode.core.wire import WireLimits, pack, unpack_untrusted
from p2pnode.core.withdrawal import Withdrawal

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
        #: The ids of the remote cards (held and rival) of each owning peer.
        self._ids_of: dict[PeerId, set[str]] = {}
        #: Owners whose link closed for good: their claims are not live (see is_live).
        self._unreachable: set[PeerId] = set()
        #: Contested ids whose holder is not preferred over the live rivals (resolve).
        self._unpinned: set[str] = set()
        self._by_capability: dict[str, set[str]] = {}
        #: Withdrawals remembered, by owner and agent id (see :meth:`withdraw`).
        self._withdrawn: dict[PeerId, dict[str, Withdrawal]] = {}
        self._withdrawals = 0
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
        if self.is_withdrawn(card, now_ms):
            return False  # its owner withdrew it: an old copy, not news
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
                self._end_claim(card.id, existing.peer_id, now_ms)
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
        if self.cards_of(peer) >= self._max_per_peer:
            self.prune_expired(now_ms)
            if self.cards_of(peer) >= self._max_per_peer:
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

    def is_pinned(self, agent_id: str) -> bool:
        """True unless the holder of contested ``agent_id`` holds it unpinned (see
        :meth:`resolve`)."""
        return agent_id not in self._unpinned

    def unpin(self, agent_id: str) -> None:
        """Hold contested ``agent_id`` unpinned: its claims came together, with no earlier
        owner to prefer (one discovery answer). Nothing for an uncontested id."""
        if agent_id in self._rivals:
            self._unpinned.add(agent_id)

    def _merge_rival(self, card: AgentCard, now_ms: int) -> bool:
        rivals = self._rivals.get(card.id, {})
        held = rivals.get(card.peer_id)
        if held is not None and card.revision <= held.revision:
            return False
        if held is None:
            self._admit(card, now_ms)
        stored = dataclasses.replace(card, origin=Origin.REMOTE, last_seen_at=now_ms)
        self._rivals.setdefault(card.id, {})[card.peer_id] = stored
        self._count(stored)
        self._index(stored)
        if held is not None:
            self._unindex(card.id, held.provider_keys() - stored.provider_keys())
        return True

    def _index(self, card: AgentCard) -> None:
        for cap in card.provider_keys():
            self._by_capability.setdefault(cap, set()).add(card.id)

    def _unindex(self, agent_id: str, caps: Iterable[str]) -> None:
        """Take ``agent_id`` out of the index of each of ``caps`` that none of its
        remaining claims (held or rival) offers."""
        claims = self.owners(agent_id)
        for cap in caps:
            ids = self._by_capability.get(cap)
            if ids is None or any(cap in c.provider_keys() for c in claims):
                continue
            ids.discard(agent_id)
            if not ids:
                del self._by_capability[cap]

    def _count(self, card: AgentCard) -> None:
        if card.origin is Origin.REMOTE:
            self._ids_of.setdefault(card.peer_id, set()).add(card.id)

    def _uncount(self, card: AgentCard) -> None:
        if card.origin is not Origin.REMOTE:
            return
        ids = self._ids_of.get(card.peer_id)
        if ids is None:
            return
        ids.discard(card.id)
        if not ids:
            del self._ids_of[card.peer_id]

    def _drop(self, agent_id: str) -> None:
        """Remove the held card of ``agent_id``, keeping its rivals."""
        card = self._cards.pop(agent_id, None)
        if card is None:
            return
        self._uncount(card)
        self._unindex(agent_id, card.provider_keys())

    def _end_claim(self, agent_id: str, peer_id: PeerId, now_ms: int | None) -> bool:
        """Remove ``peer_id``'s claim on ``agent_id`` (held or rival); a rival takes the
        place of a holder (:meth:`_promote`). False when it had none."""
        rivals = self._rivals.get(agent_id)
        if rivals is not None and peer_id in rivals:
            rival = rivals.pop(peer_id)
            self._uncount(rival)
            self._unindex(agent_id, rival.provider_keys())
        else:
            held = self._cards.get(agent_id)
            if held is None or held.peer_id != peer_id:
                return False
            self._drop(agent_id)
            self._promote(agent_id, now_ms)
        if not self._rivals.get(agent_id):
            self._rivals.pop(agent_id, None)
            self._unpinned.discard(agent_id)
        return True

    def _promote(self, agent_id: str, now_ms: int | None) -> None:
        """A rival holds ``agent_id`` after its holder's claim ended: the first learned
        live one (any, when none is live), pinned only when no other live rival is left."""
        rivals = self._rivals.get(agent_id)
        if not rivals:
            return
        live = [c for c in rivals.values() if self.is_live(c, now_ms)]
        heir = live[0] if live else next(iter(rivals.values()))
        del rivals[heir.peer_id]
        self._uncount(heir)
        self._put(heir)
        if len(live) > 1:
            self._unpinned.add(agent_id)
        else:
            self._unpinned.discard(agent_id)

    def unregister(self, agent_id: str) -> bool:
        """Remove a card (and its rivals); False when there was none."""
        rivals = self._rivals.pop(agent_id, {}).values()
        for rival in rivals:
            self._uncount(rival)
            self._unindex(agent_id, rival.provider_keys())
        self._unpinned.discard(agent_id)
        if agent_id not in self._cards:
            return False
        self._drop(agent_id)
        return True

    def withdraw_missing(self, peer_id: PeerId, listed: set[str], now_ms: int) -> list[str]:
        """End the claims of ``peer_id`` on contested ids that its HELLO (its whole list of
        agents, ``listed``) leaves out: their agents were withdrawn. Returns those ids."""
        ids = self._ids_of.get(peer_id, ())
        gone = [i for i in ids if i not in listed and (i in self._rivals)]
        for agent_id in gone:
            self._end_claim(agent_id, peer_id, now_ms)
        return gone

    def withdraw(self, withdrawal: Withdrawal, now_ms: int) -> bool:
        """Apply a verified ``withdrawal``: end its owner's claim on the id when the card
        held is older, and remember it until it expires. Returns True when a card was
        dropped. An expired withdrawal changes nothing."""
        if withdrawal.is_expired(now_ms):
            return False
        known = self._withdrawn.get(withdrawal.peer_id, {}).get(withdrawal.agent_id)
        if known is None:
            self._bound_withdrawals(self._withdrawn.get(withdrawal.peer_id, {}), now_ms)
            self._withdrawals += 1
        if known is None or known.revision < withdrawal.revision:
            self._withdrawn.setdefault(withdrawal.peer_id, {})[withdrawal.agent_id] = withdrawal
        card = self.find_owned(withdrawal.agent_id, withdrawal.peer_id)
        if card is None or card.origin is Origin.LOCAL or not withdrawal.ends(card):
            return False
        return self._end_claim(withdrawal.agent_id, withdrawal.peer_id, now_ms)

    def _bound_withdrawals(self, mine: dict[str, Withdrawal], now_ms: int) -> None:
        """Make room for one more withdrawal of an owner (``mine``): expired ones go
        first, then the soonest-expiring one of that owner (over its quota) or of the
        owner with the most (over the total)."""
        if len(mine) < self._max_per_peer and self._withdrawals < self._max_cards:
            return
        self._expire_withdrawals(now_ms)
        pool = mine
        if len(mine) < self._max_per_peer:
            if self._withdrawals < self._max_cards:
                return
            pool = max(self._withdrawn.values(), key=len)
        del pool[min(pool, key=lambda i: pool[i].expires_at)]
        self._withdrawals -= 1

    def _expire_withdrawals(self, now_ms: int) -> None:
        for owner, kept in list(self._withdrawn.items()):
            for agent_id in [i for i, w in kept.items() if w.is_expired(now_ms)]:
                del kept[agent_id]
                self._withdrawals -= 1
            if not kept:
                del self._withdrawn[owner]

    def is_withdrawn(self, card: AgentCard, now_ms: int) -> bool:
        """True when a withdrawal remembered here ends ``card`` (see :meth:`withdraw`)."""
        known = self._withdrawn.get(card.peer_id, {}).get(card.id)
        return known is not None and not known.is_expired(now_ms) and known.ends(card)

    def withdrawn_count(self) -> int:
        """Withdrawals remembered (bounded as the module docstring says)."""
        return self._withdrawals

    def note_unreachable(self, peer_id: PeerId) -> None:
        """``peer_id`` cannot be reached (the link to it closed and redials failed): its
        claims are not live until :meth:`note_reachable`. Kept only for a peer with
        cards here, so the set is bounded by the registry."""
        if peer_id in self._ids_of:
            self._unreachable.add(peer_id)

    def note_reachable(self, peer_id: PeerId) -> None:
        """A channel to ``peer_id`` opened: its claims are live again."""
        self._unreachable.discard(peer_id)

    def is_live(self, card: AgentCard, now_ms: int | None) -> bool:
        """A claim counts: not expired at ``now_ms`` (None: not checked), and its owner
        not known unreachable."""
        if now_ms is not None and card.is_expired(now_ms):
            return False
        return card.origin is Origin.LOCAL or card.peer_id not in self._unreachable

    def prune_expired(self, now_ms: int) -> list[str]:
        """Drop remote cards whose expiry has passed; returns the ids of the held ones.
        A rival takes the place of an expired holder (:meth:`_promote`)."""
        for agent_id in list(self._rivals):
            for peer, rival in list(self._rivals[agent_id].items()):
                if rival.is_expired(now_ms):
                    self._end_claim(agent_id, peer, now_ms)
        expired = [
            c for c in self._cards.values() if c.origin is Origin.REMOTE and c.is_expired(now_ms)
        ]
        for card in expired:
            self._end_claim(card.id, card.peer_id, now_ms)
        self._unreachable &= self._ids_of.keys()  # only owners of cards are remembered
        self._expire_withdrawals(now_ms)
        return [c.id for c in expired]

    def _put(self, card: AgentCard) -> None:
        self._drop(card.id)
        self._cards[card.id] = card
        self._count(card)
        self._index(card)

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

    def owned_by(self, peer_id: PeerId) -> list[AgentCard]:
        """The remote cards (held and rival) owned by ``peer_id``."""
        cards = (self.find_owned(i, peer_id) for i in self._ids_of.get(peer_id, ()))
        return [c for c in cards if c is not None]

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

    def resolve(
        self,
        agent_id: str,
        now_ms: int | None,
        *,
        prefer: PeerId | None = None,
        authority_key: bytes | None = None,
    ) -> list[AgentCard]:
        """The card a bare ``agent_id`` goes to, as a list: empty when no live owner is
        known, one card, or every live owner when the id is ambiguous.

        A local agent always; else among the live owners (:meth:`is_live`), those
        ``authority_key`` endorsed if any; of these the only one, else ``prefer`` (the
        owner this node's agents named), else the pinned holder; else all of them.
        """
        held = self._cards.get(agent_id)
        if held is not None and held.origin is Origin.LOCAL:
            return [held]
        live = [c for c in self.owners(agent_id) if self.is_live(c, now_ms)]
        if len(live) > 1 and authority_key is not None:
            endorsed = [c for c in live if c.endorsed_by(authority_key)]
            live = endorsed or live
        if len(live) <= 1:
            return live
        for card in live:
            if card.peer_id == prefer:
                return [card]
        if live[0] is held and agent_id not in self._unpinned:
            return [held]
        return live

    def rival_count(self) -> int:
        """Cards kept as rivals (another owner holds their id)."""
        return sum(len(r) for r in self._rivals.values())

    def cards_of(self, peer_id: PeerId) -> int:
        """Remote cards (held and rival) owned by ``peer_id``: what counts against its quota."""
        return len(self._ids_of.get(peer_id, ()))

    def find_by_capability(self, capability_id: str) -> list[AgentCard]:
        """Cards offering ``capability_id``, local ones first, then by agent id: of a
        contested id, every owner's card that offers it (held first), so an owner
        restarted under a new key is found while its old self's card lasts."""
        cards: list[AgentCard] = []
        for agent_id in self._by_capability.get(capability_id, ()):
            if agent_id not in self._rivals:
                cards.append(self._cards[agent_id])  # the only claim: it offers it
            else:
                offers = (c for c in self.owners(agent_id) if capability_id in c.provider_keys())
                cards.extend(offers)
        return sorted(cards, key=_local_first)

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
