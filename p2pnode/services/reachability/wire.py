"""The dial-back request and its answer (docs/protocol/reachability.md §2), sans-IO.

A requester asks a checker to dial its candidate addresses back: a ``request``
envelope with ``metadata.capability = "reach.dialback"`` and the payload
``{"nonce": bin16, "addrs": [[transport, host, port], ...]}``. The checker answers
``{"nonce": bin16, "observed": [host, port] or nil, "results": [outcome, ...]}``,
one outcome per candidate, in the request's order. Every value from a peer goes
through a ``*_untrusted`` parser here, which raises only :class:`ReachError`.
"""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass
from typing import Any

from p2pnode.core.errors import ErrorCode, RemoteError
from p2pnode.core.identity import PeerId
from p2pnode.transport.relay import RelayAddress, parse_relay_address

#: The request method (``metadata.capability``) every node serves.
METHOD = "reach.dialback"
#: Bytes of the nonce a request carries and its answer echoes.
NONCE_BYTES = 16
#: The most candidate addresses one request may name (more: TOO_MANY_ITEMS).
MAX_ADDRESSES = 4
MAX_HOST_CHARS = 64
#: The longest relayed address an answer's ``relay`` may carry (reachability.md §2.2).
MAX_RELAY_CHARS = 128

Address = tuple[str, int]


class ReachError(RemoteError):
    """A dial-back request or answer that is not what §2 allows."""


class Transport(enum.Enum):
    """How a candidate address is dialed back."""

    TCP = "tcp"  # a new TCP connection and a Noise handshake proving the peer id
    UDP = "udp"  # a DHT ping from a fresh UDP socket, answered with the peer's node id


class Outcome(enum.Enum):
    """What the checker found at one candidate address."""

    REACHED = "reached"  # the requester answered there, proving its peer id
    UNREACHABLE = "unreachable"  # dialed; nothing, or someone else, answered in time
    REFUSED = "refused"  # not dialed: not the IP the request came from, or no such transport


@dataclass(frozen=True, slots=True)
class Candidate:
    """One address the requester believes it can be reached at."""

    transport: Transport
    host: str  # an IP literal
    port: int

    @property
    def address(self) -> Address:
        return (self.host, self.port)

    def to_wire(self) -> list[Any]:
        return [self.transport.value, self.host, self.port]

    def __str__(self) -> str:
        return f"{self.transport.value}://{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class DialRequest:
    """A parsed request: the nonce and the candidates (1 to MAX_ADDRESSES, distinct)."""

    nonce: bytes
    candidates: tuple[Candidate, ...]

    def to_payload(self) -> dict[str, Any]:
        return {"nonce": self.nonce, "addrs": [c.to_wire() for c in self.candidates]}


@dataclass(frozen=True, slots=True)
class DialAnswer:
    """A checker's answer: the address it saw the request come from (None: it could
    not tell) and one outcome per candidate of the request."""

    nonce: bytes
    observed: Address | None
    outcomes: tuple[Outcome, ...]
    #: The relay the checker runs itself (§2.2, §7), offered to the requester.
    relay: RelayAddress | None = None

    def to_payload(self) -> dict[str, Any]:
        observed = list(self.observed) if self.observed is not None else None
        payload: dict[str, Any] = {
            "nonce": self.nonce,
            "observed": observed,
            "results": [o.value for o in self.outcomes],
        }
        if self.relay is not None:
            payload["relay"] = str(self.relay)
        return payload


def _fail(message: str) -> ReachError:
    return ReachError(ErrorCode.INVALID_INPUT, message)


def _host_port_untrusted(host: Any, port: Any, what: str) -> Address:
    if not isinstance(host, str) or not 0 < len(host) <= MAX_HOST_CHARS:
        raise _fail(f"{what}: the host must be a string of 1-{MAX_HOST_CHARS} characters")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise _fail(f"{what}: the host must be an IP literal") from None
    if type(port) is not int or not 0 < port < 65536:
        raise _fail(f"{what}: the port must be an integer 1-65535")
    return (host, port)


def _nonce_untrusted(value: Any) -> bytes:
    if not isinstance(value, bytes) or len(value) != NONCE_BYTES:
        raise _fail(f"nonce: {NONCE_BYTES} bytes are required")
    return value


def parse_request_untrusted(payload: Any) -> DialRequest:
    """The request in ``payload``. Raises ReachError: INVALID_INPUT (malformed, or no
    candidate), TOO_MANY_ITEMS (more than MAX_ADDRESSES)."""
    if not isinstance(payload, dict):
        raise _fail("the payload must be a map")
    nonce = _nonce_untrusted(payload.get("nonce"))
    addrs = payload.get("addrs")
    if not isinstance(addrs, list) or not addrs:
        raise _fail("addrs: a non-empty list is required")
    if len(addrs) > MAX_ADDRESSES:
        raise ReachError(
            ErrorCode.TOO_MANY_ITEMS, f"addrs: at most {MAX_ADDRESSES} addresses per request"
        )
    candidates: list[Candidate] = []
    for i, item in enumerate(addrs):
        if not isinstance(item, list) or len(item) != 3:
            raise _fail(f"addrs[{i}]: [transport, host, port] is required")
        try:
            transport = Transport(item[0])
        except ValueError:
            raise _fail(f"addrs[{i}]: the transport must be 'tcp' or 'udp'") from None
        host, port = _host_port_untrusted(item[1], item[2], f"addrs[{i}]")
        candidate = Candidate(transport, host, port)
        if candidate in candidates:
            raise _fail(f"addrs[{i}]: named twice")
        candidates.append(candidate)
    return DialRequest(nonce, tuple(candidates))


def parse_answer_untrusted(payload: Any, request: DialRequest) -> DialAnswer:
    """A checker's answer to ``request``. Raises ReachError(INVALID_INPUT) when it is
    malformed, echoes another nonce, or has not one outcome per candidate."""
    if not isinstance(payload, dict):
        raise _fail("the answer must be a map")
    if _nonce_untrusted(payload.get("nonce")) != request.nonce:
        raise _fail("nonce: not the request's")
    raw = payload.get("observed")
    observed = None
    if raw is not None:
        if not isinstance(raw, list) or len(raw) != 2:
            raise _fail("observed: [host, port] or nil is required")
        observed = _host_port_untrusted(raw[0], raw[1], "observed")
    results = payload.get("results")
    if not isinstance(results, list) or len(results) != len(request.candidates):
        raise _fail("results: one outcome per candidate is required")
    try:
        outcomes = tuple(Outcome(r) for r in results)
    except (ValueError, TypeError):
        raise _fail("results: each outcome is 'reached', 'unreachable' or 'refused'") from None
    return DialAnswer(request.nonce, observed, outcomes, _relay_untrusted(payload.get("relay")))


def _relay_untrusted(value: Any) -> RelayAddress | None:
    """An answer's ``relay`` (absent or nil: none): a relayed address whose host is an
    IP literal, at most MAX_RELAY_CHARS characters."""
    if value is None:
        return None
    relay = parse_relay_address(value) if isinstance(value, str) else None
    if relay is None or len(value) > MAX_RELAY_CHARS:
        raise _fail(f"relay: a relayed address of at most {MAX_RELAY_CHARS} characters")
    _host_port_untrusted(relay.address[0], relay.address[1], "relay")
    return relay


def offer_untrusted(answer: DialAnswer, checker: PeerId, channel_host: str | None) -> RelayAddress:
    """The relay ``answer`` offers, once it is shown to be the checker's own: the relay's
    peer id is ``checker`` and its host the IP the checker's channel comes from
    (``channel_host``; None, a relayed channel: never). Raises ReachError(INVALID_INPUT)
    otherwise (a node is never pointed at a third party)."""
    relay = answer.relay
    if relay is None:
        raise _fail("relay: none offered")
    if relay.relay_id != checker:
        raise _fail("relay: names another peer than the checker")
    if channel_host is None or relay.address[0] != channel_host:
        raise _fail("relay: not at the IP the checker's channel comes from")
    return relay


__all__ = [
    "MAX_ADDRESSES",
    "MAX_RELAY_CHARS",
    "METHOD",
    "NONCE_BYTES",
    "Candidate",
    "DialAnswer",
    "DialRequest",
    "Outcome",
    "ReachError",
    "Transport",
    "offer_untrusted",
    "parse_answer_untrusted",
    "parse_request_untrusted",
]
