"""An agent's inbox (p2pnode.node.inbox): queued without waiting while there is room, the
byte budget charged exactly for what is queued."""

from __future__ import annotations

import pytest
import trio

from p2pnode.agent import Agent
from p2pnode.card import AgentCard
from p2pnode.envelope import EnvelopeFactory, MessageType
from p2pnode.errors import ErrorCode, LocalError
from p2pnode.identity import Identity
from p2pnode.node.inbox import InboxBudget, LocalAgent, Queued

factory = EnvelopeFactory(lambda: 1_700_000_000_000)


def _agent(inbox_size: int) -> tuple[LocalAgent, trio.MemoryReceiveChannel[Queued]]:
    send, receive = trio.open_memory_channel[Queued](inbox_size)
    owner = Identity.generate()
    card = AgentCard(
        id="a", name="A", version="1.0.0", public_key=owner.public_key, tier=3, expires_at=10_000
    ).signed(owner)
    return LocalAgent(card, Agent("a", tier=3), send, receive, InboxBudget()), receive


async def test_deliver_nowait_queues_while_there_is_room_and_charges_only_what_it_queued() -> None:
    agent, receive = _agent(2)
    envelope = factory.create("b", "a", MessageType.NOTIFICATION, "x" * 100)
    assert agent.deliver_nowait(envelope, "peer", None, 1000)
    assert agent.deliver_nowait(envelope, "peer", None, 1000)
    assert not agent.deliver_nowait(envelope, "peer", None, 1000)  # full by count
    assert agent.budget.bytes_of("peer") == 2000  # the refused one left no charge
    with trio.move_on_after(0.01):
        await agent.deliver(envelope, "peer", None, 1000)  # waits for room
    assert agent.budget.bytes_of("peer") == 2000  # cancelled while waiting: uncharged
    taken = agent.taken(receive.receive_nowait())
    assert taken is envelope
    assert agent.budget.bytes_of("peer") == 1000
    await agent.deliver(envelope, "peer", None, 1000)  # room again: queued at once
    assert agent.budget.bytes_of("peer") == 2000


async def test_deliver_nowait_on_a_closed_inbox_is_channel_closed_and_uncharged() -> None:
    agent, receive = _agent(2)
    await receive.aclose()
    envelope = factory.create("b", "a", MessageType.NOTIFICATION, None)
    with pytest.raises(LocalError) as info:
        agent.deliver_nowait(envelope, "peer", None, 300)
    assert info.value.code is ErrorCode.CHANNEL_CLOSED
    assert agent.budget.bytes_of("peer") == 0
