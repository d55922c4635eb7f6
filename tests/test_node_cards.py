"""A node's cards over time, in the simulator on trio's virtual clock: agent-id
collisions, renewal before expiry, expired remote cards, the node's own address
and card met again through bootstrap and the DHT."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import trio

from p2pnode.card import Capability
from p2pnode.envelope import Envelope
from p2pnode.identity import Identity
from p2pnode.node.channels import RetryPolicy
from p2pnode.node.config import NodeConfig
from p2pnode.node.node import Node
from p2pnode.node.observability import EventKind
from p2pnode.simnet import SimNetwork

WAIT = 60.0
FAST = NodeConfig(
    retry=RetryPolicy(first_delay=0.05, max_redials=3, dial_timeout=2.0), request_timeout=5.0
)


async def echo(envelope: Envelope) -> Any:
    return {"from": envelope.recipient}


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Poll ``predicate`` on the virtual clock until it holds; fail naming ``what``."""
    with trio.move_on_after(WAIT):
        while True:
            if predicate():
                return
            await trio.sleep(0.1)
    pytest.fail(f"not within {WAIT:g} s: {what}")


@asynccontextmanager
async def nodes(count: int, config: NodeConfig = FAST) -> AsyncIterator[list[Node]]:
    sim = SimNetwork(random.Random(3))
    async with AsyncExitStack() as stack:
        out = []
        for i in range(count):
            host = sim.add_host()
            cfg = dataclasses.replace(config, listen=(host.host, 7000))
            out.append(
                await stack.enter_async_context(Node(Identity(bytes([i + 1]) * 32), host, cfg))
            )
        yield out


async def test_an_agent_id_collision_is_one_warning_naming_both_owners(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async with nodes(3) as (a, b, c):
        await a.add_agent("agent", echo)
        await b.add_agent("agent", echo)
        await c.add_agent("agent", echo)
        with caplog.at_level(logging.INFO, logger="p2pnode"):
            await b.connect(a.listen_address)
            await c.connect(a.listen_address)
            # Every card update is a new HELLO repeating the claim.
            for n in range(3):
                await b.add_capability("agent", Capability(f"extra.{n}", "X"))

            def hellos_from_b() -> int:
                link = a.links.get(b.peer_id)
                return link.frames_received if link is not None else 0

            await wait_until(lambda: hellos_from_b() >= 4, "b's first HELLO and three updates")
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        # Each node warns once per claiming owner (a: b and c; b and c: a), however many
        # HELLOs repeated the claim.
        assert len(warnings) == 4, warnings
        messages = [e.detail for e in a.events.recent(kind=EventKind.SECURITY)]
        assert len(messages) == 2
        for other, message in zip((b, c), messages, strict=True):
            assert str(other.peer_id) in message and str(a.peer_id) in message
            assert message in " ".join(warnings)
        assert a.events.metrics().security_by_code == {"INVALID_CARD": 2}
