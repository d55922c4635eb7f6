"""Bursts are decided once per run of like envelopes, as if one by one: the ingress of an
ENVELOPES frame, and the routing of :meth:`Node.send_many`."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode, P2PError
from p2pnode.core.wire import pack
from p2pnode.node.frames import FrameKind, encode_envelope
from p2pnode.node.observability import EventKind
from p2pnode.runtime import Node
from tests.sim import FAST_NODE, Inbox, connect_all, swarm, wait_until

#: Who an envelope claims to come from: the evil node's own agent, or the victim's.
SENDERS = ("mallory", "io")
#: Where it goes: an open agent, a tier-0 agent a tier-3 sender may not address, nobody.
RECIPIENTS = ("io", "vault", "ghost")
TYPES = (MessageType.NOTIFICATION, MessageType.STREAM_DATA, MessageType.REQUEST)

envelope_specs = st.lists(
    st.tuples(st.sampled_from(SENDERS), st.sampled_from(RECIPIENTS), st.sampled_from(TYPES)),
    min_size=1,
    max_size=12,
)


Spec = tuple[str, str, MessageType]


def _same_either_way(
    scenario: Callable[[list[Spec], bool], Awaitable[tuple[Any, ...]]], specs: list[Spec]
) -> None:
    """``scenario`` ends the same with the envelopes of ``specs`` in a burst and one by one."""

    async def both_ways() -> list[tuple[Any, ...]]:
        return [await scenario(specs, batched) for batched in (True, False)]

    batched, single = trio.run(both_ways, clock=trio.testing.MockClock(autojump_threshold=0))
    assert batched == single


def _what_arrived(victim: Node, inboxes: dict[str, Inbox]) -> tuple[Any, ...]:
    delivered = {name: [e.payload for e in inbox.received] for name, inbox in inboxes.items()}
    codes = sorted(str(e.code) for e in victim.events.recent(kind=EventKind.SECURITY))
    return tuple(sorted(delivered.items())), tuple(codes)


async def _victim_of(specs: list[Spec], batched: bool) -> tuple[Any, ...]:
    """What a victim made of ``specs``, sent as one ENVELOPES frame or one frame each."""
    async with swarm(2) as (_, (victim, evil)):
        inboxes = {"io": Inbox(), "vault": Inbox()}
        await victim.add_agent("io", inboxes["io"], tier=3)
        await victim.add_agent("vault", inboxes["vault"], tier=0)
        await evil.add_agent("mallory", Inbox(), tier=3)
        await connect_all([victim, evil])
        envelopes = [
            evil._factory.create(sender, recipient, kind, index)
            for index, (sender, recipient, kind) in enumerate(specs)
        ]
        link = evil.links.link(victim.peer_id)
        if batched:
            await link.send(pack([FrameKind.ENVELOPES, [e.to_dict() for e in envelopes]]))
        else:
            for envelope in envelopes:
                await link.send(encode_envelope(envelope))
        # Every envelope ends as a delivery or a security event.
        await wait_until(lambda: _handled(victim, inboxes) == len(specs))
        return _what_arrived(victim, inboxes)


def _handled(victim: Node, inboxes: dict[str, Inbox]) -> int:
    delivered = sum(len(inbox.received) for inbox in inboxes.values())
    return delivered + len(victim.events.recent(kind=EventKind.SECURITY))


@settings(max_examples=25, deadline=None)
@given(envelope_specs)
def test_a_batch_is_decided_as_its_envelopes_one_by_one(
    specs: list[Spec],
) -> None:
    _same_either_way(_victim_of, specs)


async def test_a_wait_in_a_batch_makes_the_next_envelope_decided_again(
    autojump_clock: Any,
) -> None:
    """While the reader waits for room in an inbox, the registry may change: the
    envelopes after that wait are decided against the registry as it is then."""
    gate = trio.Event()
    received: list[Envelope] = []

    async def slow(envelope: Envelope) -> None:
        received.append(envelope)
        if envelope.payload == 0:
            await gate.wait()

    async with swarm(2, dataclasses.replace(FAST_NODE, inbox_size=1)) as (_, nodes):
        victim, evil = nodes
        await victim.add_agent("io", slow, tier=3)
        await evil.add_agent("mallory", Inbox(), tier=3)
        await connect_all([victim, evil])
        burst = [evil.envelope("mallory", "io", MessageType.NOTIFICATION, i) for i in range(4)]
        await evil.links.link(victim.peer_id).send(
            pack([FrameKind.ENVELOPES, [e.to_dict() for e in burst]])
        )
        # 0 is in the handler, 1 in the inbox, and the reader waits to queue 2.
        await wait_until(lambda: len(received) == 1)
        await trio.testing.wait_all_tasks_blocked()
        victim.registry.unregister("mallory")
        gate.set()
        await wait_until(lambda: len(victim.events.recent(kind=EventKind.SECURITY)) == 1)
        await wait_until(lambda: len(received) == 3)
        assert [e.payload for e in received] == [0, 1, 2]
        refused = victim.events.recent(kind=EventKind.SECURITY)[0]
        assert refused.code is ErrorCode.SENDER_MISMATCH and refused.envelope_id == burst[3].id


async def _sent(specs: list[Spec], batched: bool) -> tuple[Any, ...]:
    """What became of ``specs`` sent by one node's agents with send_many, or one by one
    until the first refusal (where send_many stops, after writing the ones before it)."""
    async with swarm(2) as (_, (sender, receiver)):
        inboxes = {"io": Inbox(), "vault": Inbox()}
        await receiver.add_agent("io", inboxes["io"], tier=3)
        await receiver.add_agent("vault", inboxes["vault"], tier=0)
        for name in SENDERS:  # "io" here too: a local agent of the sender's own
            await sender.add_agent(name if name != "io" else "local", Inbox(), tier=3)
        await connect_all([sender, receiver])
        envelopes = [
            sender.envelope("local" if who == "io" else who, recipient, kind, index)
            for index, (who, recipient, kind) in enumerate(specs)
        ]
        refused = None
        try:
            if batched:
                await sender.send_many(envelopes)
            else:
                for envelope in envelopes:
                    await sender.send(envelope)
        except P2PError as exc:
            refused = exc.code
        events = sorted(
            (str(e.kind), str(e.outcome), str(e.code), e.recipient)
            for e in sender.events.recent()
            if e.envelope_id is not None
        )
        # The answer to a last request follows whatever was written before it.
        await sender.request("mallory", "io", "last")
        await trio.testing.wait_all_tasks_blocked()
        delivered = {name: [e.payload for e in i.received] for name, i in inboxes.items()}
        return delivered, refused, events


@settings(max_examples=25, deadline=None)
@given(envelope_specs)
def test_send_many_routes_as_its_envelopes_one_by_one(
    specs: list[Spec],
) -> None:
    _same_either_way(_sent, specs)
