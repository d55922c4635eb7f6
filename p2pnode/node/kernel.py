"""The kernel: identity, cards, channels, routing and policy; it knows no service.

Theory of operation:

* A :class:`Kernel` is an async context manager owning one nursery. Opening it
  starts the secure-channel listener and the discovery service; closing it
  cancels and awaits every task it started.
* A node hosts local agents (:meth:`Kernel.add_agent`), each with a signed
  card and a handler, through its :class:`~p2pnode.node.agents.AgentHost`.
  Each card is re-issued at half its lifetime, and remote cards past their
  expiry are forgotten (``AgentHost.keep_cards``). Each agent has a bounded
  inbox read in arrival order (per-channel order is kept end to end):
  notifications are handled one at a time, in that order; requests
  concurrently, each with a deadline, at most ``agent_concurrency`` waiting.
* **Egress** (:meth:`Kernel.send`, in :mod:`p2pnode.node.routing`): the sender
  must be a local agent. The router resolves the recipient (local agent, registry, then discovery;
  ``*`` for broadcast; a capability with ``routingHint``), checks policy for
  each target against the *signed cards* of both ends, and delivers locally or
  over the peer's link. Every decision emits a routing event.
* **Ingress** (``_on_frame``, also in the routing module): a frame from peer P is decoded with hard
  limits. A HELLO's cards must be owned by P. An envelope's sender must be
  an agent whose signed card belongs to P (otherwise SENDER_MISMATCH and a
  security event); policy is checked again against that card; duplicate
  envelope ids are dropped.
* Replies (response, error, task-accept, task-reject) answering a request
  the node allowed are not tier-checked again, so an L1 agent may answer an
  L3 agent's permitted request.
* Protocols carried in ``stream-data`` envelopes (CRDT gossip) register an
  interceptor for a payload marker (:meth:`Kernel.intercept_stream`): a
  matching envelope goes to it *after* sender authentication and ingress
  policy, instead of to the agent's handler.
* The kernel is the :class:`~p2pnode.node.service.ServiceHost` of protocol
  services and builds none: services register interceptors, request methods
  they serve (:meth:`Kernel.serve_methods`) and hooks on agents added and
  removed (:meth:`Kernel.watch_agents`). The composition root
  (:mod:`p2pnode.runtime`) builds the services and the public ``Node``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any

import trio

from p2pnode.agent.definition import Agent, as_agent
from p2pnode.core.boundary import FailureBoundary, describe
from p2pnode.core.card import AgentCard, Capability, Origin
from p2pnode.core.envelope import (
    ROUTING_HINT_CAPABILITY,
    Envelope,
    EnvelopeFactory,
    MessageType,
    Metadata,
    wall_clock_ms,
)
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.core.identity import Identity, PeerId
from p2pnode.core.jsonutil import is_json_value
from p2pnode.core.lifetime import TaskOwner
from p2pnode.core.registry import Registry
from p2pnode.core.threadstore import ThreadStore
from p2pnode.node.agents import AgentHost
from p2pnode.node.callcancel import CANCELLED, cancel_payload, requested_wait
from p2pnode.node.channels import ChannelState
from p2pnode.node.config import KernelConfig, format_address, parse_address, parse_bootstrap
from p2pnode.node.discovery import Discovery, NoDiscovery
from p2pnode.node.joining import Joining, resolve_host
from p2pnode.node.links import LinkManager
from p2pnode.node.observability import Observability
from p2pnode.node.policy import Policy
from p2pnode.node.probe import probe
from p2pnode.node.progress import ProgressCallback
from p2pnode.node.router import BoundedSet, Interceptor, Router, RoutingResult
from p2pnode.node.routing import (
    FAILOVER_ATTEMPTS,
    Handler,
    LocalAgent,
    PendingRequest,
    Routing,
)
from p2pnode.node.service import MethodServer, Service
from p2pnode.transport.net import Address, Network, StreamListener
from p2pnode.transport.secure import SecureIdentity

logger = logging.getLogger("p2pnode.node")

#: Owners ``find`` dials at most, per call, to check that they are alive, and how long
#: it waits for their channels to open.
FIND_PROBES = 16
FIND_WINDOW = 3.0


class Kernel(TaskOwner):
    """A full peer without services (:class:`p2pnode.runtime.Node` adds them). Use
    ``async with Kernel(...) as kernel``."""

    def __init__(
        self,
        identity: Identity,
        network: Network,
        config: KernelConfig | None = None,
        *,
        discovery: Discovery | None = None,
        clock_ms: Callable[[], int] = wall_clock_ms,
    ) -> None:
        self.identity = identity
        self.config = config if config is not None else KernelConfig()
        self.network = network
        self.secure_identity = SecureIdentity(identity)
        self.registry = Registry(identity)
        self.policy = Policy(self.config.policy)
        self.events = Observability(clock_ms)
        #: Contains whatever one peer's frame raises (see :mod:`p2pnode.core.boundary`).
        self.boundary = FailureBoundary(logger, self.report_input_failure)
        self._clock_ms = clock_ms
        self._factory = EnvelopeFactory(clock_ms)
        self._agents: dict[str, LocalAgent] = {}

        def on_frame(peer_id: PeerId, data: bytes) -> Awaitable[None]:
            return self.routing.on_frame(peer_id, data)

        self.links = LinkManager(
            self.secure_identity,
            network,
            self.config,
            self.registry,
            self.events,
            on_frame,  # frames go to the routing driver, made just below
            lambda: self.hosting.hello_bytes(),  # the agent host, made below
            on_departed=lambda peer, why: self.routing.peer_departed(peer, why),
        )
        self.routing = self._make_routing(discovery)
        self.routing.discovery.watch_withdrawals(self.routing.cards.withdraw)
        #: What services are told of agents hosted and removed (watch_agents).
        self._added_hooks: list[Callable[[Agent], None]] = []
        self._removed_hooks: list[Callable[[str], None]] = []
        #: The local agents: hosting, inbox tasks, card renewal (see p2pnode.node.agents).
        self.hosting = AgentHost(
            self,
            self._agents,
            self.secure_identity,
            self.config,
            self.registry,
            self.events,
            self.links,
            self.routing,
            self.advertised_addresses,
            self._on_agent_removed,
            clock_ms,
        )
        self._listen_address: Address | None = None
        #: Joining through the bootstrap peers, tried again until it works (join, status).
        self.joining = self._make_joining()

    def _make_joining(self) -> Joining:
        """Joining, given the kernel's dialing, discovery, cards and channels."""
        return Joining(
            self.config.bootstrap,
            open_channel=self._open_channel,
            bootstrap_dht=lambda addresses: self.discovery.bootstrap(addresses),
            publish=self._publish_cards,
            is_own=self._is_own_address,
            peers=self._open_channels,
            dht_contacts=self._dht_contacts,
            dial_timeout=self.config.retry.dial_timeout,
        )

    def _make_routing(self, discovery: Discovery | None) -> Routing:
        """The routing driver over the node's agents, registry, policy and links."""
        # Requests the node let through: their answers (a task's may come hours later)
        # pass for as long as the window holds them, so no age here.
        allowed = BoundedSet(self.config.dedup_window, max_age=None)
        router = Router(self.registry, self.policy, self._agents, allowed)
        return Routing(
            router,
            self._agents,
            self.registry,
            self.policy,
            self.links,
            self.events,
            self._factory,
            self.boundary,
            discovery if discovery is not None else NoDiscovery(),
            dedup_window=self.config.dedup_window,
            max_peers=self.config.max_peers,
            clock_ms=self._clock_ms,
        )

    # -- lifecycle --------------------------------------------------------------------------

    async def _start(self, nursery: trio.Nursery) -> None:
        listener = await self.network.listen_stream(self.config.listen)
        self._listen_address = listener.local_address
        await nursery.start(self._run_links, listener)
        nursery.start_soon(
            self.routing.expire_requests, self.config.request_timeout / 8, self.network.move_on_at
        )
        nursery.start_soon(self.hosting.keep_cards)

    async def _run_links(
        self,
        listener: StreamListener,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async with self.links:
            await self.links.nursery.start(self.links.accept_loop, listener)
            task_status.started()
            await trio.sleep_forever()

    async def _stop(self) -> None:
        await self.leave()
        await self.links.close_all()
        self.hosting.close_inboxes()

    async def leave(self) -> None:
        """Withdraw every local agent, as a stopping node does (closing the node does it
        too): connected peers drop their cards at once, and the DHT's records of them
        are replaced by signed withdrawals (docs/protocol/node.md "Leaving"). Bounded
        by ``config.leave_timeout``; call it before closing the discovery service."""
        await self.hosting.leave()

    def report_input_failure(self, source: str, what: str, exc: Exception) -> None:
        """A security event for an input from ``source`` that a failure boundary dropped."""
        code = exc.code if isinstance(exc, P2PError) else ErrorCode.INPUT_FAILED
        self.events.security(code, f"{what} dropped: {describe(exc)}", source, None)

    def now_ms(self) -> int:
        """The node's wall clock (ms since the epoch; the simulator's in simulations)."""
        return self._clock_ms()

    # -- routing (see p2pnode.node.routing) -------------------------------------------------

    @property
    def discovery(self) -> Discovery:
        """How the node finds agents it has not met (the DHT, once
        :func:`p2pnode.runtime.open_node` set it)."""
        return self.routing.discovery

    @discovery.setter
    def discovery(self, discovery: Discovery) -> None:
        self.routing.discovery = discovery
        discovery.watch_withdrawals(self.routing.cards.withdraw)

    @property
    def threads(self) -> ThreadStore:
        """Envelopes sent and received, by conversation."""
        return self.routing.threads

    @property
    def data_dir(self) -> Path | None:
        return self.config.data_dir

    # send and send_many hand back the routing driver's coroutine rather than awaiting
    # it in one of their own: one frame less on every envelope's way out.

    def send(self, envelope: Envelope) -> Coroutine[Any, Any, RoutingResult]:
        """Route one envelope from a local agent (see :meth:`Routing.send`); await it.

        Raises LocalError: AGENT_NOT_FOUND, CAPABILITY_NOT_FOUND, TIER_VIOLATION,
        SANDBOX_VIOLATION, ESCALATION_REQUIRED, DELIVERY_FAILED.
        """
        return self.routing.send(envelope)

    def send_many(self, envelopes: Iterable[Envelope]) -> Coroutine[Any, Any, list[RoutingResult]]:
        """Route envelopes in order, each as :meth:`send` would; each peer's share leaves
        in one coalesced write (see :meth:`Routing.send_many`); await it."""
        return self.routing.send_many(envelopes)

    @property
    def peer_id(self) -> PeerId:
        return self.identity.peer_id

    @property
    def listen_address(self) -> Address:
        if self._listen_address is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "the node is not listening")
        return self._listen_address

    def advertised_addresses(self) -> list[str]:
        host, port = self.listen_address[0], self.listen_address[1]
        if self.config.advertise_host:
            host = self.config.advertise_host
        elif host in ("0.0.0.0", "::"):
            host = "127.0.0.1"
        return [format_address((host, port))]

    async def set_card_addresses(self, addresses: Iterable[str] | None) -> bool:
        """List ``addresses`` (``host:port``) as the direct addresses of the local cards,
        or the node's own (:meth:`advertised_addresses`) again with None; relayed
        endpoints stay. When the list changes, every local card is re-issued (a new
        revision, announced as any update); True then, False when nothing changed."""
        return await self.hosting.set_card_addresses(addresses)

    # -- local agents -----------------------------------------------------------------------

    async def add_agent(
        self,
        agent: Agent | str,
        handler: Handler | None = None,
        *,
        name: str | None = None,
        tier: int = 3,
        capabilities: tuple[Capability, ...] = (),
        sandbox_id: str | None = None,
        description: str = "",
        version: str = "1.0.0",
        authority: Identity | None = None,
        roles: tuple[str, ...] = (),
    ) -> AgentCard:
        """Host an agent on this node, publish its signed card, return the card.

        ``agent`` is an :class:`~p2pnode.agent.definition.Agent` definition (its id, tier,
        sandbox, capabilities and handlers; the keyword arguments other than
        ``authority`` are then not used), or an agent id with one ``handler``
        for every envelope (a request's answer is what it returns).
        ``authority`` (tests and single-operator swarms) endorses the card's tier
        and sandbox, and ``roles`` (what access rules of tools may ask for).
        Raises LocalError(INVALID_CARD) on invalid fields.
        """
        definition = as_agent(
            agent,
            handler,
            name=name,
            tier=tier,
            capabilities=capabilities,
            sandbox=sandbox_id,
            description=description,
            version=version,
        )
        card = await self.hosting.add_agent(definition, authority=authority, roles=roles)
        for hook in tuple(self._added_hooks):
            hook(definition)
        return card

    async def add_agent_card(
        self,
        card: AgentCard,
        agent: Agent | Handler,
        *,
        authority: Identity | None = None,
        roles: tuple[str, ...] = (),
    ) -> AgentCard:
        """Host an agent whose card (owned by this node's identity) is given, with its
        definition (or one handler for every envelope); ``authority`` and ``roles`` as
        for :meth:`add_agent`."""
        stored = await self.hosting.add_agent_card(card, agent, authority=authority, roles=roles)
        if isinstance(agent, Agent):
            for hook in tuple(self._added_hooks):
                hook(agent)
        return stored

    async def remove_agent(self, agent_id: str) -> None:
        """Stop hosting local agent ``agent_id``. What is already queued for it is answered
        as if it were gone (a request with ``AGENT_UNAVAILABLE``); then its card is
        unregistered, the services watching agents are told (shared documents forget it
        as a member, its tasks are canceled), connected peers get a HELLO without it and
        :meth:`join` provides it no more. A handler still running is waited for at most
        ``config.request_timeout``.

        Raises LocalError(AGENT_NOT_FOUND).
        """
        await self.hosting.remove_agent(agent_id)

    def _on_agent_removed(self, agent_id: str) -> None:
        for hook in tuple(self._removed_hooks):
            hook(agent_id)

    def watch_agents(
        self,
        *,
        added: Callable[[Agent], None] | None = None,
        removed: Callable[[str], None] | None = None,
    ) -> Callable[[], None]:
        """Call ``added(definition)`` each time an agent is hosted from a definition
        (:meth:`add_agent`, or :meth:`add_agent_card` given an :class:`Agent`), and
        ``removed(agent_id)`` each time one is removed (before peers are told). The
        hooks run in the caller's task and must not block. Returns what stops them."""
        if added is not None:
            self._added_hooks.append(added)
        if removed is not None:
            self._removed_hooks.append(removed)

        def unwatch() -> None:
            if added is not None and added in self._added_hooks:
                self._added_hooks.remove(added)
            if removed is not None and removed in self._removed_hooks:
                self._removed_hooks.remove(removed)

        return unwatch

    def serve_methods(
        self, methods: Iterable[str], server: MethodServer | None, *, streamed: bool = False
    ) -> None:
        """Answer requests to local agents whose ``metadata.capability`` is one of
        ``methods`` with ``server`` instead of the agent's handler (``None`` stops).
        ``server.deadline`` bounds such a call; with ``streamed`` a large answer may
        leave as a stream (p2pnode.node.replystream).

        Raises LocalError(INVALID_ARGUMENT) when one of the methods is served already.
        """
        self.hosting.serve_methods(methods, server, streamed=streamed)

    async def add_capability(self, agent_id: str, capability: Capability) -> AgentCard:
        """Re-publish local agent ``agent_id``'s card with ``capability`` added: the revision
        bumps, connected peers get a HELLO and discovery a ``provide``. Returns the card
        (unchanged when it already offers that capability id).

        Raises LocalError(AGENT_NOT_FOUND) or LocalError(INVALID_CARD) (too many capabilities).
        """
        return await self.hosting.add_capability(agent_id, capability)

    def intercept_stream(self, marker: str, interceptor: Interceptor | None) -> None:
        """Send inbound ``stream-data`` envelopes whose payload is a map holding the key
        ``marker`` to ``interceptor`` instead of the recipient's handler (``None``
        removes it). It runs after sender authentication and ingress policy, once per
        allowed local recipient, on the channel's reader task (for an envelope between
        two agents of this node, in the sender's task): it must not block.

        Raises LocalError(INVALID_ARGUMENT) when ``marker`` is already intercepted.
        """
        self.routing.intercept_stream(marker, interceptor)

    def intercept_types(
        self, types: Iterable[MessageType], interceptor: Interceptor | None
    ) -> None:
        """Like :meth:`intercept_stream`, for every inbound envelope of the given types
        (checked before payload markers). Raises LocalError(INVALID_ARGUMENT) when one
        of the types is already intercepted."""
        self.routing.intercept_types(types, interceptor)

    async def start_service(self, service: Service) -> None:
        """Run ``service`` (see :mod:`p2pnode.node.service`) until the node closes; returns
        once it reported readiness."""
        await self.nursery.start(service.run)

    def default_agent(self) -> str:
        """The first local agent's id. Raises LocalError(AGENT_NOT_FOUND) when there is none."""
        for agent_id in self._agents:
            return agent_id
        raise LocalError(ErrorCode.AGENT_NOT_FOUND, "this node hosts no agent")

    async def join(self) -> int:
        """Join the swarm through the configured bootstrap peers (docs/protocol/node.md
        "Joining"): resolve their host names, open a channel to each (exchanging cards),
        bootstrap the DHT through them and publish the local cards again. Returns how
        many channels opened.

        The node's own address is skipped (one bootstrap list serves every node of a
        swarm, bootstrap nodes included). A bootstrap peer without a secure channel
        whose DHT answers (a DHT-only node, such as a stock ``kademlia`` one) counts as
        joined (one INFO line); one that cannot be resolved or reached is one WARNING,
        the first time. When none answered, the node tries again in the background
        (2 s doubling to 300 s, ±25%) until one does; ``status()["join"]`` says where
        it stands. With no bootstrap peer (the swarm's first node), the local cards are
        published again all the same.
        """
        if not self.config.bootstrap:
            await self._publish_cards()
        return await self.joining.join(self.nursery)

    async def _publish_cards(self) -> None:
        """Provide every local card to discovery (again: cards published before the DHT
        had a contact reached nobody)."""
        for agent in list(self._agents.values()):
            try:
                await self.discovery.provide(agent.card)
            except P2PError as exc:
                self.events.error(exc.code, f"publishing {agent.card.id}: {exc.message}")

    def _open_channels(self) -> int:
        return sum(1 for link in self.links if link.state is ChannelState.OPEN)

    def _dht_contacts(self) -> int | None:
        """The DHT's routing table size (None: discovery is not a DHT)."""
        contacts = self.discovery.statistics().get("contacts")
        return contacts if isinstance(contacts, int) else None

    def _is_own_address(self, address: Address) -> bool:
        """Is ``address`` this node's listener (by port, and by host as listened on or
        advertised; any loopback host when listening on every interface)?"""
        host, port = address[0], address[1]
        if port != self.listen_address[1]:
            return False
        own = {self.listen_address[0]} | {parse_address(a)[0] for a in self.advertised_addresses()}
        if self.listen_address[0] in ("0.0.0.0", "::"):
            own |= {"127.0.0.1", "::1", "localhost"}
        return host in own

    async def find(self, capability: str, viewer: str | None = None) -> list[AgentCard]:
        """Agents offering ``capability`` that local agent ``viewer`` (default: the first)
        may discover: the registry, refreshed from the DHT, filtered by the viewer's
        sandbox rules as capability routing is (seed R10.4). Agents withdrawn, expired
        or whose owner is known unreachable are not returned, nor those whose owner
        opens no channel within ``FIND_WINDOW`` seconds when dialed (the first
        ``FIND_PROBES`` owners this node has no channel to are). An owner known
        unreachable whose newer card discovery brought is dialed too, first, and its
        agents returned if it answers. Unfiltered on a node that hosts no agent (there
        is no viewer).

        Raises LocalError(AGENT_NOT_FOUND) when ``viewer`` is not a local agent.
        """
        seer = self.local_agent(viewer) if viewer is not None else self._first_card()
        returned = self._learn_found(await self.discovery.find_providers(capability))
        cards = self._live_providers(capability, returned)
        if seer is not None:
            cards = self.policy.filter_discoverable(seer, cards)
        # A card says only that its owner was alive when it signed it: the owners this
        # node has no channel to are dialed (at most FIND_PROBES, at once, for up to
        # FIND_WINDOW seconds); one that opened no channel by then is left out.
        # Owners known unreachable that are back (``returned``) are dialed first: their
        # cards are returned only if they answer.
        remote = dict.fromkeys(
            [*sorted(returned, key=str), *(c.peer_id for c in cards if c.origin is Origin.REMOTE)]
        )
        probed = set(list(remote)[:FIND_PROBES])
        await probe(self.links, probed, FIND_WINDOW)
        now = self._clock_ms()
        return [
            c
            for c in cards
            if (self._answers(c.peer_id) if c.peer_id in probed else self.registry.is_live(c, now))
        ]

    def _answers(self, peer_id: PeerId) -> bool:
        link = self.links.get(peer_id)
        return link is not None and link.state is ChannelState.OPEN

    def _learn_found(self, found: list[AgentCard]) -> set[PeerId]:
        """Learn the cards discovery ``found``; the owners among them that signed a card
        this node had not seen (a newer revision): they show they are back, even if this
        node knows them unreachable (docs/protocol/node.md "Agent ids and owners")."""
        returned: set[PeerId] = set()
        for card in found:
            if card.origin is Origin.LOCAL and card.peer_id == self.peer_id:
                continue
            held = self.registry.find_owned(card.id, card.peer_id)
            if (held is None or card.revision > held.revision) and self.routing.cards.learn(card):
                returned.add(card.peer_id)
        return returned

    def _live_providers(
        self, capability: str, returned: set[PeerId] | frozenset[PeerId] = frozenset()
    ) -> list[AgentCard]:
        """The live claims offering ``capability``, and those of the ``returned`` owners
        (known unreachable, but with a card newer than this node had: ``find`` dials them
        before answering)."""
        now = self._clock_ms()
        registry = self.registry
        return [
            c
            for c in registry.find_by_capability(capability)
            if registry.is_live(c, now) or (c.peer_id in returned and not c.is_expired(now))
        ]

    def _first_card(self) -> AgentCard | None:
        for agent in self._agents.values():
            return agent.card
        return None

    async def deliver(self, agent_id: str, envelope: Envelope) -> None:
        """Queue an inbound ``envelope`` that a service intercepted and declined for local
        agent ``agent_id``'s handler. Raises LocalError(AGENT_NOT_FOUND)."""
        agent = self._agents.get(agent_id)
        if agent is None:
            raise LocalError(ErrorCode.AGENT_NOT_FOUND, f"no local agent {agent_id!r}")
        await agent.deliver(envelope)

    def local_agent(self, agent_id: str) -> AgentCard:
        agent = self._agents.get(agent_id)
        if agent is None:
            raise LocalError(ErrorCode.AGENT_NOT_FOUND, f"no local agent {agent_id!r}")
        return agent.card

    # -- envelopes out ----------------------------------------------------------------------

    def envelope(
        self,
        sender: str,
        recipient: str,
        type: MessageType,
        payload: Any = None,
        *,
        correlation_id: str | None = None,
        metadata: Metadata | None = None,
    ) -> Envelope:
        """A new envelope from a local agent, its metadata filled from the agent's card."""
        agent = self._agents.get(sender)
        if agent is None:
            raise LocalError(ErrorCode.AGENT_NOT_FOUND, f"no local agent {sender!r}")
        card = agent.card
        if metadata is None:
            meta = agent.metadata
        elif metadata.tier == card.tier and metadata.sandbox_id == card.sandbox_id:
            meta = metadata  # the claims are the card's already
        else:
            meta = dataclasses.replace(metadata, tier=int(card.tier), sandbox_id=card.sandbox_id)
        return self._factory.create(
            sender, recipient, type, payload, correlation_id=correlation_id, metadata=meta
        )

    async def request(
        self,
        sender: str,
        recipient: str,
        payload: Any = None,
        *,
        capability: bool = False,
        metadata: Metadata | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (it travels to the owner: deadlineMs)
        on_progress: ProgressCallback | None = None,
    ) -> Envelope:
        """Send a request and wait for its response. ``metadata`` may name the capability
        of the recipient asked (``metadata.capability``); ``capability=True`` says
        ``recipient`` is a capability to resolve.

        ``timeout`` (seconds, more than 0, at most a day; default ``config.request_timeout``)
        is an idle deadline: each progress the owner reports (p2pnode.node.progress, given
        to ``on_progress``) starts it again. A timeout given travels in
        ``metadata.deadlineMs``, and the owner bounds its handler by it (node.md).

        A request to ``*`` is broadcast and answered by the first reply of any agent
        it reached (AGENT_NOT_FOUND when it reached none). Raises RemoteError with
        the responder's code when it answers with an ``error`` envelope,
        LocalError(TIMEOUT) when no answer comes within ``config.request_timeout``
        (checked every eighth of it, so up to 12.5% later), LocalError(DELIVERY_FAILED)
        at once when the recipient's peer leaves meanwhile (its link closed after failed
        redials), and what :meth:`send` raises. A request given up (timed out, or
        cancelled) to one agent is cancelled at its owner (p2pnode.node.callcancel).
        A request by capability whose provider's peer leaves before it answered (no part
        of an answer came) goes, as a new request, to another provider: at most
        ``FAILOVER_ATTEMPTS`` more times.
        """
        meta = metadata
        if capability:
            meta = dataclasses.replace(meta or Metadata(), routing_hint=ROUTING_HINT_CAPABILITY)
        wait = self.config.request_timeout if timeout is None else requested_wait(timeout)
        if timeout is not None:
            meta = dataclasses.replace(meta or Metadata(), deadline_ms=math.ceil(wait * 1000))
        # By capability a request names any provider: one whose node left before it answered
        # (its channel lost, its redials failed: now unreachable) is replaced by another.
        attempts = 1 + (FAILOVER_ATTEMPTS if capability and recipient != "*" else 0)
        for attempt in range(attempts):
            envelope = self.envelope(sender, recipient, MessageType.REQUEST, payload, metadata=meta)
            pending = await self._request_once(envelope, wait, on_progress, capability)
            left = pending.reply is None and pending.error is not None
            if not left or pending.stream is not None or attempt == attempts - 1:
                break
            logger.debug("request %s: its provider left (%s); asking another", envelope.id,
                         pending.error)  # fmt: skip
        return _answer(pending, envelope.id, recipient)

    async def _request_once(
        self,
        envelope: Envelope,
        wait: float,
        on_progress: ProgressCallback | None,
        capability: bool,
    ) -> PendingRequest:
        """Send ``envelope`` and wait up to ``wait`` (idle) for its answer; the pending
        request, answered, failed (its owner left) or not."""
        recipient = envelope.recipient
        pending = self.routing.pending[envelope.id] = PendingRequest()
        pending.idle, pending.on_progress = wait, on_progress
        targets: tuple[str, ...] = ()
        try:
            result = await self.routing.send(envelope)
            targets = result.targets
            if not result.targets:
                raise LocalError(
                    ErrorCode.AGENT_NOT_FOUND, f"no reachable agent may receive {recipient!r}"
                )
            if pending.reply is None:
                pending.targets = result.targets
            pending.sent_at = trio.current_time()
            pending.deadline = pending.sent_at + wait
            await pending.event.wait()  # set by the reply, or when it expires
        finally:
            del self.routing.pending[envelope.id]
            gone = pending.error is not None  # its owner left: nobody to tell
            if pending.reply is None and not gone and len(targets) == 1 and recipient != "*":
                # Given up (timed out, or cancelled): the owner may cancel the handler.
                self._cancel_abandoned(envelope, targets[0] if capability else recipient)
        return pending

    def _cancel_abandoned(self, request: Envelope, recipient: str) -> None:
        """Tell ``recipient``, the agent ``request`` went to, that its requester gave up
        (the cancel notification of p2pnode.node.callcancel), from the node's nursery."""
        if self.is_open:
            self.nursery.start_soon(self._send_cancel, request, recipient)

    async def _send_cancel(self, request: Envelope, recipient: str) -> None:
        try:
            notice = self.envelope(
                request.sender,
                recipient,
                MessageType.NOTIFICATION,
                cancel_payload(request, "the requester stopped waiting"),
                correlation_id=request.correlation_id or request.id,
                metadata=Metadata(capability=CANCELLED),
            )
            with trio.move_on_after(self.config.request_timeout):
                await self.routing.send(notice)
        except P2PError as exc:  # the owner's deadline still bounds the call
            logger.debug("cancel of %s to %s not sent: %s", request.id, recipient, exc)

    # -- links ------------------------------------------------------------------------------

    async def connect(self, address: Address | str) -> PeerId:
        """Join through the node at ``address`` (``host:port`` text or a pair; a host
        name is resolved): open a channel and return its peer id once its HELLO (its
        agents' cards) has arrived, or after the dial timeout. When this node's DHT has
        no contact yet, it is bootstrapped through that peer and the local cards are
        published, so third nodes find this node's agents (docs/protocol/node.md
        "Joining").

        Raises LocalError(CONFIG_ERROR) for a malformed address, LocalError(DELIVERY_FAILED)
        when its host name does not resolve or nobody answers there,
        LocalError(INVALID_ARGUMENT) when it is this node's own address.
        """
        target = parse_bootstrap(address) if isinstance(address, str) else address
        where = format_address(target)
        try:
            resolved = await resolve_host(target)
        except OSError as exc:
            raise LocalError(
                ErrorCode.DELIVERY_FAILED, f"cannot resolve {where}: {describe(exc)}"
            ) from None
        try:
            peer_id = await self._open_channel(resolved)
        except OSError as exc:  # refused, unreachable: the system's words, one error type
            raise LocalError(
                ErrorCode.DELIVERY_FAILED, f"cannot reach {where}: {describe(exc)}"
            ) from None
        await self.joining.connected(resolved)
        return peer_id

    async def _open_channel(self, address: Address) -> PeerId:
        """Open a channel to ``address``; its peer id once its HELLO arrived (or after the
        dial timeout)."""
        peer_id = await self.links.connect(address)
        if peer_id == self.peer_id:
            # An address of this node that _is_own_address cannot tell (another
            # interface of a wildcard listener): a channel to itself carries nothing.
            link = self.links.get(peer_id)
            if link is not None:
                await link.aclose()
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"{format_address(address)} is this node")
        with trio.move_on_after(self.config.retry.dial_timeout):
            await self.routing.hello_seen(peer_id).wait()
        return peer_id

    # -- status -----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """A snapshot for ``p2pnode status``."""
        metrics = self.events.metrics()
        return {
            "peerId": str(self.peer_id),
            "addresses": self.advertised_addresses(),
            "swarm": "open (self-declared tiers)" if self.policy.is_open else "authority",
            "agents": [a.card.id for a in self._agents.values()],
            "knownAgents": len(self.registry),
            "peers": sorted({str(c.peer_id) for c in self.registry.list_remote()}),
            "channels": [
                {
                    "peer": str(link.peer_id),
                    "state": link.state.value,
                    "relayed": link.relayed,
                    "sent": link.frames_sent,
                    "received": link.frames_received,
                }
                for link in self.links
            ],
            "join": self.joining.status(trio.current_time()).to_dict(),
            "discovery": self.discovery.statistics(),
            "metrics": metrics.to_dict(),
        }


def _answer(pending: PendingRequest, request_id: str, recipient: str) -> Envelope:
    """The response a request got, or the error it ends in (see :meth:`Kernel.request`)."""
    reply = pending.reply
    if reply is None and pending.error is not None:
        raise pending.error  # DELIVERY_FAILED: the owner's peer left
    if reply is None:
        raise LocalError(ErrorCode.TIMEOUT, f"no response to {request_id} from {recipient}")
    if pending.stream is not None and reply.type is MessageType.RESPONSE:
        reply = pending.stream.assemble(reply)
    if reply.type is MessageType.ERROR:
        body = reply.payload if isinstance(reply.payload, dict) else {}
        code = body.get("code", "INTERNAL")
        details = body.get("details")
        raise RemoteError(
            ErrorCode(code) if code in ErrorCode.__members__ else ErrorCode.INTERNAL,
            str(body.get("message", "error response")),
            **(details if isinstance(details, dict) and is_json_value(details) else {}),
            responder=reply.sender,
        )
    return reply


__all__ = ["Handler", "Interceptor", "Kernel", "RoutingResult"]
