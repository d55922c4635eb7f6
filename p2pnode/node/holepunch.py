"""Hole punching: a relayed channel upgraded to a direct one (docs/protocol/holepunch.md).

Theory of operation (the model is libp2p's DCUtR, "Direct Connection Upgrade through
Relay"; the byte-level contract is the protocol chapter).

Two nodes whose channel goes through a circuit relay (docs/protocol/relay.md) try to
open a direct TCP connection by dialing each other at the same moment, so that each
side's outbound SYN opens its own NAT's mapping and filter for the other's SYN (TCP
simultaneous open, RFC 793 §3.4; RFC 5382 §2.2). The node with the lower peer id is
the *initiator* (B below), the other the *responder* (A):

1. B learns its external IP from a peer with a direct channel (OBSERVE: "which
   address does my connection come from?") and sends A, over the relayed channel, a
   CONNECT with its candidate addresses: that IP with its listening port (a NAT whose
   mapping is endpoint-independent keeps the port of the listening socket the punch
   connects from), then its listen address. The time until A's CONNECT reply with A's
   own candidates is the round trip (RTT).
2. B sends SYNC; A dials B's candidates the moment SYNC arrives, B dials A's half an RTT
   after sending it (when SYNC has arrived). Both connect *from their listening port*
   (SO_REUSEADDR and SO_REUSEPORT; the listener sets SO_REUSEPORT too).
3. On B's connected socket B runs the Noise handshake as initiator. A's connected socket
   is either the same connection (simultaneous open: B's first Noise message arrives at
   once) or one B's listener accepted (B waits for A's first message): A waits
   ``hold`` seconds for bytes and runs the responder when they come, the initiator
   when they do not. A SYN that reaches the other's listener instead is an ordinary
   inbound channel. Every punched channel proves the expected peer id.
4. The link keeps sending on the relayed channel until a direct channel is handshaken;
   then new sends go to the direct one, and the relayed one is still read until the
   link retires it (channels.py), so nothing sent on it is lost.

The rules (the message codec, one attempt's state machine :class:`Punch`, the per-peer
budget :class:`PunchBudget`) are sans-IO here; :class:`HolePunchService` is the trio
driver, a node service serving the request method ``holepunch`` on every local agent.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import socket as _stdlib_socket
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import trio

from p2pnode.agent.definition import Agent, Reply
from p2pnode.core.card import AgentCard
from p2pnode.core.envelope import Envelope, MessageType, Metadata
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.core.identity import PeerId
from p2pnode.node.channels import ChannelState, PeerLink
from p2pnode.node.kernel import Kernel
from p2pnode.node.service import ServiceHost
from p2pnode.transport.net import Address
from p2pnode.transport.tcpstream import TcpStream

logger = logging.getLogger("p2pnode.holepunch")

#: The request method (``metadata.capability``) every node serves.
METHOD = "holepunch"
#: At most this many candidate addresses in a CONNECT; longer lists are refused.
MAX_ADDRESSES = 8
#: At most this many characters in one address (``host:port``, ``[v6]:port``).
MAX_ADDRESS_LEN = 64


class HolePunchError(RemoteError):
    """A peer's hole-punch message is malformed, or it broke the exchange's order."""


class Refusal(enum.StrEnum):
    """Why a node refused a hole-punch request (``details.reason`` of the ERROR reply)."""

    MALFORMED = "MALFORMED"  # not a well-formed message
    UNSUPPORTED = "UNSUPPORTED"  # this node cannot punch (no real TCP sockets)
    NOT_RELAYED = "NOT_RELAYED"  # CONNECT while the channel is direct already
    NOT_DIRECT = "NOT_DIRECT"  # OBSERVE over a relayed channel: nothing to observe
    RATE_LIMITED = "RATE_LIMITED"  # over the per-peer attempt budget (retryAfterMs)
    UNEXPECTED_SYNC = "UNEXPECTED_SYNC"  # SYNC with no CONNECT waiting for it


def refusal(reason: Refusal, message: str, **details: Any) -> HolePunchError:
    code = {
        Refusal.RATE_LIMITED: ErrorCode.BUSY,
        Refusal.UNEXPECTED_SYNC: ErrorCode.ILLEGAL_TRANSITION,
        Refusal.MALFORMED: ErrorCode.MALFORMED_MESSAGE,
    }.get(reason, ErrorCode.INVALID_ARGUMENT)
    return HolePunchError(code, message, reason=str(reason), **details)


# -- messages -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Connect:
    """Candidate addresses of the sender (request and reply alike)."""

    addresses: tuple[Address, ...]


@dataclass(frozen=True, slots=True)
class Sync:
    """Dial now (request: the initiator will dial in half a round trip; reply: acknowledged)."""


@dataclass(frozen=True, slots=True)
class Observe:
    """Which address does my connection come from? (asked over a direct channel)."""


@dataclass(frozen=True, slots=True)
class Observed:
    """The address the asker's connection comes from, as the answering node sees it."""

    address: Address


Message = Connect | Sync | Observe | Observed


def format_address(address: Address) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address_untrusted(text: object) -> Address:
    """``host:port`` or ``[v6]:port`` with an IP literal and a port 1-65535.
    Raises HolePunchError(MALFORMED_MESSAGE)."""
    if not isinstance(text, str) or not 0 < len(text) <= MAX_ADDRESS_LEN:
        raise refusal(Refusal.MALFORMED, "an address is not a short string")
    host, sep, port = text.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise refusal(Refusal.MALFORMED, f"not an IP address: {text!r}") from None
    number = int(port) if port.isascii() and port.isdigit() else 0
    if not sep or not 0 < number < 65536 or bracketed != (ip.version == 6):
        raise refusal(Refusal.MALFORMED, f"not host:port: {text!r}")
    return (str(ip), number)


def dialable(host: str, *, loopback: bool) -> bool:
    """Whether a candidate's IP may be dialed: not unspecified, multicast, broadcast or
    reserved, and loopback only when ``loopback`` (this node listens there itself): a
    peer's word must not turn a punch into a connection to this host's own services."""
    ip = ipaddress.ip_address(host)
    if ip.is_unspecified or ip.is_multicast or ip.is_reserved:
        return False
    return loopback or not ip.is_loopback


def encode_message(message: Message) -> dict[str, Any]:
    """The payload map of ``message``."""
    match message:
        case Connect(addresses):
            return {"type": "connect", "addresses": [format_address(a) for a in addresses]}
        case Sync():
            return {"type": "sync"}
        case Observe():
            return {"type": "observe"}
        case Observed(address):
            return {"type": "observed", "address": format_address(address)}


def _connect_untrusted(body: Mapping[str, Any]) -> Connect:
    raw = body.get("addresses")
    if not isinstance(raw, list) or len(raw) > MAX_ADDRESSES:
        raise refusal(Refusal.MALFORMED, f"addresses: a list of at most {MAX_ADDRESSES}")
    return Connect(tuple(dict.fromkeys(parse_address_untrusted(a) for a in raw)))


_DECODERS: dict[str, Callable[[Mapping[str, Any]], Message]] = {
    "connect": _connect_untrusted,
    "sync": lambda body: Sync(),
    "observe": lambda body: Observe(),
    "observed": lambda body: Observed(parse_address_untrusted(body.get("address"))),
}


def parse_message_untrusted(payload: object) -> Message:
    """The message a peer's payload map holds (unknown keys are ignored).
    Raises HolePunchError(MALFORMED_MESSAGE) and nothing else."""
    if not isinstance(payload, Mapping):
        raise refusal(Refusal.MALFORMED, "the payload is not a map")
    kind = payload.get("type")
    decoder = _DECODERS.get(kind) if isinstance(kind, str) else None
    if decoder is None:
        raise refusal(Refusal.MALFORMED, f"unknown message type {str(kind)[:32]!r}")
    return decoder(payload)


# -- one attempt ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PunchConfig:
    """Limits and timers (seconds) of hole punching (defaults: holepunch.md §4)."""

    #: A CONNECT or SYNC unanswered this long fails the attempt.
    answer_timeout: float = 5.0
    #: The responder waits this long for SYNC after answering CONNECT.
    sync_timeout: float = 5.0
    #: Dialing (connect and handshake) gives up after this long: the relayed channel stays.
    dial_timeout: float = 5.0
    #: Attempts per peer before backing off, and the back-off.
    max_attempts: int = 3
    backoff: float = 300.0
    #: Seconds between an initiator's failed attempt and its next one.
    retry_interval: float = 1.0
    #: Candidates dialed at most (the first ones of the peer's CONNECT).
    max_dials: int = 4
    #: Pause before connecting again to a candidate that refused (a reset).
    refused_pause: float = 0.2
    #: Peers whose budget is remembered (least recently used forgotten first).
    max_peers: int = 1024
    #: How long the external IP an OBSERVE answer gave is used, and how long one waits.
    observed_ttl: float = 60.0
    observe_timeout: float = 2.0


class Role(enum.Enum):
    INITIATOR = "initiator"
    RESPONDER = "responder"


class PunchState(enum.Enum):
    """One attempt's states, named for what they wait on."""

    IDLE = "idle"
    EXPECT_REPLY = "expect-reply"  # initiator: CONNECT sent
    EXPECT_SYNC = "expect-sync"  # responder: CONNECT answered
    DIALING = "dialing"
    DIRECT = "direct"
    FAILED = "failed"


_TRANSITIONS: dict[PunchState, frozenset[PunchState]] = {
    PunchState.IDLE: frozenset(
        {PunchState.EXPECT_REPLY, PunchState.EXPECT_SYNC, PunchState.FAILED}
    ),
    PunchState.EXPECT_REPLY: frozenset({PunchState.DIALING, PunchState.FAILED}),
    PunchState.EXPECT_SYNC: frozenset({PunchState.DIALING, PunchState.FAILED}),
    PunchState.DIALING: frozenset({PunchState.DIRECT, PunchState.FAILED}),
    PunchState.DIRECT: frozenset(),
    PunchState.FAILED: frozenset(),
}


class Punch:
    """One attempt with one peer, either role: the rules, no I/O. ``now`` is the caller's
    clock (trio's). A step the state does not allow raises and leaves the state
    unchanged: LocalError(ILLEGAL_TRANSITION) for this node's own misuse,
    HolePunchError(ILLEGAL_TRANSITION, reason UNEXPECTED_SYNC) for a peer's SYNC."""

    def __init__(self, role: Role, own: tuple[Address, ...], config: PunchConfig) -> None:
        self.role = role
        self.own = own[:MAX_ADDRESSES]
        self.config = config
        self.state = PunchState.IDLE
        self.peer: tuple[Address, ...] = ()
        self.rtt: float | None = None
        self._sent_at = 0.0
        self._deadline: float | None = None

    def _go(self, new: PunchState, deadline: float | None = None) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise LocalError(
                ErrorCode.ILLEGAL_TRANSITION, f"hole punch: {self.state.value} -> {new.value}"
            )
        self.state = new
        self._deadline = deadline

    def start(self, now: float) -> Connect:
        """Initiator: the CONNECT to send."""
        if self.role is not Role.INITIATOR:
            raise LocalError(ErrorCode.ILLEGAL_TRANSITION, "only the initiator starts")
        self._go(PunchState.EXPECT_REPLY, now + self.config.answer_timeout)
        self._sent_at = now
        return Connect(self.own)

    def receive_reply(self, reply: Connect, now: float) -> float:
        """Initiator: the responder's CONNECT arrived; send SYNC and dial after the
        returned delay (half the round trip)."""
        if self.state is not PunchState.EXPECT_REPLY:
            raise LocalError(ErrorCode.ILLEGAL_TRANSITION, f"a reply while {self.state.value}")
        self._go(PunchState.DIALING, now + self.config.dial_timeout)
        self.peer = reply.addresses
        self.rtt = max(0.0, now - self._sent_at)
        return self.rtt / 2

    def receive_connect(self, connect: Connect, now: float) -> Connect:
        """Responder: the initiator's CONNECT; the reply to send."""
        if self.role is not Role.RESPONDER:
            raise LocalError(ErrorCode.ILLEGAL_TRANSITION, "only the responder answers CONNECT")
        self._go(PunchState.EXPECT_SYNC, now + self.config.sync_timeout)
        self.peer = connect.addresses
        self._sent_at = now
        return Connect(self.own)

    def receive_sync(self, now: float) -> None:
        """Responder: SYNC arrived; dial now."""
        if self.state is not PunchState.EXPECT_SYNC:
            raise refusal(Refusal.UNEXPECTED_SYNC, f"SYNC while {self.state.value}")
        self.rtt = max(0.0, now - self._sent_at)
        self._go(PunchState.DIALING, now + self.config.dial_timeout)

    def dialed(self, direct: bool) -> None:
        """The dials ended: the link is direct now, or it stays relayed."""
        self._go(PunchState.DIRECT if direct else PunchState.FAILED)

    def fail(self) -> None:
        """The attempt ends without a direct channel (an answer missing or refused)."""
        if not self.over:
            self._go(PunchState.FAILED)

    @property
    def dial_targets(self) -> tuple[Address, ...]:
        """The peer's first ``max_dials`` candidates that may be dialed (§3: never an
        unspecified, multicast or reserved address, and a loopback one only by a node
        listening on loopback itself)."""
        loopback = any(ipaddress.ip_address(host).is_loopback for host, _ in self.own)
        return tuple(a for a in self.peer if dialable(a[0], loopback=loopback))[
            : self.config.max_dials
        ]

    @property
    def hold(self) -> float:
        """Seconds the responder's connected socket waits for the initiator's first
        Noise message before running the handshake as the initiator itself."""
        return 0.25 + 3 * (self.rtt or 0.0)

    def next_deadline(self) -> float | None:
        return self._deadline

    def handle_timer(self, now: float) -> None:
        """Past the deadline of a waiting state: the attempt failed."""
        if self._deadline is not None and now >= self._deadline and not self.over:
            self._go(PunchState.FAILED)

    @property
    def over(self) -> bool:
        return self.state in (PunchState.DIRECT, PunchState.FAILED)


class PunchBudget:
    """Attempts per peer (either role): ``max_attempts`` failed ones, then none for
    ``backoff`` seconds after the last; a success starts the count again."""

    def __init__(self, config: PunchConfig) -> None:
        self._config = config
        self._failed: OrderedDict[PeerId, tuple[int, float]] = OrderedDict()

    def retry_after(self, peer: PeerId, now: float) -> float:
        """0 when an attempt with ``peer`` may start now, else the seconds to wait."""
        count, last = self._failed.get(peer, (0, 0.0))
        if count < self._config.max_attempts:
            return 0.0
        return max(0.0, last + self._config.backoff - now)

    def note(self, peer: PeerId, now: float, *, direct: bool) -> None:
        """An attempt with ``peer`` ended (``direct``: it succeeded)."""
        count, last = self._failed.pop(peer, (0, 0.0))
        if direct:
            return
        if count >= self._config.max_attempts and now >= last + self._config.backoff:
            count = 0  # the back-off is over: a fresh budget
        self._failed[peer] = (count + 1, now)
        while len(self._failed) > self._config.max_peers:
            self._failed.popitem(last=False)

    def __len__(self) -> int:
        return len(self._failed)


# -- the trio driver ------------------------------------------------------------------


class PunchLinks(Protocol):
    """The kernel as hole punching uses it."""

    def relayed(self, peer: PeerId) -> bool | None:
        """Whether the open channel to ``peer`` is relayed (None: no open channel)."""

    def observed(self, peer: PeerId) -> Address | None:
        """Where ``peer``'s direct channel comes from, as this node sees it."""

    def direct_peers(self) -> list[PeerId]:
        """Peers with an open direct channel."""

    def listen_address(self) -> Address: ...

    def sender(self) -> str:
        """A local agent to send as."""

    def cards_of(self, peer: PeerId) -> list[AgentCard]:
        """The cards ``peer`` owns (to address its agents)."""

    def watch_open(self, watcher: Callable[[PeerId, bool], object]) -> None:
        """Call ``watcher(peer, relayed)`` when a link opens."""

    async def adopt_punched(
        self, stream: trio.abc.Stream, peer: PeerId, *, initiator: bool
    ) -> None: ...


class KernelLinks:
    """The kernel's links as :class:`PunchLinks` (what the composition root hands over)."""

    def __init__(self, kernel: Kernel) -> None:
        self._kernel = kernel

    def _link(self, peer: PeerId) -> PeerLink | None:
        link = self._kernel.links.get(peer)
        return link if link is not None and link.state is ChannelState.OPEN else None

    def relayed(self, peer: PeerId) -> bool | None:
        link = self._link(peer)
        return link.relayed if link is not None else None

    def observed(self, peer: PeerId) -> Address | None:
        link = self._link(peer)
        address = link.remote_address if link is not None and not link.relayed else None
        if address is None or not isinstance(address[0], str):
            return None
        return (address[0], int(address[1]))

    def direct_peers(self) -> list[PeerId]:
        return [
            link.peer_id
            for link in self._kernel.links
            if link.state is ChannelState.OPEN and link.relayed is False
        ]

    def listen_address(self) -> Address:
        return self._kernel.listen_address

    def sender(self) -> str:
        return self._kernel.default_agent()

    def cards_of(self, peer: PeerId) -> list[AgentCard]:
        return list(self._kernel.registry.owned_by(peer))

    def watch_open(self, watcher: Callable[[PeerId, bool], object]) -> None:
        self._kernel.links.watch_open(lambda link: watcher(link.peer_id, bool(link.relayed)))

    async def adopt_punched(
        self, stream: trio.abc.Stream, peer: PeerId, *, initiator: bool
    ) -> None:
        await self._kernel.links.adopt_punched(stream, peer, initiator=initiator)


#: Connects a new socket bound to the first address to the second.
DialFrom = Callable[[Address, Address], Awaitable[trio.abc.Stream]]


async def tcp_dial_from(local: Address, remote: Address) -> trio.abc.Stream:
    """A TCP connection to ``remote`` from ``local`` (the listening port, shared with
    SO_REUSEADDR and SO_REUSEPORT). Raises OSError."""
    family = _stdlib_socket.AF_INET6 if ":" in remote[0] else _stdlib_socket.AF_INET
    sock = trio.socket.socket(family, _stdlib_socket.SOCK_STREAM)
    try:
        sock.setsockopt(_stdlib_socket.SOL_SOCKET, _stdlib_socket.SO_REUSEADDR, 1)
        if hasattr(_stdlib_socket, "SO_REUSEPORT"):
            sock.setsockopt(_stdlib_socket.SOL_SOCKET, _stdlib_socket.SO_REUSEPORT, 1)
        await sock.bind(local)
        await sock.connect(remote)
    except BaseException:
        sock.close()
        raise
    return TcpStream.adopt(trio.SocketStream(sock))


class _Prefixed(trio.abc.Stream):
    """A stream whose first bytes were already read (the peer's first Noise message)."""

    def __init__(self, inner: trio.abc.Stream, first: bytes) -> None:
        self._inner, self._first = inner, first

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self._first:
            size = len(self._first) if max_bytes is None else max_bytes
            data, self._first = self._first[:size], self._first[size:]
            await trio.lowlevel.checkpoint()
            return data
        return await self._inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self._inner.aclose()


@dataclass
class PunchStatistics:
    attempts: int = 0  # started as initiator or responder
    direct: int = 0  # ended with a direct channel
    failed: int = 0
    refused: int = 0  # requests refused (any reason)


class HolePunchService:
    """Upgrades relayed channels (see the module docstring). ``dial_from`` None: this
    node cannot punch (a simulated network); it refuses CONNECT and starts none."""

    def __init__(
        self,
        host: ServiceHost,
        links: PunchLinks,
        dial_from: DialFrom | None,
        config: PunchConfig | None = None,
    ) -> None:
        self._host = host
        self._links = links
        self._dial_from = dial_from
        self.config = config if config is not None else PunchConfig()
        self.budget = PunchBudget(self.config)
        self.stats = PunchStatistics()
        self._punches: dict[PeerId, Punch] = {}
        self._direct: dict[PeerId, trio.Event] = {}  # set when the link turns direct
        self._running: set[PeerId] = set()
        self._external: tuple[str, float] | None = None  # (IP, until)
        self._observing = trio.Lock()
        self._nursery: trio.Nursery | None = None
        self._handlers: dict[type, Callable[[PeerId, Any], Awaitable[Message]]] = {
            Connect: self._on_connect,
            Sync: self._on_sync,
            Observe: self._on_observe,
        }

    def serve_on(self, host: ServiceHost) -> None:
        """Serve ``holepunch`` on ``host``'s local agents, and watch links open."""
        host.serve_methods([METHOD], self)
        self._links.watch_open(self._link_opened)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def statistics(self) -> dict[str, int]:
        s = self.stats
        return {
            "attempts": s.attempts, "direct": s.direct, "failed": s.failed, "refused": s.refused
        }  # fmt: skip

    # -- initiator ----------------------------------------------------------------------

    def _link_opened(self, peer: PeerId, relayed: bool) -> None:
        direct = self._direct.get(peer)
        if direct is not None and not relayed:
            direct.set()
        nursery = self._nursery
        if not relayed or self._dial_from is None or nursery is None:
            return
        # Both sides learn their external IP now, so a CONNECT's round trip does not
        # include an OBSERVE (the initiator times SYNC by it).
        nursery.start_soon(self._external_ip)
        if self._host.peer_id.raw < peer.raw and peer not in self._running:
            self._running.add(peer)
            nursery.start_soon(self._punch_peer, peer)

    async def _punch_peer(self, peer: PeerId) -> None:
        """Attempts with ``peer`` while its link is relayed and the budget allows."""
        unknown = 0  # pauses while the peer's card (whom to ask) has not arrived yet
        try:
            while self._links.relayed(peer) and unknown <= self.config.max_attempts:
                if self.budget.retry_after(peer, trio.current_time()) > 0:
                    return
                direct = await self._attempt(peer)
                if direct is None:
                    unknown += 1
                else:
                    self.budget.note(peer, trio.current_time(), direct=direct)
                    if direct:
                        return
                await trio.sleep(self.config.retry_interval)
        finally:
            self._running.discard(peer)

    async def _attempt(self, peer: PeerId) -> bool | None:
        """One attempt as the initiator: True when the link is direct now; None when it
        did not start (no card of the peer's is known yet, so no agent to ask)."""
        cards = self._links.cards_of(peer)
        if not cards:
            return None
        card = cards[0]
        punch = Punch(Role.INITIATOR, await self._candidates(), self.config)
        self.stats.attempts += 1
        try:
            connect = punch.start(trio.current_time())
            reply = await self._ask(card.id, int(card.tier), card.sandbox_id, connect)
            if not isinstance(reply, Connect):
                raise refusal(Refusal.MALFORMED, "CONNECT answered with another type")
            delay = punch.receive_reply(reply, trio.current_time())
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._sync, card.id, int(card.tier), card.sandbox_id)
                await trio.sleep(delay)
                direct = await self._dial(peer, punch)
        except HolePunchError as exc:
            self._host.events.security(exc.code, f"hole punch answer: {exc.message}", str(peer))
            direct = False
        except (P2PError, trio.TooSlowError) as exc:
            logger.info("hole punch with %s: %s", peer, exc)
            direct = False
        return self._ended(peer, punch, direct)

    def _ended(self, peer: PeerId, punch: Punch, direct: bool) -> bool:
        if punch.state is PunchState.DIALING:
            punch.dialed(direct)
        punch.fail()
        if direct:
            self.stats.direct += 1
            logger.info("channel to %s is direct now (hole punch)", peer)
        else:
            self.stats.failed += 1
        return direct

    async def _sync(self, recipient: str, tier: int, sandbox: str | None) -> None:
        try:
            await self._ask(recipient, tier, sandbox, Sync())
        except (P2PError, trio.TooSlowError) as exc:
            logger.info("hole punch SYNC to %s: %s", recipient, exc)

    async def _ask(
        self, recipient: str, tier: int, sandbox: str | None, message: Message
    ) -> Message:
        claims = Metadata(tier, sandbox, capability=METHOD)
        reply = await self._host.request(
            self._links.sender(),
            recipient,
            encode_message(message),
            metadata=claims,
            timeout=self.config.answer_timeout,
        )
        return parse_message_untrusted(reply.payload)

    async def _candidates(self) -> tuple[Address, ...]:
        """This node's external IP with its listening port, then its listen address."""
        own = self._links.listen_address()
        ip = await self._external_ip()
        out = [(ip, own[1])] if ip is not None else []
        return tuple(dict.fromkeys([*out, own]))

    async def _external_ip(self) -> str | None:
        async with self._observing:  # one OBSERVE round at a time; the others reuse it
            return await self._observe()

    async def _observe(self) -> str | None:
        now = trio.current_time()
        if self._external is not None and self._external[1] > now:
            return self._external[0]
        for peer in self._links.direct_peers()[:3]:
            cards = self._links.cards_of(peer)
            if not cards:
                continue
            card = cards[0]
            try:
                with trio.fail_after(self.config.observe_timeout):
                    answer = await self._ask(card.id, int(card.tier), card.sandbox_id, Observe())
            except (P2PError, trio.TooSlowError):
                continue
            if isinstance(answer, Observed):
                self._external = (answer.address[0], now + self.config.observed_ttl)
                return answer.address[0]
        return None

    # -- both roles: dialing ------------------------------------------------------------

    async def _dial(self, peer: PeerId, punch: Punch) -> bool:
        """Dial every target at once from the listening port; True once the link to
        ``peer`` is direct (through these dials or the listener), within the timeout."""
        dial_from = self._dial_from
        assert dial_from is not None
        local = self._links.listen_address()
        direct = self._direct.setdefault(peer, trio.Event())
        try:
            with trio.move_on_after(self.config.dial_timeout):
                async with trio.open_nursery() as nursery:
                    for target in punch.dial_targets:
                        nursery.start_soon(self._dial_one, dial_from, local, target, peer, punch)
                    # Direct through these dials, or through the listener (a SYN that
                    # met no socket of ours but the listening one).
                    await direct.wait()
                    nursery.cancel_scope.cancel()
        finally:
            if self._direct.get(peer) is direct:
                del self._direct[peer]
        return self._links.relayed(peer) is False

    async def _dial_one(
        self, dial_from: DialFrom, local: Address, target: Address, peer: PeerId, punch: Punch
    ) -> None:
        while True:
            try:
                stream = await dial_from(local, target)
                break
            except ConnectionRefusedError:
                # The peer's NAT answered our SYN with a reset before its own SYN opened
                # the way: SYN again until the dial timeout (the caller's scope) ends.
                await trio.sleep(self.config.refused_pause)
            except OSError as exc:
                logger.debug("hole punch dial %s: %s", format_address(target), exc)
                return
        adopted = False
        try:
            initiator = punch.role is Role.INITIATOR
            if not initiator:
                first = b""
                with trio.move_on_after(punch.hold):
                    first = bytes(await stream.receive_some())
                initiator = not first
                stream = _Prefixed(stream, first) if first else stream
            await self._links.adopt_punched(stream, peer, initiator=initiator)
            adopted = True
        except (P2PError, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            logger.debug("hole punch handshake via %s: %s", format_address(target), exc)
        finally:
            # Also when cancelled (another dial or the listener won, or the dial timeout
            # ended): a connection no link took is closed, never left to the collector.
            if not adopted:
                await trio.aclose_forcefully(stream)

    # -- responder ----------------------------------------------------------------------

    def deadline(self, agent: Agent, envelope: Envelope) -> float:
        return self.config.answer_timeout + 1.0

    async def serve(
        self, agent: Agent, envelope: Envelope, method: str, sender: AgentCard
    ) -> Reply | None:
        """The answer to a hole-punch request (an ERROR reply when refused)."""
        peer = sender.peer_id
        try:
            message = parse_message_untrusted(envelope.payload)
            handler = self._handlers.get(type(message))
            if handler is None:
                raise refusal(Refusal.MALFORMED, "not a request")
            answer = await handler(peer, message)
        except HolePunchError as exc:
            if exc.code is ErrorCode.MALFORMED_MESSAGE:
                self._host.events.security(exc.code, f"hole punch: {exc.message}", str(peer))
            return self._refuse(exc)
        return Reply(MessageType.RESPONSE, encode_message(answer))

    def _refuse(self, exc: HolePunchError) -> Reply:
        self.stats.refused += 1
        logger.info("hole-punch request refused: %s", exc.message)
        return Reply(MessageType.ERROR, exc.to_dict())

    async def _on_observe(self, peer: PeerId, message: Observe) -> Message:
        address = self._links.observed(peer)
        if address is None:
            raise refusal(Refusal.NOT_DIRECT, "no direct channel from you to observe")
        return Observed(address)

    async def _on_connect(self, peer: PeerId, message: Connect) -> Message:
        if self._dial_from is None or self._nursery is None:
            raise refusal(Refusal.UNSUPPORTED, "this node does not punch holes")
        if not self._links.relayed(peer):
            raise refusal(Refusal.NOT_RELAYED, "the channel is not relayed")
        now = trio.current_time()
        wait = self.budget.retry_after(peer, now)
        running = self._punches.get(peer)
        if wait > 0 or (running is not None and not running.over):
            retry = int(max(wait, self.config.sync_timeout) * 1000)
            raise refusal(Refusal.RATE_LIMITED, "too many hole punches", retryAfterMs=retry)
        punch = Punch(Role.RESPONDER, await self._candidates(), self.config)
        self.stats.attempts += 1
        answer = punch.receive_connect(message, trio.current_time())
        self._punches[peer] = punch
        self._background(self._expire, peer, punch)
        return answer

    def _background(self, work: Callable[[PeerId, Punch], Awaitable[None]], *args: Any) -> None:
        if self._nursery is None:
            raise refusal(Refusal.UNSUPPORTED, "hole punching is not running")
        self._nursery.start_soon(work, *args)

    async def _expire(self, peer: PeerId, punch: Punch) -> None:
        """A responder's attempt whose SYNC never comes fails at its deadline."""
        deadline = punch.next_deadline()
        if deadline is not None:
            await trio.sleep_until(deadline)
        if punch.state is PunchState.EXPECT_SYNC:
            punch.handle_timer(trio.current_time())
            self.budget.note(peer, trio.current_time(), direct=False)
            self._ended(peer, punch, False)
        if self._punches.get(peer) is punch and punch.over:
            del self._punches[peer]

    async def _on_sync(self, peer: PeerId, message: Sync) -> Message:
        punch = self._punches.get(peer)
        if punch is None:
            raise refusal(Refusal.UNEXPECTED_SYNC, "SYNC with no CONNECT before it")
        punch.receive_sync(trio.current_time())
        self._background(self._respond, peer, punch)
        return Sync()

    async def _respond(self, peer: PeerId, punch: Punch) -> None:
        direct = await self._dial(peer, punch)
        self.budget.note(peer, trio.current_time(), direct=direct)
        self._ended(peer, punch, direct)
        if self._punches.get(peer) is punch:
            del self._punches[peer]


__all__ = [
    "MAX_ADDRESSES",
    "METHOD",
    "Connect",
    "HolePunchError",
    "HolePunchService",
    "KernelLinks",
    "Message",
    "Observe",
    "Observed",
    "Punch",
    "PunchBudget",
    "PunchConfig",
    "PunchLinks",
    "PunchState",
    "Refusal",
    "Role",
    "Sync",
    "encode_message",
    "format_address",
    "parse_address_untrusted",
    "parse_message_untrusted",
    "tcp_dial_from",
]
