"""Presence in a 50-node swarm, in the simulator on trio's virtual clock: how soon every
node stops listing (``find``) and routing to an agent whose device left, crashed or
detached it, and how soon it reaches the agent when the device comes back
(docs/protocol/node.md "Agent ids and owners", "Channels"; data-model.md "Lifetime").

Each node runs with its DHT and default settings. Device 10 (the subject) and device 11
(the backup) both offer ``svc.echo``; ten clients open channels to the subject before
each event, so "connected" means those (and the bootstrap device), and the others
know the subject only through the DHT. Targets:

* graceful stop or detach: gone from every connected node within 2 s, from every
  ``find`` within 30 s; capability requests go to the backup;
* crash: gone within 30 s from the nodes with a channel, within the card lifetime from
  the others;
* restart with the same identity: reachable from every node within 2 s;
* restart with a new identity: the id goes to the new key once the old owner is known
  dead, and nobody routes to the new key while the old one is live.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from p2pnode.core.errors import P2PError
from p2pnode.core.identity import Identity, PeerId
from p2pnode.runtime import Node, NodeConfig
from p2pnode.simnet import LinkConditions, SimNetwork
from tests.sim import linked, virtual_ms, wait_until
from tests.sim.devices import (
    Device,
    Devices,
    answered_by,
    claims,
    find_all,
    first_false_times,
    offered_by,
)

SIZE = 50
CAP = "svc.echo"
SUBJECT, BACKUP = 10, 11
CLIENTS = range(20, 30)
DEFAULTS = NodeConfig()


@dataclasses.dataclass(eq=False)
class World:
    devices: Devices
    subject: Device
    backup: Device

    @property
    def others(self) -> list[Device]:
        """Every running device but the subject."""
        return [d for d in self.devices.up if d is not self.subject]

    @property
    def clients(self) -> list[Device]:
        return [self.devices.all[i] for i in CLIENTS]


@asynccontextmanager
async def presence_world(seed: int, config: NodeConfig = DEFAULTS) -> AsyncIterator[World]:
    """``SIZE`` joined devices, hosting agents ``a<index>``; see the module docstring."""
    rng = random.Random(seed)
    sim = SimNetwork(rng, default=LinkConditions(latency=0.02, jitter=0.01), tick=0.001)
    async with trio.open_nursery() as nursery:
        await nursery.start(sim.drive)  # one task delivers every datagram
        devices = Devices(sim, nursery, config)
        for i in range(SIZE):
            caps = (CAP, f"cap{i}") if i in (SUBJECT, BACKUP) else (f"cap{i}",)
            await devices.add(Identity(rng.randbytes(32)), f"a{i}", caps)
        world = World(devices, devices.all[SUBJECT], devices.all[BACKUP])
        yield world
        nursery.cancel_scope.cancel()


async def ask_subject(world: World) -> None:
    """Each client asks the subject by id (opening a channel to it)."""
    for client in world.clients:
        reply = await client.live.request(client.agent, world.subject.agent, None)
        assert reply.sender == world.subject.agent


async def everyone_finds_the_subject(world: World) -> None:
    """Every other node finds the subject by capability (so holds its card)."""
    nodes = [d.live for d in world.others]
    found = await find_all(nodes, CAP)
    assert stale(found, world.subject.agent, world.subject.peer_id) == len(nodes)


async def by_capability(node: Node, agent: str) -> str:
    """Who answers ``node``'s request for CAP."""
    reply = await node.request(agent, CAP, None, capability=True)
    return reply.sender


def stale(results: Sequence[Sequence[Any]], agent: str, owner: PeerId) -> int:
    return sum(1 for cards in results if offered_by(cards, agent, owner))


async def gone_after_leaving(world: World, leave: Any) -> tuple[list[float | None], list[bool]]:
    """Run ``leave()`` and time, for every other node, when it stops holding a live claim
    of the subject's agent; also whether it had a channel to the subject before."""
    subject = world.subject
    owner, agent = subject.peer_id, subject.agent
    nodes = [d.live for d in world.others]
    had_channel = [linked(n, subject.live) for n in nodes]
    times: list[float | None] = []

    async def watch() -> None:
        times.extend(await first_false_times(nodes, lambda n: claims(n, agent, owner), 2.5))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        await leave()
    return times, had_channel


async def assert_gone_gracefully(world: World, leave: Any) -> None:
    subject, backup = world.subject, world.backup
    owner, agent = subject.peer_id, subject.agent
    client = world.clients[0]
    assert await by_capability(client.live, client.agent) == agent  # the subject, first by id
    await everyone_finds_the_subject(world)
    start = trio.current_time()
    times, had_channel = await gone_after_leaving(world, leave)
    connected = [t for t, c in zip(times, had_channel, strict=True) if c]
    assert len(connected) >= len(CLIENTS) + 1, "clients and the bootstrap device"
    print("connected nodes dropped the agent after", max(t or 99.0 for t in connected), "s")
    assert all(t is not None and t <= 2.0 for t in connected), connected
    # Capability requests from the clients go to the backup from now on.
    for c in world.clients:
        assert await by_capability(c.live, c.agent) == backup.agent
    # Every node's find (its registry, refreshed from the DHT) skips it within 30 s;
    # here within 2 s already, the DHT's records being replaced by the withdrawal.
    nodes = [d.live for d in world.others]
    found = await find_all(nodes, CAP)
    print("find after", trio.current_time() - start, "s: stale on", stale(found, agent, owner))
    assert trio.current_time() - start <= 30.0
    assert stale(found, agent, owner) == 0
    assert all(offered_by(cards, backup.agent, backup.peer_id) for cards in found)


async def test_a_graceful_stop_is_gone_from_connected_nodes_within_2_s(
    autojump_clock: Any,
) -> None:
    async with presence_world(seed=1) as world:
        await ask_subject(world)
        await assert_gone_gracefully(world, lambda: world.devices.stop(world.subject))


async def test_a_detached_agent_is_gone_from_connected_nodes_within_2_s(
    autojump_clock: Any,
) -> None:
    async with presence_world(seed=2) as world:
        await ask_subject(world)
        node = world.subject.live
        await assert_gone_gracefully(world, lambda: node.remove_agent(world.subject.agent))
        assert world.subject.running  # the device stays: only its agent left


async def test_a_crash_is_gone_within_30_s_with_a_channel_and_within_the_lifetime_without(
    autojump_clock: Any,
) -> None:
    # A 2-minute card lifetime (the default is 10) keeps the wait for expiry short.
    async with presence_world(seed=3, config=NodeConfig(card_ttl_seconds=120)) as world:
        subject, backup = world.subject, world.backup
        owner, agent = subject.peer_id, subject.agent
        await ask_subject(world)
        await everyone_finds_the_subject(world)
        expires_at = subject.live.local_agent(agent).expires_at
        nodes = [d.live for d in world.others]
        had_channel = [linked(n, subject.live) for n in nodes]
        times: list[float | None] = []

        async def watch() -> None:
            times.extend(await first_false_times(nodes, lambda n: claims(n, agent, owner), 30.5))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            await world.devices.crash(subject)
        with_channel = [t for t, c in zip(times, had_channel, strict=True) if c]
        print("nodes with a channel noticed the crash after", max(t or 0.0 for t in with_channel))
        assert len(with_channel) >= len(CLIENTS) + 1
        assert all(t is not None and t <= 30.0 for t in with_channel), with_channel
        # The others never heard: they hold the card while it is valid ...
        without = [n for n, c in zip(nodes, had_channel, strict=True) if not c]
        assert sum(claims(n, agent, owner) for n in without) >= len(without) // 2
        for c in world.clients:  # ... but those that noticed ask the backup
            assert await by_capability(c.live, c.agent) == backup.agent
        # ... and drop it once it expires, as does every find.
        await trio.sleep_until(trio.current_time() + (expires_at - virtual_ms()) / 1000 + 0.5)
        assert not [n for n in nodes if claims(n, agent, owner)]
        found = await find_all(nodes, CAP)
        assert stale(found, agent, owner) == 0


async def test_a_restarted_device_is_reached_by_every_node_within_2_s(autojump_clock: Any) -> None:
    async with presence_world(seed=4) as world:
        subject = world.subject
        agent = subject.agent
        await ask_subject(world)
        await everyone_finds_the_subject(world)
        await world.devices.crash(subject)
        clients = [c.live for c in world.clients]
        await wait_until(lambda: not any(claims(c, agent, subject.peer_id) for c in clients), 30)
        await world.devices.restart(subject)  # same identity, host and port
        back = trio.current_time()
        reached: dict[int, float] = {}
        # Half the nodes that noticed the crash look for it by capability before sending
        # it anything: its newer card, from the DHT, shows it is back, and find dials it.
        finders = world.clients[: len(CLIENTS) // 2]

        async def find_again(device: Device) -> None:
            with trio.fail_after(2.0):
                for _ in range(20):  # bounded by the 2 s too
                    cards = await device.live.find(CAP)
                    if any(c.id == agent and c.peer_id == subject.peer_id for c in cards):
                        return
                    await trio.sleep(0.1)

        async with trio.open_nursery() as nursery:
            for device in finders:
                nursery.start_soon(find_again, device)

        async def ask(device: Device) -> None:
            with trio.fail_after(2.0):
                reply = await device.live.request(device.agent, agent, None)
            assert answered_by(reply) == str(subject.peer_id)
            reached[device.index] = trio.current_time() - back

        async with trio.open_nursery() as nursery:
            for device in world.others:
                nursery.start_soon(ask, device)
        print("reached after at most", max(reached.values()), "s")
        assert len(reached) == SIZE - 1
        # And listed again: by the nodes that had noticed the crash too.
        nodes = [d.live for d in world.others]
        found = await find_all(nodes, CAP)
        assert stale(found, agent, subject.peer_id) == len(nodes)


async def test_a_device_back_with_a_new_key_takes_its_agent_id_once_the_old_is_dead(
    autojump_clock: Any,
) -> None:
    async with presence_world(seed=5) as world:
        subject = world.subject
        agent, old = subject.agent, subject.peer_id
        await ask_subject(world)
        await everyone_finds_the_subject(world)
        await world.devices.crash(subject)
        crashed = trio.current_time()
        await trio.sleep(5.0)
        await world.devices.restart(subject, Identity(random.Random(99).randbytes(32)))
        new = subject.peer_id
        reached: dict[int, float] = {}

        async def ask_until_new(device: Device) -> None:
            for _ in range(60):  # one request a second, at most
                try:
                    reply = await device.live.request(device.agent, agent, None)
                except P2PError:
                    pass  # the old owner, dead: noticed by the failure
                else:
                    if answered_by(reply) == str(new):
                        reached[device.index] = trio.current_time() - crashed
                        return
                await trio.sleep(1.0)

        async with trio.open_nursery() as nursery:
            for device in world.others:
                nursery.start_soon(ask_until_new, device)
        print("the new key reached after at most", max(reached.values()), "s")
        assert len(reached) == SIZE - 1
        assert max(reached.values()) <= 30.0
        # Found as the new key's, nowhere as the old's.
        nodes = [d.live for d in world.others]
        found = await find_all(nodes, CAP)
        assert stale(found, agent, old) == 0
        assert stale(found, agent, new) == len(nodes)
