"""One node per device, in the simulator: devices that stop, crash and come back.

A :class:`Device` is a simulated host running one node (:func:`~p2pnode.runtime.open_node`,
with its DHT, on the virtual wall clock) that hosts one agent. :class:`Devices` starts
them, each in a task of its nursery bootstrapping off the first device, and ends them
the three ways a device ends:

* :meth:`Devices.stop`: the node closes the orderly way (it withdraws its agents);
* :meth:`Devices.crash`: the host drops off the network first, then the node's tasks
  are cancelled, so nothing the node says on its way out reaches anyone (a power cut);
* :meth:`Devices.restart`: a crashed or stopped device comes back on the same host and
  port, with the same identity or with a new one claiming the same agent id.

:func:`claims` and :func:`first_false_times` are what presence tests observe.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from p2pnode.core.card import AgentCard, Capability
from p2pnode.core.envelope import Envelope
from p2pnode.core.identity import Identity, PeerId
from p2pnode.runtime import Node, NodeConfig, open_node
from p2pnode.simnet import SimHost, SimNetwork
from tests.sim.dht import virtual_ms

PORT = 7000


def answering_as(peer_id: PeerId) -> Callable[[Envelope], Awaitable[Any]]:
    """An agent's handler: answers with the peer id of the node hosting it, so the asker
    sees which owner of an agent id it reached."""
    owner = str(peer_id)

    async def answer(envelope: Envelope) -> Any:
        return {"owner": owner}

    return answer


def answered_by(reply: Envelope) -> str:
    """The owner a reply of :func:`answering_as` names."""
    payload = reply.payload
    assert isinstance(payload, dict)
    return str(payload["owner"])


@dataclasses.dataclass(eq=False)
class Device:
    """One host with one node hosting ``agent`` (offering ``capabilities``)."""

    index: int
    network: SimHost
    identity: Identity
    agent: str
    capabilities: tuple[str, ...]
    node: Node | None = None
    _scope: trio.CancelScope | None = None
    _closing: trio.Event = dataclasses.field(default_factory=trio.Event)
    _stopped: trio.Event = dataclasses.field(default_factory=trio.Event)

    @property
    def host(self) -> str:
        return self.network.host

    @property
    def peer_id(self) -> PeerId:
        return self.identity.peer_id

    @property
    def running(self) -> bool:
        return self._scope is not None and not self._stopped.is_set()

    @property
    def live(self) -> Node:
        """The running node (raises AssertionError when the device is down)."""
        assert self.node is not None and self.running, f"device {self.index} is down"
        return self.node


class Devices:
    """Devices on ``sim``, run in ``nursery`` with ``config`` (listen and bootstrap set here)."""

    def __init__(self, sim: SimNetwork, nursery: trio.Nursery, config: NodeConfig) -> None:
        self.sim = sim
        self.nursery = nursery
        self.config = config
        self.all: list[Device] = []

    @property
    def up(self) -> list[Device]:
        return [d for d in self.all if d.running]

    async def add(self, identity: Identity, agent: str, capabilities: Sequence[str]) -> Device:
        """A new device on a new host, returned once its node joined."""
        device = Device(len(self.all), self.sim.add_host(), identity, agent, tuple(capabilities))
        self.all.append(device)
        await self.start(device)
        return device

    async def start(self, device: Device) -> Node:
        """(Re)start ``device``'s node; returns it once its agent is hosted and it joined."""
        if device.running:
            raise RuntimeError(f"device {device.index} is running")
        device._closing, device._stopped = trio.Event(), trio.Event()
        node: Node = await self.nursery.start(self._run, device)
        device.node = node
        return node

    def _config(self, device: Device) -> NodeConfig:
        host = device.host
        first = self.all[0].host
        bootstrap = ((first, PORT),) if first != host else ()
        return dataclasses.replace(
            self.config, listen=(host, PORT), dht_listen=(host, 0), bootstrap=bootstrap
        )

    async def _run(self, device: Device, *, task_status: trio.TaskStatus[Node]) -> None:
        try:
            with trio.CancelScope() as device._scope:
                opened = open_node(
                    device.identity, device.network, self._config(device), clock_ms=virtual_ms
                )
                async with opened as node:
                    caps = tuple(Capability(c, c) for c in device.capabilities)
                    handler = answering_as(node.peer_id)
                    await node.add_agent(device.agent, handler, capabilities=caps)
                    await node.join()
                    task_status.started(node)
                    await device._closing.wait()
        finally:
            device._stopped.set()

    async def stop(self, device: Device) -> None:
        """Close the node the orderly way: it withdraws its agents as it goes."""
        device._closing.set()
        await device._stopped.wait()

    async def crash(self, device: Device) -> None:
        """Take the host off the network, then cancel the node: nothing it says leaves.
        The host stays off until :meth:`restart`."""
        assert device._scope is not None
        self.sim.kill(device.host)
        device._scope.cancel()
        await device._stopped.wait()

    async def restart(self, device: Device, identity: Identity | None = None) -> Node:
        """Bring ``device`` back on its host and port, with ``identity`` if given (a new
        key claiming the same agent id), else its own."""
        self.sim.revive(device.host)
        if identity is not None:
            device.identity = identity
        return await self.start(device)


def claims(node: Node, agent: str, owner: PeerId) -> bool:
    """``node`` holds a live claim of ``owner`` on ``agent`` (what it would find and route to)."""
    registry = node.registry
    now = node.now_ms()
    return any(
        c.peer_id == owner and registry.is_live(c, now) for c in registry.owners(agent, now)
    )


def offered_by(cards: Sequence[AgentCard], agent: str, owner: PeerId) -> bool:
    """``cards`` (a ``find`` result) list ``owner``'s ``agent``."""
    return any(c.id == agent and c.peer_id == owner for c in cards)


async def first_false_times(
    nodes: Sequence[Node],
    predicate: Callable[[Node], bool],
    timeout: float,  # noqa: ASYNC109
    *,
    interval: float = 0.1,
) -> list[float | None]:
    """For each of ``nodes``, the seconds from now until ``predicate`` first fails
    (None: it held throughout ``timeout``), polled every ``interval``."""
    start = trio.current_time()
    times: list[float | None] = [None] * len(nodes)
    for _ in range(math.ceil(timeout / interval) + 1):  # bounded
        now = trio.current_time() - start
        for i, node in enumerate(nodes):
            if times[i] is None and not predicate(node):
                times[i] = now
        if all(t is not None for t in times) or now >= timeout:
            break
        await trio.sleep(interval)
    return times


async def find_all(nodes: Sequence[Node], capability: str) -> list[list[AgentCard]]:
    """``find(capability)`` on every node at once, in ``nodes``' order."""
    results: list[list[AgentCard]] = [[] for _ in nodes]

    async def one(i: int, node: Node) -> None:
        results[i] = await node.find(capability)

    async with trio.open_nursery() as nursery:
        for i, node in enumerate(nodes):
            nursery.start_soon(one, i, node)
    return results
