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
  ``canonical_pack`` is msgpack with map keys sorted (see :mod:`p2pnode.core.wire`).
  A card verifies when its peer id is the one derived from its public key and
  the signature checks.
* An **endorsement** is the swarm authority's Ed25519 signature over
  ``b"p2pnode-endorse-v1\\x00" || canonical_pack([agent id, owner public key,
  tier, sandboxId or None])``: it vouches for a tier and sandbox claim.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from p2pnode.core.card_rules import (  # the card's limits and checks, re-exported
    DEFAULT_CARD_TTL_MS,
    ENDPOINT_TRANSPORTS,
    MAX_ADDRESSES,
    MAX_CAPABILITIES,
    MAX_CARD_BYTES,
    MAX_LIST_ITEMS,
    MAX_PROMPTS,
    MAX_RESOURCES,
    MAX_ROLES,
    MAX_TEXT,
    MAX_TOOLS,
    MAX_URI_CHARS,
    NAME_PATTERN,
    URI_PATTERN,
    card_problems,
    is_address,
)
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.core.identity import PUBLIC_KEY_BYTES, Identity, PeerId, verify_signature
from p2pnode.core.jsonutil import b64decode, b64encode, dumps, loads_untrusted
from p2pnode.core.wire import WireLimits, canonical_pack, pack, unpack_untrusted

_CARD_LIMITS = WireLimits(max_size=MAX_CARD_BYTES, max_array_len=1024, max_map_len=1024)

CARD_SIGNING_DOMAIN = b"p2pnode-card-v1\x00"
ENDORSEMENT_DOMAIN = b"p2pnode-endorse-v1\x00"
_UNSIGNED_FIELDS = ("signature", "origin", "lastSeenAt", "endorsement")
#: The pseudo-capability an agent offering tool ``name`` is found by: ``tool:<name>``.
TOOL_PREFIX = "tool:"


def tool_capability(name: str) -> str:
    """The key agents offering tool ``name`` are found by (docs/protocol/tools.md §2)."""
    return TOOL_PREFIX + name


def pinned_address(agent_id: str, peer_id: PeerId | str) -> str:
    """The address naming ``agent_id`` of owner ``peer_id``: ``agent@peer`` (the card's
    id and owner; docs/protocol/node.md "Agent ids and owners")."""
    return f"{agent_id}@{peer_id}"


def split_address(address: str) -> tuple[str, PeerId | None]:
    """``(agent id, owner)`` of ``agent@peer`` (a full 32-character peer id after the last
    ``@``); ``(address, None)`` for anything else, a bare agent id."""
    agent_id, sep, peer_text = address.rpartition("@")
    if not sep or not agent_id or len(peer_text) != 32:
        return address, None
    try:
        return agent_id, PeerId.parse(peer_text)
    except P2PError:
        return address, None


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
    """The swarm authority's signature vouching for an agent's tier, sandbox and roles."""

    authority_key: bytes
    signature: bytes
    roles: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "authorityKey": b64encode(self.authority_key),
            "signature": b64encode(self.signature),
        }
        if self.roles:
            out["roles"] = list(self.roles)
        return out


def endorsement_message(
    agent_id: str,
    public_key: bytes,
    tier: int,
    sandbox_id: str | None,
    roles: tuple[str, ...] = (),
) -> bytes:
    """The bytes an authority signs to endorse a tier, sandbox and (when any) roles."""
    signed: list[Any] = [agent_id, public_key, int(tier), sandbox_id]
    if roles:
        signed.append(sorted(roles))
    return ENDORSEMENT_DOMAIN + canonical_pack(signed)


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
    #: Names of the agent's tools and prompts, URIs of its resources.
    tools: tuple[str, ...] = ()
    resources: tuple[str, ...] = ()
    prompts: tuple[str, ...] = ()

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
        } | self._offers()

    def _offers(self) -> dict[str, Any]:
        # Present only when non-empty, so a card offering none signs as it always did.
        offers = (("tools", self.tools), ("resources", self.resources), ("prompts", self.prompts))
        return {key: list(values) for key, values in offers if values}

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
                Endorsement(
                    _b64(endorsement["authorityKey"]),
                    _b64(endorsement["signature"]),
                    tuple(endorsement.get("roles", ())),
                )
                if endorsement
                else None
            ),
            signature=_b64(data.get("signature", "")),
            tools=tuple(data.get("tools", ())),
            resources=tuple(data.get("resources", ())),
            prompts=tuple(data.get("prompts", ())),
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
        message = endorsement_message(self.id, self.public_key, self.tier, self.sandbox_id, e.roles)
        return verify_signature(authority_key, message, e.signature)

    def endorsed_roles(self, authority_key: bytes | None) -> frozenset[str]:
        """The roles ``authority_key`` endorsed for this agent (none without an authority
        or a valid endorsement by it)."""
        if authority_key is None or self.endorsement is None:
            return frozenset()
        return frozenset(self.endorsement.roles) if self.endorsed_by(authority_key) else frozenset()

    def with_endorsement(self, authority: Identity, roles: tuple[str, ...] = ()) -> AgentCard:
        """This card carrying ``authority``'s endorsement of its tier, sandbox and ``roles``."""
        roles = tuple(sorted(set(roles)))
        message = endorsement_message(self.id, self.public_key, self.tier, self.sandbox_id, roles)
        signature = authority.sign(message)
        return dataclasses.replace(
            self, endorsement=Endorsement(authority.public_key, signature, roles)
        )

    # -- queries ----------------------------------------------------------------------------

    def capability_ids(self) -> frozenset[str]:
        return frozenset(c.id for c in self.capabilities)

    def provider_keys(self) -> frozenset[str]:
        """What the card is found by: its capability ids and ``tool:<name>`` of each tool."""
        return self.capability_ids() | {tool_capability(t) for t in self.tools}

    def has_capability(self, capability_id: str) -> bool:
        """True for one of its capabilities, or ``tool:<name>`` of one of its tools."""
        if capability_id.startswith(TOOL_PREFIX):
            return capability_id[len(TOOL_PREFIX) :] in self.tools
        return any(c.id == capability_id for c in self.capabilities)

    def is_expired(self, now_ms: int) -> bool:
        return now_ms >= self.expires_at


def _b64(text: object) -> bytes:
    decoded = b64decode(text)
    if decoded is None:
        raise LocalError(ErrorCode.INVALID_CARD, "bad base64")
    return decoded


__all__ = [
    "DEFAULT_CARD_TTL_MS",
    "ENDPOINT_TRANSPORTS",
    "MAX_ADDRESSES",
    "MAX_CAPABILITIES",
    "MAX_CARD_BYTES",
    "MAX_LIST_ITEMS",
    "MAX_PROMPTS",
    "MAX_RESOURCES",
    "MAX_ROLES",
    "MAX_TEXT",
    "MAX_TOOLS",
    "MAX_URI_CHARS",
    "NAME_PATTERN",
    "TOOL_PREFIX",
    "URI_PATTERN",
    "AgentCard",
    "Capability",
    "Endorsement",
    "Endpoint",
    "Origin",
    "Tier",
    "card_problems",
    "endorsement_message",
    "is_address",
    "pinned_address",
    "split_address",
    "tool_capability",
]
