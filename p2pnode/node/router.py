"""Routing decisions, pure: no trio, no I/O, no clock but an injected one (the age of
remembered ids).

The :class:`Router` answers every question the node's routing driver
(:mod:`p2pnode.node.routing`) asks about an envelope, from what it is given:
a view of the registry, the policy, the cards of the node's local agents and
the ids of requests the node allowed. It never sends, waits or emits: it
returns decisions, and the driver performs them (DHT fallbacks, writes,
events). That keeps the rules testable on their own (tests/test_router.py).

Egress (docs/protocol/node.md "Routing"):

* :meth:`Router.source` — the sender must be a local agent.
* :meth:`Router.known_target` — a recipient known to the registry (local
  agents are registered too); None means "ask discovery". Egress questions
  take ``now_ms``: a card past its expiry is never a target. A bare agent id
  that several owners claim goes to one of them by the registry's rule
  (:meth:`p2pnode.core.registry.Registry.resolve`): the local agent, the owner the
  swarm authority endorsed, the owner this node's agents named before
  (:meth:`Router.pin`), the first owner this node met while it is live, the
  only live one; else :class:`AmbiguousAgentError` names every live owner
  (docs/protocol/node.md "Agent ids and owners"). ``agent@peer`` always
  names the owner.
* :meth:`Router.candidates` — agents offering a capability that the source
  may discover and send a request to, local ones first; when there is none,
  :meth:`Router.refused` says why for each agent that offers it.
* :meth:`Router.check` — the policy verdict for one (source, target) pair;
  None for a reply to a request this node allowed (not tier-checked again).
* :meth:`Router.fan_out` — a broadcast's allowed targets: local agents, and
  remote agents grouped by the peer that hosts them.

Ingress (docs/protocol/node.md "Acceptance rules"):

* :meth:`Router.authenticate` — the envelope's sender must be an agent whose
  signed card belongs to the authenticated peer; returns the source card.
* :meth:`Router.ingress` — the local recipients, each with its verdict.

Replies: :meth:`Router.answers` tells whether an envelope answers a pending
request, and from an agent that request may be answered by.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Generic, NamedTuple, Protocol, TypeVar

from p2pnode.core.card import AgentCard, Origin, pinned_address, split_address
from p2pnode.core.envelope import ROUTING_HINT_CAPABILITY, Envelope, MessageType, Metadata
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.identity import PeerId
from p2pnode.node.policy import Policy, Verdict
from p2pnode.node.progress import is_progress


class RoutingResult(NamedTuple):
    """What :meth:`Node.send` did with an envelope (a tuple: one is built per envelope)."""

    envelope_id: str
    path: str  # "local", "remote" or "broadcast"
    targets: tuple[str, ...]
    delivered: int
    latency_ms: float


#: An interceptor of inbound envelopes: ``(authenticated source card, local recipient
#: agent id, envelope)``; see :mod:`p2pnode.node.service`.
Interceptor = Callable[[AgentCard, str, Envelope], Awaitable[None]]

REPLY_TYPES = frozenset(
    {MessageType.RESPONSE, MessageType.ERROR, MessageType.TASK_ACCEPT, MessageType.TASK_REJECT}
)
#: What replies answer: a request, or a task proposal (whose thread carries its reports).
ANSWERED_TYPES = frozenset({MessageType.REQUEST, MessageType.TASK_PROPOSAL})
#: What may precede a reply: the parts of an answer streamed (p2pnode.node.replystream).
REPLY_STREAM_TYPES = frozenset(
    {MessageType.STREAM_START, MessageType.STREAM_DATA, MessageType.STREAM_END}
)


class RegistryView(Protocol):
    """What routing reads of the registry."""

    def find(self, agent_id: str) -> AgentCard | None: ...

    def find_by_capability(self, capability_id: str) -> list[AgentCard]: ...

    def find_owned(self, agent_id: str, peer_id: PeerId) -> AgentCard | None: ...

    def owners(self, agent_id: str, now_ms: int | None = None) -> list[AgentCard]: ...

    def is_contested(self, agent_id: str) -> bool: ...

    def is_live(self, card: AgentCard, now_ms: int | None) -> bool: ...

    def resolve(
        self,
        agent_id: str,
        now_ms: int | None,
        *,
        prefer: PeerId | None = None,
        authority_key: bytes | None = None,
    ) -> list[AgentCard]: ...

    def __iter__(self) -> Iterator[AgentCard]: ...


class HostedAgent(Protocol):
    """What routing reads of a local agent: its current card."""

    @property
    def card(self) -> AgentCard: ...


class SeenSet(Protocol):
    """A bounded set of ids (the requests this node allowed)."""

    def add(self, key: str) -> bool: ...

    def __contains__(self, key: object) -> bool: ...


#: Seconds a BoundedSet generation collects keys before it becomes the older one.
DEFAULT_MAX_AGE = 60.0

D = TypeVar("D")


class BoundedSet:
    """Remembers keys for at least ``max_age`` seconds or until ``size`` newer keys
    came, whichever is first; never more than ``2 * size`` keys.

    Two generations of plain sets: when the newer one is full, or has collected
    for ``max_age`` seconds (``None``: no age), it becomes the older one and the
    previous older one is forgotten. Set operations are the cheapest membership
    test Python has, and this runs for every envelope; the age costs one read
    of ``clock`` (injected, monotonic by default) per key added. Without the
    age a slow stream of keys fills both generations over hours, and a node's
    memory rises all that while; with it the set holds a minute or two of
    keys, reached within two minutes of steady traffic.
    """

    __slots__ = ("_clock", "_max_age", "_new", "_old", "_rotate_at", "_size")

    def __init__(
        self,
        size: int,
        *,
        max_age: float | None = DEFAULT_MAX_AGE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._size = size
        self._max_age = max_age
        self._clock = clock
        self._new: set[str] = set()
        self._old: set[str] = set()
        self._rotate_at = math.inf if max_age is None else clock() + max_age

    def add(self, key: str) -> bool:
        """Add ``key``; False when it was already there."""
        if key in self._new or key in self._old:
            return False
        if len(self._new) >= self._size or (
            self._max_age is not None and self._clock() >= self._rotate_at
        ):
            self._old, self._new = self._new, set()
            if self._max_age is not None:
                self._rotate_at = self._clock() + self._max_age
        self._new.add(key)
        return True

    def __contains__(self, key: object) -> bool:
        return key in self._new or key in self._old


#: Inbound requests whose peer is remembered for their replies: at least this many.
_MAX_ASKERS = 65_536
#: Agent ids whose chosen owner is remembered (the oldest is forgotten first).
_MAX_PINS = 4096


class AmbiguousAgentError(LocalError):
    """An agent id claimed by more than one owner, addressed without naming one.

    Code ``INVALID_ARGUMENT``; ``details``: ``agent_id`` and ``owners`` (each
    as the ``agent@peer`` address that reaches it).
    """

    def __init__(self, agent_id: str, owners: list[AgentCard]) -> None:
        #: The cards of the live owners, held first.
        self.owners = owners
        addresses = [pinned_address(agent_id, c.peer_id) for c in owners]
        super().__init__(
            ErrorCode.INVALID_ARGUMENT,
            f"agent id {agent_id!r} is claimed by {len(owners)} owners ("
            f"{', '.join(addresses)}); address one of them as agent@peer",
            agent_id=agent_id,
            owners=addresses,
        )


@dataclass(frozen=True, slots=True)
class Fanout:
    """Where a broadcast goes: local agent ids, and remote agent ids by hosting peer."""

    local: tuple[str, ...]
    peers: Mapping[PeerId, tuple[str, ...]]

    @property
    def targets(self) -> tuple[str, ...]:
        return self.local + tuple(i for ids in self.peers.values() for i in ids)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why an inbound envelope is dropped before any agent sees it (a security event)."""

    code: ErrorCode
    reason: str


@dataclass(frozen=True, slots=True)
class Refused:
    """An agent offering a capability that policy does not let a source use.

    ``visible`` is False for a card the source may not even discover (a sandbox
    rule, seed R10.4): an error may count it but must not name it.
    """

    card: AgentCard
    verdict: Verdict
    visible: bool


class Ingress(NamedTuple):
    """The local recipients of an authenticated inbound envelope.

    ``verdicts`` pairs each recipient with its policy verdict (None: a reply to
    a request this node allowed). ``refusal`` is set when there is no such
    recipient. A named tuple rather than a frozen dataclass: one is made per
    inbound envelope, and a tuple is several times cheaper to build.
    """

    verdicts: tuple[tuple[str, Verdict | None], ...] = ()
    refusal: Refusal | None = None

    @property
    def allowed(self) -> list[str]:
        return [a for a, v in self.verdicts if v is None or v.allowed]


class Router:
    """Routing decisions over a registry view, a policy and the local agents' cards."""

    __slots__ = ("_allowed_requests", "_askers", "_local", "_pins", "_policy", "_registry")

    def __init__(
        self,
        registry: RegistryView,
        policy: Policy,
        local: Mapping[str, HostedAgent],
        allowed_requests: SeenSet,
    ) -> None:
        self._registry = registry
        self._policy = policy
        self._local = local
        self._allowed_requests = allowed_requests
        #: The peer each inbound request came from, by thread: its replies are pinned to
        #: that owner of the requester's id. Two generations, as BoundedSet.
        self._askers: tuple[dict[str, PeerId], dict[str, PeerId]] = ({}, {})
        #: The owner this node's agents named for an agent id (``agent@peer``): the one
        #: a bare id goes to when it is ambiguous.
        self._pins: dict[str, PeerId] = {}

    # -- egress ---------------------------------------------------------------------------------

    def source(self, agent_id: str) -> AgentCard:
        """The card of local agent ``agent_id``. Raises LocalError(AGENT_NOT_FOUND)."""
        agent = self._local.get(agent_id)
        if agent is None:
            raise LocalError(ErrorCode.AGENT_NOT_FOUND, f"no local agent {agent_id!r}")
        return agent.card

    def known_target(self, agent_id: str, now_ms: int | None = None) -> AgentCard | None:
        """The registry's card for ``agent_id`` (a bare id, or ``agent@peer`` naming the
        owner); None when only discovery can tell (also when the card expired at
        ``now_ms``: an expired card is never routed to). A bare id that several owners
        claim resolves by the registry's rule (:meth:`Registry.resolve`: a local agent,
        the endorsed owner, the owner this node's agents named, the first seen live
        owner, the only live one). Raises AmbiguousAgentError when none of these
        decides between live owners."""
        registry = self._registry
        if "@" not in agent_id and not registry.is_contested(agent_id):
            # The common case, a bare id with one owner: no address to parse, no list.
            card = registry.find(agent_id)
            if card is not None and now_ms is not None and card.is_expired(now_ms):
                return None
            return card
        name, owner = split_address(agent_id)
        if owner is not None:
            card = registry.find_owned(name, owner)
        else:
            chosen = registry.resolve(
                name,
                now_ms,
                prefer=self._pins.get(name),
                authority_key=self._policy.config.authority_key,
            )
            if len(chosen) > 1:
                raise AmbiguousAgentError(name, chosen)
            card = chosen[0] if chosen else None
        if card is not None and now_ms is not None and card.is_expired(now_ms):
            return None
        return card

    def reachable(self, card: AgentCard) -> bool:
        """False when ``card``'s owner is known unreachable (its link closed for good)."""
        return self._registry.is_live(card, None)

    def pin(self, envelope: Envelope) -> None:
        """Remember the owner ``envelope`` names (``agent@peer``, in anything but a reply):
        the sender chose it, so a bare ambiguous id goes there from now on. Replies never
        pin (they go to whoever asked, maybe the squatter)."""
        if envelope.type in REPLY_TYPES or envelope.type in REPLY_STREAM_TYPES:
            return
        name, owner = split_address(envelope.recipient)
        if owner is None:
            return
        if name not in self._pins and len(self._pins) >= _MAX_PINS:
            del self._pins[next(iter(self._pins))]  # the oldest pin
        self._pins[name] = owner

    def candidates(
        self, source: AgentCard, capability: str, now_ms: int | None = None
    ) -> list[AgentCard]:
        """Agents offering ``capability`` that ``source`` may discover and send a request to,
        in registry order (local agents first), ``source`` itself and cards expired at
        ``now_ms`` excluded. Providers whose owner is known unreachable come only when
        no reachable one is left (a dial may find it back)."""
        cards = _live(self._registry.find_by_capability(capability), now_ms)
        policy = self._policy
        allowed = [
            c
            for c in policy.filter_discoverable(source, cards)
            if c.id != source.id
            and policy.check_message(source, c, MessageType.REQUEST, None).allowed
        ]
        reachable = [c for c in allowed if self._registry.is_live(c, None)]
        return reachable or allowed

    def refused(
        self, source: AgentCard, capability: str, now_ms: int | None = None
    ) -> list[Refused]:
        """Why no agent offering ``capability`` is a candidate for ``source``: each one
        (``source`` itself and expired cards left out) with the refused verdict of a
        request to it, in registry order. Empty when the capability is not offered, or
        when some agent is a candidate after all."""
        policy = self._policy
        out: list[Refused] = []
        for card in _live(self._registry.find_by_capability(capability), now_ms):
            if card.id == source.id:
                continue
            verdict = policy.check_message(source, card, MessageType.REQUEST, None)
            visible = policy.can_discover(source, card)
            if verdict.allowed and visible:
                return []
            if verdict.allowed:
                # Hidden by discovery (R10.4) though a request would pass: a sandbox rule.
                verdict = Verdict(False, ErrorCode.SANDBOX_VIOLATION, "not discoverable")
            out.append(Refused(card, verdict, visible))
        return out

    def check(self, source: AgentCard, target: AgentCard, envelope: Envelope) -> Verdict | None:
        """The policy verdict; None when ``envelope`` replies to a request this node allowed."""
        if (
            envelope.type in REPLY_TYPES
            or envelope.type in REPLY_STREAM_TYPES
            or is_progress(envelope)  # a request's progress passes as its reply does
        ) and envelope.correlation_id in self._allowed_requests:
            return None
        return self._policy.check_envelope(source, target, envelope)

    def fan_out(self, source: AgentCard, envelope: Envelope, now_ms: int | None = None) -> Fanout:
        """Every agent the node knows, other than ``source``, that policy lets it reach
        (cards expired at ``now_ms`` left out)."""
        local: list[str] = []
        peers: dict[PeerId, list[str]] = {}
        for card in self._registry:
            if card.id == source.id or (now_ms is not None and card.is_expired(now_ms)):
                continue
            if not self._policy.check_envelope(source, card, envelope).allowed:
                continue
            if card.origin is Origin.LOCAL:
                local.append(card.id)
            else:
                peers.setdefault(card.peer_id, []).append(card.id)
        return Fanout(tuple(local), {p: tuple(ids) for p, ids in peers.items()})

    def note_request(self, envelope: Envelope, peer: PeerId | None = None) -> None:
        """Remember that this node let request (or task proposal) ``envelope`` through, so
        its replies pass; and, for one from ``peer``, that its replies go to that peer."""
        thread = envelope.correlation_id or envelope.id
        self._allowed_requests.add(thread)
        if peer is not None:
            new = self._askers[0]
            if len(new) >= _MAX_ASKERS:
                self._askers = ({}, new)
                new = self._askers[0]
            new[thread] = peer

    def reply_recipient(self, envelope: Envelope) -> str:
        """Where a reply goes: ``agent@peer`` when ``envelope`` answers (or streams to) a
        request that came from ``peer``, so the reply never reaches another owner of the
        requester's id; else its recipient as it is."""
        thread = envelope.correlation_id
        if thread is None or (
            envelope.type not in REPLY_TYPES and envelope.type not in REPLY_STREAM_TYPES
        ):
            return envelope.recipient
        if not self._registry.is_contested(envelope.recipient):
            return envelope.recipient  # one owner: the bare name reaches the asker
        new, old = self._askers
        peer = new.get(thread) or old.get(thread)
        if peer is None or split_address(envelope.recipient)[1] is not None:
            return envelope.recipient
        return pinned_address(envelope.recipient, peer)

    # -- ingress --------------------------------------------------------------------------------

    def authenticate(self, peer_id: PeerId, envelope: Envelope) -> AgentCard | Refusal:
        """The source card when ``envelope``'s sender is an agent of ``peer_id``."""
        # find_owned matches the owner: no second comparison of peer ids.
        source = self._registry.find_owned(envelope.sender, peer_id)
        if source is None or source.origin is Origin.LOCAL:
            return Refusal(
                ErrorCode.SENDER_MISMATCH,
                f"peer {peer_id} sent an envelope as {envelope.sender!r}, not one of its agents",
            )
        return source

    def ingress(self, source: AgentCard, envelope: Envelope) -> Ingress:
        """The local recipients of ``envelope`` from ``source``, with their verdicts."""
        if envelope.is_broadcast:
            cards = [a.card for a in self._local.values()]
        else:
            agent = self._local.get(envelope.recipient)
            if agent is None:
                meta = envelope.metadata
                if meta is not None and meta.routing_hint == ROUTING_HINT_CAPABILITY:
                    # Capabilities are resolved by the sender's node; one left unresolved
                    # is refused as what it names.
                    refusal = Refusal(
                        ErrorCode.CAPABILITY_NOT_FOUND,
                        f"capability {envelope.recipient!r} was not resolved to an agent",
                    )
                else:
                    refusal = Refusal(
                        ErrorCode.AGENT_NOT_FOUND, f"no local agent {envelope.recipient!r}"
                    )
                return Ingress(refusal=refusal)
            card = agent.card
            return Ingress(((card.id, self.check(source, card, envelope)),))
        return Ingress(tuple((c.id, self.check(source, c, envelope)) for c in cards))

    # -- replies --------------------------------------------------------------------------------

    @staticmethod
    def answers(envelope: Envelope, targets: tuple[str, ...] | None) -> bool:
        """True when ``envelope`` is a reply its sender may give to a request sent to
        ``targets`` (None: not yet resolved, any sender)."""
        return envelope.type in REPLY_TYPES and (targets is None or envelope.sender in targets)


class BurstDecisions(Generic[D]):
    """Decisions for the envelopes of a burst outside a thread, by sender, recipient and
    type, each with the metadata it was made for: envelopes alike in all four are
    routed alike. The metadata is kept, so testing it by identity is sound; the
    node shares one metadata object per agent and per distinct value received."""

    __slots__ = ("_decided",)

    def __init__(self) -> None:
        self._decided: dict[tuple[str, str, MessageType], tuple[Metadata | None, D]] = {}

    def get(self, envelope: Envelope) -> D | None:
        """The decision made for an envelope like ``envelope``, if any."""
        if envelope.correlation_id is not None:
            return None
        known = self._decided.get((envelope.sender, envelope.recipient, envelope.type))
        return known[1] if known is not None and known[0] is envelope.metadata else None

    def put(self, envelope: Envelope, decision: D) -> None:
        """Keep ``decision`` for envelopes like ``envelope`` (none when it is in a thread)."""
        if envelope.correlation_id is None:
            key = (envelope.sender, envelope.recipient, envelope.type)
            self._decided[key] = (envelope.metadata, decision)

    def clear(self) -> None:
        self._decided.clear()


#: An ingress decision: the source card and its ingress (None once the sender failed
#: authentication).
IngressDecision = tuple[AgentCard | Refusal, Ingress | None]


def silent_pass(envelope: Envelope, verdict: Verdict | None) -> bool:
    """Did policy let ``envelope``, outside a thread, through without an event?"""
    return (
        envelope.correlation_id is None
        and verdict is not None
        and verdict.allowed
        and not verdict.cross_tier
    )


def capability_refusal(source: AgentCard, capability: str, refused: list[Refused]) -> LocalError:
    """The error for ``capability`` when policy lets ``source`` use none of the agents that
    offer it (``refused``, non-empty): the first visible refusal's code (TIER_VIOLATION,
    SANDBOX_VIOLATION, ...), else SANDBOX_VIOLATION. Visible providers are named with
    their reasons; hidden ones are only counted (seed R10.4)."""
    shown = [r for r in refused if r.visible]
    hidden = len(refused) - len(shown)
    code = shown[0].verdict.code if shown else None
    parts = [f"{r.card.id} ({r.verdict.code}: {r.verdict.reason})" for r in shown]
    if hidden:
        parts.append(f"{hidden} agent(s) outside what the sandbox rules let {source.id!r} reach")
    return LocalError(
        code or ErrorCode.SANDBOX_VIOLATION,
        f"{capability!r} is offered, but policy lets {source.id!r} use none of its "
        f"providers: {'; '.join(parts)}",
        capability=capability,
        candidates=[{"agent": r.card.id, "code": str(r.verdict.code)} for r in shown],
    )


def _live(cards: list[AgentCard], now_ms: int | None) -> list[AgentCard]:
    if now_ms is None:
        return cards
    return [c for c in cards if not c.is_expired(now_ms)]


__all__ = [
    "ANSWERED_TYPES",
    "REPLY_STREAM_TYPES",
    "REPLY_TYPES",
    "AmbiguousAgentError",
    "BoundedSet",
    "BurstDecisions",
    "Fanout",
    "HostedAgent",
    "Ingress",
    "IngressDecision",
    "Interceptor",
    "Refusal",
    "Refused",
    "RegistryView",
    "Router",
    "RoutingResult",
    "SeenSet",
    "capability_refusal",
    "pinned_address",
    "silent_pass",
    "split_address",
]
