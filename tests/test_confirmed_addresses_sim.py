"""A node's cards list only the addresses its peers confirmed (reachability.md §6), in
the simulator on trio's virtual clock: the automatic check runs once the node has
peers enough, then periodically; a public node keeps its address (and its card is not
re-issued), a node behind a port-restricted or symmetric NAT drops its direct address
and keeps its relayed one, a two-node swarm (too few checkers) keeps its address, and
the checks are bounded and end with the node."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from p2pnode.core.envelope import Envelope
from p2pnode.core.identity import Identity
from p2pnode.runtime import Node, NodeConfig
from p2pnode.services.reachability import Reachability
from p2pnode.services.reachability.auto import ScheduleConfig
from p2pnode.simnet.nat import NatKind
from p2pnode.transport.relay import format_relay_address
from p2pnode.transport.relayserve import RelayServer
from tests.sim import Swarm, wait_until
from tests.sim.nat import LastBehindNat

RELAY = Identity(b"\x70" * 32)


async def echo(envelope: Envelope) -> Any:
    return None


def verdict_is(node: Node, reachability: Reachability) -> bool:
    verdict = node.reachability.verdict
    return verdict is not None and verdict.reachability is reachability


def own_card(node: Node, agent: str) -> Any:
    card = node.registry.find(agent)
    assert card is not None
    return card


@asynccontextmanager
async def swarm_of(
    count: int,
    config: NodeConfig,
    *,
    natted: NatKind | None = None,
    sim: LastBehindNat | None = None,
) -> AsyncIterator[tuple[LastBehindNat, Swarm]]:
    """``count`` nodes with a DHT on ``sim``, each hosting agent ``a<i>``, all joined;
    the last one behind a NAT of kind ``natted`` (if given), with ``config.relays``."""
    sim = sim if sim is not None else LastBehindNat(random.Random(5))
    async with trio.open_nursery() as nursery:
        sw = Swarm(sim, nursery, config=dataclasses.replace(config, relays=()), dht=True)
        for i in range(count):
            last = i == count - 1
            if last and natted is not None:
                sim.next_kind = natted
            await sw.add(config=config if last else None)
            await sw.nodes[-1].add_agent(f"a{i}", echo, tier=3)
        for node in sw.nodes:
            await node.join()
        yield sim, sw
        await sw.aclose()
        nursery.cancel_scope.cancel()


async def test_a_public_node_keeps_its_address_and_card_after_a_reachable_verdict(
    autojump_clock: Any,
) -> None:
    async with swarm_of(4, NodeConfig()) as (_, sw):
        node = sw.nodes[-1]
        before = own_card(node, "a3")
        await wait_until(lambda: verdict_is(node, Reachability.REACHABLE), timeout=120)
        after = own_card(node, "a3")
        assert after.addresses == before.addresses == tuple(node.advertised_addresses())
        # Nothing changed: the card was not re-issued.
        assert after.revision == before.revision
        assert node.auto_reach.republished == 0
        reach = node.status()["reachability"]
        assert reach["verdict"]["reachability"] == "reachable"
        assert reach["cardAddresses"] == node.advertised_addresses()
        assert reach["dhtMode"] == "server"
        assert reach["auto"]["checks"] == 1


@pytest.mark.parametrize("kind", [NatKind.PORT_RESTRICTED, NatKind.SYMMETRIC])
async def test_a_natted_node_drops_its_direct_address_and_keeps_its_relayed_one(
    autojump_clock: Any, kind: NatKind
) -> None:
    sim = LastBehindNat(random.Random(6))
    relay_host = sim.add_host()
    relayed = format_relay_address((relay_host.host, 4100), RELAY.peer_id)
    server = RelayServer(relay_host, RELAY.peer_id)
    async with trio.open_nursery() as outer:
        await outer.start(server.serve, (relay_host.host, 4100))
        config = NodeConfig(relays=(relayed,))
        async with swarm_of(4, config, natted=kind, sim=sim) as (_, sw):
            node, peer = sw.nodes[-1], sw.nodes[0]
            before = own_card(node, "a3")
            assert before.addresses == tuple(node.advertised_addresses())
            await wait_until(lambda: server.core.reservation(node.peer_id) is not None)
            await wait_until(lambda: verdict_is(node, Reachability.UNREACHABLE), timeout=120)
            await wait_until(lambda: own_card(node, "a3").revision > before.revision)
            after = own_card(node, "a3")
            assert after.addresses == ()
            assert [e.address for e in after.endpoints] == [relayed]
            assert server.core.reservation(node.peer_id) is not None
            # Peers are told: the card they hold lists no direct address either.
            await wait_until(lambda: own_card(peer, "a3").revision == after.revision)
            assert own_card(peer, "a3").addresses == ()
            reach = node.status()["reachability"]
            assert reach["cardAddresses"] == []
            assert reach["dhtMode"] == "client"
            assert node.auto_reach.republished == 1
        outer.cancel_scope.cancel()


async def test_a_two_node_swarm_keeps_its_address_without_enough_checkers(
    autojump_clock: Any,
) -> None:
    async with swarm_of(2, NodeConfig()) as (_, sw):
        node = sw.nodes[-1]
        before = own_card(node, "a1")
        schedule = node.auto_reach.schedule
        start = trio.current_time()
        # settle 5 s, then retries after 30 s and 60 s: three undecided checks.
        await wait_until(lambda: schedule.undecided >= 3, timeout=300)
        elapsed = trio.current_time() - start
        cfg = schedule.config
        assert elapsed >= cfg.settle + cfg.retry_min + 2 * cfg.retry_min
        assert verdict_is(node, Reachability.UNKNOWN)
        after = own_card(node, "a1")
        assert after.addresses == before.addresses == tuple(node.advertised_addresses())
        assert after.revision == before.revision
        assert node.status()["reachability"]["cardAddresses"] == node.advertised_addresses()


async def test_the_periodic_check_is_bounded_and_ends_with_the_node(
    autojump_clock: Any,
) -> None:
    schedule = ScheduleConfig(interval=60.0, jitter=0.1)
    config = NodeConfig(reachability=schedule)
    async with swarm_of(4, config) as (_, sw):
        node = sw.nodes[-1]
        checks = node.auto_reach.schedule
        await wait_until(lambda: checks.checks >= 1, timeout=120)
        revision = own_card(node, "a3").revision
        window = 600.0
        await trio.sleep(window)  # a fixed span of virtual time, to count the checks in
        ran = checks.checks - 1
        # Every 60 s ± 10%: between 600/66 and 600/54 checks in the window.
        assert int(window / (schedule.interval * 1.1)) <= ran <= int(window / 54) + 1
        assert checks.undecided == 0
        # Verdict after verdict with the same addresses: the card is never re-issued.
        assert own_card(node, "a3").revision == revision
        assert node.auto_reach.republished == 0
        await sw.aclose()
        done = checks.checks
        await trio.sleep(3 * schedule.interval)
        assert checks.checks == done
