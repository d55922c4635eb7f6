"""Export Agent Cards as A2A 1.0 ``AgentCard`` JSON documents.

Field shapes follow the A2A 1.0 protobuf JSON mapping (``tests/vectors/a2a``):
each capability becomes a skill (id, name, description, tags), the card's
addresses become ``supportedInterfaces`` with the ``P2PNODE-NOISE`` binding,
and the document carries one detached JWS signature (RFC 7515, ``EdDSA``) by
the card's owner so A2A tools can check it with the owner's Ed25519 key.

The JWS payload is the document without ``signatures``, with empty strings,
lists and objects removed recursively, in RFC 8785 canonical JSON (our
documents hold only strings, integers and booleans, for which sorted keys and
no whitespace is exactly JCS); the signing input is
``b64url(protected) + "." + b64url(payload)``.
"""

from __future__ import annotations

import base64
import json
from typing import Any

from p2pnode.core.card import AgentCard
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.identity import Identity

A2A_PROTOCOL_VERSION = "1.0"
P2PNODE_BINDING = "P2PNODE-NOISE"
_MEDIA_TYPE = "application/json"


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _drop_empty(value: Any) -> Any:
    if isinstance(value, dict):
        pruned = {k: _drop_empty(v) for k, v in value.items()}
        return {k: v for k, v in pruned.items() if v not in ("", [], {})}
    if isinstance(value, list):
        pruned_list = [_drop_empty(v) for v in value]
        return [v for v in pruned_list if v not in ("", [], {})]
    return value


def jcs_bytes(document: dict[str, Any]) -> bytes:
    """The canonical JSON the A2A signature covers (see the module docstring)."""
    payload = {k: v for k, v in document.items() if k != "signatures"}
    text = json.dumps(
        _drop_empty(payload), sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    return text.encode("utf-8")


def jws_signing_input(protected_b64: str, document: dict[str, Any]) -> bytes:
    """``protected + "." + b64url(JCS(document))``: the bytes the EdDSA signature covers."""
    return f"{protected_b64}.{_b64url(jcs_bytes(document))}".encode("ascii")


def _interfaces(card: AgentCard) -> list[dict[str, str]]:
    urls = [f"p2pnode://{address}/{card.peer_id}/{card.id}" for address in card.addresses]
    if not urls:
        urls = [f"p2pnode://{card.peer_id}/{card.id}"]
    return [
        {"url": url, "protocolBinding": P2PNODE_BINDING, "protocolVersion": A2A_PROTOCOL_VERSION}
        for url in urls
    ]


def _tags(capability_id: str, tier: int) -> list[str]:
    parts = [p for p in capability_id.replace("/", ".").split(".") if p]
    return [*dict.fromkeys(parts), f"tier:L{tier}"]


def to_a2a(card: AgentCard, signer: Identity | None = None) -> dict[str, Any]:
    """The A2A 1.0 AgentCard document for ``card``, signed when ``signer`` owns the card.

    Raises LocalError(INVALID_CARD) when the card has no capability (A2A needs a skill).
    """
    if not card.capabilities:
        raise LocalError(ErrorCode.INVALID_CARD, "an A2A card needs at least one skill")
    document: dict[str, Any] = {
        "name": card.name,
        "description": card.description or card.name,
        "supportedInterfaces": _interfaces(card),
        "version": card.version,
        "capabilities": {"streaming": True},
        "defaultInputModes": [_MEDIA_TYPE],
        "defaultOutputModes": [_MEDIA_TYPE],
        "skills": [
            {
                "id": cap.id,
                "name": cap.name,
                "description": cap.description or cap.name,
                "tags": _tags(cap.id, card.tier),
            }
            for cap in card.capabilities
        ],
    }
    if signer is not None:
        if signer.public_key != card.public_key:
            raise LocalError(ErrorCode.INVALID_SIGNATURE, "the signer does not own this card")
        header = {"alg": "EdDSA", "kid": str(card.peer_id), "typ": "JOSE"}
        protected = _b64url(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
        signature = signer.sign(jws_signing_input(protected, document))
        document["signatures"] = [{"protected": protected, "signature": _b64url(signature)}]
    return document
