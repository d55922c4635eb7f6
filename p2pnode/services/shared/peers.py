"""Which replicas a shared document is gossiped with (see :mod:`p2pnode.services.shared.service`).

A remote agent offering ``crdt:<doc>`` whose card has not expired is a gossip
peer of the document when policy lets a local member of it and that agent
exchange ``stream-data`` both ways (and discover each other); one agent per
remote node, so ``fanout`` counts distinct replicas. The replicas policy
forbids are listed with the first member's refusal, and a document left
without any peer because of them gets a convergence warning.

A concept of its own, apart from :mod:`~p2pnode.services.shared.docops` (what a
document's names, gossip payloads and JSON operations look like: a sans-IO protocol
module other layers import) and from the driver in
:mod:`~p2pnode.services.shared.service`: this is the rule choosing a document's gossip
partners from the registry under policy, read against gossip.md §9 on its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import trio

from p2pnode.core.card import AgentCard, Origin
from p2pnode.core.envelope import MessageType
from p2pnode.core.errors import ErrorCode
from p2pnode.node.service import PolicyChecks, ServiceHost
from p2pnode.services.shared.docops import CAPABILITY_PREFIX


def check_mutual(policy: PolicyChecks, a: AgentCard, b: AgentCard) -> None:
    """Raise the policy's LocalError unless ``a`` and ``b`` may exchange ``stream-data``
    both ways."""
    for source, target in ((a, b), (b, a)):
        verdict = policy.check_message(source, target, MessageType.STREAM_DATA, None)
        if not verdict.allowed:
            raise verdict.to_local_error()


def mutual(policy: PolicyChecks, a: AgentCard, b: AgentCard) -> bool:
    """May ``a`` discover ``b``, and both exchange ``stream-data`` both ways?"""
    return (
        policy.can_discover(a, b)
        and policy.check_message(a, b, MessageType.STREAM_DATA, None).allowed
        and policy.check_message(b, a, MessageType.STREAM_DATA, None).allowed
    )


def eligible_peers(
    host: ServiceHost, doc: str, members: Iterable[str], suspended: dict[str, float]
) -> dict[str, str]:
    """Remote agent -> local member, at most one agent per remote node; agents
    ``suspended`` until a later time (trio clock) are left out."""
    now_ms, now = host.now_ms(), trio.current_time()
    cards = [host.local_agent(m) for m in sorted(members)]
    best: dict[Any, tuple[str, str]] = {}
    for card in host.registry.find_by_capability(CAPABILITY_PREFIX + doc):
        if card.origin is Origin.LOCAL or card.is_expired(now_ms):
            continue
        if suspended.get(card.id, -1.0) > now:
            continue
        for member in cards:
            if mutual(host.policy, member, card):
                current = best.get(card.peer_id)
                if current is None or card.id < current[0]:
                    best[card.peer_id] = (card.id, member.id)
                break
    return dict(best.values())


def refused_replicas(host: ServiceHost, doc: str, members: Iterable[str]) -> list[dict[str, str]]:
    """The replicas of ``doc`` that policy forbids every one of ``members`` to gossip with
    (see :meth:`p2pnode.services.shared.service.SharedState.refused`)."""
    now_ms = host.now_ms()
    cards = [host.local_agent(m) for m in sorted(members)]
    out = []
    for card in host.registry.find_by_capability(CAPABILITY_PREFIX + doc):
        if card.origin is Origin.LOCAL or card.is_expired(now_ms) or not cards:
            continue
        if any(mutual(host.policy, member, card) for member in cards):
            continue
        code, reason = _refusal(host.policy, cards[0], card)
        out.append({"agent": card.id, "peer": str(card.peer_id), "code": code, "reason": reason})
    return out


def convergence_warning(doc: str, refused: list[dict[str, str]]) -> str | None:
    """The warning for ``doc`` left without a gossip peer by the ``refused`` replicas
    (None when there are none)."""
    if not refused:
        return None
    who = ", ".join(f"{r['agent']} ({r['code']})" for r in refused)
    return f"{doc!r} cannot converge: policy forbids gossip with every other replica of it ({who})"


def _refusal(policy: PolicyChecks, member: AgentCard, card: AgentCard) -> tuple[str, str]:
    if not policy.can_discover(member, card):
        return str(ErrorCode.SANDBOX_VIOLATION), (
            f"the sandbox rules of {member.id!r} hide agent {card.id!r}"
        )
    for source, target in ((member, card), (card, member)):
        verdict = policy.check_message(source, target, MessageType.STREAM_DATA, None)
        if not verdict.allowed:
            return str(verdict.code), verdict.reason
    return str(ErrorCode.INTERNAL), "no reason"  # not reached: mutual() said no


__all__ = [
    "check_mutual",
    "convergence_warning",
    "eligible_peers",
    "mutual",
    "refused_replicas",
]
