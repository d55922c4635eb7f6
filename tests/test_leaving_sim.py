"""Leaving and coming back under another key, in the simulator on trio's virtual clock:
a graceful stop is withdrawn from connected peers at once and from the DHT for the
others; a node restarted under a new identity takes its agent id over from its dead
old self, for nodes that knew the old one and for nodes that never met either."""

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
from p2pnode.core.errors import ErrorCode, P2PError
from p2pnode.core.identity import Identity
from p2pnode.dht.node import DhtNode
from p2pnode.node.discovery import DhtDiscovery
from p2pnode.runtime import Node
from p2pnode.simnet import SimHost, SimNetwork
from tests.sim import FAST_NODE, virtual_ms, wait_until

PORT = 7000
SUMMARIZE = Capability("text.summarize", "Summarize")


async def echo(envelope: Envelope) -> Any:
    return {"by": envelope.recipient}


@asynccontextmanager
async def dht_node(
    network: SimHost, identity: Identity, bootstrap: tuple[tuple[str, int], ...] = ()
) -> AsyncIterator[Node]:
    """A node with its DHT on the virtual wall clock; it leaves before its DHT closes,
    as :func:`p2pnode.runtime.open_node` does."""
    config = dataclasses.replace(FAST_NODE, listen=(network.host, PORT), bootstrap=bootstrap)
    async with (
        Node(identity, network, config, clock_ms=virtual_ms) as node,
        DhtNode(
            network, identity=identity, address=(network.host, PORT), wall_clock_ms=virtual_ms
        ) as dht,
    ):
        node.discovery = DhtDiscovery(dht)
        try:
            yield node
        finally:
            with trio.CancelScope(shield=True):
                await node.leave()


def key(n: int) -> Identity:
    return Identity(bytes([n]) * 32)


async def start_seed(
    stack: AsyncExitStack, sim: SimNetwork, agent_id: str
) -> tuple[Node, tuple[tuple[str, int], ...]]:
    """The swarm's first node, hosting ``agent_id``, and the bootstrap list naming it."""
    seed = await stack.enter_async_context(dht_node(sim.add_host(), key(1)))
    await seed.add_agent(agent_id, echo)
    await seed.join()
    return seed, ((seed.listen_address[0], PORT),)


async def run_node(
    host: SimHost,
    identity: Identity,
    boot: tuple[tuple[str, int], ...],
    stop: trio.Event,
    *,
    task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A node in a task of its own, until ``stop`` is set: one that stops out of order."""
    async with dht_node(host, identity, boot) as node:
        task_status.started(node)
        await stop.wait()


async def test_a_graceful_stop_is_withdrawn_from_peers_and_from_the_dht(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="p2pnode")
    sim = SimNetwork(random.Random(21))
    async with AsyncExitStack() as stack:
        seed, boot = await start_seed(stack, sim, "hub")
        others = []
        for n in range(2, 10):
            node = await stack.enter_async_context(dht_node(sim.add_host(), key(n), boot))
            await node.add_agent(f"a{n}", echo)
            await node.join()
            others.append(node)
        async with dht_node(sim.add_host(), key(30), boot) as leaver:
            await leaver.add_agent("notes", echo, capabilities=(SUMMARIZE,))
            await leaver.join()
            # Every node finds it (most through the DHT, without a channel to it).
            for node in others:
                assert [c.id for c in await node.find(SUMMARIZE.id)] == ["notes"]
            connected = [n for n in [seed, *others] if n.links.get(leaver.peer_id)]
            assert seed in connected
            left_at = trio.current_time()
            caplog.clear()
        # Connected nodes dropped the card from the HELLO, at once.
        for node in connected:
            assert node.registry.find("notes") is None
        assert trio.current_time() - left_at < 2.0
        # One INFO line per neighbour, and no redial of a peer that said it left.
        about = [r for r in caplog.records if str(leaver.peer_id) in r.getMessage()]
        assert len(about) == len(connected), [r.getMessage() for r in about]
        assert all("withdrew notes" in r.getMessage() for r in about)
        # Nodes without a channel learn it from the DHT: the withdrawal replaced the card.
        for node in others:
            assert await node.find(SUMMARIZE.id) == []
            assert node.registry.find("notes") is None
        assert trio.current_time() - left_at < 30.0


async def test_a_node_restarted_under_a_new_key_takes_its_agent_id_over(
    autojump_clock: Any,
) -> None:
    sim = SimNetwork(random.Random(22))
    async with AsyncExitStack() as stack:
        _, boot = await start_seed(stack, sim, "caller")
        host = sim.add_host()
        stop = trio.Event()
        nursery = await stack.enter_async_context(trio.open_nursery())
        first: Node = await nursery.start(run_node, host, key(40), boot, stop)
        await first.add_agent("summarizer", echo, capabilities=(SUMMARIZE,))
        await first.join()
        knew = await stack.enter_async_context(dht_node(sim.add_host(), key(2), boot))
        await knew.add_agent("asker", echo)
        await knew.join()
        assert (await knew.request("asker", "summarizer", None)).sender == "summarizer"
        # The device crashes: nothing is withdrawn (its host is off the network).
        sim.kill(host.host)
        stop.set()
        await wait_until(lambda: not first.is_open)
        sim.revive(host.host)
        crashed_at = trio.current_time()
        second = await stack.enter_async_context(dht_node(host, key(41), boot))
        await second.add_agent("summarizer", echo, capabilities=(SUMMARIZE,))
        await second.join()
        # A node that had a channel to the old owner, and one that never met either
        # (the DHT gives it both cards at once), both reach the new owner by the name.
        fresh = await stack.enter_async_context(dht_node(sim.add_host(), key(3), boot))
        await fresh.add_agent("newcomer", echo)
        await fresh.join()
        for node, sender in ((knew, "asker"), (fresh, "newcomer")):
            reply = await node.request(sender, "summarizer", None)
            owner = node.registry.resolve("summarizer", virtual_ms())
            assert [c.peer_id for c in owner] == [second.peer_id]
            assert reply.sender == "summarizer"
            found = await node.find(SUMMARIZE.id)
            assert [c.peer_id for c in found] == [second.peer_id]
        assert trio.current_time() - crashed_at < 30.0


async def test_a_live_owner_keeps_its_id_against_a_new_claimant(autojump_clock: Any) -> None:
    sim = SimNetwork(random.Random(23))
    async with AsyncExitStack() as stack:
        seed, boot = await start_seed(stack, sim, "caller")
        owner = await stack.enter_async_context(dht_node(sim.add_host(), key(50), boot))
        await owner.add_agent("carol", echo)
        await owner.join()
        assert (await seed.request("caller", "carol", None)).sender == "carol"
        squatter = await stack.enter_async_context(dht_node(sim.add_host(), key(51), boot))
        await squatter.add_agent("carol", echo)
        await squatter.join()
        await wait_until(lambda: len(seed.registry.owners("carol")) == 2)
        for _ in range(3):
            await seed.request("caller", "carol", None)
            chosen = seed.registry.resolve("carol", virtual_ms())
            assert [c.peer_id for c in chosen] == [owner.peer_id]


@dataclasses.dataclass
class Providers:
    """Two nodes offering SUMMARIZE (``svc-a``, ``svc-b``) and a node asking for it."""

    sim: SimNetwork
    hosts: list[SimHost]
    nodes: list[Node]
    asker: Node


@asynccontextmanager
async def two_providers(seed: int, first_key: int, asker_key: int) -> AsyncIterator[Providers]:
    sim = SimNetwork(random.Random(seed))
    async with AsyncExitStack() as stack:
        _, boot = await start_seed(stack, sim, "hub")
        hosts = [sim.add_host(), sim.add_host()]
        nursery = await stack.enter_async_context(trio.open_nursery())
        stops = [trio.Event(), trio.Event()]
        nodes: list[Node] = []
        for n, (host, stop) in enumerate(zip(hosts, stops, strict=True)):
            provider: Node = await nursery.start(run_node, host, key(first_key + n), boot, stop)
            await provider.add_agent(f"svc-{'ab'[n]}", echo, capabilities=(SUMMARIZE,))
            await provider.join()
            nodes.append(provider)
        asker = await stack.enter_async_context(dht_node(sim.add_host(), key(asker_key), boot))
        await asker.add_agent("asker", echo)
        await asker.join()
        try:
            yield Providers(sim, hosts, nodes, asker)
        finally:
            for stop in stops:
                stop.set()


async def test_a_request_by_capability_fails_over_from_a_dead_provider(
    autojump_clock: Any,
) -> None:
    async with two_providers(24, 60, 3) as world:
        asker = world.asker
        # The asker learns both cards from the DHT (as find does, without its dials).
        for card in await asker.discovery.find_providers(SUMMARIZE.id):
            asker.routing.cards.learn(card)
        assert sorted(c.id for c in asker.registry.find_by_capability(SUMMARIZE.id)) == [
            "svc-a", "svc-b"
        ]
        assert asker.links.get(world.nodes[0].peer_id) is None  # never met: nothing to notice
        world.sim.kill(world.hosts[0].host)  # svc-a's device dies without a word
        reply = await asker.request("asker", SUMMARIZE.id, None, capability=True)
        assert reply.sender == "svc-b"
        # Its owner is now known unreachable: find and routing leave it out.
        assert [c.id for c in await asker.find(SUMMARIZE.id)] == ["svc-b"]
        reply = await asker.request("asker", SUMMARIZE.id, None, capability=True)
        assert reply.sender == "svc-b"


async def test_find_leaves_out_a_dead_owner_it_never_had_a_channel_to(autojump_clock: Any) -> None:
    # Its card is valid for minutes yet; find dials the owner and leaves it out.
    async with two_providers(25, 70, 4) as world:
        world.sim.kill(world.hosts[0].host)  # before the asker ever met it
        started = trio.current_time()
        assert [c.id for c in await world.asker.find(SUMMARIZE.id)] == ["svc-b"]
        assert trio.current_time() - started < 5.0
        card = world.asker.registry.get("svc-a")
        assert not card.is_expired(virtual_ms())  # not by its lifetime


async def test_a_request_by_capability_in_flight_moves_on_when_its_provider_dies(
    autojump_clock: Any,
) -> None:
    # The request reached svc-a, whose device then dies without a word: once the asker's
    # channel to it is lost for good, the request goes to svc-b instead of failing.
    sim = SimNetwork(random.Random(26))
    working = trio.Event()

    async def slow(envelope: Envelope) -> Any:
        working.set()
        await trio.sleep(600)
        return {"by": envelope.recipient}

    async with AsyncExitStack() as stack:
        _, boot = await start_seed(stack, sim, "hub")
        nursery = await stack.enter_async_context(trio.open_nursery())
        doomed_host, stop_a, stop_b = sim.add_host(), trio.Event(), trio.Event()
        doomed: Node = await nursery.start(run_node, doomed_host, key(80), boot, stop_a)
        await doomed.add_agent("svc-a", slow, capabilities=(SUMMARIZE,))
        await doomed.join()
        asker = await stack.enter_async_context(dht_node(sim.add_host(), key(5), boot))
        await asker.add_agent("asker", echo)
        await asker.join()
        replies: list[Envelope] = []

        async def ask() -> None:
            replies.append(
                await asker.request("asker", SUMMARIZE.id, None, capability=True, timeout=120)
            )

        nursery.start_soon(ask)
        await working.wait()
        other: Node = await nursery.start(run_node, sim.add_host(), key(81), boot, stop_b)
        await other.add_agent("svc-b", echo, capabilities=(SUMMARIZE,))
        await other.join()
        sim.kill(doomed_host.host)
        killed = trio.current_time()
        await wait_until(lambda: replies, 60)
        assert replies[0].sender == "svc-b"
        assert trio.current_time() - killed < 30  # the channel's idle timeout, then redials
        stop_a.set()
        stop_b.set()


async def test_a_request_moved_off_a_provider_dying_under_its_write_runs_once(
    autojump_clock: Any,
) -> None:
    # The asker's channel to svc-a breaks as svc-a's device dies; a request written to it
    # meanwhile waits for the redials, which fail: the link closes for good (failing what
    # waits on that peer) and the write fails, so the request goes to svc-b. It is svc-b's
    # to answer then, once: not failed by svc-a's departure and sent again.
    sim = SimNetwork(random.Random(27))
    calls: list[str] = []

    async def counted(envelope: Envelope) -> Any:
        calls.append(envelope.id)
        return {"by": envelope.recipient}

    async with AsyncExitStack() as stack:
        _, boot = await start_seed(stack, sim, "hub")
        nursery = await stack.enter_async_context(trio.open_nursery())
        doomed_host, stops = sim.add_host(), [trio.Event(), trio.Event()]
        doomed: Node = await nursery.start(run_node, doomed_host, key(90), boot, stops[0])
        await doomed.add_agent("svc-a", echo, capabilities=(SUMMARIZE,))
        await doomed.join()
        asker = await stack.enter_async_context(dht_node(sim.add_host(), key(6), boot))
        await asker.add_agent("asker", echo)
        await asker.join()
        assert (await asker.request("asker", SUMMARIZE.id, None, capability=True)).sender == "svc-a"
        other: Node = await nursery.start(run_node, sim.add_host(), key(91), boot, stops[1])
        await other.add_agent("svc-b", counted, capabilities=(SUMMARIZE,))
        await other.join()
        for card in await asker.discovery.find_providers(SUMMARIZE.id):
            asker.routing.cards.learn(card)
        assert [c.id for c in asker.routing.router.candidates(
            asker.registry.get("asker"), SUMMARIZE.id)] == ["svc-a", "svc-b"]  # fmt: skip
        sim.kill(doomed_host.host)
        reply = await asker.request("asker", SUMMARIZE.id, None, capability=True)
        assert reply.sender == "svc-b"
        await trio.sleep(30)  # any second copy would have arrived
        assert len(calls) == 1
        for stop in stops:
            stop.set()


@pytest.mark.parametrize("by_capability", [False, True], ids=["by id", "by capability"])
async def test_requests_to_a_process_that_restarted_under_its_key_fail_at_once(
    autojump_clock: Any, by_capability: bool
) -> None:
    # The device restarts within the asker's redials: its channel comes back, to a new
    # process that never saw the request. Its HELLO names another incarnation, so the
    # request fails then (by capability: it is asked again, of the new process) instead
    # of waiting out its 120 s.
    sim = SimNetwork(random.Random(28))
    working = trio.Event()

    async def stuck(envelope: Envelope) -> Any:
        working.set()
        await trio.sleep(600)

    async with AsyncExitStack() as stack:
        _, boot = await start_seed(stack, sim, "hub")
        nursery = await stack.enter_async_context(trio.open_nursery())
        host, stop = sim.add_host(), trio.Event()
        first: Node = await nursery.start(run_node, host, key(95), boot, stop)
        await first.add_agent("worker", stuck, capabilities=(SUMMARIZE,))
        await first.join()
        asker = await stack.enter_async_context(dht_node(sim.add_host(), key(7), boot))
        await asker.add_agent("asker", echo)
        await asker.join()
        outcome: list[Envelope | P2PError] = []

        async def ask() -> None:
            target = SUMMARIZE.id if by_capability else "worker"
            try:
                outcome.append(
                    await asker.request("asker", target, None, capability=by_capability,
                                        timeout=120)
                )  # fmt: skip
            except P2PError as exc:
                outcome.append(exc)

        nursery.start_soon(ask)
        await working.wait()
        sim.kill(host.host)
        stop.set()
        await wait_until(lambda: not first.is_open)
        sim.revive(host.host)
        second = await stack.enter_async_context(dht_node(host, key(95), boot))
        await second.add_agent("worker", echo, capabilities=(SUMMARIZE,))
        back = trio.current_time()
        await wait_until(lambda: outcome, 60)
        assert trio.current_time() - back < 15
        (result,) = outcome
        if by_capability:
            assert isinstance(result, Envelope) and result.sender == "worker"
        else:
            assert isinstance(result, P2PError)
            assert result.code is ErrorCode.DELIVERY_FAILED
            assert f"peer {second.peer_id} restarted" in result.message


async def test_a_request_survives_a_lost_connection_to_the_same_process(
    autojump_clock: Any,
) -> None:
    # The connection breaks and comes back to the same process (same incarnation in its
    # HELLO): the request in its hands is still answered there, not failed or sent again.
    sim = SimNetwork(random.Random(29))
    calls: list[str] = []

    async def slow(envelope: Envelope) -> Any:
        calls.append(envelope.id)
        await trio.sleep(4)  # within the owner's deadline (FAST_NODE: 5 s)
        return {"by": envelope.recipient}

    async with AsyncExitStack() as stack:
        _, boot = await start_seed(stack, sim, "hub")
        provider_host = sim.add_host()
        provider = await stack.enter_async_context(dht_node(provider_host, key(96), boot))
        await provider.add_agent("worker", slow, capabilities=(SUMMARIZE,))
        await provider.join()
        asker_host = sim.add_host()
        asker = await stack.enter_async_context(dht_node(asker_host, key(8), boot))
        await asker.add_agent("asker", echo)
        await asker.join()
        replies: list[Envelope] = []

        async def ask() -> None:
            replies.append(await asker.request("asker", SUMMARIZE.id, None, capability=True,
                                               timeout=120))  # fmt: skip

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await wait_until(lambda: calls)
            link = asker.links.get(provider.peer_id)
            assert link is not None
            opened = link.opened_at
            sim.partition([asker_host.host])  # the channel breaks
            await trio.sleep(0.2)
            sim.heal()
            await wait_until(lambda: link.opened_at > opened)  # redialed: a new channel
            await wait_until(lambda: replies, 60)
        assert replies[0].sender == "worker"
        assert len(calls) == 1
