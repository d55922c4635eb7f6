"""A2A 1.0 AgentCard export, checked structurally against tests/vectors/a2a."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from p2pnode.core.a2a import jws_signing_input, to_a2a
from p2pnode.core.card import AgentCard, Capability
from p2pnode.core.errors import LocalError
from p2pnode.core.identity import Identity, verify_signature

VECTORS = Path(__file__).parent / "vectors" / "a2a"
REQUIRED = ["name", "description", "supportedInterfaces", "version", "capabilities"]
REQUIRED += ["defaultInputModes", "defaultOutputModes", "skills"]


def _card(owner: Identity) -> AgentCard:
    return AgentCard(
        id="mercury",
        name="MERCURY",
        version="2.1.0",
        description="Strategic planner",
        public_key=owner.public_key,
        tier=1,
        capabilities=(
            Capability("plan.roadmap", "Roadmap", "Plans a roadmap"),
            Capability("review", "Review", ""),
        ),
        addresses=("127.0.0.1:7000",),
        issued_at=1,
        expires_at=2,
    ).signed(owner)


def _shape(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(value[0])] if value else []
    return type(value).__name__


def test_export_has_card_fields_and_one_skill_per_capability() -> None:
    owner = Identity.generate()
    card = _card(owner)
    doc = to_a2a(card, owner)
    assert doc["name"] == "MERCURY"
    assert doc["description"] == "Strategic planner"
    assert doc["version"] == "2.1.0"
    assert [s["id"] for s in doc["skills"]] == ["plan.roadmap", "review"]
    assert doc["skills"][0]["name"] == "Roadmap"
    assert doc["skills"][0]["description"] == "Plans a roadmap"
    assert doc["skills"][1]["description"] == "Review"  # A2A requires a non-empty description
    assert all(skill["tags"] for skill in doc["skills"])
    assert "127.0.0.1:7000" in doc["supportedInterfaces"][0]["url"]


def test_export_matches_the_reference_document_shape() -> None:
    reference = json.loads((VECTORS / "a2a_agent_card_signed_example.json").read_text())
    owner = Identity.generate()
    doc = to_a2a(_card(owner), owner)
    for key in REQUIRED:
        assert key in doc and doc[key] not in ("", [], None)
    ref_shape, our_shape = _shape(reference), _shape(doc)
    for key in ("supportedInterfaces", "skills", "signatures", "defaultInputModes"):
        assert our_shape[key] == ref_shape[key]
    assert set(doc) <= set(reference) | {"provider", "documentationUrl", "iconUrl"}


def test_export_signature_verifies_with_the_owner_key_and_detects_tampering() -> None:
    owner = Identity.generate()
    doc = to_a2a(_card(owner), owner)
    sig = doc["signatures"][0]
    header = json.loads(base64.urlsafe_b64decode(sig["protected"] + "=="))
    assert header == {"alg": "EdDSA", "kid": str(owner.peer_id), "typ": "JOSE"}
    raw_sig = base64.urlsafe_b64decode(sig["signature"] + "==")
    assert verify_signature(owner.public_key, jws_signing_input(sig["protected"], doc), raw_sig)
    doc["description"] = "tampered"
    assert not verify_signature(owner.public_key, jws_signing_input(sig["protected"], doc), raw_sig)


def test_export_needs_a_capability_and_the_owner() -> None:
    owner = Identity.generate()
    card = _card(owner)
    with pytest.raises(LocalError):
        to_a2a(card, Identity.generate())
    import dataclasses

    with pytest.raises(LocalError):
        to_a2a(dataclasses.replace(card, capabilities=()))
