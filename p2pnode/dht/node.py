"""The DHT node with the Agent Card API: provide, find_card, find_providers, find_agent.

Theory of operation (docs/protocol/dht.md §4): :class:`DhtNode` is a
:class:`~p2pnode.dht.peer.DhtPeer` that publishes an agent's signed card under
``p2pnode:card:<peer id>/<agent id>``, one provider record per capability
under ``p2pnode:cap:<capability>`` and one under ``p2pnode:cap:agent:<agent
id>`` (lookup by id), all signed by the agent's key
(:func:`~p2pnode.dht.publish.card_makers`) and kept republished by the
peer's :class:`~p2pnode.dht.publish.Publisher`. Readers accept a provider
only when the publisher's own card for that agent, fetched and verified,
lists the capability. Each card or provider record read is one input behind
the peer's failure boundary: one that fails to decode is skipped alone.

An owner withdraws an agent (:meth:`DhtNode.withdraw`, §4.5) by publishing, at
the card's revision + 1, the signed withdrawal under the card key and provider
records without addresses under its provider keys: the merge keeps the higher
revision, so the withdrawal replaces the card wherever it is stored, and
readers skip the agent (and tell :attr:`DhtNode.on_withdrawal`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from p2pnode.core.card import AgentCard
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.identity import PeerId
from p2pnode.core.withdrawal import Withdrawal, is_withdrawal_untrusted
from p2pnode.dht.config import DhtConfig, DhtStatistics
from p2pnode.dht.peer import DhtPeer
from p2pnode.dht.publish import card_makers
from p2pnode.dht.records import (
    MAX_TTL_MS,
    MAX_VALUE_BYTES,
    ProviderInfo,
    RecordKind,
    SignedRecord,
    agent_capability,
    capability_key,
    card_key,
    encode_value,
)

log = logging.getLogger("p2pnode.dht")


class DhtNode(DhtPeer):
    """A Kademlia node that publishes and finds Agent Cards.

    Use as ``async with DhtNode(net, identity=..., ...) as node:``.
    """

    #: Told each verified withdrawal a read meets (the node drops the card it holds).
    on_withdrawal: Callable[[Withdrawal], object] | None = None

    async def provide(self, card: AgentCard) -> int:
        """Publish ``card`` and a provider record for each of its capabilities.

        Keeps them republished until the node closes. Returns the number of
        stores accepted. Raises LocalError if the card is not ours or too large.
        """
        if self.identity is None or card.public_key != self.identity.public_key:
            raise LocalError(ErrorCode.INVALID_CARD, "can only provide our own card")
        card.verify()
        makers = card_makers(
            card,
            self.identity,
            ttl_ms=self.config.record_ttl_ms,
            wall_clock_ms=self.wall_clock_ms,
        )
        first = makers[0][2]()
        if len(first.encoded) + 8 > MAX_VALUE_BYTES:
            raise LocalError(ErrorCode.MESSAGE_TOO_LARGE, "card too large for a DHT value")
        for key, kind, make in makers:
            self.publisher.keep(key, kind, make)
        return await self.publisher.publish([(key, make) for key, _, make in makers])

    async def withdraw(self, card: AgentCard, withdrawal: Withdrawal) -> int:
        """Replace ``card``'s records by its ``withdrawal`` (§4.5), kept republished until
        it expires as the card's were. Returns the number of stores accepted.

        Raises LocalError(INVALID_CARD) unless both are this node's own.
        """
        identity = self.identity
        if identity is None or withdrawal.public_key != identity.public_key:
            raise LocalError(ErrorCode.INVALID_CARD, "can only withdraw our own card")
        if not withdrawal.ends(card):
            raise LocalError(ErrorCode.INVALID_CARD, f"the withdrawal does not end {card.id!r}")
        ttl = min(self.config.record_ttl_ms, MAX_TTL_MS)

        def maker(kind: RecordKind, key: bytes, payload: bytes) -> Callable[[], SignedRecord]:
            def make() -> SignedRecord:
                expires = min(withdrawal.expires_at, self.wall_clock_ms() + ttl)
                return SignedRecord.create(
                    identity, kind, key, withdrawal.revision, expires, payload
                )

            return make

        ck = card_key(card.peer_id, card.id)
        makers = [(ck, RecordKind.CARD, maker(RecordKind.CARD, ck, withdrawal.to_bytes()))]
        for cap in [agent_capability(card.id), *sorted(card.provider_keys())]:
            empty = ProviderInfo(cap, card.id, ()).to_bytes()
            key = capability_key(cap)
            makers.append((key, RecordKind.PROVIDER, maker(RecordKind.PROVIDER, key, empty)))
        accepted = 0

        async def put(key: bytes, make: Callable[[], SignedRecord]) -> None:
            nonlocal accepted
            record = make()
            # At once to the k closest contacts of the table, no lookup first: a put's
            # lookup waits out the hard timeout of a dead contact among the closest
            # (common under churn), longer than a leaving node has. Then the full put.
            async with trio.open_nursery() as both:
                value = encode_value([record])
                both.start_soon(self.publisher.store_at, self.table.closest(key), key, value)
                accepted += await self.publisher.put_records(key, [record])

        async with trio.open_nursery() as nursery:  # a leaving node has little time
            for key, kind, make in makers:
                self.publisher.keep(key, kind, make)
                nursery.start_soon(put, key, make)
        return accepted

    async def find_card(self, peer_id: PeerId, agent_id: str) -> AgentCard | None:
        """The newest verified card of agent ``agent_id`` owned by ``peer_id``, or None."""
        key = card_key(peer_id, agent_id)
        recs = await self.get_records(key, quorum=self.config.card_quorum)
        card = self._card_from(recs, peer_id)
        return card if card is not None and card.id == agent_id else None

    def _card_from(self, recs: list[SignedRecord], peer_id: PeerId) -> AgentCard | None:
        """The newest card of ``recs`` by ``peer_id``, unless a withdrawal among them ends it."""
        best: AgentCard | None = None
        withdrawn = -1  # the highest revision withdrawn
        for r in recs:
            if r.kind is not RecordKind.CARD or r.publisher != peer_id:
                continue
            if is_withdrawal_untrusted(r.payload):
                withdrawal = self._withdrawal_from(r)
                if withdrawal is not None:
                    withdrawn = max(withdrawn, withdrawal.revision)
                continue
            try:
                card = AgentCard.from_bytes_untrusted(r.payload)
            except Exception as exc:  # each record is one input: a bad one ends only itself
                self.stats.records_rejected += 1
                self.boundary.contain(str(peer_id), "card record", exc)
                continue
            if card.peer_id != peer_id or card.is_expired(self.wall_clock_ms()):
                continue
            if best is None or card.revision > best.revision:
                best = card
        return best if best is not None and best.revision >= withdrawn else None

    def _withdrawal_from(self, record: SignedRecord) -> Withdrawal | None:
        """The verified withdrawal a card record holds (its publisher's own, live), told
        to :attr:`on_withdrawal`; None (counted, reported) for a bad one."""
        try:
            withdrawal = Withdrawal.from_bytes_untrusted(record.payload)
        except Exception as exc:  # one record, one input (see the module docstring)
            self.stats.records_rejected += 1
            self.boundary.contain(str(record.publisher), "withdrawal record", exc)
            return None
        if withdrawal.public_key != record.public_key or withdrawal.is_expired(
            self.wall_clock_ms()
        ):
            return None
        if self.on_withdrawal is not None:
            self.on_withdrawal(withdrawal)
        return withdrawal

    async def find_providers(self, capability: str, *, limit: int = 20) -> list[AgentCard]:
        """Verified cards of agents that provide ``capability`` (at most ``limit``)."""
        # Provider sets are merged from many publishers, and a far node may hold
        # only some of them: read until the k closest answered, not to a quorum.
        recs = await self.get_records(capability_key(capability), quorum=0)
        providers: list[tuple[PeerId, str]] = []
        addressless: list[tuple[PeerId, str]] = []
        for r in recs:
            if r.kind is not RecordKind.PROVIDER:
                continue
            try:
                info = ProviderInfo.from_bytes_untrusted(r.payload)
            except Exception as exc:
                self.stats.records_rejected += 1
                self.boundary.contain(str(r.publisher), "provider record", exc)
                continue
            # No addresses: a withdrawal (§4.5) or a card with relayed endpoints only.
            found = providers if info.addresses else addressless
            if (r.publisher, info.agent_id) not in found:
                found.append((r.publisher, info.agent_id))
        cards: list[AgentCard] = []

        def take(card: AgentCard | None) -> None:
            if card is None:
                return
            if card.has_capability(capability) or capability == agent_capability(card.id):
                cards.append(card)

        async def fetch(peer_id: PeerId, agent_id: str) -> None:
            take(await self.find_card(peer_id, agent_id))

        async def read_addressless(peer_id: PeerId, agent_id: str) -> None:
            # No direct address: the withdrawal itself, or the record of a card reached
            # only through relays (a node behind a NAT, reachability.md §6). The card key
            # decides, read at every one of the k closest, so the signed withdrawal reaches
            # the node (which drops the card it may hold) even where one keeps the old card.
            recs = await self.get_records(card_key(peer_id, agent_id), quorum=0)
            card = self._card_from(recs, peer_id)
            take(card if card is not None and card.id == agent_id else None)

        async with trio.open_nursery() as nursery:
            for peer_id, agent_id in providers[:limit]:
                nursery.start_soon(fetch, peer_id, agent_id)
            for peer_id, agent_id in [p for p in addressless if p not in providers][:limit]:
                nursery.start_soon(read_addressless, peer_id, agent_id)
        cards.sort(key=lambda c: (c.peer_id.raw, c.id))
        return cards

    async def find_agent(self, agent_id: str) -> list[AgentCard]:
        """Verified cards of agents named ``agent_id`` (ids are names: several owners may
        use one; the node's registry keeps the first owner it met)."""
        return await self.find_providers(agent_capability(agent_id))


__all__ = ["DhtConfig", "DhtNode", "DhtStatistics"]
