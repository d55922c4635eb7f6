"""Joining in the simulator, on trio's virtual clock (docs/protocol/node.md "Joining"):
``connect`` makes a node's agents findable by third nodes, a node whose bootstrap peer
is down keeps trying with backoff until it joins, and short-lived cards stay findable
while their node lives, also after the DHT around it went and came back."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from p2pnode.core.card import Capability
from p2pnode.core.envelope import Envelope
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.identity import Identity
from p2pnode.dht.records import RecordKind, card_key
from p2pnode.node.config import format_address
from p2pnode.node.discovery import DhtDiscovery
from p2pnode.node.joining import JoinState
from p2pnode.runtime import Node, open_node
from p2pnode.simnet import SimHost, SimNetwork
from p2pnode.transport.net import Address
from tests.sim import FAST_NODE, virtual_ms, wait_until

UNIT = Capability("test.unit", "Tests")


async def echo(envelope: Envelope) -> Any:
    return {"from": envelope.recipient}


@asynccontextmanager
async def node_on(
    host: SimHost, index: int, *, bootstrap: tuple[Address, ...] = (), card_ttl: int = 3600
) -> AsyncIterator[Node]:
    """A node with its DHT on ``host`` port 7000, identity ``index``, on the virtual clock."""
    config = dataclasses.replace(
        FAST_NODE,
        listen=(host.host, 7000),
        dht_listen=(host.host, 0),
        bootstrap=bootstrap,
        card_ttl_seconds=card_ttl,
    )
    async with open_node(Identity(bytes([index]) * 32), host, config, clock_ms=virtual_ms) as node:
        yield node


def contacts(node: Node) -> int:
    return int(node.discovery.statistics()["contacts"])


def held_revision(holder: Node, owner: Node, agent_id: str) -> int | None:
    """The revision of ``owner``'s card record for ``agent_id`` that ``holder``'s DHT
    store holds (unexpired), or None."""
    discovery = holder.discovery
    assert isinstance(discovery, DhtDiscovery)
    records = discovery.dht.records.get(card_key(owner.peer_id, agent_id), virtual_ms())
    revisions = [r.revision for r in records if r.kind is RecordKind.CARD]
    return max(revisions, default=None)


async def test_connect_makes_the_agents_findable_by_a_third_node(autojump_clock: Any) -> None:
    sim = SimNetwork(random.Random(3))
    async with (
        node_on(sim.add_host(), 1) as hub,
        node_on(sim.add_host(), 2) as provider,
        node_on(sim.add_host(), 3) as asker,
    ):
        await provider.add_agent("io", echo, capabilities=(UNIT,))
        assert contacts(provider) == 0  # its card went nowhere yet
        # The library's one call, with the address as text: no bootstrap list, no join().
        await provider.connect(format_address(hub.listen_address))
        assert provider.joining.state is JoinState.JOINED
        assert provider.status()["join"]["joined"] is True
        assert contacts(provider) >= 1
        await asker.connect(hub.listen_address)
        assert "io" not in asker.registry  # the asker met only the hub
        found = await asker.find("test.unit")
        assert [(c.id, c.peer_id) for c in found] == [("io", provider.peer_id)]


async def test_a_node_keeps_trying_until_its_bootstrap_peer_starts(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="p2pnode.node")
    sim = SimNetwork(random.Random(4))
    hub_host = sim.add_host()
    bootstrap = ((hub_host.host, 7000),)
    where = format_address(bootstrap[0])
    async with node_on(sim.add_host(), 2, bootstrap=bootstrap) as late:
        await late.add_agent("io", echo, capabilities=(UNIT,))
        started = trio.current_time()
        assert await late.join() == 0
        status = late.joining.status(trio.current_time())
        assert status.state is JoinState.RETRYING
        assert status.summary().startswith("not joined: no bootstrap peer answered; retrying")
        assert late.status()["join"]["joined"] is False
        # Backoff, not a fixed pace: 2 s doubling (±25%), so about 5 attempts in 90 s.
        await trio.sleep(90)
        attempts = late.joining.status(trio.current_time()).attempts
        assert 4 <= attempts <= 7, attempts
        unreachable = [
            r
            for r in caplog.records
            if r.levelno == logging.WARNING and r.getMessage().startswith(f"bootstrap {where}")
        ]
        assert len(unreachable) == 1, [r.getMessage() for r in unreachable]  # once, not per try
        assert "retrying" in unreachable[0].getMessage()
        async with node_on(hub_host, 1) as hub:
            await wait_until(lambda: late.joining.state is JoinState.JOINED, timeout=400)
            assert trio.current_time() - started > 90
            joined = [r for r in caplog.records if r.getMessage().startswith("joined the swarm")]
            assert len(joined) == 1
            summary = late.joining.status(trio.current_time()).summary()
            assert summary.startswith("joined via 1 of 1 bootstrap peers")
            async with node_on(sim.add_host(), 3, bootstrap=bootstrap) as third:
                assert await third.join() == 1
                assert "io" not in third.registry and "io" in hub.registry
                assert [c.id for c in await third.find("test.unit")] == ["io"]


async def test_a_short_lived_card_of_a_running_node_stays_findable(autojump_clock: Any) -> None:
    # A 60 s card is re-issued every 30 s; five minutes on, a node that just started
    # finds it, at its latest revision and unexpired.
    sim = SimNetwork(random.Random(5))
    hub_host = sim.add_host()
    bootstrap = ((hub_host.host, 7000),)
    async with (
        node_on(hub_host, 1) as hub,
        node_on(sim.add_host(), 2, bootstrap=bootstrap, card_ttl=60) as provider,
    ):
        first = await provider.add_agent("io", echo, capabilities=(UNIT,))
        await provider.join()
        await trio.sleep(300)
        current = provider.local_agent("io")
        assert current.revision >= first.revision + 9  # re-issued about every 30 s
        assert first.expires_at < virtual_ms() < current.expires_at
        await wait_until(lambda: held_revision(hub, provider, "io") == current.revision)
        async with node_on(sim.add_host(), 3, bootstrap=bootstrap, card_ttl=60) as newcomer:
            await newcomer.join()
            found = await newcomer.find("test.unit")
            assert [c.id for c in found] == ["io"]
            assert found[0].revision >= current.revision
            assert not found[0].is_expired(virtual_ms())


async def _run_hub(
    host: SimHost, *, task_status: trio.TaskStatus[tuple[trio.CancelScope, Node]]
) -> None:
    with trio.CancelScope() as scope:
        async with node_on(host, 1) as hub:
            task_status.started((scope, hub))
            await trio.sleep_forever()


async def test_cards_renewed_while_alone_reach_the_swarm_once_it_is_back(
    autojump_clock: Any,
) -> None:
    # The hub crashes and comes back empty. Meanwhile the provider's calls failed, its
    # table emptied, and its card was re-issued with nobody to store it at. Once its
    # DHT rejoins, it puts its records again at once, not at the next renewal.
    sim = SimNetwork(random.Random(6))
    hub_host = sim.add_host()
    bootstrap = ((hub_host.host, 7000),)
    async with trio.open_nursery() as nursery:
        scope, hub = await nursery.start(_run_hub, hub_host)
        async with node_on(sim.add_host(), 2, bootstrap=bootstrap, card_ttl=60) as provider:
            first = await provider.add_agent("io", echo, capabilities=(UNIT,))
            await provider.join()
            await wait_until(lambda: held_revision(hub, provider, "io") == first.revision)
            scope.cancel()  # a crash: its records are gone with it
            await wait_until(lambda: contacts(provider) == 0, timeout=120)
            await trio.sleep(60)
            assert first.expires_at < virtual_ms()  # the card first published has lapsed
            scope, hub = await nursery.start(_run_hub, hub_host)
            assert held_revision(hub, provider, "io") is None
            await wait_until(lambda: contacts(provider) > 0, timeout=400)
            rejoined = trio.current_time()
            current = provider.local_agent("io").revision
            # Well before the next re-issue (every 30 s) could have put it there.
            await wait_until(lambda: held_revision(hub, provider, "io") == current, timeout=5)
            assert trio.current_time() - rejoined < 5
            async with node_on(sim.add_host(), 3, bootstrap=bootstrap, card_ttl=60) as newcomer:
                await newcomer.join()
                found = await newcomer.find("test.unit")
                assert [c.id for c in found] == ["io"]
                assert not found[0].is_expired(virtual_ms())
        scope.cancel()


async def test_connect_refuses_a_malformed_or_unreachable_address(autojump_clock: Any) -> None:
    sim = SimNetwork(random.Random(7))
    empty = sim.add_host()  # nothing listens there
    async with node_on(sim.add_host(), 2) as node:
        for text, code in [
            ("http://10.0.0.9:7000", ErrorCode.CONFIG_ERROR),
            ("10.0.0.9", ErrorCode.CONFIG_ERROR),
            (f"{empty.host}:7000", ErrorCode.DELIVERY_FAILED),
        ]:
            with pytest.raises(LocalError) as info:
                await node.connect(text)
            assert info.value.code is code, text
        assert node.joining.state is JoinState.ALONE
