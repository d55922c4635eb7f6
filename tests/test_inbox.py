"""An agent's inbox (p2pnode.node.inbox): queued without waiting while there is room, the
byte budget charged exactly for what is queued; cancel notifications taken on delivery
for their requester's call only; BUSY for a request to an agent at its limit of calls."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.agent.definition import Agent
from p2pnode.core.card import AgentCard
from p2pnode.core.envelope import EnvelopeFactory, MessageType, Metadata
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.identity import Identity
from p2pnode.node.callcancel import CANCELLED, cancelled_request_untrusted
from p2pnode.node.inbox import InboxBudget, LocalAgent, Queued, RunningCall

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


# -- running calls: cancels and the concurrency limit (p2pnode.node.callcancel) ------------------

CANCEL = Metadata(capability=CANCELLED)


def _call(agent: LocalAgent, peer: str | None, sender: str, deadline: float) -> RunningCall:
    request = factory.create(sender, "a", MessageType.REQUEST, None)
    key = (peer, sender, request.id)
    call = RunningCall(key, Queued(request, peer, 1), trio.CancelScope(), deadline, 30.0)
    agent.calls[key] = call
    return call


async def test_a_cancel_is_taken_on_delivery_and_cancels_only_its_requesters_call() -> None:
    agent, receive = _agent(4)
    call = _call(agent, "peer", "b", 30.0)
    _, _, request_id = call.key
    attempts = [
        ("mallory", "peer", {"requestId": request_id}),  # another agent
        ("b", "other-peer", {"requestId": request_id}),  # the same id from another peer
        ("b", "peer", {"requestId": "unknown"}),
        ("b", "peer", {"requestId": ""}),
        ("b", "peer", {"requestId": "x" * 129}),
        ("b", "peer", "junk"),
    ]
    for sender, peer, payload in attempts:
        cancel = factory.create(sender, "a", MessageType.NOTIFICATION, payload, metadata=CANCEL)
        assert agent.deliver_nowait(cancel, peer)  # taken, never queued
    assert not call.scope.cancel_called and not call.by_caller
    cancel = factory.create(
        "b", "a", MessageType.NOTIFICATION, {"requestId": request_id}, metadata=CANCEL
    )
    assert agent.deliver_nowait(cancel, "peer")
    assert call.scope.cancel_called and call.by_caller
    with pytest.raises(trio.WouldBlock):
        receive.receive_nowait()  # none of them reached the inbox
    assert agent.budget.total == 0
    # A plain notification still goes to the inbox.
    note = factory.create("b", "a", MessageType.NOTIFICATION, {"requestId": request_id})
    assert agent.deliver_nowait(note, "peer")
    assert agent.taken(receive.receive_nowait()) is note


async def test_a_request_to_a_saturated_agent_with_a_full_inbox_is_refused_busy() -> None:
    agent, receive = _agent(1)
    agent.max_calls = 2
    now = trio.current_time()
    _call(agent, "peer", "b", now + 12.0)
    _call(agent, "peer", "b", now + 3.5)
    request = factory.create("b", "a", MessageType.REQUEST, None)
    assert agent.deliver_nowait(request, "peer")  # room in the inbox: queued
    with pytest.raises(LocalError) as info:
        await agent.deliver(request, "peer")
    assert info.value.code is ErrorCode.BUSY
    assert info.value.details == {"retryAfterMs": 3500, "limit": 2}
    # Below the limit a full inbox means back-pressure, as before.
    agent.calls.popitem()
    with trio.move_on_after(0.01) as waited:
        await agent.deliver(request, "peer")
    assert waited.cancelled_caught
    assert agent.taken(receive.receive_nowait()) is request


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=200),
        lambda inner: (
            st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
        ),
        max_leaves=12,
    )
    | st.fixed_dictionaries({"requestId": st.text(max_size=200)})
)
def test_a_cancel_payload_names_a_request_id_or_nothing(payload: Any) -> None:
    named = cancelled_request_untrusted(payload)
    if named is None:
        return
    assert isinstance(payload, dict) and payload["requestId"] == named
    assert 0 < len(named) <= 128
