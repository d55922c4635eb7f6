"""The agents a node hosts: their signed cards, their inbox tasks, and their cards over time.

Theory of operation:

* :class:`AgentHost` is a part of the :class:`~p2pnode.node.kernel.Kernel`,
  which delegates ``add_agent``, ``add_agent_card``, ``remove_agent`` and
  ``add_capability`` to it. It holds the node's local agents (the same map
  the router and the routing driver read).
* Each hosted agent has a bounded inbox (by count, and by bytes per sending
  peer and in total: p2pnode.node.inbox) read by one task at a time, in
  arrival order, in the agent's own nursery (under the node's).
  Notifications and the other envelopes that get no answer are handled by
  that reader, in order, one at a time. Requests are answered concurrently
  without a task per request: the reader runs a request's handler itself,
  and a handler that answers without waiting (most) costs nothing more. The
  first time a handler waits (seen by :func:`_watched` before trio parks the
  task), its request becomes a *call*: its task's scope gets the call's
  deadline (for a method a service serves, the server's: for tools a
  tool's own or ``tool_deadline``; else ``request_timeout``; the requester's
  ``metadata.deadlineMs`` when shorter; each progress the handler reports,
  p2pnode.node.progress, starts it again), the call is registered for its
  requester's cancel (p2pnode.node.callcancel), and while the agent has fewer
  than ``agent_concurrency`` calls a new task takes over the inbox; the old
  one finishes its call, queues the answer and ends. At the limit the reader
  stays in its call (the inbox waits, then refuses requests BUSY:
  p2pnode.node.inbox) until a call ends and frees a slot. A call past its
  deadline is cancelled and answered ``TIMEOUT``; one its requester
  cancelled is cancelled and not answered. So a handler that hangs holds
  one slot until its deadline, and the agent's other requests, and other
  agents, are served meanwhile.
* A requester that vanished or never reads must not hold the agent up, yet
  handing every reply to another task costs a scheduler pass per request.
  So a small reply (at most :data:`INLINE_REPLY_BYTES`) is written by the
  reader itself when it can leave at once: nothing is queued for the
  requester's peer and its link is open with no write waiting. That write
  gets :data:`INLINE_REPLY_WAIT` seconds; a peer that cannot take it by
  then has stopped reading, its channel is dropped as after a stalled
  write, and the reply is lost (the requester times out, as for any lost
  reply). Every other reply (a call's included) is queued for the
  requester's peer (p2pnode.node.replies) and written by that peer's own
  task, so the agent goes on with the next envelope at once.
* Every card change (an agent added, replaced, given a capability, removed)
  is announced: a HELLO of the current cards to each open link, and a
  discovery ``provide`` of the new card.
* Each card is re-issued at half its lifetime, and remote cards past their
  expiry are forgotten (:meth:`AgentHost.keep_cards`, run by the node).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import trio

from p2pnode.agent.definition import Agent, Message, agent_for_handler
from p2pnode.core.card import AgentCard, Capability, Endpoint
from p2pnode.core.envelope import Envelope, MessageType, payload_envelope_size
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.core.identity import Identity
from p2pnode.core.lifetime import TaskOwner
from p2pnode.core.registry import Registry
from p2pnode.core.withdrawal import Withdrawal
from p2pnode.node.callcancel import owner_limit
from p2pnode.node.channels import ChannelState
from p2pnode.node.config import KernelConfig
from p2pnode.node.frames import INCARNATION_BYTES, encode_hello
from p2pnode.node.inbox import LOCAL, InboxBudget, Queued, RunningCall
from p2pnode.node.links import LinkManager
from p2pnode.node.observability import Observability
from p2pnode.node.progress import (
    PROGRESS_METADATA,
    Progress,
    ProgressReporter,
    reset_reporter,
    set_reporter,
)
from p2pnode.node.replies import ReplyLimits, ReplyQueues
from p2pnode.node.replystream import reply_streamed, surely_inline
from p2pnode.node.routing import Handler, LocalAgent, Routing
from p2pnode.node.service import MethodServer
from p2pnode.transport.secure import SecureIdentity

logger = logging.getLogger("p2pnode.node")

#: Seconds between checks for expired remote cards (local ones are renewed on time).
CARD_CHECK_INTERVAL = 30.0
#: Replies up to this many bytes may be written by the agent's own task (module docstring).
INLINE_REPLY_BYTES = 64 * 1024
#: Seconds such a reply may take to leave before its write is cut (:class:`InlineWatch`).
INLINE_REPLY_WAIT = 0.25


T = TypeVar("T")


# -- the bound on replies an agent's task writes itself, without a timer per reply -----


@dataclass(slots=True)
class Writer:
    """One agent task's scope, and the number of the write it is in (0: none)."""

    scope: trio.CancelScope
    writing: int = 0


class InlineWatch:
    """Cancels writers stuck in one write for ``wait`` seconds; ``on_cut`` is told the
    key of each writer cut. The watcher runs in ``owner``'s nursery, started with the
    first write.

    An agent's task writes a small reply itself when it can leave at once (the module
    docstring). A peer that stopped reading can still block that write once its socket
    buffer is full, and the agent must not wait on it for long. A cancel scope with a
    deadline per reply would bound it, but registering and clearing a deadline costs
    about a twentieth of a whole request's round trip. So each agent task runs in one
    long-lived cancel scope (a :class:`Writer`), and numbers each write it starts; one
    watcher task per node looks at the writers every ``wait / 2`` seconds while writes
    are happening, and cancels a writer found in the same write at two looks in a row:
    that write has been stuck for between ``wait / 2`` and ``wait`` seconds. Cancelling
    a write cuts the channel (its stream state is unknown: p2pnode.transport.channel)
    and loses the reply; the agent's task then opens a new scope and goes on with its
    inbox.

    The watcher sleeps on an event while no write happens (a node at rest, or a
    simulated swarm on the virtual clock, wakes for nothing) and goes back to it after a
    look that finds no write started or running since the one before. A write costs two
    attribute stores and a flag test."""

    def __init__(self, owner: TaskOwner, wait: float, on_cut: Callable[[str], None]) -> None:
        self._owner = owner
        self._wait = wait
        self._on_cut = on_cut
        self._writers: dict[str, Writer] = {}
        self._started = 0  # writes started, ever: a look tells whether any came since
        self._watching = False
        self._wake = trio.Event()
        self._running = False

    def open(self, key: str, scope: trio.CancelScope) -> Writer:
        """Register the task ``key`` (an agent id) running in ``scope``."""
        writer = self._writers[key] = Writer(scope)
        return writer

    def close(self, key: str, writer: Writer) -> None:
        """The task ``key`` left ``writer``'s scope."""
        if self._writers.get(key) is writer:
            del self._writers[key]

    def begin(self, writer: Writer) -> None:
        """``writer``'s task starts a write (end it with :meth:`end`)."""
        started = self._started = self._started + 1
        writer.writing = started
        if not self._watching:
            self._watching = True
            if self._running:
                self._wake.set()
            elif self._owner.is_open:
                self._running = True
                self._owner.nursery.start_soon(self._watch)

    @staticmethod
    def end(writer: Writer) -> None:
        writer.writing = 0

    async def _watch(self) -> None:
        try:
            while True:
                await self._look_while_writing()
                self._watching = False
                self._wake = trio.Event()
                await self._wake.wait()
        finally:
            self._running = False
            self._watching = False

    async def _look_while_writing(self) -> None:
        seen: dict[str, int] = {}
        started = -1
        while seen or started != self._started:
            started = self._started
            await trio.sleep(self._wait / 2)
            for key, writer in list(self._writers.items()):
                if writer.writing and seen.get(key) == writer.writing:
                    writer.scope.cancel()  # its task is parked in that write (docstring)
                    self._on_cut(key)
            seen = {k: w.writing for k, w in self._writers.items() if w.writing}


@dataclass(frozen=True, slots=True)
class _Served:
    """A request method a service serves instead of the agents' handlers."""

    server: MethodServer
    streamed: bool


@dataclass(slots=True, eq=False)
class _Serving:
    """One hosted agent's tasks: the nursery its readers and waiting calls run in, and
    the task that reads its inbox now."""

    nursery: trio.Nursery
    reader: _Reader | None = None


@dataclass(slots=True, eq=False)
class _Reader:
    """One of an agent's tasks: its scope (``writer``), the call it is in once a handler
    waited, and whether it handed the inbox over (then it ends with that call)."""

    writer: Writer
    call: RunningCall | None = None
    demoted: bool = False


@types.coroutine
def _watched(
    handling: Coroutine[Any, Any, T],
    host: AgentHost,
    agent: LocalAgent,
    serving: _Serving,
    reader: _Reader,
    item: Queued,
    envelope: Envelope,
) -> Generator[Any, Any, T]:
    """Await ``handling`` (a request's handler) in this task, telling ``host`` the first
    time it waits.

    It runs the coroutine step by step as ``await`` would, passing what it yields to trio
    and what trio sends or throws back, so it stays in this task, its cancel scopes and
    its context. A handler that answers without waiting costs one generator; one that
    waits is seen at its first wait, before trio parks the task (module docstring).
    """
    try:
        trap = handling.send(None)
    except StopIteration as finished:
        return finished.value  # type: ignore[no-any-return]
    host._waiting(agent, serving, reader, item, envelope)
    while True:
        try:
            sent = yield trap
        except GeneratorExit:
            handling.close()
            raise
        except BaseException as exc:  # trio's Cancelled, or any error thrown in
            try:
                trap = handling.throw(exc)
            except StopIteration as finished:
                return finished.value  # type: ignore[no-any-return]
        else:
            try:
                trap = handling.send(sent)
            except StopIteration as finished:
                return finished.value  # type: ignore[no-any-return]


def _size(payload: object) -> int:
    return payload_envelope_size(payload)


def _renewal_due(card: AgentCard) -> int:
    """When (ms) a local card is re-issued: half its lifetime after it was issued."""
    return card.issued_at + (card.expires_at - card.issued_at) // 2


class AgentHost:
    """The local agents of one node (see the module docstring). Its tasks run in the
    node's nursery (``owner``); ``advertised_addresses`` gives the node's addresses, and
    ``on_removed`` is told the id of each agent removed (before peers are told)."""

    def __init__(
        self,
        owner: TaskOwner,
        agents: dict[str, LocalAgent],
        secure_identity: SecureIdentity,
        config: KernelConfig,
        registry: Registry,
        events: Observability,
        links: LinkManager,
        routing: Routing,
        advertised_addresses: Callable[[], list[str]],
        on_removed: Callable[[str], None],
        clock_ms: Callable[[], int],
        *,
        inbox_budget: InboxBudget | None = None,
        reply_limits: ReplyLimits | None = None,
    ) -> None:
        self.agents = agents
        #: Bytes queued in the agents' inboxes, per peer and in all (shared by them).
        self.inbox_budget = inbox_budget if inbox_budget is not None else InboxBudget()
        #: Replies waiting to be written, per requesting peer.
        self.replies = ReplyQueues(
            owner,
            reply_limits
            if reply_limits is not None
            else ReplyLimits(timeout=config.request_timeout),
        )
        #: Sent in every HELLO: peers tell this process from a restart of it (node.md).
        self.incarnation = os.urandom(INCARNATION_BYTES)
        #: Request methods services serve (see :meth:`serve_methods`), by method name.
        self._methods: dict[str, _Served] = {}
        self._owner = owner
        self._secure_identity = secure_identity
        self._identity = secure_identity.identity
        self._config = config
        self._registry = registry
        self._events = events
        self._links = links
        self._routing = routing
        self._advertised_addresses = advertised_addresses
        #: The direct addresses new cards list, when set (set_card_addresses).
        self._card_addresses: tuple[str, ...] | None = None
        #: Relayed addresses of relays picked at run time (set_auto_relays).
        self._auto_relays: tuple[str, ...] = ()
        self._on_removed = on_removed
        self._clock_ms = clock_ms
        #: Set when a local agent's task has ended (its inbox closed and drained).
        self._done: dict[str, trio.Event] = {}
        #: Replies queued per local agent, and who waits for them all to leave.
        self._replying: dict[str, int] = {}
        self._reply_idle: dict[str, trio.Event] = {}
        #: Set when a local card changes, so the renewal timer looks again.
        self._cards_changed = trio.Event()
        #: Cuts a reply an agent's task writes itself once it is stuck (InlineWatch).
        self._inline = InlineWatch(owner, INLINE_REPLY_WAIT, self._reply_cut)
        #: Calls cancelled in all: at their deadline, or by their requester.
        self.calls_cut = 0
        self._repeats = 0  # calls registered under a request id already running
        self._left = False  # leave() ran: the node is stopping

    # -- hosting ----------------------------------------------------------------------------

    async def add_agent(
        self, agent: Agent, *, authority: Identity | None = None, roles: tuple[str, ...] = ()
    ) -> AgentCard:
        """See :meth:`p2pnode.node.kernel.Kernel.add_agent`."""
        card = self._new_card(agent)
        return await self.add_agent_card(card, agent, authority=authority, roles=roles)

    def _new_card(self, agent: Agent) -> AgentCard:
        """A first card for ``agent`` on this node (signed when registered)."""
        now = self._clock_ms()
        addresses = self.card_addresses()
        card = AgentCard(
            id=agent.id,
            name=agent.name,
            version=agent.version,
            description=agent.description,
            tier=agent.tier,
            capabilities=agent.capabilities,
            sandbox_id=agent.sandbox,
            public_key=self._identity.public_key,
            addresses=addresses,
            endpoints=tuple(Endpoint("tcp+noise", a) for a in addresses),
            noise_static_key=self._secure_identity.static_public,
            # A restarted node's card must supersede the one it published before.
            revision=now,
            issued_at=now,
            expires_at=now + self._config.card_ttl_seconds * 1000,
        )
        return _listing_catalog(card, agent)

    def card_addresses(self) -> tuple[str, ...]:
        """The direct addresses the local cards list (by default the node's own)."""
        if self._card_addresses is not None:
            return self._card_addresses
        return tuple(self._advertised_addresses())

    async def set_card_addresses(self, addresses: Iterable[str] | None) -> bool:
        """See :meth:`p2pnode.node.kernel.Kernel.set_card_addresses`."""
        before = self.card_addresses()
        self._card_addresses = tuple(addresses) if addresses is not None else None
        after = self.card_addresses()
        if after == before:
            return False
        for agent in list(self.agents.values()):
            card = agent.card
            # Relayed and other endpoints stay; the direct ones follow the addresses.
            kept = tuple(e for e in card.endpoints if e.address not in card.addresses)
            direct = tuple(Endpoint("tcp+noise", a) for a in after)
            readdressed = dataclasses.replace(card, addresses=after, endpoints=direct + kept)
            try:
                await self.add_agent_card(readdressed, agent.definition)
            except P2PError as exc:
                self._events.error(exc.code, f"readdressing the card of {card.id}: {exc.message}")
        return True

    async def set_auto_relays(self, relays: Iterable[str]) -> bool:
        """List ``relays`` (relayed addresses of relays the node picked itself,
        docs/protocol/reachability.md §7) as the local cards' endpoints besides the
        configured ones, in place of the last such list; when it changes every local
        card is re-issued. True then, False when nothing changed."""
        before, after = self._auto_relays, tuple(relays)
        if after == before:
            return False
        self._auto_relays = after
        for agent in list(self.agents.values()):
            card = agent.card
            kept = tuple(e for e in card.endpoints if e.address not in before)
            relisted = dataclasses.replace(card, endpoints=kept)
            try:
                await self.add_agent_card(relisted, agent.definition)
            except P2PError as exc:
                self._events.error(exc.code, f"relisting the relays of {card.id}: {exc.message}")
        return True

    async def add_agent_card(
        self,
        card: AgentCard,
        agent: Agent | Handler,
        *,
        authority: Identity | None = None,
        roles: tuple[str, ...] = (),
    ) -> AgentCard:
        """See :meth:`p2pnode.node.kernel.Kernel.add_agent_card`."""
        if card.public_key != self._identity.public_key:
            raise LocalError(ErrorCode.INVALID_CARD, "the card belongs to another identity")
        if not isinstance(agent, Agent):
            agent = agent_for_handler(card.id, agent)
        relays = self._config.relays + self._auto_relays
        card = _with_relays(_listing_catalog(card, agent), relays)
        if authority is not None:
            # The endorsement covers id, key, tier, sandbox and roles only, so it survives
            # the revision bump and re-signing in register().
            card = card.with_endorsement(authority, roles)
        elif roles:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "roles are endorsed by an authority")
        stored = self._registry.register(card, self._clock_ms())
        existing = self.agents.get(card.id)
        if existing is None:
            send, receive = trio.open_memory_channel[Queued](self._config.inbox_size)
            hosted = LocalAgent(
                stored, agent, send, receive, self.inbox_budget, self._config.agent_concurrency
            )
            self.agents[card.id] = hosted
            done = self._done[card.id] = trio.Event()
            self._owner.nursery.start_soon(self._agent_loop, hosted, done)
        else:
            existing.definition = agent
            existing.set_card(stored)
        self._cards_changed.set()  # its renewal may be due before the one waited for
        self._owner.nursery.start_soon(self._announce, stored)
        return stored

    async def remove_agent(self, agent_id: str) -> None:
        """See :meth:`p2pnode.node.kernel.Kernel.remove_agent`."""
        agent = self.agents.get(agent_id)
        if agent is None:
            raise LocalError(ErrorCode.AGENT_NOT_FOUND, f"no local agent {agent_id!r}")
        agent.definition = _withdrawn(agent_id)
        agent.inbox_send.close()  # its task answers what is queued, then ends
        done = self._done.get(agent_id)
        if done is not None:
            with trio.move_on_after(self._config.request_timeout):
                await done.wait()
                await self._wait_replies(agent_id)  # they leave as the agent
        if self.agents.get(agent_id) is agent:  # not removed (or replaced) meanwhile
            del self.agents[agent_id]
            self._done.pop(agent_id, None)
            self._registry.unregister(agent_id)
            self._on_removed(agent_id)
            withdrawal = Withdrawal.of(agent.card, self._identity, self._clock_ms())
            self._owner.nursery.start_soon(self._withdraw, [(agent.card, withdrawal)])

    async def leave(self) -> None:
        """Withdraw every local agent (the node is stopping): one HELLO with their signed
        withdrawals and no cards to every connected peer, and the withdrawals to
        discovery, all within ``config.leave_timeout``. Agents keep answering meanwhile;
        once left, card changes are no longer announced."""
        if self._left:
            return
        self._left = True
        now = self._clock_ms()
        gone = [(a.card, Withdrawal.of(a.card, self._identity, now)) for a in self.agents.values()]
        if gone:
            with trio.move_on_after(self._config.leave_timeout):
                await self._withdraw(gone, cards=[])

    async def _withdraw(
        self,
        gone: list[tuple[AgentCard, Withdrawal]],
        cards: list[AgentCard] | None = None,
    ) -> None:
        """Tell connected peers (a HELLO of ``cards``, by default the current ones, with the
        withdrawals) and discovery, concurrently, that the agents of ``gone`` left."""
        if cards is None:
            cards = [a.card for a in self.agents.values()]
        withdrawals = [w for _, w in gone]
        hello = encode_hello(cards, self._advertised_addresses(), withdrawals, self.incarnation)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._send_hello, hello)
            for card, withdrawal in gone:
                nursery.start_soon(self._withdraw_from_discovery, card, withdrawal)

    async def _withdraw_from_discovery(self, card: AgentCard, withdrawal: Withdrawal) -> None:
        try:
            await self._routing.discovery.withdraw(card, withdrawal)
        except P2PError as exc:
            self._events.error(exc.code, f"withdrawing {card.id}: {exc.message}")

    async def add_capability(self, agent_id: str, capability: Capability) -> AgentCard:
        """See :meth:`p2pnode.node.kernel.Kernel.add_capability`."""
        agent = self.agents.get(agent_id)
        if agent is None:
            raise LocalError(ErrorCode.AGENT_NOT_FOUND, f"no local agent {agent_id!r}")
        if agent.card.has_capability(capability.id):
            return agent.card
        card = dataclasses.replace(agent.card, capabilities=(*agent.card.capabilities, capability))
        return await self.add_agent_card(card, agent.definition)

    def serve_methods(
        self, methods: Iterable[str], server: MethodServer | None, *, streamed: bool = False
    ) -> None:
        """See :meth:`p2pnode.node.kernel.Kernel.serve_methods`."""
        names = tuple(methods)
        if server is None:
            for name in names:
                self._methods.pop(name, None)
            return
        taken = sorted(n for n in names if n in self._methods)
        if taken:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"methods served already: {taken}")
        for name in names:
            self._methods[name] = _Served(server, streamed)

    def close_inboxes(self) -> None:
        """Close every agent's inbox: its task answers what is queued, then ends."""
        for agent in self.agents.values():
            agent.inbox_send.close()

    # -- cards over time --------------------------------------------------------------------

    async def keep_cards(self) -> None:
        """Renew local cards at half their lifetime and forget expired remote ones, forever.

        A card is valid until its ``expiresAt``; peers and the DHT refuse it after
        that (docs/protocol/dht.md §4.2). So each local card is re-issued once half
        its lifetime has passed: new issue and expiry times (the same lifetime),
        revision + 1, re-signed, a HELLO to connected peers and a discovery
        ``provide``, as for any card update. Remote cards past their expiry are
        dropped from the registry: they are not found, routed to or announced.
        """
        while True:
            now = self._clock_ms()
            for agent in list(self.agents.values()):
                if now >= _renewal_due(agent.card) and self.agents.get(agent.card.id) is agent:
                    await self._renew(agent)
            expired = self._registry.prune_expired(now)
            if expired:
                logger.info("forgot %d expired remote cards: %s", len(expired), ", ".join(expired))
            due = min((_renewal_due(a.card) for a in self.agents.values()), default=None)
            delay = CARD_CHECK_INTERVAL
            if due is not None:
                # At least a second: a renewal that failed is retried, not spun on.
                delay = min(delay, max(1.0, (due - self._clock_ms()) / 1000))
            with trio.move_on_after(delay):
                await self._cards_changed.wait()
            self._cards_changed = trio.Event()

    async def _renew(self, agent: LocalAgent) -> None:
        card = agent.card
        now = self._clock_ms()
        renewed = dataclasses.replace(
            card, issued_at=now, expires_at=now + (card.expires_at - card.issued_at)
        )
        try:
            await self.add_agent_card(renewed, agent.definition)
        except P2PError as exc:
            self._events.error(exc.code, f"renewing the card of {card.id}: {exc.message}")

    async def _announce(self, card: AgentCard) -> None:
        """Send connected peers a HELLO of the current cards, and provide ``card``."""
        if self._left:
            return
        await self._send_hello(self.hello_bytes())
        try:
            await self._routing.discovery.provide(card)
        except P2PError as exc:
            self._events.error(exc.code, f"publishing {card.id}: {exc.message}")

    async def _send_hello(self, hello: bytes) -> None:
        """Write ``hello`` to every open link, each within ``config.request_timeout``."""
        for link in self._links:
            if link.state is ChannelState.OPEN:
                with trio.move_on_after(self._config.request_timeout):
                    try:
                        await link.send(hello)
                    except P2PError as exc:  # the link reports a peer that is gone
                        logger.debug("card update to %s failed: %s", link.peer_id, exc)

    def hello_bytes(self) -> bytes:
        """A HELLO frame of the local agents' cards (none once the node left) and the
        node's addresses."""
        cards = [] if self._left else [a.card for a in self.agents.values()]
        return encode_hello(cards, self._advertised_addresses(), None, self.incarnation)

    # -- inboxes ----------------------------------------------------------------------------

    async def _agent_loop(self, agent: LocalAgent, done: trio.Event) -> None:
        """The agent's tasks: this one reads its inbox first; readers that take over and
        calls that wait run in the agent's own nursery (the module docstring)."""
        try:
            async with agent.inbox_receive, trio.open_nursery() as nursery:
                await self._read(agent, _Serving(nursery))
        finally:
            done.set()

    async def _read(self, agent: LocalAgent, serving: _Serving) -> None:
        """Read the inbox in arrival order until it closes; or, once the request this task
        is answering waits and the inbox is handed to a new reader, finish that call."""
        key = agent.card.id
        set_reporter(None)  # not the call of the task that started this one
        while True:  # a fresh scope each time one was cancelled (InlineWatch, a call cut)
            with trio.CancelScope() as scope:
                reader = serving.reader = _Reader(self._inline.open(key, scope))
                try:
                    await self._serve_inbox(agent, serving, reader)
                finally:
                    self._inline.close(key, reader.writer)
            if reader.call is not None:  # its call was cut: deadline, or its caller left
                self._call_cut(agent, serving, reader, reader.call)
            if reader.demoted or not scope.cancelled_caught:
                return

    async def _serve_inbox(self, agent: LocalAgent, serving: _Serving, reader: _Reader) -> None:
        inbox = agent.inbox_receive
        next_item: Queued | None
        async for next_item in inbox:
            while next_item is not None:
                item, envelope = next_item, agent.taken(next_item)
                if envelope is None:
                    pass  # its peer left: nobody to answer
                elif envelope.type is MessageType.REQUEST:
                    await self._answer(agent, serving, reader, item, envelope)
                    if reader.demoted:
                        return  # another task reads the inbox now
                else:  # nothing to answer: straight to the agent's handler, in order
                    await agent.definition.handle(envelope)
                # Drain what is already queued without a scheduler pass per envelope.
                try:
                    next_item = inbox.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    next_item = None

    async def _answer(
        self,
        agent: LocalAgent,
        serving: _Serving,
        reader: _Reader,
        item: Queued,
        envelope: Envelope,
    ) -> None:
        """Run the handler of request ``envelope`` (taken from ``item``) and answer it.
        The handler runs in this task; should it wait, :meth:`_waiting` makes it a call
        (see the module docstring)."""
        meta = envelope.metadata
        method = meta.capability if meta is not None else None
        if method is not None and (served := self._methods.get(method)) is not None:
            sender = self._sender_card(envelope, item)
            if sender is None:  # its card left the registry since it was delivered
                gone = LocalError(ErrorCode.AGENT_NOT_FOUND, f"sender {envelope.sender!r} unknown")
                error = MessageType.ERROR
                await self._reply(agent, item, reader.writer, error, gone.to_dict(), streamed=False)
                return
            handling = served.server.serve(agent.definition, envelope, method, sender)
            streamed = served.streamed
        else:
            handling = agent.definition.handle(envelope)
            streamed = False
        token = set_reporter((self._reporter, agent, reader, item, envelope))
        try:
            answer = await _watched(handling, self, agent, serving, reader, item, envelope)
        finally:
            reset_reporter(token)
        if reader.call is not None:
            self._call_ended(agent, serving, reader, reader.call)
        if answer is not None:  # None: forwarded to the agent's process, which answers
            writer = None if reader.demoted else reader.writer
            await self._reply(agent, item, writer, answer.type, answer.payload, streamed=streamed)

    def _sender_card(self, envelope: Envelope, item: Queued) -> AgentCard | None:
        """The card of ``envelope``'s sender, owned by the peer ``item`` came from (a local
        agent's when from none)."""
        if item.peer_id is None:
            local = self.agents.get(envelope.sender)
            return local.card if local is not None else None
        return self._registry.find_owned(envelope.sender, item.peer_id)

    def _waiting(
        self,
        agent: LocalAgent,
        serving: _Serving,
        reader: _Reader,
        item: Queued,
        envelope: Envelope,
    ) -> None:
        """The handler of ``envelope``, run by ``reader``'s task, waits: it becomes a call
        with a deadline, found by its requester's cancel; the inbox goes to a new reader
        while the agent's calls are under its limit. Sync: runs as the handler yields."""
        limit = self._deadline(agent, envelope)
        deadline = trio.current_time() + limit
        key = (item.peer, envelope.sender, envelope.id)
        if key in agent.calls:  # a repeated request id: counted, not found by a cancel
            self._repeats += 1
            key = (item.peer, envelope.sender, f"{envelope.id}\x00{self._repeats}")
        call = agent.calls[key] = RunningCall(key, item, reader.writer.scope, deadline, limit)
        reader.call = call
        reader.writer.scope.deadline = deadline
        if len(agent.calls) < agent.max_calls:
            self._hand_over(agent, serving, reader)

    def _hand_over(self, agent: LocalAgent, serving: _Serving, reader: _Reader) -> None:
        """``reader``'s task keeps its call only; a new task reads the inbox."""
        reader.demoted = True
        serving.nursery.start_soon(self._read, agent, serving)

    def _deadline(self, agent: LocalAgent, envelope: Envelope) -> float:
        """Seconds the handler of request ``envelope`` may run: its server's deadline
        for a method a service serves, else the node's request timeout."""
        meta = envelope.metadata
        method = meta.capability if meta is not None else None
        served = self._methods.get(method) if method is not None else None
        if served is None:
            return owner_limit(self._config.request_timeout, envelope)
        return owner_limit(served.server.deadline(agent.definition, envelope), envelope)

    def _reporter(
        self, agent: LocalAgent, reader: _Reader, item: Queued, envelope: Envelope
    ) -> ProgressReporter:
        """The progress reporter of request ``envelope``, run by ``reader``'s task."""

        def extend() -> None:
            call = reader.call
            if call is not None:  # a handler that has not waited yet has no deadline yet
                call.deadline = trio.current_time() + call.limit
                call.scope.deadline = call.deadline

        async def send(request: Envelope, progress: Progress) -> bool:
            with trio.move_on_after(self._config.request_timeout):
                code = await self._routing.reply(
                    agent.card.id,
                    request,
                    MessageType.NOTIFICATION,
                    progress.to_payload(),
                    item.peer,
                    PROGRESS_METADATA,
                )
                return code is None
            return False

        return ProgressReporter(envelope, extend, send)

    def _call_ended(
        self, agent: LocalAgent, serving: _Serving, reader: _Reader, call: RunningCall
    ) -> None:
        """``call`` (``reader``'s) has left its handler: its slot is free. A reader held in
        a call of its own for want of a slot hands the inbox over now."""
        if agent.calls.get(call.key) is call:
            del agent.calls[call.key]
        reader.call = None
        if not reader.demoted:
            reader.writer.scope.deadline = math.inf
        held = serving.reader
        if (
            held is not None
            and held is not reader
            and held.call is not None
            and not held.demoted
            and len(agent.calls) < agent.max_calls
        ):
            self._hand_over(agent, serving, held)

    def _call_cut(
        self, agent: LocalAgent, serving: _Serving, reader: _Reader, call: RunningCall
    ) -> None:
        """``call`` was cancelled: answered TIMEOUT when its deadline passed, not at all
        when its requester cancelled it (it no longer waits)."""
        self._call_ended(agent, serving, reader, call)
        self.calls_cut += 1
        if call.by_caller:
            return
        error = RemoteError(
            ErrorCode.TIMEOUT,
            f"the handler of agent {agent.card.id!r} ran past its deadline of {call.limit:g} s",
            deadlineSeconds=call.limit,
            agentId=agent.card.id,
        )
        payload = error.to_dict()
        self._queue_reply(agent, call.item, MessageType.ERROR, payload, _size(payload), False)

    async def _reply(
        self,
        agent: LocalAgent,
        item: Queued,
        writer: Writer | None,
        type: MessageType,
        payload: object,
        *,
        streamed: bool,
    ) -> None:
        """Answer ``item``: written at once by ``writer``'s task when it can leave at once,
        else queued for its requester's peer (the module docstring)."""
        sender, to, peer = agent.card.id, item.envelope, item.peer
        # An answer surely small enough for one envelope is not measured for streaming.
        streamed = streamed and not surely_inline(payload)
        key = LOCAL if peer is None else peer
        size = payload_envelope_size(payload)
        if (
            size <= INLINE_REPLY_BYTES
            and writer is not None
            and self.replies.queued(key) == 0
            and self._writable(item)
        ):
            send = partial(reply_streamed, self._routing.reply) if streamed else self._routing.reply
            self._inline.begin(writer)  # cut if it cannot leave within INLINE_REPLY_WAIT
            try:
                code = await send(sender, to, type, payload, peer)
            finally:
                InlineWatch.end(writer)
            self.replies.note(key, code)
            return
        self._queue_reply(agent, item, type, payload, size, streamed)

    def _queue_reply(
        self,
        agent: LocalAgent,
        item: Queued,
        type: MessageType,
        payload: object,
        size: int,
        streamed: bool,
    ) -> None:
        """Queue the answer to ``item`` for its requester's peer's reply task."""
        sender, to, peer = agent.card.id, item.envelope, item.peer
        send = partial(reply_streamed, self._routing.reply) if streamed else self._routing.reply

        def job() -> Awaitable[ErrorCode | None]:
            return send(sender, to, type, payload, peer)

        self._replying[sender] = self._replying.get(sender, 0) + 1
        key = LOCAL if peer is None else peer
        if not self.replies.put(key, job, size, self._replied(sender)):
            self._replied(sender)()

    def _reply_cut(self, agent_id: str) -> None:
        """A reply of ``agent_id``, written by its own task, could not leave in time."""
        self.replies.note(f"a requester of {agent_id}", ErrorCode.TIMEOUT)

    def _writable(self, item: Queued) -> bool:
        """True when an answer to ``item`` would be written at once: to a local requester,
        or over an open link with nothing waiting to be written."""
        if item.peer_id is None:
            return item.peer is None
        link = self._links.get(item.peer_id)
        return link is not None and link.writable_now

    def _replied(self, agent_id: str) -> Callable[[], None]:
        def done() -> None:
            left = self._replying.get(agent_id, 0) - 1
            if left > 0:
                self._replying[agent_id] = left
                return
            self._replying.pop(agent_id, None)
            idle = self._reply_idle.pop(agent_id, None)
            if idle is not None:
                idle.set()

        return done

    async def _wait_replies(self, agent_id: str) -> None:
        """Wait until no reply of ``agent_id`` is queued."""
        if self._replying.get(agent_id, 0) > 0:
            await self._reply_idle.setdefault(agent_id, trio.Event()).wait()


def _listing_catalog(card: AgentCard, agent: Agent) -> AgentCard:
    """``card`` listing what ``agent``'s catalog serves, whatever it listed before."""
    offers = agent.card_offers()
    tools, resources, prompts = offers["tools"], offers["resources"], offers["prompts"]
    if (card.tools, card.resources, card.prompts) == (tools, resources, prompts):
        return card
    return dataclasses.replace(card, tools=tools, resources=resources, prompts=prompts)


def _withdrawn(agent_id: str) -> Agent:
    """What answers for an agent being removed: a request gets AGENT_UNAVAILABLE."""
    agent = Agent(agent_id)

    @agent.on_message
    def unavailable(message: Message) -> None:
        if message.type is MessageType.REQUEST:
            raise RemoteError(ErrorCode.AGENT_UNAVAILABLE, f"agent {agent_id!r} was withdrawn")

    return agent


def _with_relays(card: AgentCard, relays: tuple[str, ...]) -> AgentCard:
    """``card`` listing each relayed address of ``relays`` as a ``tcp+noise`` endpoint
    (docs/protocol/relay.md section 3): peers that know the form dial the node through
    the relay, others skip it (they dial ``addresses`` only)."""
    listed = {e.address for e in card.endpoints}
    extra = tuple(Endpoint("tcp+noise", text) for text in relays if text not in listed)
    return dataclasses.replace(card, endpoints=card.endpoints + extra) if extra else card


__all__ = ["CARD_CHECK_INTERVAL", "AgentHost", "InlineWatch", "Writer"]

