"""What a caller reads when routing cannot deliver: said from the caller's side, and
saying why when the capability's only provider is the sender itself."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import trio

from p2pnode.core.card import AgentCard, Capability
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from tests.sim import Inbox, swarm


async def test_a_capability_only_the_sender_offers_is_refused_saying_why(
    autojump_clock: Any,
) -> None:
    async with swarm(1) as (_, (node,)):
        echo = (Capability("echo", "Echo"),)
        await node.add_agent("io", Inbox(), tier=3, capabilities=echo)
        # find lists io as a provider of echo ...
        assert [c.id for c in await node.find("echo")] == ["io"]
        # ... but a capability request never goes back to its sender: the error says so.
        with pytest.raises(LocalError) as info:
            await node.request("io", "echo", {"x": 1}, capability=True)
        assert info.value.code is ErrorCode.CAPABILITY_NOT_FOUND
        assert "never goes to its sender" in info.value.message
        assert "'io'" in info.value.message
        # From another local agent the same request is delivered locally.
        await node.add_agent("sun", Inbox(), tier=3)
        reply = await node.request("sun", "echo", {"x": 1}, capability=True)
        assert (reply.sender, reply.payload) == ("io", {"echo": {"x": 1}})
        # A capability nobody offers keeps the plain message.
        with pytest.raises(LocalError) as info:
            await node.request("sun", "nobody", None, capability=True)
        assert "never goes to its sender" not in info.value.message


async def test_an_agent_gone_from_its_owner_is_named_from_the_callers_side(
    autojump_clock: Any,
) -> None:
    async with swarm(2) as (_, (a, b)):
        await a.add_agent("triton", Inbox(), tier=3)
        io = await b.add_agent("io", Inbox(), tier=3)
        await a.connect(b.listen_address)
        # A card of b's that b no longer hosts (a stale card, as after a restart).
        gone = dataclasses.replace(io, id="reverser", name="REVERSER").signed(b.identity)
        assert a.routing.cards.learn(AgentCard.from_bytes_untrusted(gone.to_bytes()))
        with trio.fail_after(2), pytest.raises(RemoteError) as info:
            await a.request("triton", "reverser", "anyone?")
        assert info.value.code is ErrorCode.AGENT_NOT_FOUND
        assert info.value.message.startswith(f"agent 'reverser' is not hosted by peer {b.peer_id}")
        assert "local" not in info.value.message
