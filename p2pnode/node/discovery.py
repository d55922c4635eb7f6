"""How a node finds agents it has not met: the DHT, behind a small protocol.

The node asks for providers of a capability and for agents by id, publishes
its own cards and their withdrawals, and bootstraps; :class:`DhtDiscovery` answers from the
Kademlia DHT, :class:`NoDiscovery` for nodes that only know peers they met.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from p2pnode.core.card import AgentCard
from p2pnode.core.withdrawal import Withdrawal
from p2pnode.dht.node import DhtNode
from p2pnode.transport.net import Address


class Discovery(Protocol):
    """What the node needs from the DHT."""

    async def bootstrap(self, addresses: list[Address]) -> None: ...

    async def provide(self, card: AgentCard) -> None: ...

    async def find_providers(self, capability: str) -> list[AgentCard]: ...

    async def find_agent(self, agent_id: str) -> list[AgentCard]: ...

    async def withdraw(self, card: AgentCard, withdrawal: Withdrawal) -> None:
        """Replace what was published of ``card`` by its ``withdrawal``."""
        ...

    def watch_withdrawals(self, seen: Callable[[Withdrawal], object]) -> None:
        """Call ``seen`` with each verified withdrawal a lookup meets (another owner's
        agent that left), so the node drops the card it may hold."""
        ...

    def statistics(self) -> dict[str, Any]:
        """Counters for ``status`` (empty when there is nothing to count)."""
        ...


class NoDiscovery:
    """Discovery for a node without a DHT: only peers met directly are known."""

    async def bootstrap(self, addresses: list[Address]) -> None:
        return None

    async def provide(self, card: AgentCard) -> None:
        return None

    async def find_providers(self, capability: str) -> list[AgentCard]:
        return []

    async def find_agent(self, agent_id: str) -> list[AgentCard]:
        return []

    async def withdraw(self, card: AgentCard, withdrawal: Withdrawal) -> None:
        return None

    def watch_withdrawals(self, seen: Callable[[Withdrawal], object]) -> None:
        return None

    def statistics(self) -> dict[str, int]:
        return {}


class MemoryDiscovery:
    """A directory shared by the nodes of one process (tests, benchmarks): what their
    agents ``provide`` is found by capability or id, with no network at all."""

    def __init__(self) -> None:
        self.cards: dict[str, AgentCard] = {}

    async def bootstrap(self, addresses: list[Address]) -> None:
        return None

    async def provide(self, card: AgentCard) -> None:
        self.cards[card.id] = card

    async def find_providers(self, capability: str) -> list[AgentCard]:
        return [c for c in self.cards.values() if c.has_capability(capability)]

    async def find_agent(self, agent_id: str) -> list[AgentCard]:
        return [c for c in self.cards.values() if c.id == agent_id]

    async def withdraw(self, card: AgentCard, withdrawal: Withdrawal) -> None:
        held = self.cards.get(card.id)
        if held is not None and withdrawal.ends(held):
            del self.cards[card.id]

    def watch_withdrawals(self, seen: Callable[[Withdrawal], object]) -> None:
        return None  # nothing stale is kept here: a withdrawn card is gone

    def statistics(self) -> dict[str, int]:
        return {"cards": len(self.cards)}


class DhtDiscovery:
    """The node's view of the DHT (see :class:`p2pnode.node.discovery.Discovery`)."""

    def __init__(self, dht: DhtNode) -> None:
        self.dht = dht

    async def bootstrap(self, addresses: list[Address]) -> None:
        if addresses:
            await self.dht.bootstrap(addresses)

    async def provide(self, card: AgentCard) -> None:
        await self.dht.provide(card)

    async def find_providers(self, capability: str) -> list[AgentCard]:
        return await self.dht.find_providers(capability)

    async def find_agent(self, agent_id: str) -> list[AgentCard]:
        return await self.dht.find_agent(agent_id)

    async def withdraw(self, card: AgentCard, withdrawal: Withdrawal) -> None:
        if self.dht.is_running:  # a node closed after its DHT has nobody left to tell
            await self.dht.withdraw(card, withdrawal)

    def watch_withdrawals(self, seen: Callable[[Withdrawal], object]) -> None:
        self.dht.on_withdrawal = seen

    def statistics(self) -> dict[str, Any]:
        """The DHT's mode, its counters (docs/protocol/dht.md), its routing table size, the contacts
        of each bucket (farthest from our id first) and its records."""
        stats = dataclasses.asdict(self.dht.statistics())
        table = self.dht.table
        return {
            "mode": self.dht.mode.value,  # server, or client (reachability.md §5)
            "contacts": len(table),
            "buckets": table.bucket_fill(),
            "records": len(self.dht.records),
            **stats,
        }
