"""Who may use a tool, resource or prompt: the :class:`Caller` as the owner's node
authenticated it, and the :class:`Access` rule checked against it (docs/protocol/tools.md
§4). Re-exported by :mod:`p2pnode.agent.tools`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from p2pnode.core.card import AgentCard


@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling, as the owner's node authenticated it: the caller's signed card,
    and the roles the swarm authority endorsed for it."""

    agent_id: str
    peer_id: str
    tier: int
    sandbox: str | None
    roles: frozenset[str] = frozenset()

    @classmethod
    def from_card(cls, card: AgentCard, authority_key: bytes | None) -> Caller:
        return cls(
            card.id,
            str(card.peer_id),
            int(card.tier),
            card.sandbox_id,
            card.endorsed_roles(authority_key),
        )


class Access:
    """Who may use a tool, resource or prompt. Each rule given must hold: the caller's
    tier is one of ``tiers``, its sandbox one of ``sandboxes``, its id one of
    ``agents``, its node one of ``peers`` (peer ids), and it holds one of ``roles``
    (endorsed by the swarm authority; an open swarm has no roles). No rule: anyone
    the node's policy lets send the owner a request."""

    __slots__ = ("agents", "peers", "roles", "sandboxes", "tiers")

    def __init__(
        self,
        *,
        tiers: Iterable[int] | None = None,
        sandboxes: Iterable[str] | None = None,
        agents: Iterable[str] | None = None,
        peers: Iterable[str] | None = None,
        roles: Iterable[str] | None = None,
    ) -> None:
        self.tiers = frozenset(int(t) for t in tiers) if tiers is not None else None
        self.sandboxes = frozenset(sandboxes) if sandboxes is not None else None
        self.agents = frozenset(agents) if agents is not None else None
        self.peers = frozenset(peers) if peers is not None else None
        self.roles = frozenset(roles) if roles is not None else None

    def refusal(self, caller: Caller | None) -> str | None:
        """Why ``caller`` may not use the entry (None: it may)."""
        if self.is_open():
            return None
        if caller is None:
            return "the caller is not authenticated"
        if self.tiers is not None and caller.tier not in self.tiers:
            return f"tier L{caller.tier} is not one of {_listed(f'L{t}' for t in self.tiers)}"
        if self.sandboxes is not None and caller.sandbox not in self.sandboxes:
            return f"sandbox {caller.sandbox!r} is not one of {_listed(self.sandboxes)}"
        if self.agents is not None and caller.agent_id not in self.agents:
            return f"agent {caller.agent_id!r} is not allowed"
        if self.peers is not None and caller.peer_id not in self.peers:
            return f"peer {caller.peer_id} is not allowed"
        if self.roles is not None and not caller.roles & self.roles:
            return f"no endorsed role among {_listed(self.roles)}"
        return None

    def is_open(self) -> bool:
        # Asked on every call of a tool: plain tests, no generator.
        return (
            self.tiers is None
            and self.sandboxes is None
            and self.agents is None
            and self.peers is None
            and self.roles is None
        )

    def __repr__(self) -> str:
        rules = ", ".join(f"{k}={sorted(v)}" for k in self.__slots__ if (v := getattr(self, k)))
        return f"Access({rules})"


def _listed(items: Iterable[str]) -> str:
    return ", ".join(sorted(items))


ANYONE = Access()


__all__ = ["ANYONE", "Access", "Caller"]
