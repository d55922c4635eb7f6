"""The composition root: the kernel and its services, built in one place.

The kernel (:class:`~p2pnode.node.kernel.Kernel`) knows no service. :class:`Node`,
the node users hold (``p2pnode.Node``, what :func:`open_node` yields), is the kernel
with its services, built in this order and wired here only:

1. **shared state** (:class:`~p2pnode.services.shared.service.SharedState`): opened
   on demand (:meth:`Node.open_shared`), then ``node.shared``;
2. **tasks** (:class:`~p2pnode.services.tasks.service.TaskService`, ``node.tasks``):
   built with the node and run from its start; it is handed the swarm slot below;
3. **swarms** (:class:`~p2pnode.services.swarms.service.SwarmService`): opened on
   demand (:meth:`Node.open_swarms`, shared state first), then it runs accepted
   invitations for the task service (through :class:`SwarmSlot`, a protocol the task
   service was given: no service writes another's attributes);
4. **tools**: the audit (``node.tool_audit``), which serves the MCP request methods
   of the local agents, and the client (``node.tools``);
5. **attach** (the agent socket, :meth:`Node.open_agent_socket`) and **metrics**
   (:meth:`Node.serve_metrics`) where the daemon asks for them;
6. **reachability** (``node.reachability``): serves ``reach.dialback`` to every peer
   and checks this node's own addresses (:meth:`Node.check_reachability`); its UDP
   side is the DHT's, wired by :func:`open_node`. ``node.auto_reach`` runs the check
   once the node has peers enough, then every 10 minutes, and gives the kernel's
   cards the confirmed addresses (:meth:`Kernel.set_card_addresses`);
   ``node.auto_relay`` keeps reservations on relays checkers offered once the verdict
   is ``unreachable`` and no relay is configured.

:class:`Node` is a subclass of the kernel so that everything the kernel offers
(``send``, ``request``, ``find``, ``add_agent``, ``connect``, its ``routing`` and
``events`` ...) stays where users and tools reach it, without a forwarding layer
on the envelope path. :class:`NodeConfig` is the kernel's configuration plus the
services' (``tasks``); the kernel reads only its own fields.

:func:`open_node` also runs the DHT: it binds UDP on the same port number as the
TCP listener (unless ``NodeConfig.dht_listen`` names a port), so one ``host:port``
in a bootstrap list or a card reaches both. With a data directory, the DHT routing
table is restored from ``routing.snapshot`` at start and saved there on exit, so a
restarted node rejoins without its bootstrap peers.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import trio

from p2pnode.core.envelope import wall_clock_ms
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.identity import Identity, PeerId, write_private_file
from p2pnode.dht.config import DhtConfig
from p2pnode.dht.node import DhtNode
from p2pnode.node.channels import ChannelState
from p2pnode.node.config import KernelConfig, parse_address
from p2pnode.node.discovery import DhtDiscovery, Discovery
from p2pnode.node.holepunch import HolePunchService, KernelLinks, tcp_dial_from
from p2pnode.node.kernel import Kernel
from p2pnode.services.attach.service import AgentSocket
from p2pnode.services.metrics import MetricsExporter
from p2pnode.services.reachability.auto import AutoCheck, AutoSide, ScheduleConfig
from p2pnode.services.reachability.autorelay import (
    AutoRelay,
    AutoRelayConfig,
    RelayBook,
    RelaySide,
)
from p2pnode.services.reachability.dhtside import DhtReach
from p2pnode.services.reachability.service import ReachabilityService
from p2pnode.services.reachability.verdict import Verdict
from p2pnode.services.reachability.wire import Candidate, Transport
from p2pnode.services.shared.service import (
    STORE_FILE_NAME,
    SUBSCRIPTIONS_FILE_NAME,
    SharedConfig,
    SharedState,
    Watch,
)
from p2pnode.services.swarms.coordinator import SwarmConfig
from p2pnode.services.swarms.service import SwarmService
from p2pnode.services.tasks.executor import Joiner
from p2pnode.services.tasks.negotiation import TaskConfig
from p2pnode.services.tasks.service import TaskHandle, TaskService
from p2pnode.services.tools.audit import ToolAudit
from p2pnode.services.tools.client import ToolClient
from p2pnode.transport.net import Address, Network, TrioNetwork

SNAPSHOT_FILE = "routing.snapshot"
logger = logging.getLogger("p2pnode.node")


@dataclass(frozen=True, slots=True)
class NodeConfig(KernelConfig):
    """Everything a node needs besides its network and identity: the kernel's
    settings (:class:`~p2pnode.node.config.KernelConfig`) and the services'."""

    #: Task negotiation timers and bounds (p2pnode.services.tasks.service).
    tasks: TaskConfig = field(default_factory=TaskConfig)
    #: The DHT's tunables (:func:`open_node`); defaults as docs/protocol/dht.md §7.
    dht: DhtConfig = field(default_factory=DhtConfig)
    #: When the node checks its own addresses by itself (reachability.md §6).
    reachability: ScheduleConfig = field(default_factory=ScheduleConfig)
    #: Relays the node picks by itself when nobody can dial it (reachability.md §7).
    auto_relay: AutoRelayConfig = field(default_factory=AutoRelayConfig)


class SwarmSlot:
    """The node's swarm service as the task service uses it (a
    :class:`~p2pnode.services.tasks.executor.SwarmRunner`): empty until
    :meth:`Node.open_swarms` fills it, and answering only while the service runs."""

    def __init__(self) -> None:
        self.service: SwarmService | None = None

    def running(self) -> SwarmService | None:
        """The swarm service, while it runs."""
        service = self.service
        return service if service is not None and service.running else None

    def joiner(self) -> Joiner | None:
        service = self.running()
        return service.joiner() if service is not None else None

    def statistics(self) -> dict[str, int]:
        service = self.running()
        return service.statistics() if service is not None else {}


class KernelReach:
    """The kernel as the reachability service uses it (its
    :class:`~p2pnode.services.reachability.service.KernelSide`)."""

    def __init__(self, node: Node) -> None:
        self._node = node
        #: The DHT's UDP address while :func:`open_node` runs it.
        self.dht_address: Address | None = None

    def observed(self, peer: PeerId) -> Address | None:
        link = self._node.links.get(peer)
        if link is not None and link.relayed:  # it comes from the relay's address
            return None
        address = None if link is None else link.remote_address
        if address is None or not isinstance(address[0], str):
            why = f"no open channel to {peer}: where it asks from cannot be told"
            raise LocalError(ErrorCode.CHANNEL_CLOSED, why)
        return (address[0], int(address[1]))

    def met(self) -> list[PeerId]:
        return [link.peer_id for link in self._node.links if link.state is ChannelState.OPEN]

    async def meet(self, address: Address) -> PeerId:
        return await self._node.connect(address)

    def sender(self) -> str:
        return self._node.default_agent()

    def candidates(self) -> list[Candidate]:
        host, port = parse_address(self._node.advertised_addresses()[0])
        out = [Candidate(Transport.TCP, host, port)]
        if self.dht_address is not None:
            out.append(Candidate(Transport.UDP, host, self.dht_address[1]))
        return out


class Node(Kernel):
    """A full peer: the kernel and its services (see the module docstring). Use
    ``async with Node(...) as node``, or :func:`open_node` (with the DHT)."""

    config: NodeConfig

    def __init__(
        self,
        identity: Identity,
        network: Network,
        config: NodeConfig | None = None,
        *,
        discovery: Discovery | None = None,
        clock_ms: Callable[[], int] = wall_clock_ms,
    ) -> None:
        config = config if config is not None else NodeConfig()
        super().__init__(identity, network, config, discovery=discovery, clock_ms=clock_ms)
        self._shared: SharedState | None = None
        self._swarms = SwarmSlot()
        #: Task negotiation between agents (p2pnode.services.tasks.service), run with the node.
        self.tasks = TaskService(self, config.tasks, swarms=self._swarms)
        #: Serves and audits the local agents' tools, resources and prompts.
        self.tool_audit = ToolAudit(
            self.registry,
            self.events,
            lambda: self.policy.config.authority_key,
            tool_deadline=config.tool_deadline,
        )
        self.tool_audit.serve_on(self)
        #: The swarm's tools, resources and prompts, used as a local agent.
        self.tools = ToolClient(self, self.default_agent)
        self._reach_kernel = KernelReach(self)
        self._dht_reach: DhtReach | None = None
        #: Relays this node picks by itself once nobody can dial it (reachability.md §7).
        self.auto_relay = AutoRelay(
            RelaySide(
                self.links.start_relay, self.links.stop_relay, self.hosting.set_auto_relays,
                lambda: self.reachability.own_verdict, self._want_relay_offers,
            ),
            RelayBook(config.auto_relay, self.peer_id, config.relays),
        )
        #: Dial-back checks: served to peers, and run for this node (check_reachability).
        self.reachability = ReachabilityService(
            self, network, self._reach_kernel, lambda: self._dht_reach,
            on_offer=self.auto_relay.offered, on_verdict=lambda _: self.auto_relay.poke(),
        )
        self.reachability.serve_on(self)
        #: Checks this node's addresses now and then; its cards list the confirmed ones.
        self.auto_reach = AutoCheck(
            AutoSide(
                self.reachability.check, self._reach_peers, self._reach_addresses,
                self.set_card_addresses,
            ),
            config.reachability,
            random.Random(),
        )
        #: Upgrades relayed channels to direct ones (docs/protocol/holepunch.md); only
        #: on real TCP sockets.
        self.holepunch = HolePunchService(
            self, KernelLinks(self), tcp_dial_from if isinstance(network, TrioNetwork) else None
        )
        self.holepunch.serve_on(self)

    async def _start(self, nursery: trio.Nursery) -> None:
        await super()._start(nursery)
        await nursery.start(self.tasks.run)
        await nursery.start(self.holepunch.run)
        await nursery.start(self.auto_reach.run)
        await nursery.start(self.auto_relay.run)

    def _want_relay_offers(self) -> None:
        """The automatic relays know too few relays: a check soon brings offers."""
        self.auto_reach.schedule.addresses_changed(trio.current_time())

    def _reach_peers(self) -> int:
        """Peers that may be checkers: open channels and DHT contacts."""
        discovery = self.discovery
        contacts = len(discovery.dht.table) if isinstance(discovery, DhtDiscovery) else 0
        return len(self._reach_kernel.met()) + contacts

    def _reach_addresses(self) -> tuple[object, ...]:
        """The node's own addresses and relays: a change calls for a check."""
        return (tuple(self._reach_kernel.candidates()), self.config.relays)

    # -- services opened on demand ----------------------------------------------------------

    async def open_shared(
        self, config: SharedConfig | None = None, *, rng: random.Random | None = None
    ) -> SharedState:
        """Start the node's shared-state service (CRDT documents replicated by gossip,
        durable in ``data_dir/crdt.sqlite3`` when the node has a data directory) in the
        node's nursery; returns it (the running one if already started). Call after
        adding the node's agents so saved subscriptions are restored."""
        if self._shared is None:
            shared = SharedState(self, config, rng=rng)
            self._shared = shared
            try:
                await self.start_service(shared)
            except BaseException:
                self._shared = None
                raise
        return self._shared

    @property
    def shared(self) -> SharedState:
        """The service started by :meth:`open_shared`. Raises LocalError(INVALID_ARGUMENT)."""
        if self._shared is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "shared state is not open; open_shared()")
        return self._shared

    async def open_swarms(
        self, config: SwarmConfig | None = None, *, shared: SharedConfig | None = None
    ) -> SwarmService:
        """Run the swarm service (opening shared state first, with ``shared``, if it is
        not open); returns it (the running one if already started). From then on this
        node's agents may accept invitations to swarms."""
        running = self._swarms.running()
        if running is not None:
            return running
        service = SwarmService(self, self.tasks, await self.open_shared(shared), config)
        await self.start_service(service)
        self._swarms.service = service
        return service

    async def open_agent_socket(
        self, path: Path, *, endorser: Identity | None = None
    ) -> AgentSocket:
        """Serve agents attached from other processes on the Unix socket ``path``: they
        use the shared documents (when open), the swarm's tools and task proposals, and
        the uses of their own tools are audited here; ``endorser`` endorses their cards."""
        socket = AgentSocket(
            self,
            path,
            documents=self._shared,
            tools=self.tools,
            tasks=self.tasks,
            audit=self.tool_audit,
            endorser=endorser,
        )
        await self.start_service(socket)
        return socket

    async def serve_metrics(self, address: tuple[str, int]) -> MetricsExporter:
        """Serve Prometheus metrics at ``address``, read from the node at each scrape.
        Raises LocalError(CONFIG_ERROR) without prometheus-client or when the address
        cannot be bound."""
        exporter = MetricsExporter(self, address)
        await self.start_service(exporter)
        return exporter

    async def check_reachability(self) -> Verdict:
        """Ask peers to dial this node's addresses back (docs/protocol/reachability.md);
        the verdict, also in ``status``. Raises LocalError(AGENT_NOT_FOUND) when the node
        hosts no agent to ask as. A decisive verdict sets the cards' direct addresses
        (reachability.md §6), as the automatic checks do."""
        verdict = await self.reachability.check()
        await self.auto_reach.apply(verdict)
        return verdict

    # -- status -----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """A snapshot for ``p2pnode status``: the kernel's, with the services'."""
        out = super().status()
        discovery, metrics = out.pop("discovery"), out.pop("metrics")
        shared = self._shared
        out["documents"] = shared.subscriptions() if shared is not None else {}
        out["documentWarnings"] = shared.warnings() if shared is not None else {}
        out["discovery"] = discovery
        out["tasks"] = self.tasks.statistics()
        # The verdict (with its confirmed addresses), what the cards list, the DHT's mode.
        reach = self.reachability.statistics()
        reach["cardAddresses"] = list(self.hosting.card_addresses())
        reach["dhtMode"] = discovery.get("mode")
        reach["auto"] = self.auto_reach.statistics()
        reach["autoRelay"] = self.auto_relay.statistics()
        out["reachability"] = reach
        out["holepunch"] = self.holepunch.statistics()
        out["metrics"] = metrics
        return out


async def open_swarms(
    node: Node, config: SwarmConfig | None = None, *, shared: SharedConfig | None = None
) -> SwarmService:
    """:meth:`Node.open_swarms` of ``node``."""
    return await node.open_swarms(config, shared=shared)


@asynccontextmanager
async def open_node(
    identity: Identity,
    network: Network,
    config: NodeConfig,
    *,
    clock_ms: Callable[[], int] = wall_clock_ms,
) -> AsyncIterator[Node]:
    """A running node with its DHT; everything is closed on exit. ``clock_ms`` is the
    wall clock cards and DHT records expire on (simulations pass a virtual one)."""
    async with Node(identity, network, config, clock_ms=clock_ms) as node:
        host, port = config.dht_listen
        if port == 0:
            port = node.listen_address[1]
        dht_node = DhtNode(
            network,
            identity=identity,
            address=(host, port),
            config=config.dht,
            wall_clock_ms=clock_ms,
        )
        async with dht_node as dht:
            node.discovery = DhtDiscovery(dht)
            # Joining asks a bootstrap peer that opened no channel whether its DHT answers.
            node.joining.probe_dht = partial(_dht_answers, dht)
            node._dht_reach = DhtReach(
                dht, network, node.reachability.dial_peer_id.raw, random.Random()
            )
            node._reach_kernel.dht_address = dht.address
            # What the DHT drops (a forged or poisoned record, a datagram that failed)
            # is a security event of the node, counted in `status` like a bad frame.
            dht.boundary.also_report(node.report_input_failure)
            snapshot = config.data_dir / SNAPSHOT_FILE if config.data_dir else None
            if snapshot is not None and snapshot.exists():
                try:
                    restored = dht.restore(snapshot.read_bytes())
                    logger.info("restored %d DHT contacts from %s", restored, snapshot)
                except (LocalError, OSError) as exc:
                    logger.warning("ignoring DHT snapshot %s: %s", snapshot, exc)
            try:
                yield node
            finally:
                # Withdraw the agents while the DHT still runs: peers and lookups stop
                # listing them now, not when their cards expire.
                with trio.CancelScope(shield=True):
                    await node.leave()
                node._dht_reach = None
                node._reach_kernel.dht_address = None
                if snapshot is not None:
                    write_private_file(snapshot, dht.snapshot())


async def _dht_answers(dht: DhtNode, address: Address) -> bool:
    return await dht.ping(address) is not None


# Besides its own names, the services' names that programs using a node meet (hosting,
# the CLI) are public here: the files shared state keeps in the data directory, its
# configuration, the service and a document's watch; the handle of a proposed task.
__all__ = [
    "SNAPSHOT_FILE",
    "STORE_FILE_NAME",
    "SUBSCRIPTIONS_FILE_NAME",
    "Node",
    "NodeConfig",
    "SharedConfig",
    "SharedState",
    "SwarmSlot",
    "TaskHandle",
    "Watch",
    "open_node",
    "open_swarms",
]
