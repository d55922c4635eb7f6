"""The broadcast tree on real nodes in the simulator (trio's virtual clock): updates
reach every node by push, not by anti-entropy, even when they are made while the
tree's links are still being requested (docs/protocol/gossip.md §5, rule 1)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from p2pnode.crdt.ops import CounterAdd
from tests.sim import FAST_SHARED, Member, open_swarm, wait_until

DOC = "plan"


def have(members: list[Member], origin: str, seq: int) -> bool:
    return all(m.shared.replica.has_applied(DOC, origin, seq) for m in members)


def unpushed(member: Member) -> int:
    """Deltas the member learnt from anti-entropy whose push never came (a push that
    comes after the batch that overtook it counts: the tree did reach the node)."""
    stats = member.shared.statistics(DOC)
    return stats.new_by_batch - stats.pushes_after_batch


@pytest.mark.parametrize("seed", [1, 2])
async def test_the_first_update_made_as_peers_meet_reaches_every_node_by_push(
    autojump_clock: Any, seed: int
) -> None:
    # A writer updates as soon as the nodes found each other: most link requests are
    # still on their way (their channels open first) when the update spreads. The peers
    # are named by agent id and the ring of requests is by replica id.
    async with open_swarm(seed=seed, discovery=True, shared=FAST_SHARED) as sw:
        members = await sw.add_subscribed(12, DOC)
        for member in members:
            await member.shared.refresh()
        writer = members[0]
        delta = await writer.shared.update(writer.agent, DOC, CounterAdd(("n",), 1))
        await wait_until(lambda: have(members, delta.origin, delta.seq), 5.0)
        stats = [m.shared.statistics(DOC) for m in members]
        assert [s.new_by_batch for s in stats] == [0] * len(members)
        assert sum(s.duplicates for s in stats) <= 2 * len(members)


async def test_a_node_that_joins_later_gets_the_next_update_by_push(autojump_clock: Any) -> None:
    # The tree is built; a new node joins and an update is made at once, before its
    # link requests (or the others' requests to it) landed.
    async with open_swarm(seed=5, discovery=True, shared=FAST_SHARED) as sw:
        members = await sw.add_subscribed(8, DOC)
        for member in members:
            await member.shared.refresh()
        for k in range(3):
            writer = members[k]
            delta = await writer.shared.update(writer.agent, DOC, CounterAdd(("n",), 1))
            await wait_until(lambda d=delta: have(members, d.origin, d.seq), 5.0)  # type: ignore[misc]
        # A push overtaken by a batch may still be on its way when the last node has
        # the update; it counts when it comes, so let those land first.
        await trio.sleep(3.0)
        before = [unpushed(m) for m in members]
        late = await sw.add(agent="agent8")
        await late.shared.subscribe(late.agent, DOC)
        await late.shared.refresh()
        for writer in (late, members[3]):
            delta = await writer.shared.update(writer.agent, DOC, CounterAdd(("n",), 1))
            await wait_until(lambda d=delta: have([*members, late], d.origin, d.seq), 5.0)  # type: ignore[misc]
        # The late node may catch up on the three older updates by anti-entropy; the
        # others get the new ones by push (perhaps after a batch), and so does it.
        await wait_until(lambda: [unpushed(m) for m in members] == before, 5.0)
        assert unpushed(late) <= 3
