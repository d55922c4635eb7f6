"""Replies a peer can rely on: a refused request is answered, never left to time out."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import trio

from p2pnode.core.card import AgentCard
from p2pnode.core.envelope import MessageType, Metadata
from p2pnode.core.errors import ErrorCode, RemoteError
from p2pnode.node.frames import encode_envelope
from p2pnode.node.observability import EventKind
from p2pnode.node.routing import PendingRequest
from tests.sim import Inbox, swarm, wait_until


async def test_a_request_for_an_agent_the_node_does_not_host_is_answered(
    autojump_clock: Any,
) -> None:
    async with swarm(2) as (_, (a, b)):
        await a.add_agent("triton", Inbox(), tier=3)
        io = await b.add_agent("io", Inbox(), tier=3)
        await a.connect(b.listen_address)
        # A card of b's that b no longer hosts (a stale card, as after a restart).
        ghost = dataclasses.replace(io, id="ghost", name="GHOST").signed(b.identity)
        assert a.routing.cards.learn(AgentCard.from_bytes_untrusted(ghost.to_bytes()))
        with trio.fail_after(2), pytest.raises(RemoteError) as info:
            await a.request("triton", "ghost", "anyone?")
        assert info.value.code is ErrorCode.AGENT_NOT_FOUND


async def test_a_sandbox_refusal_is_answered_like_a_tier_refusal(autojump_clock: Any) -> None:
    async with swarm(2) as (_, (victim, rogue)):
        inbox = Inbox()
        await victim.add_agent("io", inbox, tier=3, sandbox_id="prod")
        await rogue.add_agent("triton", Inbox(), tier=3, sandbox_id="lab")
        await rogue.connect(victim.listen_address)
        # The rogue skips its own egress policy and writes the request itself.
        request = rogue.envelope("triton", "io", MessageType.REQUEST, "let me in")
        pending = rogue.routing.pending[request.id] = PendingRequest()
        await rogue.links.link(victim.peer_id).send(encode_envelope(request))
        with trio.fail_after(2):
            await pending.event.wait()
        assert pending.reply is not None and pending.reply.type is MessageType.ERROR
        assert pending.reply.sender == "io"
        assert pending.reply.payload["code"] == ErrorCode.SANDBOX_VIOLATION
        assert inbox.received == []


async def test_an_unresolved_capability_is_refused_as_one(autojump_clock: Any) -> None:
    async with swarm(2) as (_, (a, b)):
        await a.add_agent("triton", Inbox(), tier=3)
        await b.add_agent("io", Inbox(), tier=3)
        await a.connect(b.listen_address)
        # A peer that skipped resolving the capability sends it as the recipient.
        hint = Metadata(routing_hint="capability")
        request = a.envelope("triton", "plan.x", MessageType.REQUEST, None, metadata=hint)
        await a.links.link(b.peer_id).send(encode_envelope(request))

        def refused() -> bool:
            events = b.events.recent(kind=EventKind.SECURITY)
            return any(e.code is ErrorCode.CAPABILITY_NOT_FOUND for e in events)

        await wait_until(refused)
