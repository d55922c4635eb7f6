"""Swarms of whole nodes in the simulator, on trio's virtual clock.

One builder, :class:`Swarm`: every member is a :class:`~p2pnode.runtime.Node` on
its own simulated host, with identity ``bytes([index + 1]) * 32`` and listening on
port 7000, run in a task of the swarm's nursery so that one member can be stopped
and restarted (same identity, host and data directory) while the others go on.
Optionally the members share a :class:`MemoryDiscovery` directory, or each runs
its DHT (opened by :func:`~p2pnode.runtime.open_node`, as a daemon does,
bootstrapping off the first member), and they open the shared-state service;
a member may host one agent whose envelopes its
:class:`Inbox` records. :func:`swarm` is the plain form most tests use: ``count``
nodes without agents or discovery, yielded as ``(sim, nodes)``.

The predicates (:func:`knows`, :func:`met`, :func:`converged`) are what tests
wait for with :func:`tests.sim.waiting.wait_until`.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from p2pnode.core.envelope import Envelope
from p2pnode.core.identity import Identity
from p2pnode.node.channels import ChannelState
from p2pnode.node.discovery import MemoryDiscovery
from p2pnode.runtime import Node, NodeConfig, open_node
from p2pnode.services.shared.service import SharedConfig, SharedState
from p2pnode.simnet import SimHost, SimNetwork
from tests.sim.configs import FAST_NODE
from tests.sim.waiting import wait_until


class Inbox:
    """A handler that records what an agent received and echoes the payload back."""

    def __init__(self) -> None:
        self.received: list[Envelope] = []

    async def __call__(self, envelope: Envelope) -> Any:
        self.received.append(envelope)
        return {"echo": envelope.payload}


@dataclasses.dataclass(eq=False)
class Member:
    """One node of a :class:`Swarm`, restartable on the same identity, host and data
    directory. ``node`` is the running node (the last one, after a stop)."""

    index: int
    network: SimHost
    config: NodeConfig
    #: The agent this member hosts (``None``: none), with ``inbox`` as its handler.
    hosted: str | None = None
    sandbox: str | None = None
    inbox: Inbox = dataclasses.field(default_factory=Inbox)
    node: Node | None = None
    _scope: trio.CancelScope | None = None
    _closing: trio.Event = dataclasses.field(default_factory=trio.Event)
    _stopped: trio.Event = dataclasses.field(default_factory=trio.Event)

    @property
    def agent(self) -> str:
        """The id of the agent this member hosts."""
        if self.hosted is None:
            raise LookupError(f"member {self.index} hosts no agent")
        return self.hosted

    @property
    def host(self) -> str:
        """The simulated host's name (what ``sim.kill`` and ``sim.partition`` take)."""
        return self.network.host

    @property
    def identity(self) -> Identity:
        return Identity(bytes([self.index + 1]) * 32)

    @property
    def running(self) -> bool:
        return self._scope is not None and not self._stopped.is_set()

    @property
    def shared(self) -> SharedState:
        assert self.node is not None
        return self.node.shared


class Swarm:
    """Nodes on one simulated network, each run in a task of ``nursery``.

    ``discovery``: the members share a :class:`MemoryDiscovery` (``directory``).
    ``dht``: each member runs its DHT on its listening port, and the members after
    the first bootstrap off the first one (unless the config names bootstrap peers);
    they still join explicitly (:meth:`Node.join`). With neither, a node knows only
    the peers it met. ``shared``: each member opens the shared-state service with
    this config (its gossip RNG seeded by its index).
    ``data_root``: where durable members keep their data (``node<index>``).
    """

    def __init__(
        self,
        sim: SimNetwork,
        nursery: trio.Nursery,
        *,
        config: NodeConfig = FAST_NODE,
        discovery: bool = False,
        dht: bool = False,
        shared: SharedConfig | None = None,
        data_root: Path | None = None,
    ) -> None:
        if discovery and dht:
            raise ValueError("a swarm discovers through its directory or through the DHT")
        self.sim = sim
        self.nursery = nursery
        self.config = config
        self.directory = MemoryDiscovery() if discovery else None
        self.dht = dht
        self.shared = shared
        self.data_root = data_root
        self.members: list[Member] = []

    @property
    def nodes(self) -> list[Node]:
        """The members' nodes, in the order they were added."""
        nodes = [m.node for m in self.members]
        assert all(n is not None for n in nodes)
        return [n for n in nodes if n is not None]

    async def add(
        self,
        *,
        agent: str | None = None,
        sandbox: str | None = None,
        durable: bool = False,
        config: NodeConfig | None = None,
    ) -> Member:
        """Start a new member on a new host and return it once its node is open.
        ``durable``: it keeps its data under ``data_root`` (which must be given)."""
        index = len(self.members)
        host = self.sim.add_host()
        data_dir = None
        if durable:
            if self.data_root is None:
                raise ValueError("a durable member needs the swarm's data_root")
            data_dir = self.data_root / f"node{index}"
        base = self.config if config is None else config
        own = dataclasses.replace(base, listen=(host.host, 7000), data_dir=data_dir)
        if self.dht:
            first = (self.members[0].host, 7000) if self.members else None
            bootstrap = base.bootstrap or ((first,) if first is not None else ())
            own = dataclasses.replace(own, dht_listen=(host.host, 0), bootstrap=bootstrap)
        member = Member(index, host, own, agent, sandbox)
        self.members.append(member)
        await self.start(member)
        return member

    async def add_subscribed(self, count: int, doc: str) -> list[Member]:
        """Add ``count`` members hosting agents ``agent<index>``, each subscribed to
        ``doc`` (the swarm must open shared state)."""
        members = []
        for _ in range(count):
            member = await self.add(agent=f"agent{len(self.members)}")
            await member.shared.subscribe(member.agent, doc)
            members.append(member)
        return members

    async def start(self, member: Member) -> Node:
        """(Re)start ``member``'s node and return it once it is open."""
        if member.running:
            raise RuntimeError(f"member {member.index} is running")
        member._closing = trio.Event()
        member._stopped = trio.Event()
        node: Node = await self.nursery.start(self._run, member)
        member.node = node
        return node

    async def _run(self, member: Member, *, task_status: trio.TaskStatus[Node]) -> None:
        try:
            with trio.CancelScope() as member._scope:
                opened: AbstractAsyncContextManager[Node] = (
                    open_node(member.identity, member.network, member.config)
                    if self.dht
                    else Node(
                        member.identity, member.network, member.config, discovery=self.directory
                    )
                )
                async with opened as node:
                    if member.hosted is not None:
                        await node.add_agent(member.hosted, member.inbox, sandbox_id=member.sandbox)
                    if self.shared is not None:
                        await node.open_shared(self.shared, rng=random.Random(member.index))
                    task_status.started(node)
                    await member._closing.wait()
        finally:
            member._stopped.set()

    async def stop(self, member: Member) -> None:
        """Stop ``member`` abruptly, as a crash would: its node's tasks are cancelled."""
        assert member._scope is not None
        member._scope.cancel()
        await member._stopped.wait()

    async def close(self, member: Member) -> None:
        """Close ``member``'s node the orderly way (its ``async with`` ends)."""
        member._closing.set()
        await member._stopped.wait()

    async def aclose(self) -> None:
        """Close the running members, the last added first."""
        for member in reversed(self.members):
            if member.running:
                await self.close(member)


@asynccontextmanager
async def open_swarm(
    count: int = 0,
    config: NodeConfig = FAST_NODE,
    seed: int = 1,
    *,
    discovery: bool = False,
    dht: bool = False,
    shared: SharedConfig | None = None,
    data_root: Path | None = None,
) -> AsyncIterator[Swarm]:
    """A :class:`Swarm` on a network seeded with ``seed``, with ``count`` members
    (no agents) already open; the members left running are closed on exit."""
    async with trio.open_nursery() as nursery:
        sw = Swarm(
            SimNetwork(random.Random(seed)),
            nursery,
            config=config,
            discovery=discovery,
            dht=dht,
            shared=shared,
            data_root=data_root,
        )
        for _ in range(count):
            await sw.add()
        yield sw
        await sw.aclose()


@asynccontextmanager
async def swarm(
    count: int, config: NodeConfig = FAST_NODE, seed: int = 1
) -> AsyncIterator[tuple[SimNetwork, list[Node]]]:
    """``count`` open nodes without agents or discovery, yielded as ``(sim, nodes)``."""
    async with open_swarm(count, config, seed) as sw:
        yield sw.sim, sw.nodes


# -- predicates to wait for ---------------------------------------------------------------------


def knows(node: Node, other: Node) -> bool:
    """``node``'s registry holds every card ``other`` hosts, as ``other``'s, at least at
    the revision ``other`` has (the HELLO or announcement carrying them arrived)."""
    for card in other.registry.list_local():
        seen = node.registry.find(card.id)
        if seen is None or seen.peer_id != other.peer_id or seen.revision < card.revision:
            return False
    return True


def linked(node: Node, other: Node) -> bool:
    """``node`` has an open channel to ``other``."""
    link = node.links.get(other.peer_id)
    return link is not None and link.state is ChannelState.OPEN


def met(a: Node, b: Node) -> bool:
    """``a`` and ``b`` have open channels to each other and each knows the other's cards."""
    return linked(a, b) and linked(b, a) and knows(a, b) and knows(b, a)


def converged(members: list[Member], doc: str) -> bool:
    """Every member's replica of ``doc`` has the same value and vector clock."""
    states = [(m.shared.read(doc), m.shared.clock(doc)) for m in members]
    return all(s == states[0] for s in states)


async def connect_all(nodes: list[Node]) -> None:
    """Connect every node to the first and wait until each pair has met."""
    hub = nodes[0]
    for node in nodes[1:]:
        await node.connect(hub.listen_address)
    await wait_until(lambda: all(met(hub, node) for node in nodes[1:]))


@asynccontextmanager
async def victim_honest_evil(
    honest_agent: str, honest_tier: int
) -> AsyncIterator[tuple[Node, Node, Node, Inbox]]:
    """Three connected nodes: a victim hosting "io" (whose inbox is yielded), an honest
    node hosting ``honest_agent``, and an evil node hosting "mallory"."""
    async with swarm(3) as (_, (victim, honest, evil)):
        inbox = Inbox()
        await victim.add_agent("io", inbox, tier=3)
        await honest.add_agent(honest_agent, Inbox(), tier=honest_tier)
        await evil.add_agent("mallory", Inbox(), tier=3)
        await connect_all([victim, honest, evil])
        yield victim, honest, evil, inbox
