"""Targets the router does not know yet: ask discovery, admit the cards it finds
(through the node's card intake, as any card), and decide again."""

from __future__ import annotations

from collections.abc import Callable

from p2pnode.core.card import AgentCard
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.node.cardintake import CardIntake
from p2pnode.node.discovery import Discovery
from p2pnode.node.router import Router, capability_refusal, split_address


async def find_agent(
    agent_id: str, router: Router, discovery: Discovery, cards: CardIntake, now_ms: int
) -> AgentCard:
    """The card ``agent_id`` (or ``agent@peer``) routes to, after asking discovery.
    Raises LocalError(AGENT_NOT_FOUND)."""
    cards.learn_all(await discovery.find_agent(split_address(agent_id)[0]))
    card = router.known_target(agent_id, now_ms)
    if card is None:
        raise LocalError(ErrorCode.AGENT_NOT_FOUND, f"no agent {agent_id!r}", agent_id=agent_id)
    return card


async def find_provider(
    source: AgentCard,
    capability: str,
    router: Router,
    discovery: Discovery,
    cards: CardIntake,
    clock_ms: Callable[[], int],
) -> AgentCard:
    """The agent ``source`` may send to for ``capability``, asking discovery when none is
    known. Raises LocalError: CAPABILITY_NOT_FOUND, or policy's refusal of every
    provider (TIER_VIOLATION, SANDBOX_VIOLATION, ...)."""
    candidates = router.candidates(source, capability, clock_ms())
    if not candidates:
        for found in await discovery.find_providers(capability):
            cards.learn(found)
        candidates = router.candidates(source, capability, clock_ms())
    if not candidates:
        refused = router.refused(source, capability, clock_ms())
        if refused:
            # Offered, but policy refuses every provider: say so, not "not found".
            raise capability_refusal(source, capability, refused)
        raise LocalError(
            ErrorCode.CAPABILITY_NOT_FOUND,
            f"no reachable agent offers {capability!r}",
            capability=capability,
        )
    return candidates[0]


__all__ = ["find_agent", "find_provider"]
