"""A node's cards over time, in the simulator on trio's virtual clock: agent-id
collisions, renewal before expiry, expired remote cards, the node's own address
and card met again through bootstrap and the DHT."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import pytest
import trio

from p2pnode.core.card import Capability
from p2pnode.core.envelope import Envelope
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.identity import Identity
from p2pnode.dht.node import DhtNode
from p2pnode.node.discovery import DhtDiscovery
from p2pnode.node.observability import EventKind
from p2pnode.runtime import Node
from p2pnode.simnet import SimHost, SimNetwork
from tests.sim import FAST_NODE, dht_swarm, make_card, swarm, virtual_ms, wait_until


async def echo(envelope: Envelope) -> Any:
    return {"from": envelope.recipient}


async def test_an_agent_id_collision_is_one_warning_naming_both_owners(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async with swarm(3) as (_, (a, b, c)):
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

            await wait_until(lambda: hellos_from_b() >= 4)
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


# -- cards over time: nodes with their DHT, on a wall clock that follows trio's ------------------

TTL = 600  # seconds: the shortest card lifetimes are minutes


@asynccontextmanager
async def dht_node(
    network: SimHost, seed: int, bootstrap: tuple[tuple[str, int], ...] = ()
) -> AsyncIterator[Node]:
    """What :func:`p2pnode.runtime.open_node` builds, with the virtual wall clock."""
    identity = Identity(bytes([seed]) * 32)
    host = network.host
    config = dataclasses.replace(
        FAST_NODE, listen=(host, 7000), card_ttl_seconds=TTL, bootstrap=bootstrap
    )
    async with (
        Node(identity, network, config, clock_ms=virtual_ms) as node,
        DhtNode(network, identity=identity, address=(host, 7000), wall_clock_ms=virtual_ms) as dht,
    ):
        node.discovery = DhtDiscovery(dht)
        yield node


async def test_cards_are_renewed_and_a_late_joiner_finds_the_agents(autojump_clock: Any) -> None:
    sim = SimNetwork(random.Random(11))
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(dht_node(sim.add_host(), 1))
        await first.add_agent("io", echo, capabilities=(Capability("test.unit", "T"),))
        await first.join()
        others = []
        for seed in (2, 3, 4):
            node = await stack.enter_async_context(
                dht_node(sim.add_host(), seed, (first.listen_address,))
            )
            await node.join()
            others.append(node)
        issued = first.local_agent("io")
        # Five card lifetimes: without renewal the card (and its DHT records) would be
        # refused everywhere after the first.
        await trio.sleep(5 * TTL)
        card = first.local_agent("io")
        assert card.revision > issued.revision
        assert card.expires_at - card.issued_at == TTL * 1000
        assert not card.is_expired(virtual_ms())
        # A peer connected all along holds the renewed card (it came in a HELLO).
        held = others[0].registry.find("io")
        assert held is not None and held.revision == card.revision
        late = await stack.enter_async_context(
            dht_node(sim.add_host(), 9, (others[-1].listen_address,))
        )
        await late.add_agent("callisto", echo)
        await late.join()
        found = await late.find("test.unit")
        assert [c.id for c in found] == ["io"]
        assert found[0].revision == card.revision
        reply = await late.request("callisto", "test.unit", {"n": 1}, capability=True)
        assert reply.sender == "io"


async def test_a_gone_nodes_cards_expire_everywhere(autojump_clock: Any) -> None:
    sim = SimNetwork(random.Random(12))
    async with AsyncExitStack() as stack:
        keeper = await stack.enter_async_context(dht_node(sim.add_host(), 1))
        await keeper.add_agent("callisto", echo)
        await keeper.join()
        async with dht_node(sim.add_host(), 2, (keeper.listen_address,)) as doomed:
            await doomed.add_agent("io", echo, capabilities=(Capability("test.unit", "T"),))
            await doomed.join()
            await wait_until(lambda: keeper.registry.find("io") is not None)
            assert [c.id for c in await keeper.find("test.unit")] == ["io"]
            expires_at = doomed.local_agent("io").expires_at
        # The node is gone: nothing renews its card. Past its expiry it is not found,
        # not routed to, and the registry forgets it on its own.
        await trio.sleep((expires_at - virtual_ms()) / 1000 + 1)
        assert await keeper.find("test.unit") == []
        with pytest.raises(LocalError) as info:
            await keeper.request("callisto", "test.unit", None, capability=True)
        assert info.value.code is ErrorCode.CAPABILITY_NOT_FOUND
        with pytest.raises(LocalError) as info:
            await keeper.request("callisto", "io", None)
        assert info.value.code is ErrorCode.AGENT_NOT_FOUND
        await wait_until(lambda: "io" not in keeper.registry, timeout=60)


async def test_an_expired_cards_records_are_not_republished(autojump_clock: Any) -> None:
    async with dht_swarm(6, seed=5) as (_, dhts):
        owner = dhts[1]
        assert owner.identity is not None
        # A card that expires before the first republish and is never renewed.
        card = make_card(
            owner.identity, ["plan"], ttl_ms=int(owner.config.republish_interval * 500)
        )
        await owner.provide(card)
        assert owner.publisher.kept == 3
        await trio.sleep(owner.config.republish_interval + owner.config.maintenance_interval * 2)
        # The owner forgot them instead of announcing an expired card again.
        assert owner.publisher.kept == 0
        assert await dhts[4].find_providers("plan") == []


# -- the node's own address and card, met again --------------------------------------------------


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


async def test_a_node_skips_its_own_address_in_the_bootstrap_list(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    sim = SimNetwork(random.Random(13))
    hosts = [sim.add_host(), sim.add_host()]
    # One list for the whole swarm, as bootstrap/README.md has it: each node is in it.
    everyone = tuple((h.host, 7000) for h in hosts)
    with caplog.at_level(logging.INFO, logger="p2pnode"):
        async with dht_node(hosts[0], 1, everyone) as a, dht_node(hosts[1], 2, everyone) as b:
            await a.add_agent("sun", echo, tier=0)
            await b.add_agent("io", echo)
            assert await a.join() == 1  # b only
            assert await b.join() == 1  # a only
            assert {link.peer_id for link in a.links} == {b.peer_id}
            assert (await a.request("sun", "io", None)).sender == "io"
            # Dialed anyway (an address only the handshake shows to be its own), the
            # channel to itself is closed and nothing is learnt from it.
            with pytest.raises(LocalError) as info:
                await a.connect(a.listen_address)
            assert info.value.code is ErrorCode.INVALID_ARGUMENT
            for node in (a, b):
                assert node.events.recent(kind=EventKind.SECURITY) == []
                assert node.events.metrics().errors == 0
    assert warnings_of(caplog) == []


async def test_a_capability_fallback_to_the_dht_ignores_the_nodes_own_card(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    sim = SimNetwork(random.Random(14))
    async with AsyncExitStack() as stack:
        first = await stack.enter_async_context(dht_node(sim.add_host(), 1))
        node = await stack.enter_async_context(dht_node(sim.add_host(), 2, (first.listen_address,)))
        await node.add_agent("io", echo, capabilities=(Capability("test.unit", "T"),))
        await node.join()
        # The only provider is the sender itself: routing falls back to the DHT, which
        # hands back the node's own card.
        with caplog.at_level(logging.INFO, logger="p2pnode"):
            with pytest.raises(LocalError) as info:
                await node.request("io", "test.unit", None, capability=True)
            assert [c.id for c in await node.find("test.unit")] == ["io"]
        assert info.value.code is ErrorCode.CAPABILITY_NOT_FOUND
        assert node.events.recent(kind=EventKind.SECURITY) == []
        assert warnings_of(caplog) == []


async def test_bootstrapping_off_a_dht_only_node_is_quiet(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    sim = SimNetwork(random.Random(15))
    plain = sim.add_host()
    # A DHT node with no secure-channel listener, like a stock `kademlia` node.
    async with DhtNode(
        plain, node_id=bytes([7]) * 20, address=(plain.host, 7000), wall_clock_ms=virtual_ms
    ):
        entry = ((plain.host, 7000),)
        with caplog.at_level(logging.INFO, logger="p2pnode"):
            async with (
                dht_node(sim.add_host(), 1, entry) as a,
                dht_node(sim.add_host(), 2, entry) as b,
            ):
                await a.add_agent("io", echo, capabilities=(Capability("test.unit", "T"),))
                await b.add_agent("callisto", echo)
                assert await a.join() == 0
                assert await b.join() == 0
                # Joined all the same: through the DHT, b finds and reaches a's agent.
                reply = await b.request("callisto", "test.unit", None, capability=True)
                assert reply.sender == "io"
                assert a.events.metrics().errors == 0
    assert warnings_of(caplog) == []
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert f"bootstrap {plain.host}:7000: no p2pnode channel there; joining by its DHT" in said
