"""What keeps the A2A gateway's memory and work bounded: the task store keeps the last
MAX_TASKS tasks, and one discovery of the swarm's agents serves every request for
``refresh`` seconds (a clock injected, no sleeps)."""

from __future__ import annotations

import asyncio
from typing import cast

from a2a.server.context import ServerCallContext
from a2a.types import ListTasksRequest, Task, TaskState, TaskStatus

from p2pnode import Identity
from p2pnode.bridges.a2a.gateway import BoundedTaskStore, NodeSwarm
from p2pnode.core.card import AgentCard, Capability
from p2pnode.hosting.aio import AioNode


def test_the_task_store_keeps_the_last_tasks_saved() -> None:
    async def check() -> None:
        store, context = BoundedTaskStore(limit=3), ServerCallContext()
        for i in range(5):
            status = TaskStatus(state=TaskState.TASK_STATE_COMPLETED)
            await store.save(Task(id=f"t{i}", context_id="c", status=status), context)
        await store.save(Task(id="t2", context_id="c"), context)  # saved again: newest
        kept = {t.id for t in (await store.list(ListTasksRequest(), context)).tasks}
        assert kept == {"t2", "t3", "t4"}
        assert await store.get("t0", context) is None
        await store.delete("t3", context)
        await store.save(Task(id="t5", context_id="c"), context)
        kept = {t.id for t in (await store.list(ListTasksRequest(), context)).tasks}
        assert kept == {"t2", "t4", "t5"}

    asyncio.run(check())


def _card(agent_id: str, *capabilities: str) -> AgentCard:
    return AgentCard(
        id=agent_id,
        name=agent_id,
        version="1",
        public_key=Identity.generate().public_key,
        capabilities=tuple(Capability(c, c) for c in capabilities),
    )


class _Registry:
    def __init__(self, cards: list[AgentCard]) -> None:
        self.cards = cards

    def list_local(self) -> list[AgentCard]:
        return [c for c in self.cards if c.id == "gateway"]

    def list_remote(self) -> list[AgentCard]:
        return [c for c in self.cards if c.id != "gateway"]


class _Node:
    """What NodeSwarm reads of an AioNode: the registry, and find() as a viewer."""

    def __init__(self, cards: list[AgentCard], hidden: set[str]) -> None:
        self.registry = _Registry(cards)
        self.hidden = hidden
        self.finds: list[tuple[str, str | None]] = []

    async def find(self, capability: str, viewer: str | None = None) -> list[AgentCard]:
        self.finds.append((capability, viewer))
        return [
            c
            for c in self.registry.cards
            if c.id not in self.hidden and any(k.id == capability for k in c.capabilities)
        ]


def test_one_discovery_serves_for_refresh_seconds() -> None:
    cards = [_card("gateway"), _card("b", "x", "y"), _card("a", "y"), _card("secret", "z")]
    node = _Node(cards, hidden={"secret"})
    now = [100.0]
    swarm = NodeSwarm(cast(AioNode, node), "gateway", refresh=5.0, clock=lambda: now[0])

    async def check() -> None:
        found = await asyncio.gather(*(swarm.agents() for _ in range(10)))
        # Sorted by id, the viewer's own card and what find() hides left out.
        assert all([c.id for c in f] == ["a", "b"] for f in found)
        assert sorted(node.finds) == [("x", "gateway"), ("y", "gateway"), ("z", "gateway")]
        now[0] += 4.9
        await swarm.agents()
        assert len(node.finds) == 3  # still fresh
        node.registry.cards.append(_card("c", "w"))
        now[0] += 0.1
        assert [c.id for c in await swarm.agents()] == ["a", "b", "c"]
        assert len(node.finds) == 7

    asyncio.run(check())
