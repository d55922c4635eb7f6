"""Circuit relays for nodes behind NAT: messages, limits and rules (sans-IO).

Theory of operation (the byte-level contract is docs/protocol/relay.md).

A publicly reachable node may run a relay. A node nobody can dial (the
*target*) keeps a **reservation** on it: it opens a TCP stream to the relay and
sends a signed RESERVE; the stream stays open as the reservation's *control
stream* and carries INCOMING notices. A *dialer* opens a stream to the relay
and sends CONNECT naming the target's peer id. The relay answers the target
with INCOMING(token) on its control stream; the target opens a fresh stream to
the relay and sends ACCEPT(token). The relay then answers OK on both streams
and splices them byte for byte. Everything after the OK frames is end to end:
the dialer runs the ordinary Noise handshake (docs/protocol/noise.md)
expecting the target's peer id, so the relay sees only ciphertext and cannot
pose as either side. This is the reservation and limited-relaying model of
libp2p's Circuit Relay v2, with our own framing.

A relay never dials anyone: it only splices a CONNECT to a target that holds a
reservation on it (anything else is refused with NO_RESERVATION).

This module is the pure part: the control messages and their codec
(:func:`encode_message`, :class:`ControlReader`), the relayed address form
(:func:`format_relay_address`, :func:`parse_relay_address`), the relay's
limits (:class:`RelayLimits`) and its bookkeeping (:class:`RelayCore`: who
holds a reservation, which circuits are pending or open, per-IP rates, the
counters). Time is a parameter (``now``, trio's clock; ``wall_ms``, the wall
clock for RESERVE timestamps); tokens come from an injected random source.
:class:`CircuitMeter` is one direction's byte budget and rate. The trio server
and client are in :mod:`p2pnode.transport.relayserve`.
"""

from __future__ import annotations

import enum
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from p2pnode.core.card_rules import is_address
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.identity import PUBLIC_KEY_BYTES, Identity, PeerId, verify_signature
from p2pnode.core.wire import WireError, WireLimits, canonical_pack, unpack_untrusted

__all__ = [
    "MAX_CONTROL_FRAME",
    "RELAY_ADDRESS_PREFIX",
    "RESERVE_CONTEXT",
    "TOKEN_BYTES",
    "Accept",
    "CircuitEnd",
    "CircuitMeter",
    "Connect",
    "ControlMessage",
    "ControlReader",
    "Incoming",
    "Ok",
    "PendingCircuit",
    "Refused",
    "RelayAddress",
    "RelayCore",
    "RelayError",
    "RelayLimits",
    "RelayRefusal",
    "RelayRefusedError",
    "RelayStatistics",
    "Reservation",
    "Reserve",
    "decode_message_untrusted",
    "encode_message",
    "format_relay_address",
    "parse_relay_address",
    "reserve_message",
    "reserve_signed_bytes",
]

#: Largest control frame body (the msgpack map after the 2-byte length).
MAX_CONTROL_FRAME = 512
#: Length of an INCOMING/ACCEPT token.
TOKEN_BYTES = 16
#: Prefix of the bytes a target signs in RESERVE (then the relay's raw peer id and
#: the timestamp as 8 big-endian bytes), so a RESERVE is good at one relay only.
RESERVE_CONTEXT = b"p2pnode/relay/1 reserve\x00"
#: How a relayed address starts in a card (``relay:<host>:<port>/<relay peer id>``).
RELAY_ADDRESS_PREFIX = "relay:"
_WIRE_LIMITS = WireLimits(
    max_size=MAX_CONTROL_FRAME,
    max_str_len=64,
    max_bin_len=64,
    max_array_len=0,
    max_map_len=8,
    max_depth=1,
)


class RelayError(RemoteError):
    """A relay or a relay client broke the relay protocol (framing, message form)."""


class RelayRefusal(enum.StrEnum):
    """Why a relay refused a RESERVE, CONNECT or ACCEPT (sent in REFUSED)."""

    MALFORMED = "MALFORMED"  # the first frame is not a well-formed request
    BAD_RESERVATION = "BAD_RESERVATION"  # bad signature, stale or replayed timestamp
    RESERVATION_LIMIT = "RESERVATION_LIMIT"  # too many reservations (total or per IP)
    NO_RESERVATION = "NO_RESERVATION"  # the target holds no reservation: no third parties
    CONNECTION_LIMIT = "CONNECTION_LIMIT"  # too many circuits (total or per reservation)
    RATE_LIMITED = "RATE_LIMITED"  # too many RESERVE/CONNECT from this source IP
    UNKNOWN_TOKEN = "UNKNOWN_TOKEN"  # ACCEPT for no pending circuit (or too late)
    ACCEPT_TIMEOUT = "ACCEPT_TIMEOUT"  # the target did not ACCEPT in time
    OTHER = "OTHER"  # a reason this implementation does not know (a newer relay)


class RelayRefusedError(RemoteError):
    """The relay refused: ``reason`` says why (also in ``details["reason"]``)."""

    def __init__(self, reason: RelayRefusal, message: str, retry_after: int = 0) -> None:
        super().__init__(
            ErrorCode.RELAY_REFUSED, message, reason=str(reason), retry_after=retry_after
        )
        self.reason = reason
        self.retry_after = retry_after


class CircuitEnd(enum.StrEnum):
    """Why a relayed connection ended (counted in :class:`RelayStatistics`)."""

    CLOSED = "CLOSED"  # one side closed or the connection broke
    DURATION_LIMIT = "DURATION_LIMIT"  # open longer than RelayLimits.circuit_duration
    DATA_LIMIT = "DATA_LIMIT"  # one direction carried more than RelayLimits.circuit_data


# --- messages -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reserve:
    """Target -> relay: keep a reservation for the key's peer id (first frame or renewal)."""

    public_key: bytes  # Ed25519, 32 bytes
    timestamp_ms: int  # wall clock, ms since the epoch; newer on every renewal
    signature: bytes  # over reserve_signed_bytes(relay id, timestamp_ms)

    @property
    def peer_id(self) -> PeerId:
        """The peer id the reservation is for."""
        return PeerId.from_public_key(self.public_key)


@dataclass(frozen=True, slots=True)
class Connect:
    """Dialer -> relay: splice me to ``target`` (which must hold a reservation here)."""

    target: PeerId


@dataclass(frozen=True, slots=True)
class Accept:
    """Target -> relay, on a fresh stream: I take the circuit INCOMING named."""

    token: bytes


@dataclass(frozen=True, slots=True)
class Incoming:
    """Relay -> target on its control stream: a dialer waits; ACCEPT ``token``."""

    token: bytes


@dataclass(frozen=True, slots=True)
class Ok:
    """Relay -> client: granted. For RESERVE ``ttl`` is the reservation's remaining
    lifetime; for CONNECT and ACCEPT ``duration`` and ``data`` are the circuit's limits
    (0: no limit). Bytes after an OK to CONNECT/ACCEPT are the relayed stream."""

    ttl: int = 0  # seconds
    duration: int = 0  # seconds
    data: int = 0  # bytes per direction


@dataclass(frozen=True, slots=True)
class Refused:
    """Relay -> client: refused; the relay closes the stream after it."""

    reason: RelayRefusal
    retry_after: int = 0  # seconds; 0: no advice


ControlMessage = Reserve | Connect | Accept | Incoming | Ok | Refused


def reserve_signed_bytes(relay_id: PeerId, timestamp_ms: int) -> bytes:
    """What a target signs in RESERVE: the context, the relay's id, the timestamp."""
    return RESERVE_CONTEXT + relay_id.raw + timestamp_ms.to_bytes(8, "big")


def reserve_message(identity: Identity, relay_id: PeerId, wall_ms: int) -> Reserve:
    """A RESERVE of ``identity`` for the relay ``relay_id`` at wall time ``wall_ms``."""
    if not 0 <= wall_ms < 2**63:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "timestamp out of range")
    signature = identity.sign(reserve_signed_bytes(relay_id, wall_ms))
    return Reserve(identity.public_key, wall_ms, signature)


def _fields(message: ControlMessage) -> dict[str, Any]:
    if isinstance(message, Reserve):
        return {
            "t": "reserve",
            "key": message.public_key,
            "ts": message.timestamp_ms,
            "sig": message.signature,
        }
    if isinstance(message, Connect):
        return {"t": "connect", "target": message.target.raw}
    if isinstance(message, Accept):
        return {"t": "accept", "token": message.token}
    if isinstance(message, Incoming):
        return {"t": "incoming", "token": message.token}
    if isinstance(message, Ok):
        return {"t": "ok", "ttl": message.ttl, "duration": message.duration, "data": message.data}
    return {"t": "refused", "reason": str(message.reason), "retry": message.retry_after}


def encode_message(message: ControlMessage) -> bytes:
    """One control frame: a 2-byte big-endian length, then a canonical msgpack map.

    Raises LocalError(INVALID_ARGUMENT) if the frame would exceed MAX_CONTROL_FRAME.
    """
    body = canonical_pack(_fields(message))
    if len(body) > MAX_CONTROL_FRAME:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "control message too large")
    return len(body).to_bytes(2, "big") + body


def _bin(obj: Mapping[str, Any], key: str, size: int) -> bytes:
    value = obj.get(key)
    if not isinstance(value, bytes) or len(value) != size:
        raise RelayError(ErrorCode.MALFORMED_MESSAGE, f"{key}: {size} bytes expected")
    return value


def _uint(obj: Mapping[str, Any], key: str, bits: int = 63) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**bits:
        raise RelayError(ErrorCode.MALFORMED_MESSAGE, f"{key}: unsigned integer expected")
    return value


def _reason(obj: Mapping[str, Any]) -> RelayRefusal:
    text = obj.get("reason")
    if not isinstance(text, str):
        raise RelayError(ErrorCode.MALFORMED_MESSAGE, "reason: string expected")
    try:
        return RelayRefusal(text)
    except ValueError:
        return RelayRefusal.OTHER  # a newer relay's reason: still a refusal


_DECODERS: dict[str, Callable[[Mapping[str, Any]], ControlMessage]] = {
    "reserve": lambda o: Reserve(
        _bin(o, "key", PUBLIC_KEY_BYTES), _uint(o, "ts"), _bin(o, "sig", 64)
    ),
    "connect": lambda o: Connect(PeerId.from_bytes_untrusted(_bin(o, "target", 20))),
    "accept": lambda o: Accept(_bin(o, "token", TOKEN_BYTES)),
    "incoming": lambda o: Incoming(_bin(o, "token", TOKEN_BYTES)),
    "ok": lambda o: Ok(_uint(o, "ttl", 32), _uint(o, "duration", 32), _uint(o, "data")),
    "refused": lambda o: Refused(_reason(o), _uint(o, "retry", 32)),
}


def decode_message_untrusted(body: bytes | bytearray) -> ControlMessage:
    """Decode one frame body (without its length). Unknown keys are ignored.

    Raises RelayError (MALFORMED_MESSAGE, MESSAGE_TOO_LARGE) or another RemoteError
    (INVALID_PEER_ID) on bad input.
    """
    try:
        obj = unpack_untrusted(body, _WIRE_LIMITS)
    except WireError as exc:
        raise RelayError(exc.code, f"control frame: {exc.message}") from None
    if not isinstance(obj, dict):
        raise RelayError(ErrorCode.MALFORMED_MESSAGE, "control frame is not a map")
    decoder = _DECODERS.get(obj.get("t"))  # type: ignore[arg-type]
    if decoder is None:
        raise RelayError(ErrorCode.MALFORMED_MESSAGE, "unknown control message type")
    return decoder(obj)


class ControlReader:
    """Splits peer bytes into control frames; what follows the last frame a caller
    took (the start of the relayed stream) stays for :meth:`take_rest`."""

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = bytearray()

    def receive_data_untrusted(self, data: bytes | bytearray) -> None:
        """Buffer peer bytes. Raises RelayError(MESSAGE_TOO_LARGE) when the buffer
        holds more than a frame's worth without a complete frame."""
        self._buffer += data
        if len(self._buffer) > 2 + MAX_CONTROL_FRAME and self._pending_length() is None:
            raise RelayError(ErrorCode.MESSAGE_TOO_LARGE, "control frame too large")

    def _pending_length(self) -> int | None:
        """The length of the next complete frame's body, else None."""
        if len(self._buffer) < 2:
            return None
        length = int.from_bytes(self._buffer[:2], "big")
        if length > MAX_CONTROL_FRAME:
            raise RelayError(
                ErrorCode.MESSAGE_TOO_LARGE, f"control frame of {length} bytes", size=length
            )
        if length == 0:
            raise RelayError(ErrorCode.MALFORMED_MESSAGE, "empty control frame")
        return length if len(self._buffer) >= 2 + length else None

    def next_message_untrusted(self) -> ControlMessage | None:
        """The next complete message, else None. Raises RelayError on a bad frame."""
        length = self._pending_length()
        if length is None:
            return None
        body = bytes(self._buffer[2 : 2 + length])
        del self._buffer[: 2 + length]
        return decode_message_untrusted(body)

    def take_rest(self) -> bytes:
        """Every buffered byte not yet taken as a frame (and forget them)."""
        rest = bytes(self._buffer)
        self._buffer.clear()
        return rest


# --- relayed addresses ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RelayAddress:
    """Where a target is reached: through the relay at ``address`` whose id is ``relay_id``."""

    address: tuple[str, int]
    relay_id: PeerId

    def __str__(self) -> str:
        return format_relay_address(self.address, self.relay_id)


def format_relay_address(address: tuple[str, int], relay_id: PeerId) -> str:
    """``relay:<host>:<port>/<relay peer id>`` (an IPv6 host in brackets)."""
    host, port = address
    shown = f"[{host}]" if ":" in host else host
    return f"{RELAY_ADDRESS_PREFIX}{shown}:{port}/{relay_id}"


def parse_relay_address(text: object) -> RelayAddress | None:
    """The relayed address ``text`` names, or None when it is not one (another address
    form, or a malformed relayed address): callers skip what they cannot use."""
    if not isinstance(text, str) or not text.startswith(RELAY_ADDRESS_PREFIX):
        return None
    hostport, _, peer_text = text[len(RELAY_ADDRESS_PREFIX) :].partition("/")
    if not is_address(hostport):
        return None
    try:
        relay_id = PeerId.parse_untrusted(peer_text)
    except RemoteError:
        return None
    host, _, port = hostport.rpartition(":")
    return RelayAddress((host.strip("[]"), int(port)), relay_id)


# --- limits and bookkeeping ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RelayLimits:
    """What a relay grants (seconds, bytes). Every limit is in docs/protocol/relay.md."""

    max_reservations: int = 128
    max_reservations_per_ip: int = 4
    #: A reservation lasts this long unless renewed (a renewal restarts it).
    reservation_ttl: float = 300.0
    #: RESERVE timestamps further than this from the relay's wall clock are refused.
    clock_skew: float = 120.0
    max_circuits: int = 256
    #: Pending plus open circuits to one target.
    max_circuits_per_reservation: int = 16
    #: A circuit is closed this long after it opened.
    circuit_duration: float = 3600.0
    #: A circuit is closed when one direction has carried more bytes than this.
    circuit_data: int = 64 * 1024 * 1024
    #: Bytes per second per direction of one circuit (0: unlimited), with this burst.
    circuit_rate: int = 1024 * 1024
    circuit_burst: int = 256 * 1024
    #: RESERVE and CONNECT requests per second from one source IP, with this burst.
    requests_per_ip: float = 2.0
    request_burst: int = 20
    #: A pending circuit is refused ACCEPT_TIMEOUT if its target has not accepted by then.
    pending_timeout: float = 10.0
    #: A client must send its first frame (and its reply must arrive) within this time.
    control_timeout: float = 10.0
    #: Source IPs whose request rate is remembered (the least recently seen is forgotten).
    max_tracked_ips: int = 4096

    def __post_init__(self) -> None:
        for name in (
            "max_reservations",
            "max_reservations_per_ip",
            "reservation_ttl",
            "clock_skew",
            "max_circuits",
            "max_circuits_per_reservation",
            "circuit_duration",
            "circuit_data",
            "circuit_burst",
            "requests_per_ip",
            "request_burst",
            "pending_timeout",
            "control_timeout",
            "max_tracked_ips",
        ):
            if getattr(self, name) <= 0:
                raise LocalError(ErrorCode.CONFIG_ERROR, f"{name} must be positive")
        if self.circuit_rate < 0:
            raise LocalError(ErrorCode.CONFIG_ERROR, "circuit_rate must be >= 0")


@dataclass(frozen=True, slots=True)
class RelayStatistics:
    """What a relay has done, for ``status`` and metrics."""

    reservations: int  # held now
    circuits: int  # pending or open now
    circuits_opened: int  # spliced since start
    bytes_relayed: int  # both directions, since start
    refusals: Mapping[str, int]  # RelayRefusal value -> count
    circuit_ends: Mapping[str, int]  # CircuitEnd value -> count


@dataclass(slots=True)
class Reservation:
    """A reservation held on the relay (the core's record; mutable bookkeeping)."""

    peer_id: PeerId
    source: str  # the IP the control stream comes from
    generation: int  # which control stream holds it (a newer RESERVE stream replaces it)
    expires: float  # trio time
    timestamp_ms: int  # of the newest RESERVE accepted
    circuits: int = 0  # pending or open


@dataclass(frozen=True, slots=True)
class PendingCircuit:
    """A CONNECT waiting for its target's ACCEPT."""

    token: bytes
    target: PeerId
    deadline: float


class _Buckets:
    """Token buckets per key (a source IP), at most ``capacity`` keys remembered."""

    __slots__ = ("_burst", "_capacity", "_levels", "_rate")

    def __init__(self, rate: float, burst: int, capacity: int) -> None:
        self._rate, self._burst, self._capacity = rate, burst, capacity
        self._levels: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def take(self, key: str, now: float) -> bool:
        """Spend one token of ``key``'s bucket; False when it is empty."""
        tokens, then = self._levels.pop(key, (float(self._burst), now))
        tokens = min(float(self._burst), tokens + (now - then) * self._rate)
        allowed = tokens >= 1.0
        self._levels[key] = (tokens - 1.0 if allowed else tokens, now)
        if len(self._levels) > self._capacity:
            self._levels.popitem(last=False)
        return allowed


@dataclass(slots=True)
class _Counters:
    circuits_opened: int = 0
    bytes_relayed: int = 0
    refusals: dict[str, int] = field(default_factory=dict)
    circuit_ends: dict[str, int] = field(default_factory=dict)


def _default_token(size: int) -> bytes:
    return os.urandom(size)


class RelayCore:
    """The relay's rules and state: reservations, pending and open circuits, rates.

    Every refusal raises :class:`RelayRefusedError` (and is counted); the caller
    answers REFUSED with its reason. Nothing here blocks or reads a clock.
    """

    def __init__(
        self,
        relay_id: PeerId,
        limits: RelayLimits,
        *,
        token_bytes: Callable[[int], bytes] = _default_token,
    ) -> None:
        self.relay_id = relay_id
        self.limits = limits
        self._token_bytes = token_bytes
        self._reservations: dict[PeerId, Reservation] = {}
        self._per_ip: dict[str, int] = {}
        self._pending: dict[bytes, PendingCircuit] = {}
        self._circuits = 0  # pending plus open, all targets
        self._generations = 0
        self._rates = _Buckets(limits.requests_per_ip, limits.request_burst, limits.max_tracked_ips)
        self._counters = _Counters()

    # --- queries ----------------------------------------------------------------

    def reservation(self, peer_id: PeerId) -> Reservation | None:
        """The reservation ``peer_id`` holds, if any."""
        return self._reservations.get(peer_id)

    def holds(self, peer_id: PeerId, generation: int) -> bool:
        """True while the control stream ``generation`` still holds ``peer_id``'s reservation."""
        held = self._reservations.get(peer_id)
        return held is not None and held.generation == generation

    def statistics(self) -> RelayStatistics:
        """Counters of what the relay has done and holds."""
        c = self._counters
        return RelayStatistics(
            reservations=len(self._reservations),
            circuits=self._circuits,
            circuits_opened=c.circuits_opened,
            bytes_relayed=c.bytes_relayed,
            refusals=dict(c.refusals),
            circuit_ends=dict(c.circuit_ends),
        )

    def _refuse(
        self, reason: RelayRefusal, message: str, retry_after: int = 0
    ) -> RelayRefusedError:
        self._counters.refusals[reason] = self._counters.refusals.get(reason, 0) + 1
        return RelayRefusedError(reason, message, retry_after)

    def refused(self, reason: RelayRefusal, message: str) -> RelayRefusedError:
        """Count a refusal decided by the I/O layer (MALFORMED, ACCEPT_TIMEOUT) and
        return its error."""
        return self._refuse(reason, message)

    def _check_rate(self, source: str, now: float) -> None:
        if not self._rates.take(source, now):
            retry = max(1, round(1 / self.limits.requests_per_ip))
            raise self._refuse(RelayRefusal.RATE_LIMITED, f"too many requests from {source}", retry)

    # --- reservations -------------------------------------------------------------

    def reserve_untrusted(
        self, message: Reserve, source: str, now: float, wall_ms: int, *, generation: int | None
    ) -> Reservation:
        """Grant or renew a reservation. ``generation`` is the control stream's (None
        for a stream's first RESERVE, which takes a new one and replaces any older
        stream's reservation of the same peer). Raises RelayRefusedError."""
        if generation is None:
            self._check_rate(source, now)
        peer_id = self._check_reserve_untrusted(message, wall_ms)
        held = self._reservations.get(peer_id)
        if held is not None and message.timestamp_ms <= held.timestamp_ms:
            raise self._refuse(RelayRefusal.BAD_RESERVATION, "RESERVE timestamp not newer")
        if held is not None and generation is not None and held.generation != generation:
            raise self._refuse(RelayRefusal.BAD_RESERVATION, "reservation taken by another stream")
        if held is None or held.source != source:
            self._check_room(source, moving=held is not None)
        if held is not None:
            self._drop_ip(held.source)
            circuits = held.circuits
        else:
            circuits = 0
        if generation is None:
            self._generations += 1
            generation = self._generations
        granted = Reservation(
            peer_id, source, generation, now + self.limits.reservation_ttl, message.timestamp_ms
        )
        granted.circuits = circuits
        self._reservations[peer_id] = granted
        self._per_ip[source] = self._per_ip.get(source, 0) + 1
        return granted

    def _check_reserve_untrusted(self, message: Reserve, wall_ms: int) -> PeerId:
        skew_ms = self.limits.clock_skew * 1000
        if abs(message.timestamp_ms - wall_ms) > skew_ms:
            raise self._refuse(RelayRefusal.BAD_RESERVATION, "RESERVE timestamp too far off")
        signed = reserve_signed_bytes(self.relay_id, message.timestamp_ms)
        if not verify_signature(message.public_key, signed, message.signature):
            raise self._refuse(RelayRefusal.BAD_RESERVATION, "RESERVE signature invalid")
        return message.peer_id

    def _check_room(self, source: str, *, moving: bool) -> None:
        total = len(self._reservations) - (1 if moving else 0)
        if total >= self.limits.max_reservations:
            raise self._refuse(RelayRefusal.RESERVATION_LIMIT, "relay holds its maximum", 60)
        if self._per_ip.get(source, 0) >= self.limits.max_reservations_per_ip:
            raise self._refuse(RelayRefusal.RESERVATION_LIMIT, f"{source} holds its maximum", 60)

    def _drop_ip(self, source: str) -> None:
        left = self._per_ip.get(source, 0) - 1
        if left > 0:
            self._per_ip[source] = left
        else:
            self._per_ip.pop(source, None)

    def release(self, peer_id: PeerId, generation: int) -> None:
        """The control stream ``generation`` ended: drop its reservation if it still
        holds it (pending circuits to it then fail UNKNOWN_TOKEN/ACCEPT_TIMEOUT)."""
        held = self._reservations.get(peer_id)
        if held is not None and held.generation == generation:
            del self._reservations[peer_id]
            self._drop_ip(held.source)

    # --- circuits -----------------------------------------------------------------

    def connect(self, target: PeerId, source: str, now: float) -> PendingCircuit:
        """A CONNECT to ``target``: a pending circuit whose token the target must ACCEPT.
        Raises RelayRefusedError (RATE_LIMITED, NO_RESERVATION, CONNECTION_LIMIT)."""
        self._check_rate(source, now)
        held = self._reservations.get(target)
        if held is None or held.expires <= now:
            raise self._refuse(RelayRefusal.NO_RESERVATION, "target holds no reservation here")
        if self._circuits >= self.limits.max_circuits:
            raise self._refuse(RelayRefusal.CONNECTION_LIMIT, "relay carries its maximum", 10)
        if held.circuits >= self.limits.max_circuits_per_reservation:
            raise self._refuse(RelayRefusal.CONNECTION_LIMIT, "target's circuits at maximum", 10)
        token = self._token_bytes(TOKEN_BYTES)
        if len(token) != TOKEN_BYTES or token in self._pending:
            raise LocalError(ErrorCode.INTERNAL, "token source gave a bad or repeated token")
        pending = PendingCircuit(token, target, now + self.limits.pending_timeout)
        self._pending[token] = pending
        held.circuits += 1
        self._circuits += 1
        return pending

    def accept(self, token: bytes, now: float) -> PendingCircuit:
        """An ACCEPT of ``token``: the pending circuit, now open. Raises
        RelayRefusedError(UNKNOWN_TOKEN) for no pending circuit or one past its deadline."""
        pending = self._pending.get(token)
        if pending is None or pending.deadline < now:
            raise self._refuse(RelayRefusal.UNKNOWN_TOKEN, "no circuit pending for this token")
        del self._pending[token]
        self._counters.circuits_opened += 1
        return pending

    def abandon(self, token: bytes) -> None:
        """A pending circuit whose dialer left or whose target never accepted: free it."""
        pending = self._pending.pop(token, None)
        if pending is not None:
            self._free(pending.target)

    def circuit_closed(self, target: PeerId, end: CircuitEnd) -> None:
        """An open circuit to ``target`` ended."""
        self._counters.circuit_ends[end] = self._counters.circuit_ends.get(end, 0) + 1
        self._free(target)

    def _free(self, target: PeerId) -> None:
        self._circuits -= 1
        held = self._reservations.get(target)
        if held is not None and held.circuits > 0:
            held.circuits -= 1

    def count_bytes(self, n: int) -> None:
        """``n`` more bytes relayed."""
        self._counters.bytes_relayed += n

    def circuit_limits(self) -> Ok:
        """The OK that opens a circuit: its duration and data limits."""
        return Ok(0, int(self.limits.circuit_duration), self.limits.circuit_data)


class CircuitMeter:
    """One direction of one circuit: its byte budget and its rate (a token bucket)."""

    __slots__ = ("_budget", "_burst", "_level", "_rate", "_then", "paced", "sent")

    def __init__(self, limits: RelayLimits, now: float) -> None:
        self._budget = limits.circuit_data
        self._rate = limits.circuit_rate
        self._burst = max(limits.circuit_burst, 1)
        self._level = float(self._burst)
        self._then = now
        #: Whether a rate is set: without one :meth:`admit` ignores ``now`` (the caller
        #: need not read the clock for every chunk).
        self.paced = bool(self._rate)
        self.sent = 0

    def admit(self, n: int, now: float) -> float:
        """Account ``n`` bytes about to be forwarded: the seconds to wait before
        forwarding them (0 within the rate), or -1 when they would exceed the byte
        budget (the circuit must then close with DATA_LIMIT)."""
        if self.sent + n > self._budget:
            return -1.0
        self.sent += n
        if not self.paced:
            return 0.0
        self._level = min(float(self._burst), self._level + (now - self._then) * self._rate)
        self._then = now
        self._level -= n
        return 0.0 if self._level >= 0 else -self._level / self._rate
