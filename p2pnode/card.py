"""Signed Agent Cards.

An Agent Card says who an agent is (id, name, version, tier, sandbox), what it
can do (capabilities with JSON Schemas), and how to reach its owner (the
owner's Ed25519 public key, peer id, network addresses and Noise static key).

Theory of operation:

* The **plain form** of a card is a dict with camelCase keys (the seed's
  field names) whose bytes fields are standard base64 text. The JSON and the
  msgpack encodings are that same dict, so both round-trip losslessly.
* :func:`card_problems` checks a plain form and returns *every* problem; the
  dataclass constructor runs it too, so an :class:`AgentCard` object is always
  valid. Invalid input raises ``INVALID_CARD`` with the list in
  ``details["problems"]``.
* The **signature** is Ed25519 by the owner over::

      b"p2pnode-card-v1\\x00" || canonical_pack(signed part)

  where the signed part is the plain form without ``signature``, ``origin``,
  ``lastSeenAt`` (local bookkeeping of whoever holds the card) and
  ``endorsement`` (signed separately by the swarm authority), and
  ``canonical_pack`` is msgpack with map keys sorted (see :mod:`p2pnode.wire`).
  A card verifies when its peer id is the one derived from its public key and
  the signature checks.
* An **endorsement** is the swarm authority's Ed25519 signature over
  ``b"p2pnode-endorse-v1\\x00" || canonical_pack([agent id, owner public key,
  tier, sandboxId or None])``: it vouches for a tier and sandbox claim.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from p2pnode.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, PeerId, verify_signature
from p2pnode.jsonutil import b64decode, b64encode, dumps, is_json_value, loads_untrusted
from p2pnode.wire import WireLimits, canonical_pack, pack, unpack_untrusted

CARD_SIGNING_DOMAIN = b"p2pnode-card-v1\x00"
ENDORSEMENT_DOMAIN = b"p2pnode-endorse-v1\x00"
MAX_CARD_BYTES = 64 * 1024
MAX_CAPABILITIES = 64
MAX_ADDRESSES = 16
MAX_LIST_ITEMS = 32
MAX_TEXT = 4096
DEFAULT_CARD_TTL_MS = 60 * 60 * 1000
_CARD_LIMITS = WireLimits(max_size=MAX_CARD_BYTES, max_array_len=1024, max_map_len=1024)
_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
_ADDRESS_PATTERN = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$")
ENDPOINT_TRANSPORTS = frozenset({"local", "tcp+noise", "websocket"})
_ORIGINS = frozenset({"local", "remote"})
_UNSIGNED_FIELDS = ("signature", "origin", "lastSeenAt", "endorsement")


class Tier(enum.IntEnum):
    """Planetary tiers: L0 orchestrator, L1 strategic, L2 operational, L3 specialist."""

    L0 = 0
    L1 = 1
    L2 = 2
    L3 = 3


class Origin(enum.StrEnum):
    """Where the holder of a card got it from."""

    LOCAL = "local"
    REMOTE = "remote"


@dataclass(frozen=True, slots=True)
class Capability:
    """One thing an agent can do, with JSON Schemas for its input and output."""

    id: str
    name: str
    description: str = ""
    input_schema: Any = None
    output_schema: Any = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "description": self.description,
            "inputSchema": self.input_schema,
            "outputSchema": self.output_schema,
        }


@dataclass(frozen=True, slots=True)
class Endpoint:
    """How to reach the agent: ``local`` (same process) or ``tcp+noise`` at ``address``."""

    transport: str
    address: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"transport": self.transport, "address": self.address}


@dataclass(frozen=True, slots=True)
class Endorsement:
    """The swarm authority's signature vouching for an agent's tier and sandbox."""

    authority_key: bytes
    signature: bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "authorityKey": b64encode(self.authority_key),
            "signature": b64encode(self.signature),
        }


def endorsement_message(
    agent_id: str, public_key: bytes, tier: int, sandbox_id: str | None
) -> bytes:
    """The bytes an authority signs to endorse a tier and sandbox claim."""
    return ENDORSEMENT_DOMAIN + canonical_pack([agent_id, public_key, int(tier), sandbox_id])


@dataclass(frozen=True, slots=True)
class AgentCard:
    """A validated Agent Card. Construct with keyword arguments; invalid data raises
    LocalError(INVALID_CARD) listing every problem."""

    id: str
    name: str
    version: str
    public_key: bytes
    description: str = ""
    tier: int = Tier.L3
    protocols: tuple[str, ...] = ("a2a/1.0", "p2pnode/1")
    endpoints: tuple[Endpoint, ...] = ()
    capabilities: tuple[Capability, ...] = ()
    revision: int = 0
    sandbox_id: str | None = None
    origin: Origin = Origin.LOCAL
    last_seen_at: int = 0
    addresses: tuple[str, ...] = ()
    noise_static_key: bytes | None = None
    issued_at: int = 0
    expires_at: int = DEFAULT_CARD_TTL_MS
    peer_id: PeerId = field(default=None)  # type: ignore[assignment]  # derived when omitted
    endorsement: Endorsement | None = None
    signature: bytes = b""

    def __post_init__(self) -> None:
        key = self.public_key
        if self.peer_id is None and isinstance(key, bytes) and len(key) == PUBLIC_KEY_BYTES:
            object.__setattr__(self, "peer_id", PeerId.from_public_key(self.public_key))
        problems = card_problems(self._plain_or_problem())
        if problems:
            raise LocalError(
                ErrorCode.INVALID_CARD, "; ".join(problems), problems=problems, agent_id=self.id
            )

    def _plain_or_problem(self) -> Mapping[str, Any]:
        try:
            return self.to_dict()
        except (TypeError, AttributeError, ValueError):
            return {"__malformed__": True}

    # -- plain form -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """The plain form (camelCase keys, bytes as base64): what JSON and msgpack carry."""
        return {
            "id": self.id,
            "name": self.name,
            "version": self.version,
            "description": self.description,
            "tier": self.tier if isinstance(self.tier, bool) else int(self.tier),
            "protocols": list(self.protocols),
            "endpoints": [e.to_dict() for e in self.endpoints],
            "capabilities": [c.to_dict() for c in self.capabilities],
            "revision": self.revision,
            "sandboxId": self.sandbox_id,
            "origin": str(self.origin),
            "lastSeenAt": self.last_seen_at,
            "publicKey": b64encode(self.public_key),
            "peerId": str(self.peer_id) if self.peer_id is not None else None,
            "addresses": list(self.addresses),
            "noiseStaticKey": (
                b64encode(self.noise_static_key) if self.noise_static_key is not None else None
            ),
            "issuedAt": self.issued_at,
            "expiresAt": self.expires_at,
            "endorsement": self.endorsement.to_dict() if self.endorsement else None,
            "signature": b64encode(self.signature),
        }

    @classmethod
    def from_dict(cls, data: object) -> AgentCard:
        """Build a card from its plain form. Raises LocalError(INVALID_CARD) with every problem."""
        problems = card_problems(data)
        if problems:
            agent_id = data.get("id") if isinstance(data, Mapping) else None
            raise LocalError(
                ErrorCode.INVALID_CARD, "; ".join(problems), problems=problems, agent_id=agent_id
            )
        assert isinstance(data, Mapping)
        endorsement = data.get("endorsement")
        noise = data.get("noiseStaticKey")
        return cls(
            id=data["id"],
            name=data["name"],
            version=data["version"],
            description=data.get("description", ""),
            tier=data["tier"],
            protocols=tuple(data.get("protocols", ())),
            endpoints=tuple(
                Endpoint(e["transport"], e.get("address")) for e in data.get("endpoints", ())
            ),
            capabilities=tuple(
                Capability(
                    c["id"],
                    c["name"],
                    c.get("description", ""),
                    c.get("inputSchema"),
                    c.get("outputSchema"),
                )
                for c in data["capabilities"]
            ),
            revision=data.get("revision", 0),
            sandbox_id=data.get("sandboxId"),
            origin=Origin(data.get("origin", "local")),
            last_seen_at=data.get("lastSeenAt", 0),
            public_key=_b64(data["publicKey"]),
            peer_id=PeerId.parse(data["peerId"]) if data.get("peerId") else None,  # type: ignore[arg-type]
            addresses=tuple(data.get("addresses", ())),
            noise_static_key=_b64(noise) if noise is not None else None,
            issued_at=data.get("issuedAt", 0),
            expires_at=data["expiresAt"],
            endorsement=(
                Endorsement(_b64(endorsement["authorityKey"]), _b64(endorsement["signature"]))
                if endorsement
                else None
            ),
            signature=_b64(data.get("signature", "")),
        )

    @classmethod
    def from_dict_untrusted(cls, data: object) -> AgentCard:
        """Like :meth:`from_dict` for a peer's data; raises RemoteError(INVALID_CARD)."""
        try:
            return cls.from_dict(data)
        except LocalError as exc:
            raise RemoteError(exc.code, exc.message, **exc.details) from None

    def to_json(self) -> str:
        """Deterministic JSON text of the plain form."""
        return dumps(self.to_dict())

    @classmethod
    def from_json_untrusted(cls, text: str | bytes) -> AgentCard:
        """Parse JSON text. Raises RemoteError(INVALID_CARD)."""
        try:
            data = loads_untrusted(text, MAX_CARD_BYTES)
        except ValueError as exc:
            raise RemoteError(ErrorCode.INVALID_CARD, str(exc), problems=[str(exc)]) from None
        return cls.from_dict_untrusted(data)

    def to_bytes(self) -> bytes:
        """msgpack of the plain form."""
        return pack(self.to_dict())

    @classmethod
    def from_bytes_untrusted(cls, data: bytes, *, verify: bool = True) -> AgentCard:
        """Decode msgpack bytes from a peer and (by default) check the owner's signature.

        Raises RemoteError (MALFORMED_MESSAGE, MESSAGE_TOO_LARGE, INVALID_CARD or
        INVALID_SIGNATURE).
        """
        card = cls.from_dict_untrusted(unpack_untrusted(data, _CARD_LIMITS))
        if verify:
            card.verify()
        return card

    # -- signing ----------------------------------------------------------------------------

    def signing_bytes(self) -> bytes:
        """The exact bytes the owner's signature covers (see the module docstring)."""
        plain = self.to_dict()
        for name in _UNSIGNED_FIELDS:
            del plain[name]
        return CARD_SIGNING_DOMAIN + canonical_pack(plain)

    def signed(self, identity: Identity) -> AgentCard:
        """This card signed by its owner. Raises LocalError if ``identity`` does not own it."""
        if identity.public_key != self.public_key:
            raise LocalError(
                ErrorCode.INVALID_SIGNATURE, "the identity does not own this card", agent_id=self.id
            )
        return dataclasses.replace(self, signature=identity.sign(self.signing_bytes()))

    def is_signed_by_owner(self) -> bool:
        """True when the peer id matches the key and the owner's signature checks."""
        return self.peer_id == PeerId.from_public_key(self.public_key) and verify_signature(
            self.public_key, self.signing_bytes(), self.signature
        )

    def verify(self) -> None:
        """Raise RemoteError(INVALID_SIGNATURE) unless :meth:`is_signed_by_owner`."""
        if self.peer_id != PeerId.from_public_key(self.public_key):
            raise RemoteError(
                ErrorCode.INVALID_SIGNATURE,
                "peer id does not match the public key",
                agent_id=self.id,
            )
        if not verify_signature(self.public_key, self.signing_bytes(), self.signature):
            raise RemoteError(ErrorCode.INVALID_SIGNATURE, "bad card signature", agent_id=self.id)

    def endorsed_by(self, authority_key: bytes) -> bool:
        """True when the card carries a valid endorsement of its tier and sandbox by
        ``authority_key``."""
        e = self.endorsement
        if e is None or e.authority_key != authority_key:
            return False
        message = endorsement_message(self.id, self.public_key, self.tier, self.sandbox_id)
        return verify_signature(authority_key, message, e.signature)

    def with_endorsement(self, authority: Identity) -> AgentCard:
        """This card carrying ``authority``'s endorsement of its tier and sandbox."""
        message = endorsement_message(self.id, self.public_key, self.tier, self.sandbox_id)
        return dataclasses.replace(
            self, endorsement=Endorsement(authority.public_key, authority.sign(message))
        )

    # -- queries ----------------------------------------------------------------------------

    def capability_ids(self) -> frozenset[str]:
        return frozenset(c.id for c in self.capabilities)

    def has_capability(self, capability_id: str) -> bool:
        return any(c.id == capability_id for c in self.capabilities)

    def is_expired(self, now_ms: int) -> bool:
        return now_ms >= self.expires_at


def _b64(text: object) -> bytes:
    decoded = b64decode(text)
    if decoded is None:
        raise LocalError(ErrorCode.INVALID_CARD, "bad base64")
    return decoded


# -- validation ---------------------------------------------------------------------------------


def _check_text(
    problems: list[str], data: Mapping[str, Any], key: str, *, required: bool, allow_empty: bool
) -> None:
    if key not in data:
        if required:
            problems.append(f"{key}: required")
        return
    value = data[key]
    if not isinstance(value, str):
        problems.append(f"{key}: must be a string")
    elif not allow_empty and not value.strip():
        problems.append(f"{key}: must not be empty")
    elif len(value) > MAX_TEXT:
        problems.append(f"{key}: longer than {MAX_TEXT} characters")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_text_in(value: object, allowed: frozenset[str]) -> bool:
    # A membership test hashes its operand: a peer's list or map must not reach it.
    return isinstance(value, str) and value in allowed


def _check_bytes(
    problems: list[str], data: Mapping[str, Any], key: str, sizes: tuple[int, ...]
) -> None:
    raw = b64decode(data.get(key))
    if raw is None:
        problems.append(f"{key}: must be base64")
    elif len(raw) not in sizes:
        problems.append(f"{key}: must be {' or '.join(map(str, sizes))} bytes, not {len(raw)}")


def _capability_problems(caps: object) -> list[str]:
    if not isinstance(caps, list):
        return ["capabilities: must be a list"]
    if len(caps) > MAX_CAPABILITIES:
        return [f"capabilities: more than {MAX_CAPABILITIES}"]
    problems: list[str] = []
    seen: set[str] = set()
    for i, cap in enumerate(caps):
        where = f"capabilities[{i}]"
        if not isinstance(cap, Mapping):
            problems.append(f"{where}: must be an object")
            continue
        cap_id = cap.get("id")
        if not isinstance(cap_id, str) or not _ID_PATTERN.fullmatch(cap_id):
            problems.append(f"{where}.id: must match {_ID_PATTERN.pattern}")
        elif cap_id in seen:
            problems.append(f"{where}.id: duplicate {cap_id!r}")
        else:
            seen.add(cap_id)
        for key, required in (("name", True), ("description", False)):
            sub: list[str] = []
            _check_text(sub, cap, key, required=required, allow_empty=not required)
            problems.extend(f"{where}.{p}" for p in sub)
        for key in ("inputSchema", "outputSchema"):
            if not is_json_value(cap.get(key)):
                problems.append(f"{where}.{key}: must be JSON data")
        unknown = set(cap) - {"id", "name", "description", "inputSchema", "outputSchema"}
        if unknown:
            # Peer keys may mix bytes and str, which do not compare: sort their text.
            problems.append(f"{where}: unknown fields {sorted(map(str, unknown))}")
    return problems


def is_address(text: object) -> bool:
    """True when ``text`` is ``host:port`` or ``[v6]:port`` with a port of 0-65535: what a
    node can dial (:func:`p2pnode.node.config.parse_address` accepts every such text)."""
    return (
        isinstance(text, str)
        and _ADDRESS_PATTERN.fullmatch(text) is not None
        and int(text.rpartition(":")[2]) <= 65535
    )


def _list_problems(
    data: Mapping[str, Any], key: str, check: Callable[[str], bool] | None, limit: int
) -> list[str]:
    value = data.get(key, [])
    if not isinstance(value, list):
        return [f"{key}: must be a list"]
    if len(value) > limit:
        return [f"{key}: more than {limit} entries"]
    problems = []
    for i, item in enumerate(value):
        if not isinstance(item, str) or len(item) > 256:
            problems.append(f"{key}[{i}]: must be a string of at most 256 characters")
        elif check is not None and not check(item):
            problems.append(f"{key}[{i}]: {item!r} must look like host:port")
    return problems


def _endpoint_problems(value: object) -> list[str]:
    if not isinstance(value, list) or len(value) > MAX_LIST_ITEMS:
        return [f"endpoints: must be a list of at most {MAX_LIST_ITEMS}"]
    problems = []
    for i, ep in enumerate(value):
        if not isinstance(ep, Mapping):
            problems.append(f"endpoints[{i}]: must be an object")
        elif not _is_text_in(ep.get("transport"), ENDPOINT_TRANSPORTS):
            problems.append(f"endpoints[{i}].transport: one of {sorted(ENDPOINT_TRANSPORTS)}")
        elif not (ep.get("address") is None or isinstance(ep.get("address"), str)):
            problems.append(f"endpoints[{i}].address: must be a string")
    return problems


_KNOWN_FIELDS = frozenset(
    {
        "id", "name", "version", "description", "tier", "protocols", "endpoints", "capabilities",
        "revision", "sandboxId", "origin", "lastSeenAt", "publicKey", "peerId", "addresses",
        "noiseStaticKey", "issuedAt", "expiresAt", "endorsement", "signature",
    }
)  # fmt: skip


def card_problems(data: object) -> list[str]:
    """Every problem with the plain form of a card; empty when it is valid."""
    if not isinstance(data, Mapping):
        return ["card: must be an object"]
    problems: list[str] = []
    unknown = set(data) - _KNOWN_FIELDS
    if unknown:
        problems.append(f"unknown fields {sorted(map(str, unknown))}")
    agent_id = data.get("id")
    if "id" not in data:
        problems.append("id: required")
    elif not isinstance(agent_id, str) or not _ID_PATTERN.fullmatch(agent_id):
        problems.append(f"id: must match {_ID_PATTERN.pattern}")
    _check_text(problems, data, "name", required=True, allow_empty=False)
    _check_text(problems, data, "version", required=True, allow_empty=False)
    _check_text(problems, data, "description", required=False, allow_empty=True)
    if "tier" not in data:
        problems.append("tier: required")
    elif not _is_int(data["tier"]) or not 0 <= data["tier"] <= 3:
        problems.append("tier: must be 0, 1, 2 or 3")
    if "capabilities" not in data:
        problems.append("capabilities: required")
    else:
        problems.extend(_capability_problems(data["capabilities"]))
    problems.extend(_list_problems(data, "protocols", None, MAX_LIST_ITEMS))
    problems.extend(_list_problems(data, "addresses", is_address, MAX_ADDRESSES))
    problems.extend(_endpoint_problems(data.get("endpoints", [])))
    for key in ("revision", "lastSeenAt", "issuedAt"):
        if key in data and (not _is_int(data[key]) or not 0 <= data[key] < 2**63):
            problems.append(f"{key}: must be a non-negative integer")
    expires: Any = data.get("expiresAt")
    issued: Any = data.get("issuedAt", 0)
    if "expiresAt" not in data:
        problems.append("expiresAt: required")
    elif not _is_int(expires) or not 0 <= expires < 2**63:
        problems.append("expiresAt: must be a non-negative integer")
    elif _is_int(issued) and expires <= issued:
        problems.append("expiresAt: must be after issuedAt")
    sandbox = data.get("sandboxId")
    if sandbox is not None and (not isinstance(sandbox, str) or not _ID_PATTERN.fullmatch(sandbox)):
        problems.append(f"sandboxId: must match {_ID_PATTERN.pattern}")
    if not _is_text_in(data.get("origin", "local"), _ORIGINS):
        problems.append("origin: must be 'local' or 'remote'")
    if "publicKey" not in data:
        problems.append("publicKey: required")
    else:
        _check_bytes(problems, data, "publicKey", (PUBLIC_KEY_BYTES,))
    if data.get("noiseStaticKey") is not None:
        _check_bytes(problems, data, "noiseStaticKey", (32,))
    if "signature" in data:
        _check_bytes(problems, data, "signature", (0, SIGNATURE_BYTES))
    problems.extend(_peer_id_problems(data))
    endorsement = data.get("endorsement")
    if endorsement is not None:
        if not isinstance(endorsement, Mapping):
            problems.append("endorsement: must be an object")
        else:
            _check_bytes(problems, endorsement, "authorityKey", (PUBLIC_KEY_BYTES,))
            _check_bytes(problems, endorsement, "signature", (SIGNATURE_BYTES,))
    return [f"card {agent_id!r}: {p}" if isinstance(agent_id, str) else p for p in problems]


def _peer_id_problems(data: Mapping[str, Any]) -> list[str]:
    text = data.get("peerId")
    if text is None:
        return []
    try:
        peer_id = PeerId.parse(text)
    except P2PError:
        return ["peerId: not a peer id"]
    key = b64decode(data.get("publicKey"))
    if key is not None and len(key) == PUBLIC_KEY_BYTES and PeerId.from_public_key(key) != peer_id:
        return ["peerId: does not match publicKey"]
    return []
