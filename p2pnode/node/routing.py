"""The routing driver of a node: envelopes out (egress) and frames in (ingress).

:class:`Routing` performs what the pure :class:`~p2pnode.node.router.Router`
decides: it asks discovery when the registry does not know a target, writes
routed envelopes to the peers' links (a burst for one peer as one frame),
delivers to local agents' inboxes, hands intercepted payloads to services,
matches replies to pending requests, and emits the events. It is given the
parts it uses (registry, policy, links, events, envelope factory, failure
boundary, discovery) and owns the rest of the routing state: pending
requests, the duplicate window, HELLO arrivals and interceptors. Beside it, the
pieces it alone uses: what an envelope holds on its way (:class:`Route`,
:class:`PendingRequest`), the services' :class:`Interceptors`, and the discovery of
targets the router does not know (:func:`find_agent`, :func:`find_provider`). The
kernel module's docstring has the rules; docs/protocol/node.md has them in protocol
terms.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import trio

from p2pnode.core.boundary import FailureBoundary
from p2pnode.core.card import AgentCard, Origin
from p2pnode.core.envelope import (
    ROUTING_HINT_CAPABILITY,
    Envelope,
    EnvelopeFactory,
    MessageType,
    Metadata,
    envelope_size,
    payload_limit_error,
)
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.core.identity import PeerId
from p2pnode.core.registry import Registry
from p2pnode.core.threadstore import ThreadStore
from p2pnode.node.cardintake import CardIntake
from p2pnode.node.channels import ChannelState, tick_on_grid
from p2pnode.node.config import parse_address
from p2pnode.node.discovery import Discovery
from p2pnode.node.frames import (
    MAX_FRAME_BYTES,
    EnvelopeBatch,
    Hello,
    Refused,
    decode_frame_untrusted,
    encode_envelope,
    encode_envelopes,
)
from p2pnode.node.inbox import LocalAgent as LocalAgent  # re-exported
from p2pnode.node.links import LinkManager
from p2pnode.node.observability import Observability, Outcome, RoutingPath
from p2pnode.node.policy import Policy, Verdict
from p2pnode.node.probe import probe
from p2pnode.node.progress import ProgressCallback, is_progress, progress_untrusted
from p2pnode.node.replystream import STREAM_TYPES, ReplyStream
from p2pnode.node.router import (
    ANSWERED_TYPES,
    AmbiguousAgentError,
    BoundedSet,
    BurstDecisions,
    Ingress,
    IngressDecision,
    Interceptor,
    Refusal,
    Router,
    RoutingResult,
    capability_refusal,
    pinned_address,
    silent_pass,
    split_address,
)
from p2pnode.transport.net import MoveOnAt, trio_move_on_at

logger = logging.getLogger("p2pnode.node")

#: Further providers a request by capability tries when the chosen one's owner cannot
#: be reached (docs/protocol/node.md "Routing (egress)").
FAILOVER_ATTEMPTS = 2
#: Seconds discovery is given to name another owner of an agent whose owner is known
#: unreachable, before the known owner is dialed anyway.
SUCCESSOR_WAIT = 1.0
#: Seconds after discovery named no other owner of such an agent during which it is not
#: asked again: every request to a dead agent would cost a DHT lookup otherwise.
SUCCESSOR_RECHECK = 3.0
#: Agents remembered that way at most (the oldest forgotten first).
SUCCESSOR_MEMORY = 1024

Handler = Callable[[Envelope], Awaitable[Any]]
#: An envelope's ingress so far, its hand-over left: its sender's card, recipients, size.
Taken = tuple[AgentCard, Ingress, int]
#: The decisions of an ENVELOPES frame's envelopes (None: a frame of one).
Decided = BurstDecisions[IngressDecision] | None


# -- on the way ------------------------------------------------------------------------
# A route waiting for its peer's batch to be written, the frames of a burst, a request
# waiting for its reply.


@dataclasses.dataclass(slots=True)
class Route:
    """An envelope routed to a remote agent, waiting for its peer's batch to be written."""

    envelope: Envelope
    target: AgentCard
    start: float
    result: RoutingResult | None = None

    def done(self) -> RoutingResult:
        assert self.result is not None, "results are read only after a successful write"
        return self.result


def frames_of(envelopes: list[Envelope]) -> list[bytes]:
    """One ENVELOPES frame for a burst; one ENVELOPE frame each when there is one, or
    when together they exceed the frame limit (the channel then refuses only the
    envelope that is too large by itself)."""
    if len(envelopes) > 1:
        frame = encode_envelopes(envelopes)
        if len(frame) <= MAX_FRAME_BYTES:
            return [frame]
    return [encode_envelope(e) for e in envelopes]


class PendingRequest:
    """A request waiting for its response (or for its deadline, on the trio clock)."""

    __slots__ = (
        "deadline", "error", "event", "idle", "on_progress", "peer", "reply", "sent_at", "stream",
        "targets",
    )  # fmt: skip

    def __init__(self) -> None:
        self.event = trio.Event()
        self.reply: Envelope | None = None
        #: Why no reply can come (the owner's peer left), set instead of ``reply``.
        self.error: LocalError | None = None
        #: The peer the request was written to (None: local, a broadcast, or not yet sent).
        self.peer: PeerId | None = None
        #: The parts of an answer streamed before the response (p2pnode.node.replystream).
        self.stream: ReplyStream | None = None
        # The agents that may answer (several for a broadcast); known once routing
        # resolved the recipient.
        self.targets: tuple[str, ...] | None = None
        self.deadline = math.inf  # set once the request is on its way
        #: When its write returned (inf: not written yet).
        self.sent_at = math.inf
        #: Seconds each progress of the request moves its deadline to (p2pnode.node.progress).
        self.idle = math.inf
        self.on_progress: ProgressCallback | None = None

    def moved_to(self, peer: PeerId) -> None:
        """The request goes to ``peer`` instead, its first provider's peer gone: the
        failure that peer's departure set (:meth:`Routing.peer_departed`, while the write
        to it was failing) is not this request's any more."""
        self.peer = peer
        if self.error is not None and self.reply is None:
            self.error, self.event = None, trio.Event()  # nobody waits on it yet

    def progressed(self, envelope: Envelope, now: float) -> None:
        """A progress notification ``envelope`` (its thread this request's) arrived: from an
        agent the request went to, it moves the deadline and reaches the callback."""
        if self.reply is not None or self.targets is None or envelope.sender not in self.targets:
            return
        update = progress_untrusted(envelope.payload)
        if update is None:
            return
        self.deadline = max(self.deadline, now + self.idle)
        if self.on_progress is not None:
            try:
                self.on_progress(update)
            except Exception:  # the caller's callback: never the peer's fault
                logger.exception("progress callback of %s failed", envelope.correlation_id)


# -- interceptors ----------------------------------------------------------------------
# Which service takes an envelope instead of its addressed agent, by message type or by
# a marker key in a stream message's payload (Kernel.intercept_types, intercept_stream).


class Interceptors:
    """Interceptors by message type and by stream marker; a type wins over a marker."""

    __slots__ = ("_by_marker", "_by_type")

    def __init__(self) -> None:
        self._by_marker: dict[str, Interceptor] = {}
        self._by_type: dict[MessageType, Interceptor] = {}

    def set_stream(self, marker: str, interceptor: Interceptor | None) -> None:
        """Take (or, with None, give back) stream messages whose payload has ``marker``."""
        if interceptor is None:
            self._by_marker.pop(marker, None)
        elif marker in self._by_marker:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"stream marker {marker!r} is taken")
        else:
            self._by_marker[marker] = interceptor

    def set_types(self, types: Iterable[MessageType], interceptor: Interceptor | None) -> None:
        """Take (or, with None, give back) every envelope of ``types``."""
        types = list(types)
        if interceptor is not None:
            taken = [t.value for t in types if t in self._by_type]
            if taken:
                raise LocalError(ErrorCode.INVALID_ARGUMENT, f"message types taken: {taken}")
        for type_ in types:
            if interceptor is None:
                self._by_type.pop(type_, None)
            else:
                self._by_type[type_] = interceptor

    def of(self, envelope: Envelope) -> Interceptor | None:
        """The interceptor that takes ``envelope``; None: its agent gets it."""
        if self._by_type:
            by_type = self._by_type.get(envelope.type)
            if by_type is not None:
                return by_type
        if envelope.type is not MessageType.STREAM_DATA or not isinstance(envelope.payload, dict):
            return None
        for marker, interceptor in self._by_marker.items():
            if marker in envelope.payload:
                return interceptor
        return None


# -- unknown targets -------------------------------------------------------------------
# Targets the router does not know yet: ask discovery, admit the cards it finds (through
# the card intake, as any card), and decide again.


async def find_agent(
    agent_id: str,
    router: Router,
    discovery: Discovery,
    cards: CardIntake,
    links: LinkManager,
    now_ms: int,
) -> AgentCard:
    """The card ``agent_id`` (or ``agent@peer``) routes to, after asking discovery; an id
    ambiguous between live owners is decided again after probing the owners this node
    has no channel to (p2pnode.node.probe): a dead one is then unreachable and no
    longer counts. Raises LocalError(AGENT_NOT_FOUND), AmbiguousAgentError when two or
    more owners still answer."""
    cards.learn_all(await discovery.find_agent(split_address(agent_id)[0]))
    try:
        card = router.known_target(agent_id, now_ms)
    except AmbiguousAgentError as ambiguous:
        await probe(links, [c.peer_id for c in ambiguous.owners])
        card = router.known_target(agent_id, now_ms)
    if card is None:
        raise LocalError(ErrorCode.AGENT_NOT_FOUND, f"no agent {agent_id!r}", agent_id=agent_id)
    return card


async def find_provider(
    source: AgentCard,
    capability: str,
    router: Router,
    discovery: Discovery,
    cards: CardIntake,
    clock_ms: Callable[[], int],
) -> AgentCard:
    """The agent ``source`` may send to for ``capability``, asking discovery when none is
    known or only unreachable ones. Raises LocalError: CAPABILITY_NOT_FOUND, or policy's
    refusal of every provider (TIER_VIOLATION, SANDBOX_VIOLATION, ...)."""
    candidates = router.candidates(source, capability, clock_ms())
    if not candidates or not router.reachable(candidates[0]):
        # None known, or only providers whose owner is gone: discovery may know others.
        for found in await discovery.find_providers(capability):
            cards.learn(found)
        candidates = router.candidates(source, capability, clock_ms())
    if not candidates:
        refused = router.refused(source, capability, clock_ms())
        if refused:
            # Offered, but policy refuses every provider: say so, not "not found".
            raise capability_refusal(source, capability, refused)
        if source.has_capability(capability):
            # Never the sender itself: an agent delegating its own capability would loop.
            raise LocalError(
                ErrorCode.CAPABILITY_NOT_FOUND,
                f"no reachable agent but the sender {source.id!r} itself offers {capability!r} "
                f"(a capability request never goes to its sender: send it from another "
                f"agent, or to {source.id!r} by id)",
                capability=capability,
            )
        raise LocalError(
            ErrorCode.CAPABILITY_NOT_FOUND,
            f"no reachable agent offers {capability!r}",
            capability=capability,
        )
    return candidates[0]


class Routing:
    """The routing driver of one node: performs what :class:`~p2pnode.node.router.Router`
    decides (see the module docstring)."""

    def __init__(
        self,
        router: Router,
        agents: dict[str, LocalAgent],
        registry: Registry,
        policy: Policy,
        links: LinkManager,
        events: Observability,
        factory: EnvelopeFactory,
        boundary: FailureBoundary,
        discovery: Discovery,
        *,
        dedup_window: int,
        max_peers: int,
        clock_ms: Callable[[], int],
    ) -> None:
        self.router = router
        self.discovery = discovery
        self.threads = ThreadStore()
        #: Requests sent by local agents and waiting for a reply, by envelope id.
        self.pending: dict[str, PendingRequest] = {}
        self._agents = agents
        self._registry = registry
        self._policy = policy
        self._links = links
        self._events = events
        self._factory = factory
        self._boundary = boundary
        self._clock_ms = clock_ms
        self._max_peers = max_peers
        self._seen = BoundedSet(dedup_window)
        #: agent -> when discovery last named no successor of its unreachable owner.
        self._no_successor: dict[str, float] = {}
        #: Admits the cards peers present.
        self.cards = CardIntake(
            links.local_peer_id, registry, policy, events, clock_ms, on_fresh=links.peer_returned
        )
        self._hellos: dict[PeerId, trio.Event] = {}
        self.interceptors = Interceptors()

    def intercept_stream(self, marker: str, interceptor: Interceptor | None) -> None:
        """See :meth:`p2pnode.node.kernel.Kernel.intercept_stream`."""
        self.interceptors.set_stream(marker, interceptor)

    def intercept_types(
        self, types: Iterable[MessageType], interceptor: Interceptor | None
    ) -> None:
        """See :meth:`p2pnode.node.kernel.Kernel.intercept_types`."""
        self.interceptors.set_types(types, interceptor)

    def hello_seen(self, peer_id: PeerId) -> trio.Event:
        """Set once a HELLO from ``peer_id`` has been processed."""
        event = self._hellos.get(peer_id)
        if event is None:
            if len(self._hellos) >= self._max_peers:
                self._hellos.clear()  # only a wait aid: forgetting costs one short wait
            event = self._hellos[peer_id] = trio.Event()
        return event

    async def reply(
        self,
        sender: str,
        to: Envelope,
        type: MessageType,
        payload: Any,
        peer: str | None = None,
        metadata: Metadata | None = None,
    ) -> ErrorCode | None:
        """Answer ``to`` from local agent ``sender``, to the owner ``peer`` (when known) of the
        requester's id; None when delivered, else the code of why not (logged, not raised:
        the requester times out)."""
        reply = self._factory.reply(to, sender, type, payload)
        if metadata is not None:  # a progress notification in the request's thread
            reply = dataclasses.replace(reply, metadata=metadata)
        if peer is not None and self._registry.is_contested(to.sender):
            # Two owners claim the requester's name: the reply names the one that asked.
            reply = dataclasses.replace(reply, recipient=pinned_address(to.sender, peer))
        try:
            await self.send(reply)
        except P2PError as exc:
            logger.info("reply %s to %s not delivered: %s", reply.id, to.sender, exc)
            return exc.code
        return None

    def peer_departed(self, peer_id: PeerId, why: str) -> int:
        """Fail at once the requests pending on ``peer_id``, whose link closed for good:
        no answer can come (DELIVERY_FAILED saying ``why``). Returns how many."""
        return self._fail_pending(peer_id, why, math.inf)

    def peer_restarted(self, peer_id: PeerId, since: float) -> int:
        """Fail at once the requests written to ``peer_id`` before ``since``, when its
        current channel opened: that channel's HELLO named another incarnation, so the
        process they went to is gone (node.md "Redials and departure"). Returns how many."""
        return self._fail_pending(peer_id, f"peer {peer_id} restarted", since)

    def _fail_pending(self, peer_id: PeerId, why: str, written_before: float) -> int:
        failed = 0
        for request_id, pending in self.pending.items():
            if pending.peer != peer_id or pending.reply is not None or pending.error is not None:
                continue
            if pending.sent_at > written_before:
                continue
            pending.error = LocalError(
                ErrorCode.DELIVERY_FAILED,
                f"no response to {request_id}: {why}",
                peer=str(peer_id),
            )
            pending.event.set()
            failed += 1
        return failed

    async def expire_requests(
        self, interval: float, move_on_at: MoveOnAt = trio_move_on_at
    ) -> None:
        """Wake requests whose deadline passed, every ``interval`` seconds, forever
        (through the network's timer ``move_on_at``: see :func:`tick_on_grid`)."""
        # One timer for all pending requests instead of a cancel scope per request, which
        # costs about 10 microseconds of every round trip. On the clock's grid of
        # ``interval``, as the links' watchdogs: nodes sharing a clock wake together.
        await tick_on_grid(move_on_at, interval, self._expire)

    def _expire(self, now: float) -> None:
        for pending in list(self.pending.values()):
            if pending.deadline <= now:
                pending.event.set()
        self.release_departed()

    def release_departed(self) -> int:
        """Release what peers this node has no channel to any more (they left) hold: their
        thread envelopes are forgotten, and their queued inbox envelopes are skipped
        unread. Returns the thread bytes released. Run with the request timer."""
        present = {
            str(link.peer_id) for link in self._links if link.state is not ChannelState.CLOSED
        }
        released = 0
        for owner in self.threads.owners():
            if owner and owner not in present:
                released += self.threads.forget(owner)
        for agent in self._agents.values():  # one budget for every inbox
            agent.budget.departed = {p for p in agent.budget.peers() if p not in present}
            break
        return released

    async def send(self, envelope: Envelope) -> RoutingResult:
        """Route one envelope from a local agent (see the module docstring).

        Raises LocalError: AGENT_NOT_FOUND, CAPABILITY_NOT_FOUND, TIER_VIOLATION,
        SANDBOX_VIOLATION, ESCALATION_REQUIRED, DELIVERY_FAILED.
        """
        routed = await self._route(envelope)
        if isinstance(routed, RoutingResult):
            return routed
        peer_id = routed.target.peer_id
        pending = self.pending.get(envelope.id)
        if pending is not None:  # set before the write: the peer may leave during it
            pending.peer = peer_id
        try:
            await self._links.link(peer_id).send_many([encode_envelope(routed.envelope)])
        except P2PError as exc:
            self._note_failure(routed.envelope, routed.start, exc)
            return await self._fail_over(envelope, routed, exc)
        return self._delivered(
            routed.envelope, RoutingPath.REMOTE, routed.target, routed.start, str(peer_id)
        )

    async def _look_up(self, recipient: str, known: AgentCard | None) -> AgentCard:
        """The target of ``recipient`` after asking discovery (:func:`find_agent`). When
        a card is ``known`` (its owner unreachable), discovery gets ``SUCCESSOR_WAIT``
        seconds to name another owner (one restarted under a new key); then the known
        card is used: the dial tells. Discovery is not asked again for that agent for
        ``SUCCESSOR_RECHECK`` seconds after it named no other owner."""
        if known is None:
            return await find_agent(
                recipient, self.router, self.discovery, self.cards, self._links, self._clock_ms()
            )
        now = trio.current_time()
        if now - self._no_successor.get(recipient, -math.inf) < SUCCESSOR_RECHECK:
            return known
        found = known
        with trio.move_on_after(SUCCESSOR_WAIT):
            found = await find_agent(
                recipient, self.router, self.discovery, self.cards, self._links, self._clock_ms()
            )
        if found.peer_id == known.peer_id:
            self._no_successor.pop(recipient, None)
            self._no_successor[recipient] = trio.current_time()
            if len(self._no_successor) > SUCCESSOR_MEMORY:
                del self._no_successor[next(iter(self._no_successor))]
        return found

    async def _fail_over(self, envelope: Envelope, failed: Route, error: P2PError) -> RoutingResult:
        """A request by capability whose provider could not be reached (no channel to its
        owner opened) goes to the next provider, the owner now unreachable: at most
        ``FAILOVER_ATTEMPTS`` more. Anything else raises ``error``."""
        metadata = envelope.metadata
        by_capability = metadata is not None and metadata.routing_hint == ROUTING_HINT_CAPABILITY
        for _ in range(FAILOVER_ATTEMPTS):
            if not by_capability or not self._dial_failed(failed.target.peer_id, error):
                break
            routed = await self._route(envelope)
            if isinstance(routed, RoutingResult):
                return routed  # delivered to a local agent
            if routed.target.peer_id == failed.target.peer_id:
                break  # no other provider
            pending = self.pending.get(envelope.id)
            if pending is not None:
                pending.moved_to(routed.target.peer_id)
            try:
                await self._links.link(routed.target.peer_id).send_many(
                    [encode_envelope(routed.envelope)]
                )
            except P2PError as exc:
                self._note_failure(routed.envelope, routed.start, exc)
                failed, error = routed, exc
                continue
            where = str(routed.target.peer_id)
            return self._delivered(
                routed.envelope, RoutingPath.REMOTE, routed.target, routed.start, where
            )
        raise error

    def _dial_failed(self, peer_id: PeerId, error: P2PError) -> bool:
        """True when ``error`` means no channel to ``peer_id`` could be opened: the owner
        is then unreachable (docs/protocol/node.md "Agent ids and owners")."""
        link = self._links.get(peer_id)
        if error.code is not ErrorCode.DELIVERY_FAILED or (
            link is not None and link.state is ChannelState.OPEN
        ):
            return False
        self._registry.note_unreachable(peer_id)
        return True

    async def send_many(self, envelopes: Iterable[Envelope]) -> list[RoutingResult]:
        """Route envelopes in order, each as :meth:`send` would, and return their results.

        Envelopes for the same remote peer leave in one coalesced channel write
        after all are routed, so a burst of small envelopes costs one write and
        one wake-up instead of one per envelope; per-peer order is kept. Routing
        stops at the first envelope that cannot be routed; the ones before it
        are still delivered, then the error is raised (what :meth:`send` raises).
        """
        results: list[RoutingResult | Route] = []
        remote: dict[PeerId, list[Route]] = {}
        error: P2PError | None = None
        # Remote targets that envelopes alike take without a check or an event, as the
        # last one routed in full did: a burst is routed once. Routing in full may wait,
        # the only time the registry, local agents or policy change: emptied first.
        plain: BurstDecisions[AgentCard] = BurstDecisions()
        for envelope in envelopes:
            if envelope.is_broadcast and remote:
                # A broadcast is written at once: what is queued for its peers goes first.
                error = await self._write_routes(remote)
                remote = {}
                if error is not None:
                    break
            target = plain.get(envelope)
            if (
                target is not None
                and not target.is_expired(envelope.timestamp)
                and payload_limit_error(envelope.payload) is None  # else _route refuses it
            ):
                routed: RoutingResult | Route = Route(envelope, target, trio.current_time())
            else:
                plain.clear()
                try:
                    routed = await self._route(envelope, plain)
                except P2PError as exc:
                    error = exc
                    break
            if isinstance(routed, Route):
                remote.setdefault(routed.target.peer_id, []).append(routed)
            results.append(routed)
        error = await self._write_routes(remote) or error
        if error is not None:
            raise error
        return [r if isinstance(r, RoutingResult) else r.done() for r in results]

    async def _write_routes(self, remote: dict[PeerId, list[Route]]) -> P2PError | None:
        """Write each peer's routed envelopes in one go; the first failure, if any."""
        error: P2PError | None = None
        for peer_id, routes in remote.items():
            peer = str(peer_id)
            try:
                await self._links.link(peer_id).send_many(frames_of([r.envelope for r in routes]))
            except P2PError as exc:
                for route in routes:
                    self._note_failure(route.envelope, route.start, exc)
                error = error or exc
                continue
            written = trio.current_time()  # once for the burst: they left together
            for route in routes:
                route.result = self._delivered(
                    route.envelope, RoutingPath.REMOTE, route.target, route.start, peer, written
                )
        return error

    async def _route(
        self,
        envelope: Envelope,
        plain: BurstDecisions[AgentCard] | None = None,
    ) -> RoutingResult | Route:
        """Resolve and check ``envelope``; deliver it when the target is local (or it is a
        broadcast), else return the route for the caller to write. A refusal emits its
        routing event and is raised. One coroutine: it runs for every envelope sent.
        A remote target that envelopes like this one may take without a check is
        entered in ``plain`` (see :meth:`send_many`)."""
        start = trio.current_time()
        sent = envelope
        try:
            source = self.router.source(envelope.sender)
            if envelope.correlation_id is not None:  # what the thread store files
                self.threads.add(envelope)
            if envelope.is_broadcast:
                return await self._broadcast(source, envelope, start)
            if envelope.metadata and envelope.metadata.routing_hint == ROUTING_HINT_CAPABILITY:
                envelope, target = await self._by_capability(source, envelope)
            else:
                # The envelope was stamped by this node's clock as it was made: no second read.
                recipient = self.router.reply_recipient(envelope)  # pinned to the asker
                try:
                    found = self.router.known_target(recipient, envelope.timestamp)
                except AmbiguousAgentError:
                    found = None  # decided below, after probing its owners
                if found is None or not self.router.reachable(found):
                    # Unknown, ambiguous, or its owner gone: discovery may know more.
                    found = await self._look_up(recipient, found)
                target = found
                if target.id != envelope.recipient:  # agent@peer: the peer's agent is "agent"
                    self.router.pin(envelope)
                    envelope = dataclasses.replace(envelope, recipient=target.id)
            verdict = self.router.check(source, target, envelope)
            if verdict is not None and verdict.reported:
                self._note_verdict(verdict, envelope, None)
                if not verdict.allowed:
                    raise verdict.to_local_error()
            if target.origin is not Origin.LOCAL:
                over = payload_limit_error(envelope.payload)
                if over is not None:  # the peer's decoder would drop it unanswered
                    raise over
                if envelope.type is MessageType.TASK_PROPOSAL:  # answers pass ingress policy
                    self.router.note_request(envelope)
                elif plain is not None and envelope is sent and silent_pass(sent, verdict):
                    plain.put(sent, target)
                return Route(envelope, target, start)
            await self._deliver_local(envelope, [target.id])
            return self._delivered(envelope, RoutingPath.LOCAL, target, start, str(target.peer_id))
        except P2PError as exc:
            self._note_failure(sent, start, exc)
            raise

    async def _by_capability(
        self, source: AgentCard, envelope: Envelope
    ) -> tuple[Envelope, AgentCard]:
        """``envelope`` addressed to the agent chosen for the capability it names, which
        goes with it (the receiver dispatches on it), and that agent's card."""
        target = await find_provider(
            source, envelope.recipient, self.router, self.discovery, self.cards, self._clock_ms
        )
        assert envelope.metadata is not None
        metadata = dataclasses.replace(
            envelope.metadata, routing_hint=None, capability=envelope.recipient
        )
        return dataclasses.replace(envelope, recipient=target.id, metadata=metadata), target

    def _delivered(
        self,
        envelope: Envelope,
        path: RoutingPath,
        target: AgentCard,
        start: float,
        peer: str,
        now: float | None = None,
    ) -> RoutingResult:
        """The result of ``envelope``, sent to ``target`` of ``peer``: its two events."""
        latency = ((trio.current_time() if now is None else now) - start) * 1000
        self._events.sent_and_delivered(envelope, path, peer, latency, target.id)
        return RoutingResult(envelope.id, path, (target.id,), 1, latency)

    def _note_failure(self, envelope: Envelope, start: float, exc: P2PError) -> None:
        latency = (trio.current_time() - start) * 1000
        if envelope.is_broadcast:
            path = RoutingPath.BROADCAST
        else:
            local = envelope.recipient in self._agents
            path = RoutingPath.LOCAL if local else RoutingPath.REMOTE
        outcome = Outcome.FAILED if exc.code is ErrorCode.DELIVERY_FAILED else Outcome.REJECTED
        self._events.routing_decision(envelope, path, outcome, latency, code=exc.code)

    def _note_verdict(self, verdict: Verdict, envelope: Envelope, peer: str | None) -> None:
        """The event of a refusal or of a cross-tier message (a plain allow has none)."""
        if not verdict.allowed:
            code = verdict.code or ErrorCode.INTERNAL
            self._events.security(code, verdict.reason, peer, envelope)
        elif verdict.cross_tier and verdict.source_tier is not None:
            assert verdict.target_tier is not None
            self._events.audit_cross_tier(envelope, verdict.source_tier, verdict.target_tier)

    async def _broadcast(
        self, source: AgentCard, envelope: Envelope, start: float
    ) -> RoutingResult:
        fanout = self.router.fan_out(source, envelope, self._clock_ms())
        over = payload_limit_error(envelope.payload) if fanout.peers else None
        if over is not None:  # refused whole, before any agent has it
            raise over
        await self._deliver_local(envelope, fanout.local)
        frame = encode_envelope(envelope)
        async with trio.open_nursery() as nursery:
            for peer_id, agent_ids in fanout.peers.items():
                nursery.start_soon(self._broadcast_to_peer, peer_id, agent_ids, frame)
        self._events.message_sent(envelope, path=RoutingPath.BROADCAST)
        latency = (trio.current_time() - start) * 1000
        targets = fanout.targets
        self._events.routing_decision(
            envelope, RoutingPath.BROADCAST, Outcome.DELIVERED, latency, target=",".join(targets)
        )
        return RoutingResult(envelope.id, "broadcast", targets, len(targets), latency)

    async def _broadcast_to_peer(
        self, peer_id: PeerId, agent_ids: tuple[str, ...], frame: bytes
    ) -> None:
        try:
            await self._links.link(peer_id).send(frame)
        except P2PError as exc:
            self._events.error(exc.code, f"broadcast to {peer_id} ({agent_ids}): {exc.message}")

    async def _deliver_local(self, envelope: Envelope, agent_ids: Sequence[str]) -> None:
        interceptor = self.interceptors.of(envelope)  # services see local envelopes too
        for agent_id in agent_ids:
            agent = self._agents.get(agent_id)
            if agent is None:
                continue
            if envelope.type in ANSWERED_TYPES:
                self.router.note_request(envelope)
            if self._resolve_pending(envelope):
                continue
            if interceptor is not None:
                await interceptor(self.router.source(envelope.sender), agent_id, envelope)
            else:
                await agent.deliver(envelope)

    def _resolve_pending(self, envelope: Envelope) -> bool:
        if envelope.correlation_id is None:
            return False
        pending = self.pending.get(envelope.correlation_id)
        if envelope.type is MessageType.NOTIFICATION and is_progress(envelope):
            if pending is not None:
                pending.progressed(envelope, trio.current_time())
            return True  # taken here, matched or not: never an agent's message
        if pending is None or pending.reply is not None:
            return False
        if envelope.type in STREAM_TYPES:
            if pending.targets is not None and envelope.sender not in pending.targets:
                return False
            if pending.stream is None:
                pending.stream = ReplyStream()
            pending.stream.take(envelope)
            return True
        if not Router.answers(envelope, pending.targets):
            return False
        pending.reply = envelope
        pending.event.set()
        return True

    # -- frames in --------------------------------------------------------------------------

    async def on_frame(self, peer_id: PeerId, data: bytes) -> None:
        """Ingress of one frame: its failure boundary. Whatever processing it raises ends
        here, as a security event naming the peer (module :mod:`p2pnode.core.boundary`)."""
        peer = str(peer_id)
        try:
            frame = decode_frame_untrusted(data)
            if isinstance(frame, Envelope):
                await self._on_envelope(peer_id, peer, frame)
            elif isinstance(frame, EnvelopeBatch):
                for problem in frame.rejected:
                    self._boundary.contain(peer, "envelope", problem)
                for refused in frame.refused:
                    try:
                        await self._on_refused(peer_id, peer, refused)
                    except Exception as exc:
                        self._boundary.contain(peer, "envelope", exc)
                decisions: BurstDecisions[IngressDecision] = BurstDecisions()
                for envelope in frame.envelopes:
                    # Each envelope of a batch is an input of its own: one that fails
                    # does not cost the peer the ones after it. Most take no wait, and
                    # no coroutine is made for them.
                    try:
                        taken = self._take(peer_id, peer, envelope, decisions)
                        if taken is not None:
                            await self._finish(peer_id, peer, envelope, taken, decisions)
                    except Exception as exc:
                        decisions.clear()
                        self._boundary.contain(peer, "envelope", exc)
            else:
                self._on_hello(peer_id, frame)
        except Exception as exc:
            self._boundary.contain(peer, "frame", exc)

    async def _on_refused(self, peer_id: PeerId, peer: str, refused: Refused) -> None:
        """An envelope over a decoding limit, known by its header: reported as the peer's
        fault, and a request from one of the peer's agents to a local agent answered with
        the limit's error (docs/protocol/node.md, "Refusals")."""
        envelope, error = refused.envelope, refused.error
        self._boundary.contain(peer, "envelope", error)
        source = self.router.authenticate(peer_id, envelope)
        if isinstance(source, Refusal):
            self._events.security(source.code, source.reason, peer, envelope)
            return
        if (
            envelope.type is not MessageType.REQUEST
            or envelope.recipient not in self._agents
            or not self._seen.add(envelope.id)  # a retried write is answered once
        ):
            return
        details = {**error.details, "agent_id": envelope.recipient}
        answer = RemoteError(error.code, error.message, **details)
        await self._refuse(peer_id, envelope, envelope.recipient, answer)

    def _on_hello(self, peer_id: PeerId, hello: Hello) -> None:
        if hello.incarnation is not None:
            self._note_incarnation(peer_id, hello.incarnation)
        self.cards.withdraw_from(peer_id, hello.withdrawals)
        if hello.withdrawals and not hello.cards:
            self._links.peer_leaving(peer_id)  # a stopping node's last HELLO
        self.cards.learn_from(peer_id, hello.cards)
        addresses = []
        for text in hello.addresses:
            try:
                addresses.append(parse_address(text))
            except LocalError:
                continue
        self._links.learn_addresses(peer_id, addresses)
        self.hello_seen(peer_id).set()

    def _note_incarnation(self, peer_id: PeerId, incarnation: bytes) -> None:
        """A HELLO naming another incarnation than the peer's last one: it restarted, and
        what was written to it before its current channel will not be answered."""
        link = self._links.get(peer_id)
        if link is None:
            return
        before, link.incarnation = link.incarnation, incarnation
        if before is not None and before != incarnation:
            failed = self.peer_restarted(peer_id, link.opened_at)
            logger.info("peer %s restarted: %d pending requests failed", peer_id, failed)

    async def _on_envelope(
        self,
        peer_id: PeerId,
        peer: str,
        envelope: Envelope,
        decisions: BurstDecisions[IngressDecision] | None = None,
    ) -> None:
        """Ingress of one envelope from the authenticated ``peer_id`` (text: ``peer``).

        ``decisions``, one map per ENVELOPES frame, keeps the sender's authentication
        and the ingress decision of envelopes outside a thread by all they read of one,
        so a burst is decided once. They read the registry, the local agents and the
        policy, which change only while this task waits: emptied after any wait."""
        taken = self._take(peer_id, peer, envelope, decisions)
        if taken is not None:
            await self._finish(peer_id, peer, envelope, taken, decisions)

    async def _finish(
        self, peer_id: PeerId, peer: str, envelope: Envelope, taken: Taken, decisions: Decided
    ) -> None:
        """The hand-over :meth:`_take` left, and what it means for ``decisions``."""
        source, ingress, size = taken
        without_wait = await self._hand_over(peer_id, peer, envelope, source, ingress, size)
        if decisions is not None:
            if without_wait:
                decisions.put(envelope, (source, ingress))
            else:
                decisions.clear()

    def _take(
        self, peer_id: PeerId, peer: str, envelope: Envelope, decisions: Decided
    ) -> Taken | None:
        """The part of :meth:`_on_envelope` that never waits: None when that was all of
        it, else what the hand-over needs."""
        decided = decisions.get(envelope) if decisions is not None else None
        if decided is None:
            source, ingress = self.router.authenticate(peer_id, envelope), None
        else:
            source, ingress = decided
        if isinstance(source, Refusal):
            if decisions is not None:
                decisions.put(envelope, (source, None))
            self._events.security(source.code, source.reason, peer, envelope)
            return None
        if not self._seen.add(envelope.id):
            return None
        size = envelope_size(envelope)  # one walk for the thread store and the inbox
        self._events.message_received(envelope, peer=peer)
        if envelope.correlation_id is not None:  # a reply or a thread's message
            self.threads.add(envelope, peer, size)
            if self._resolve_pending(envelope):
                return None
        if ingress is None:
            ingress = self.router.ingress(source, envelope)
        if self._queue_nowait(peer_id, peer, envelope, ingress, size):
            if decisions is not None and decided is None:
                decisions.put(envelope, (source, ingress))
            return None
        return source, ingress, size

    def _queue_nowait(
        self, peer_id: PeerId, peer: str, envelope: Envelope, ingress: Ingress, size: int
    ) -> bool:
        """The hand-over of most envelopes, with no coroutine: True when ``envelope`` has
        one recipient, allowed with nothing to report, no interceptor, and went into its
        inbox at once. False: nothing was done; :meth:`_hand_over` does all of it."""
        verdicts = ingress.verdicts
        if len(verdicts) != 1 or self.interceptors.of(envelope) is not None:
            return False
        agent_id, verdict = verdicts[0]
        if verdict is not None and verdict.reported:
            return False
        try:
            if not self._agents[agent_id].deliver_nowait(envelope, peer, peer_id, size):
                return False
        except LocalError:  # over the inbox budget, or closing: the hand-over reports it
            return False
        if envelope.type in ANSWERED_TYPES:
            self.router.note_request(envelope, peer_id)
        return True

    async def _hand_over(
        self,
        peer_id: PeerId,
        peer: str,
        envelope: Envelope,
        source: AgentCard,
        ingress: Ingress,
        size: int,
    ) -> bool:
        """Give an authenticated, new ``envelope`` to the recipients ``ingress`` allows,
        refusing it to the others; True when that took no wait."""
        if ingress.refusal is not None:
            return await self._refuse_all(peer_id, peer, envelope, ingress.refusal)
        without_wait = True
        allowed = []
        for agent_id, verdict in ingress.verdicts:
            if verdict is not None and verdict.reported:
                self._note_verdict(verdict, envelope, peer)
            if verdict is None or verdict.allowed:
                allowed.append(self._agents[agent_id])
            elif envelope.type is MessageType.REQUEST and not envelope.is_broadcast:
                await self._refuse(peer_id, envelope, agent_id, verdict.to_remote_error())
                without_wait = False
        if allowed and envelope.type in ANSWERED_TYPES:
            self.router.note_request(envelope, peer_id)
        interceptor = self.interceptors.of(envelope)
        if interceptor is not None:
            for agent in allowed:
                await interceptor(source, agent.card.id, envelope)
            return not allowed and without_wait
        for agent in allowed:
            try:
                if not agent.deliver_nowait(envelope, peer, peer_id, size):
                    without_wait = False
                    await agent.deliver(envelope, peer, peer_id, size)  # waits for room
            except LocalError as exc:
                if exc.code is not ErrorCode.BUSY:
                    raise
                # Over the inbox budget (p2pnode.node.inbox): refused, not buffered.
                self._events.security(exc.code, exc.message, peer, envelope)
                if envelope.type is MessageType.REQUEST and not envelope.is_broadcast:
                    details = {**exc.details, "agent_id": agent.card.id}  # retryAfterMs
                    error = RemoteError(exc.code, exc.message, **details)
                    await self._refuse(peer_id, envelope, agent.card.id, error)
                    without_wait = False
        return without_wait

    async def _refuse_all(
        self, peer_id: PeerId, peer: str, envelope: Envelope, refusal: Refusal
    ) -> bool:
        """Report an envelope no recipient may take; answer it when it is a request
        (in the name of the agent asked for, so the requester's pending request matches
        it instead of timing out). True when that took no wait."""
        self._events.security(refusal.code, refusal.reason, peer, envelope)
        if envelope.type is not MessageType.REQUEST:
            return True
        reason = refusal.reason
        if refusal.code is ErrorCode.AGENT_NOT_FOUND:
            # Worded for the requester, who reads it: "local" would be this node's view.
            reason = (
                f"agent {envelope.recipient!r} is not hosted by peer "
                f"{self._links.local_peer_id} (it left, or the requester's card is stale)"
            )
        error = RemoteError(refusal.code, reason, agent_id=envelope.recipient)
        await self._refuse(peer_id, envelope, envelope.recipient, error)
        return False

    async def _refuse(
        self, peer_id: PeerId, request: Envelope, sender: str, error: P2PError
    ) -> None:
        """Answer ``request`` from ``peer_id`` with an ``error`` envelope from ``sender``,
        straight to the requester's link: it refuses the requester's own request, so egress
        policy (which may forbid ``sender`` to address the requester at all) does not apply."""
        reply = self._factory.reply(request, sender, MessageType.ERROR, error.to_dict())
        try:
            await self._links.link(peer_id).send(encode_envelope(reply))
        except P2PError as exc:
            logger.info("refusal %s to %s not delivered: %s", reply.id, request.sender, exc)
            return
        self.threads.add(reply)
        self._events.message_sent(reply, RoutingPath.REMOTE, str(peer_id))
