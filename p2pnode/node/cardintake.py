"""Admitting the cards peers present (in HELLOs and DHT reads): policy admission, then
the registry's merge rules, with one warning per agent id that two owners claim.

A HELLO lists all of its sender's agents: a claim of that peer on a contested id
that its HELLO leaves out was withdrawn, and ends (the rival's ambiguity with it).
Cards of one discovery answer arrive together: when two owners of an id come in
one answer and no owner was known before, neither was seen first, and the id is
held unpinned (docs/protocol/node.md "Agent ids and owners")."""

from __future__ import annotations

import logging
from collections.abc import Callable

from p2pnode.core.card import AgentCard
from p2pnode.core.errors import ErrorCode, RemoteError
from p2pnode.core.identity import PeerId
from p2pnode.core.registry import Registry
from p2pnode.core.withdrawal import Withdrawal
from p2pnode.node.observability import Observability
from p2pnode.node.policy import Policy
from p2pnode.node.router import BoundedSet

logger = logging.getLogger("p2pnode.node")

#: Agent-id collisions remembered (to warn once each); a bound, not a limit.
MAX_COLLISIONS = 4096


class CardIntake:
    """Admits remote cards into one node's registry and reports the refused ones."""

    def __init__(
        self,
        local_peer_id: PeerId,
        registry: Registry,
        policy: Policy,
        events: Observability,
        clock_ms: Callable[[], int],
        *,
        on_fresh: Callable[[PeerId], None] | None = None,
    ) -> None:
        """``on_fresh`` is told the owner of each card merged as new or newer: a fresh
        card shows its peer is up (node/links.py resets that peer's dial budget)."""
        self._local_peer_id = local_peer_id
        self._on_fresh = on_fresh
        self._registry = registry
        self._policy = policy
        self._events = events
        self._clock_ms = clock_ms
        self._collisions = BoundedSet(MAX_COLLISIONS)

    def learn(self, card: AgentCard, peer: str | None = None) -> bool:
        """Admit a remote card (policy, then the registry's merge rules); False if refused."""
        if card.peer_id == self._local_peer_id:
            # One of this node's own cards, read back from the DHT (or from a channel to
            # itself): nothing to learn, and no one to warn about.
            return False
        verdict = self._policy.admit_card(card)
        if not verdict.allowed:
            self._events.security(
                verdict.code or ErrorCode.INVALID_ENDORSEMENT, verdict.reason, peer, None
            )
            return False
        try:
            fresh = self._registry.merge_remote(card, self._clock_ms())
        except RemoteError as exc:
            if "holder" in exc.details:
                self._note_collision(card, exc, peer)
            else:
                self._events.security(exc.code, exc.message, peer, None)
            return False
        if fresh and self._on_fresh is not None:
            self._on_fresh(card.peer_id)
        owners = self._registry.owners(card.id)
        if len(owners) > 1 and not (
            owners[0].peer_id == card.peer_id and self._registry.is_pinned(card.id)
        ):
            # A rival claim (the pinned holder repeating its own is none): the id keeps
            # its holder, but an operator must hear that someone else claims it.
            self._note_collision(card, self._rivalry(card, owners), peer)
        return True

    def _rivalry(self, card: AgentCard, owners: list[AgentCard]) -> RemoteError:
        """What the security event about ``card``'s claim on a contested id says."""
        others = ", ".join(str(c.peer_id) for c in owners if c.peer_id != card.peer_id)
        holder = owners[0]
        if self._registry.is_pinned(card.id):
            outcome = (
                f"the bare id stays with peer {holder.peer_id}, met first, while it is "
                f"live; the claimant is reached as {card.id}@{card.peer_id}"
            )
        else:
            outcome = "each owner is reached as agent@peer; the bare id may be ambiguous"
        return RemoteError(
            ErrorCode.INVALID_CARD,
            f"agent id {card.id!r} of peer {card.peer_id} is also claimed by peer "
            f"{others}: {outcome}",
        )

    def learn_all(self, cards: list[AgentCard]) -> None:
        """Admit the cards of one discovery answer. An id with no live owner before it
        and several after it is held unpinned: nothing says which came first."""
        now = self._clock_ms()
        fresh = {c.id for c in cards if not self._registry.owners(c.id, now)}
        for card in cards:
            self.learn(card)
        for agent_id in fresh:
            if len(self._registry.owners(agent_id, now)) > 1:
                self._registry.unpin(agent_id)

    def learn_from(self, peer_id: PeerId, cards: tuple[AgentCard, ...]) -> None:
        """Admit the cards of a HELLO from ``peer_id``: only its own agents' cards."""
        for card in cards:
            if card.peer_id != peer_id:
                self._events.security(
                    ErrorCode.SENDER_MISMATCH,
                    f"peer {peer_id} sent the card of {card.id} owned by {card.peer_id}",
                    str(peer_id),
                    None,
                )
                continue
            self.learn(card, str(peer_id))
        listed = {c.id for c in cards if c.peer_id == peer_id}
        for agent_id in self._registry.withdraw_missing(peer_id, listed, self._clock_ms()):
            logger.info("peer %s withdrew its claim on agent id %r", peer_id, agent_id)

    def withdraw_from(self, peer_id: PeerId, withdrawals: tuple[Withdrawal, ...]) -> None:
        """Apply the withdrawals of a HELLO from ``peer_id``: only its own agents'. One
        INFO line names the agents that left."""
        gone = []
        for withdrawal in withdrawals:
            if withdrawal.peer_id != peer_id:
                self._events.security(
                    ErrorCode.SENDER_MISMATCH,
                    f"peer {peer_id} sent the withdrawal of {withdrawal.agent_id} owned by "
                    f"{withdrawal.peer_id}",
                    str(peer_id),
                    None,
                )
                continue
            if self.withdraw(withdrawal):
                gone.append(withdrawal.agent_id)
        if gone:
            logger.info("peer %s withdrew %s", peer_id, ", ".join(gone))

    def withdraw(self, withdrawal: Withdrawal) -> bool:
        """Apply a verified withdrawal (from a HELLO or a DHT read): its owner's card of
        the agent leaves the registry at once. True when a card was dropped."""
        if withdrawal.peer_id == self._local_peer_id:
            return False  # our own, read back from the DHT
        dropped = self._registry.withdraw(withdrawal, self._clock_ms())
        if dropped:
            logger.debug("agent %s@%s withdrawn", withdrawal.agent_id, withdrawal.peer_id)
        return dropped

    def _note_collision(self, card: AgentCard, exc: RemoteError, peer: str | None) -> None:
        """An agent id claimed by two owners: one warning (a security event naming both)
        per id and claiming owner. Every HELLO and DHT read repeats the claim, and an
        operator needs to hear it once, not on each of them."""
        if self._collisions.add(f"{card.id}\0{card.peer_id}"):
            self._events.security(exc.code, exc.message, peer, None)
        else:
            logger.debug("%s", exc.message)


__all__ = ["MAX_COLLISIONS", "CardIntake"]
