"""The reachability service: every node checks others' addresses, and its own.

Theory of operation (docs/protocol/reachability.md):

* **Checker** (:meth:`ReachabilityService.serve`, the request method ``reach.dialback`` of
  every local agent). A requester names candidate addresses and a nonce
  (:mod:`~p2pnode.services.reachability.wire`). The checker looks up the address the
  requester's channel comes from (the *observed* address) and dials back, at once, each
  candidate whose IP is the observed IP: TCP with a new connection and a Noise handshake
  that must prove the requester's peer id; UDP with a DHT ``ping`` from a fresh socket
  whose reply must carry the requester's node id. Fresh sockets, never the node's own
  listening ports, so a NAT mapping the requester opened towards the checker cannot
  let a dial-back through by accident. A candidate on another IP is never dialed
  (``refused``): a checker cannot be made to send to a third party. Requests are
  limited per requesting peer (:class:`~p2pnode.node.limits.PeerQuota`).
* **Requester** (:meth:`ReachabilityService.check`). Picks checkers partly from a DHT lookup
  of a random key (peers the network chose) and partly from peers with an open channel
  (:func:`~p2pnode.services.reachability.verdict.pick_checkers`), asks them all at once,
  and asks each checker's DHT, by ``stun``, where it sees this node's UDP socket. The
  answers go to :func:`~p2pnode.services.reachability.verdict.decide`; the last verdict
  is :attr:`ReachabilityService.verdict`. The verdict also sets the DHT's mode
  (:func:`~p2pnode.services.reachability.verdict.dht_mode`): a node nobody reaches
  queries the DHT as a client and answers no DHT request.

The kernel side (observed addresses, open channels, opening one, the node's own
addresses) and the DHT side come in as protocols from the composition root.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from p2pnode.agent.definition import Agent, Reply
from p2pnode.core.card import AgentCard, Origin
from p2pnode.core.envelope import Envelope, MessageType, Metadata
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.core.identity import Identity, PeerId
from p2pnode.dht.config import DhtMode
from p2pnode.node.limits import PeerQuota
from p2pnode.node.service import ServiceHost
from p2pnode.services.reachability.verdict import (
    DEFAULT_CHECKERS,
    Report,
    Verdict,
    decide,
    dht_mode,
    pick_checkers,
)
from p2pnode.services.reachability.wire import (
    MAX_ADDRESSES,
    METHOD,
    NONCE_BYTES,
    Address,
    Candidate,
    DialAnswer,
    DialRequest,
    Outcome,
    ReachError,
    Transport,
    offer_untrusted,
    parse_answer_untrusted,
    parse_request_untrusted,
)
from p2pnode.transport.channel import connect_secure
from p2pnode.transport.net import Network
from p2pnode.transport.relay import RelayAddress, parse_relay_address
from p2pnode.transport.secure import SecureIdentity

logger = logging.getLogger("p2pnode.reachability")


@dataclass(frozen=True, slots=True)
class ReachConfig:
    """Limits and timers (seconds) of the reachability service (defaults: §3 of the doc)."""

    #: A dial-back of one candidate gives up after this long (``unreachable``).
    dial_timeout: float = 3.0
    #: The requester waits this long for each checker's answer.
    answer_timeout: float = 10.0
    #: Requests a peer may make: a burst of ``peer_burst``, then one per ``peer_interval``.
    peer_burst: int = 2
    peer_interval: float = 30.0
    #: Candidate addresses being dialed back at once, for all requesters together.
    max_dialing: int = 32
    #: Checkers a check asks.
    checkers: int = DEFAULT_CHECKERS


class KernelSide(Protocol):
    """What the service uses of the kernel (given by the composition root)."""

    def observed(self, peer: PeerId) -> Address | None:
        """The address ``peer``'s open channel comes from; None when it goes through a
        relay. Raises LocalError(CHANNEL_CLOSED) when no channel to ``peer`` is open (it
        closed since the request came): where it comes from cannot be told."""

    def met(self) -> list[PeerId]:
        """Peers with an open channel."""

    async def meet(self, address: Address) -> PeerId:
        """Open a channel to the node at ``address``; its proven peer id (raises
        P2PError when nobody answers there)."""

    def sender(self) -> str:
        """The local agent a check asks as (raises LocalError when there is none)."""

    def candidates(self) -> list[Candidate]:
        """This node's own addresses, to be checked."""


class DhtSide(Protocol):
    """What the service uses of the node's DHT (absent: UDP is refused, not checked)."""

    async def ping_from_fresh_socket(self, address: Address, node_id: bytes) -> bool:
        """True when a DHT ``ping`` sent from a new socket is answered with ``node_id``."""

    async def stun(self, address: Address) -> Address | None:
        """Where the DHT at ``address`` sees this node's DHT socket (None: no answer)."""

    async def looked_up(self) -> list[tuple[PeerId, Address]]:
        """Peers near a random key, by a DHT lookup: their ids and UDP addresses."""

    def set_mode(self, mode: DhtMode) -> None:
        """Switch the DHT to answering requests (SERVER) or none (CLIENT)."""


#: One checker of a check: the local agent asking, the checker agent's card, and the
#: checker's DHT address (None: unknown).
Checker = tuple[str, AgentCard, Address | None]


def _pair_of(
    host: ServiceHost, peer: PeerId, now_ms: int, senders: Sequence[AgentCard]
) -> tuple[str, AgentCard] | None:
    """A local agent of ``senders`` and a live card of an agent of ``peer`` that the
    policy lets it send a check to (a request asks as one agent, to one agent: with a
    tier-2 agent first here and only tier-3 agents there, another pair must be found)."""
    registry = host.registry
    for card in registry:
        if card.peer_id != peer or not registry.is_live(card, now_ms):
            continue
        claims = _claims(card)
        for sender in senders:
            if host.policy.check_message(sender, card, MessageType.REQUEST, claims).allowed:
                return sender.id, card
    return None


def _claims(card: AgentCard) -> Metadata:
    """The metadata of a check sent to ``card``'s agent."""
    return Metadata(int(card.tier), card.sandbox_id, capability=METHOD)


def _with_external_udp(
    chosen: list[Candidate], mapped: dict[Address | None, Address | None]
) -> list[Candidate]:
    """``chosen`` and the external UDP address a quorum of ``stun`` replies named (a
    consistent mapping, §2.1), if it is not among them and there is room."""
    reports = [Report(f"stun{i}", mapped=m) for i, m in enumerate(mapped.values())]
    external = decide(reports, []).external_udp
    if external is None or len(chosen) >= MAX_ADDRESSES:
        return chosen
    extra = Candidate(Transport.UDP, external[0], external[1])
    return chosen if extra in chosen else [*chosen, extra]


def _first_address(card: AgentCard) -> Address | None:
    for text in card.addresses:
        host, _, port = text.rpartition(":")
        if host and port.isdigit():
            return (host.strip("[]"), int(port))
    return None


class ReachabilityService:
    """The service (see the module docstring): the
    :class:`~p2pnode.node.service.MethodServer` of ``reach.dialback``, and the check.
    Nothing runs in the background: dial-backs run in the request's task, a check in
    its caller's."""

    def __init__(
        self,
        host: ServiceHost,
        network: Network,
        kernel: KernelSide,
        dht: Callable[[], DhtSide | None],
        config: ReachConfig | None = None,
        *,
        rng: random.Random | None = None,
        dial_identity: Identity | None = None,
        nonce: Callable[[int], bytes] = os.urandom,
        on_offer: Callable[[RelayAddress], object] | None = None,
        on_verdict: Callable[[Verdict], object] | None = None,
    ) -> None:
        """``dht`` gives the node's DHT side while it runs (None otherwise).
        ``dial_identity`` is whom dial-backs prove to be (default: a fresh key, never
        the node's own, so a dial-back never replaces the channel to the requester).
        ``on_offer`` is told each relay a checker offered (§7), once it is shown to be the
        checker's own; ``on_verdict`` each verdict on this node's own addresses."""
        self._host = host
        self._network = network
        self._kernel = kernel
        self._dht = dht
        self.config = config if config is not None else ReachConfig()
        self._rng = rng if rng is not None else random.Random()
        self._nonce = nonce
        self._dialer = SecureIdentity(
            dial_identity if dial_identity is not None else Identity.generate()
        )
        #: Whom dial-backs prove to be (also the node id a UDP dial-back states).
        self.dial_peer_id: PeerId = self._dialer.peer_id
        cfg = self.config
        self._quota = PeerQuota(
            1 / cfg.peer_interval,
            cfg.peer_burst,
            max_held=1,
            max_bytes=MAX_ADDRESSES,
            max_total_bytes=max(cfg.max_dialing, MAX_ADDRESSES),
        )
        #: The last check's verdict (None before the first).
        self.verdict: Verdict | None = None
        #: The last verdict on this node's own addresses (None before the first).
        self.own_verdict: Verdict | None = None
        #: The relay this node runs, offered in its answers (§2.2; None: it relays not).
        self.relay_offer: RelayAddress | None = None
        self._on_offer = on_offer
        self._on_verdict = on_verdict
        #: Relay offers taken, and refused (not the checker's own), since the start.
        self.offers_taken = 0
        self.offers_refused = 0
        #: Requests answered, and refused whole (malformed or over a limit), since the start.
        self.served = 0
        self.refused = 0

    def offer_relay(self, relay: str | None) -> None:
        """Offer ``relay`` (``relay:<host>:<port>/<this node's peer id>``, the relay this
        node runs) in every dial-back answer (§2.2), or no relay with None.
        Raises LocalError(INVALID_ARGUMENT) for another form or another peer's relay."""
        if relay is None:
            self.relay_offer = None
            return
        parsed = parse_relay_address(relay)
        if parsed is None or parsed.relay_id != self._host.peer_id:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"not a relay of this node: {relay}")
        self.relay_offer = parsed

    def serve_on(self, host: ServiceHost) -> None:
        """Serve ``reach.dialback`` on ``host``'s local agents."""
        host.serve_methods([METHOD], self)

    def statistics(self) -> dict[str, Any]:
        """For ``status``: the last verdict and the checker's counts."""
        verdict = self.verdict.to_dict() if self.verdict is not None else None
        return {
            "verdict": verdict,
            "served": self.served,
            "refused": self.refused,
            "relayOffer": None if self.relay_offer is None else str(self.relay_offer),
            "offersTaken": self.offers_taken,
            "offersRefused": self.offers_refused,
        }

    # -- checker ------------------------------------------------------------------------

    def deadline(self, agent: Agent, envelope: Envelope) -> float:
        """Dial-backs run at once: one dial timeout, and a second for the answer."""
        return self.config.dial_timeout + 1.0

    async def serve(
        self, agent: Agent, envelope: Envelope, method: str, sender: AgentCard
    ) -> Reply | None:
        """The answer to a dial-back request (an ``error`` reply when refused whole)."""
        peer = sender.peer_id
        try:
            request = parse_request_untrusted(envelope.payload)
        except ReachError as exc:
            self._host.events.security(exc.code, f"dial-back request: {exc.message}", str(peer))
            return self._refuse(exc, peer)
        try:
            observed = self._kernel.observed(peer)
        except LocalError as exc:  # no answer rather than a wrong one: every "refused"
            return self._refuse(exc, peer)  # would count as a denial (§4.2)
        size = len(request.candidates)
        retry = self._quota.admit(str(peer), size, trio.current_time())
        if retry is not None:
            busy = ReachError(
                ErrorCode.BUSY, "too many dial-back requests", retryAfterMs=int(retry * 1000)
            )
            return self._refuse(busy, peer)
        try:
            answer = await self._dial_back(peer, request, observed)
        finally:
            self._quota.release(str(peer), size)
        self.served += 1
        return Reply(MessageType.RESPONSE, answer.to_payload())

    def _refuse(self, exc: P2PError, peer: PeerId | None) -> Reply:
        self.refused += 1
        logger.info("dial-back request from %s refused: %s", peer, exc.message)
        return Reply(MessageType.ERROR, exc.to_dict())

    async def _dial_back(
        self, peer: PeerId, request: DialRequest, observed: Address | None
    ) -> DialAnswer:
        outcomes = [Outcome.REFUSED] * len(request.candidates)

        async def one(i: int, candidate: Candidate) -> None:
            outcomes[i] = await self._dial_one(peer, candidate)

        async with trio.open_nursery() as nursery:
            for i, candidate in enumerate(request.candidates):
                if observed is not None and candidate.host == observed[0]:
                    nursery.start_soon(one, i, candidate)
        return DialAnswer(request.nonce, observed, tuple(outcomes), self.relay_offer)

    async def _dial_one(self, peer: PeerId, candidate: Candidate) -> Outcome:
        """Dial ``candidate`` back; REACHED only when ``peer`` proved itself there."""
        dht = self._dht()
        if candidate.transport is Transport.UDP and dht is None:
            return Outcome.REFUSED
        reached = False
        with trio.move_on_after(self.config.dial_timeout):
            if candidate.transport is Transport.TCP:
                reached = await self._tcp_reaches(candidate.address, peer)
            elif dht is not None:
                reached = await dht.ping_from_fresh_socket(candidate.address, peer.raw)
        return Outcome.REACHED if reached else Outcome.UNREACHABLE

    async def _tcp_reaches(self, address: Address, peer: PeerId) -> bool:
        try:
            stream = await self._network.connect_stream(address)
        except OSError:
            return False
        try:
            channel = await connect_secure(stream, self._dialer, expected_peer_id=peer)
        except (P2PError, OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        try:
            # The handshake proved the peer id. Its first message (its HELLO) shows it
            # completed the handshake too: hanging up before would be a failed inbound
            # handshake at the requester (a security event there).
            await channel.receive_message()
        except (P2PError, OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        finally:
            with trio.CancelScope(shield=True):
                await channel.aclose()
        return True

    # -- requester ----------------------------------------------------------------------

    async def check(self, candidates: Sequence[Candidate] | None = None) -> Verdict:
        """Ask :attr:`ReachConfig.checkers` peers to dial back ``candidates`` (default:
        this node's own addresses); the verdict (also kept in :attr:`verdict`).

        Raises LocalError(INVALID_ARGUMENT) for no or too many candidates, or when
        this node hosts no agent to ask as.
        """
        own = candidates is None
        chosen = list(candidates) if candidates is not None else self._kernel.candidates()
        if not 0 < len(chosen) <= MAX_ADDRESSES:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"1-{MAX_ADDRESSES} candidates")
        senders = self._senders()
        checkers = await self._checkers(senders)
        mapped = await self._stun_all(checkers)
        if own:
            chosen = _with_external_udp(chosen, mapped)
        request = DialRequest(self._nonce(NONCE_BYTES), tuple(dict.fromkeys(chosen)))
        reports: list[Report] = []

        async def ask(checker: Checker) -> None:
            sender, card, udp = checker
            report = await self._ask(sender, card, request, mapped.get(udp))
            if report is not None:
                reports.append(report)

        async with trio.open_nursery() as nursery:
            for checker in checkers:
                nursery.start_soon(ask, checker)
        verdict = decide(reports, request.candidates)
        logger.info("reachability: %s", verdict.to_dict())
        self.verdict = verdict
        if own:
            self.own_verdict = verdict
            self._apply(verdict)
            if self._on_verdict is not None:
                self._on_verdict(verdict)
        return verdict

    def _senders(self) -> list[AgentCard]:
        """The local agents a check may ask as: the kernel's choice first.

        Raises LocalError(AGENT_NOT_FOUND) when this node hosts none."""
        first = self._kernel.sender()
        local = [c for c in self._host.registry if c.origin is Origin.LOCAL]
        return sorted(local, key=lambda card: card.id != first)

    async def _stun_all(
        self, checkers: Sequence[Checker]
    ) -> dict[Address | None, Address | None]:
        """Where each checker's DHT sees this node's DHT socket (§2.4), by its address."""
        dht = self._dht()
        mapped: dict[Address | None, Address | None] = {}

        async def stun(dht: DhtSide, udp: Address) -> None:
            mapped[udp] = await dht.stun(udp)

        async with trio.open_nursery() as nursery:
            for _, _, udp in checkers:
                if dht is not None and udp is not None:
                    nursery.start_soon(stun, dht, udp)
        return mapped

    def _apply(self, verdict: Verdict) -> None:
        """Put the DHT in the mode ``verdict`` calls for (§5): client when unreachable."""
        dht, mode = self._dht(), dht_mode(verdict)
        if dht is not None and mode is not None:
            dht.set_mode(mode)

    async def _checkers(self, senders: Sequence[AgentCard]) -> list[Checker]:
        """The checkers to ask: the local agent that asks, a card of the checker's
        agent it may send to (:func:`_pair_of`), and the checker's DHT address (from
        the lookup; else its card's address, the DHT's port by default). Peers are taken
        in :func:`pick_checkers`'s order, those whose card this node holds first;
        looked-up peers it holds no card of are then met (at once), to fill what is
        missing."""
        dht = self._dht()
        looked_up = await dht.looked_up() if dht is not None else []
        where = dict(looked_up)
        met = self._kernel.met()
        count = self.config.checkers
        order = pick_checkers(
            list(where), met, self._rng, count=len(where) + len(met), exclude=[self._host.peer_id]
        )
        chosen: list[Checker] = []
        unmet: list[PeerId] = []
        for peer in order:
            pair = _pair_of(self._host, peer, self._host.now_ms(), senders)
            if pair is not None:
                chosen.append((*pair, where.get(peer, _first_address(pair[1]))))
            elif peer in where:
                unmet.append(peer)
        if len(chosen) < count and unmet:
            found: list[Checker] = []

            async def meet(peer: PeerId) -> None:
                pair = await self._meet(peer, where[peer], senders)
                if pair is not None:
                    found.append((*pair, where[peer]))

            async with trio.open_nursery() as nursery:
                for peer in unmet[: 2 * (count - len(chosen))]:
                    nursery.start_soon(meet, peer)
            chosen.extend(found)
        return chosen[:count]

    async def _meet(
        self, peer: PeerId, udp: Address, senders: Sequence[AgentCard]
    ) -> tuple[str, AgentCard] | None:
        """Open a channel to a looked-up peer (its TCP listener is on its DHT port,
        docs/protocol/node.md) so its cards arrive; who asks it, and its card, or None."""
        with trio.move_on_after(self.config.dial_timeout):
            try:
                met = await self._kernel.meet(udp)
            except P2PError:
                return None
            if met == peer:
                return _pair_of(self._host, peer, self._host.now_ms(), senders)
        return None

    async def _ask(
        self, sender: str, card: AgentCard, request: DialRequest, mapped: Address | None
    ) -> Report | None:
        """One checker's report (None when it did not answer or answered nonsense);
        ``mapped``: where its DHT saw this node's DHT socket (§2.4)."""
        answer = await self._answer(sender, card, request)
        if answer is None:
            return None
        if answer.relay is not None:
            self._take_offer(answer, card.peer_id)
        outcomes = dict(zip(request.candidates, answer.outcomes, strict=True))
        return Report(str(card.peer_id), outcomes, answer.observed, mapped)

    def _take_offer(self, answer: DialAnswer, checker: PeerId) -> None:
        """Hand the checker's relay offer on (§7), or refuse it: one naming another
        peer, or another IP than the checker's channel, is a security event."""
        observed = self._kernel.observed(checker)
        try:
            relay = offer_untrusted(answer, checker, observed[0] if observed else None)
        except ReachError as exc:
            self.offers_refused += 1
            self._host.events.security(exc.code, f"dial-back answer: {exc.message}", str(checker))
            return
        self.offers_taken += 1
        if self._on_offer is not None:
            self._on_offer(relay)

    async def _answer(
        self, sender: str, card: AgentCard, request: DialRequest
    ) -> DialAnswer | None:
        claims = _claims(card)
        try:
            reply = await self._host.request(
                sender,
                card.id,
                request.to_payload(),
                metadata=claims,
                timeout=self.config.answer_timeout,
            )
            return parse_answer_untrusted(reply.payload, request)
        except ReachError as exc:
            what = f"dial-back answer: {exc.message}"
            self._host.events.security(exc.code, what, str(card.peer_id))
        except (RemoteError, LocalError) as exc:
            logger.info("reachability: checker %s gave no answer: %s", card.peer_id, exc)
        return None


__all__ = ["DhtSide", "KernelSide", "ReachConfig", "ReachabilityService"]
