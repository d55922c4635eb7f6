"""Card files: the human-edited template of a node's agent card.

A template is a JSON object with the descriptive fields of a card (``id``,
``name``, ``version``, ``description``, ``tier``, ``protocols``,
``capabilities``, optional ``sandboxId``, ``addresses``, ``endpoints``) and
``ttlSeconds``. The node fills in what only it knows (public key, peer id,
Noise key, issue and expiry times, revision) and signs the result.
A file that already holds a signed card (it has ``signature``) is read as is,
except by a node publishing it: that fills in its addresses and Noise key,
re-issues and signs it again (:func:`card_from_template`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from p2pnode.core.card import DEFAULT_CARD_TTL_MS, AgentCard
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.identity import Identity, PeerId
from p2pnode.core.jsonutil import b64encode, loads_untrusted

CARD_FILE_NAME = "card.json"
MAX_CARD_FILE_BYTES = 1024 * 1024
_TEMPLATE_ONLY = frozenset({"ttlSeconds"})


def default_agent_id(peer_id: PeerId) -> str:
    """The agent id ``p2pnode init`` and ``run`` give a node's first agent when none is
    chosen: readable, and unique per identity, so two nodes set up the same way do not
    claim one id (ids are first come, first served in every registry)."""
    return f"agent-{str(peer_id)[:6]}"


def starter_template(agent_id: str, name: str, tier: int = 3) -> dict[str, Any]:
    """A starter template for ``p2pnode init``."""
    return {
        "id": agent_id,
        "name": name,
        "version": "0.1.0",
        "description": f"{name}, an agent on p2pnode.",
        "tier": tier,
        "protocols": ["a2a/1.0", "p2pnode/1"],
        "capabilities": [
            {
                "id": "echo",
                "name": "Echo",
                "description": "Returns the payload it is given.",
                "inputSchema": {"type": "object"},
                "outputSchema": {"type": "object"},
            }
        ],
        "ttlSeconds": DEFAULT_CARD_TTL_MS // 1000,
    }


def read_card_file(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``. Raises LocalError(CONFIG_ERROR) with a clear message."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise LocalError(ErrorCode.CONFIG_ERROR, f"cannot read {path}: {exc.strerror}") from exc
    try:
        data = loads_untrusted(raw, MAX_CARD_FILE_BYTES)
    except ValueError as exc:
        raise LocalError(ErrorCode.CONFIG_ERROR, f"{path}: {exc}") from exc
    if not isinstance(data, dict):
        raise LocalError(ErrorCode.CONFIG_ERROR, f"{path}: must hold a JSON object")
    return data


def card_from_template(
    template: dict[str, Any],
    identity: Identity,
    now_ms: int,
    *,
    revision: int = 0,
    noise_static_key: bytes | None = None,
    addresses: tuple[str, ...] | None = None,
) -> AgentCard:
    """A signed card from a template. Raises LocalError(INVALID_CARD) listing every problem.

    A file that holds a signed card is returned as it is, unless ``addresses`` or
    ``noise_static_key`` is given (a node about to publish it): the node then fills
    those in, re-issues the card now with its lifetime and ``revision`` (never
    lowering it) and signs it again, exactly as for a template.
    """
    if "signature" in template:
        card = AgentCard.from_dict(template)
        if card.public_key != identity.public_key:
            raise LocalError(ErrorCode.INVALID_CARD, "the card file belongs to another identity")
        if addresses is None and noise_static_key is None:
            return card
        return dataclasses.replace(
            card,
            addresses=addresses if addresses is not None else card.addresses,
            noise_static_key=noise_static_key or card.noise_static_key,
            issued_at=now_ms,
            expires_at=now_ms + (card.expires_at - card.issued_at),
            revision=max(revision, card.revision),
            last_seen_at=now_ms,
        ).signed(identity)
    ttl = template.get("ttlSeconds", DEFAULT_CARD_TTL_MS // 1000)
    if not isinstance(ttl, int) or isinstance(ttl, bool) or not 60 <= ttl <= 30 * 86400:
        raise LocalError(
            ErrorCode.INVALID_CARD,
            "ttlSeconds: must be an integer from 60 to 2592000",
            problems=["ttlSeconds: must be an integer from 60 to 2592000"],
        )
    plain = {k: v for k, v in template.items() if k not in _TEMPLATE_ONLY}
    plain.update(
        publicKey=b64encode(identity.public_key),
        issuedAt=now_ms,
        expiresAt=now_ms + ttl * 1000,
        revision=revision,
        lastSeenAt=now_ms,
    )
    if addresses is not None:
        plain["addresses"] = list(addresses)
    if noise_static_key is not None:
        plain["noiseStaticKey"] = b64encode(noise_static_key)
    return AgentCard.from_dict(plain).signed(identity)
