"""Agent Cards: validation, signing, codecs (Properties 2 and 4)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.card import AgentCard, Capability, card_problems, is_address
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.identity import Identity
from p2pnode.core.jsonutil import b64encode
from p2pnode.core.wire import pack
from tests.strategies import cards, identities

OWNER = Identity(bytes(range(32)))


def make_card(**overrides: Any) -> AgentCard:
    fields: dict[str, Any] = dict(
        id="venus",
        name="VENUS",
        version="1.0.0",
        public_key=OWNER.public_key,
        tier=2,
        capabilities=(Capability("design.ui", "UI design", "Designs UIs", {"type": "object"}),),
        issued_at=1_000,
        expires_at=10_000,
    )
    fields.update(overrides)
    return AgentCard(**fields)


@settings(max_examples=150)
@given(cards())
def test_json_round_trip_is_lossless(card: AgentCard) -> None:
    assert AgentCard.from_json_untrusted(card.to_json()) == card


@settings(max_examples=150)
@given(cards())
def test_msgpack_round_trip_is_lossless_and_verifies(card: AgentCard) -> None:
    decoded = AgentCard.from_bytes_untrusted(card.to_bytes())
    assert decoded == card
    assert decoded.is_signed_by_owner()


@settings(max_examples=100)
@given(cards(), st.sampled_from(["id", "name", "version", "tier", "capabilities", "expiresAt"]))
def test_missing_required_field_is_rejected(card: AgentCard, field: str) -> None:
    plain = card.to_dict()
    del plain[field]
    with pytest.raises(LocalError) as info:
        AgentCard.from_dict(plain)
    assert info.value.code is ErrorCode.INVALID_CARD
    assert any(field in p for p in info.value.details["problems"])


def test_validation_reports_every_problem_at_once() -> None:
    problems = card_problems({"id": "", "name": 3, "tier": 9, "capabilities": "x"})
    joined = " | ".join(problems)
    for needle in (
        "id:",
        "name:",
        "version:",
        "tier:",
        "capabilities:",
        "publicKey:",
        "expiresAt:",
    ):
        assert needle in joined
    assert len(problems) >= 7


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"id": "has space"}, "id:"),
        ({"id": "*"}, "id:"),
        ({"tier": 4}, "tier:"),
        ({"tier": True}, "tier:"),
        ({"revision": -1}, "revision:"),
        ({"expires_at": 500}, "expiresAt: must be after issuedAt"),
        ({"addresses": ("nohostport",)}, "addresses[0]"),
        ({"sandbox_id": "bad sandbox"}, "sandboxId"),
        ({"public_key": b"short"}, "publicKey"),
        ({"noise_static_key": b"x" * 31}, "noiseStaticKey"),
        (
            {"capabilities": (Capability("a", "A"), Capability("a", "B"))},
            "duplicate",
        ),
        ({"capabilities": (Capability("a", "A", input_schema={1, 2}),)}, "inputSchema"),
    ],
)
def test_constructor_rejects_invalid_fields(overrides: dict[str, Any], needle: str) -> None:
    with pytest.raises(LocalError) as info:
        make_card(**overrides)
    assert any(needle in p for p in info.value.details["problems"]), info.value.details


def test_peer_id_is_derived_and_checked() -> None:
    card = make_card()
    assert card.peer_id == OWNER.peer_id
    plain = card.to_dict()
    plain["peerId"] = str(Identity.generate().peer_id)
    with pytest.raises(RemoteError, match="does not match"):
        AgentCard.from_dict_untrusted(plain)


def test_signature_covers_content_but_not_bookkeeping() -> None:
    card = make_card().signed(OWNER)
    assert card.is_signed_by_owner()
    seen_later = dataclasses.replace(card, last_seen_at=99, origin="remote")  # type: ignore[arg-type]
    assert seen_later.is_signed_by_owner()
    for change in ({"tier": 0}, {"revision": 5}, {"name": "SUN"}, {"addresses": ("1.2.3.4:5",)}):
        tampered = dataclasses.replace(card, **change)
        with pytest.raises(RemoteError) as info:
            tampered.verify()
        assert info.value.code is ErrorCode.INVALID_SIGNATURE


@given(identities)
def test_card_signed_with_another_key_is_rejected(other: Identity) -> None:
    card = make_card()
    with pytest.raises(LocalError):
        card.signed(other)
    forged = dataclasses.replace(card, signature=other.sign(card.signing_bytes()))
    assert not forged.is_signed_by_owner()
    with pytest.raises(RemoteError):
        AgentCard.from_bytes_untrusted(forged.to_bytes())


def test_unsigned_card_does_not_verify() -> None:
    with pytest.raises(RemoteError) as info:
        AgentCard.from_bytes_untrusted(make_card().to_bytes())
    assert info.value.code is ErrorCode.INVALID_SIGNATURE


def test_swapped_key_with_matching_peer_id_is_rejected() -> None:
    card = make_card().signed(OWNER)
    thief = Identity.generate()
    plain = card.to_dict()
    plain["publicKey"] = b64encode(thief.public_key)
    plain["peerId"] = str(thief.peer_id)
    with pytest.raises(RemoteError) as info:
        AgentCard.from_bytes_untrusted(pack(plain))
    assert info.value.code is ErrorCode.INVALID_SIGNATURE


def test_endorsement() -> None:
    authority = Identity.generate()
    card = make_card(tier=0).signed(OWNER).with_endorsement(authority)
    assert card.endorsed_by(authority.public_key)
    assert card.is_signed_by_owner()  # the endorsement is outside the owner's signature
    assert not card.endorsed_by(Identity.generate().public_key)
    promoted = dataclasses.replace(card, tier=1)
    assert not promoted.endorsed_by(authority.public_key)
    assert AgentCard.from_bytes_untrusted(promoted.signed(OWNER).to_bytes()).endorsement is not None


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_remote_errors(data: bytes) -> None:
    with pytest.raises(RemoteError):
        AgentCard.from_bytes_untrusted(data)


@settings(max_examples=50)
@given(cards())
def test_truncated_and_oversized_encodings(card: AgentCard) -> None:
    data = card.to_bytes()
    for cut in range(0, len(data), max(1, len(data) // 25)):
        with pytest.raises(RemoteError):
            AgentCard.from_bytes_untrusted(data[:cut])
    with pytest.raises(RemoteError) as info:
        AgentCard.from_bytes_untrusted(pack({"x": "y" * 70_000}))
    assert info.value.code is ErrorCode.MESSAGE_TOO_LARGE


@settings(max_examples=100)
@given(
    cards(),
    st.sampled_from(["tier", "name", "capabilities", "publicKey", "expiresAt"]),
    st.none()
    | st.integers(-(2**63), 2**63 - 1)
    | st.text(max_size=5)
    | st.lists(st.integers(0, 9)),
)
def test_wrongly_typed_fields_raise_only_remote_errors(
    card: AgentCard, key: str, value: object
) -> None:
    plain = card.to_dict()
    plain[key] = value
    try:
        decoded = AgentCard.from_bytes_untrusted(pack(plain))
    except RemoteError:
        return
    assert decoded.to_dict()[key] == value  # only a value that is actually valid may pass


def test_json_garbage_is_remote_error() -> None:
    for text in ("", "{", "[]", "null", json.dumps({"id": 1}), "x" * 70_000):
        with pytest.raises(RemoteError):
            AgentCard.from_json_untrusted(text)


# -- regressions: peer values that used to escape as TypeError or LocalError -------------------


def test_unhashable_endpoint_transport_is_remote_error() -> None:
    # {"endpoints": [{"transport": []}]}: the transport reached a frozenset membership test.
    data = bytes.fromhex("81a9656e64706f696e74739181a97472616e73706f727490")
    with pytest.raises(RemoteError) as info:
        AgentCard.from_bytes_untrusted(data)
    assert info.value.code is ErrorCode.INVALID_CARD
    plain = make_card().to_dict()
    transports: list[object] = [[], {"a": 1}, {b"k": 1, "k": 2}, 1.5, None]
    for transport in transports:
        plain["endpoints"] = [{"transport": transport, "address": None}]
        with pytest.raises(RemoteError) as info:
            AgentCard.from_bytes_untrusted(pack(plain))
        assert any("endpoints[0].transport" in p for p in info.value.details["problems"])


@pytest.mark.parametrize("origin", [[], {"x": 1}, ["local"]])
def test_unhashable_origin_is_invalid_card(origin: object) -> None:
    plain = make_card().to_dict()
    plain["origin"] = origin
    with pytest.raises(RemoteError) as info:
        AgentCard.from_bytes_untrusted(pack(plain), verify=False)
    assert any("origin" in p for p in info.value.details["problems"])


def test_unknown_capability_keys_mixing_bytes_and_str_are_reported() -> None:
    plain = make_card().signed(OWNER).to_dict()
    plain["capabilities"][0]["zz"] = 1
    plain["capabilities"][0][b"unknown"] = 2
    with pytest.raises(RemoteError) as info:
        AgentCard.from_bytes_untrusted(pack(plain))
    problems = info.value.details["problems"]
    assert any("unknown fields" in p and "zz" in p and "unknown" in p for p in problems)


@pytest.mark.parametrize(
    "schema", ["1" * 40, "-18446744073709551617", "NaN", "[Infinity]", '{"a": 1e999}']
)
def test_json_schema_numbers_msgpack_cannot_carry_are_rejected(schema: str) -> None:
    # A card is signed over its msgpack form: a JSON card it could not encode used to pass
    # validation, then raise LocalError from to_bytes() and verify().
    text = make_card().signed(OWNER).to_json()
    tampered = text.replace('"inputSchema":{"type":"object"}', f'"inputSchema":{schema}')
    assert tampered != text
    with pytest.raises(RemoteError) as info:
        AgentCard.from_json_untrusted(tampered)
    assert any("inputSchema" in p for p in info.value.details["problems"])


def test_json_schema_with_64_bit_extremes_round_trips() -> None:
    schema = {"min": -(2**63), "max": 2**64 - 1}
    card = make_card(capabilities=(Capability("design.ui", "UI", "", schema),)).signed(OWNER)
    decoded = AgentCard.from_json_untrusted(card.to_json())
    assert decoded == card
    assert AgentCard.from_bytes_untrusted(decoded.to_bytes()).capabilities[0].input_schema == schema


@pytest.mark.parametrize(
    "address", ["10.0.0.1:65536", "10.0.0.1:99999", "host:7000\n", "[::1]:1\n", ":1", "h:"]
)
def test_addresses_a_node_cannot_dial_are_rejected(address: str) -> None:
    # A port past 65535 matched the pattern, then dialing the card's owner raised
    # CONFIG_ERROR from the address parser; `$` let a trailing newline through.
    with pytest.raises(LocalError) as info:
        make_card(addresses=("10.0.0.1:7000", address))
    assert any("addresses[1]" in p for p in info.value.details["problems"])
    assert is_address("10.0.0.1:65535") and is_address("[::1]:0")


@pytest.mark.parametrize("field", ["id", "sandbox_id"])
def test_ids_with_a_trailing_newline_are_rejected(field: str) -> None:
    with pytest.raises(LocalError) as info:
        make_card(**{field: "venus\n"})
    assert info.value.code is ErrorCode.INVALID_CARD
    plain = make_card(capabilities=()).to_dict()
    plain["capabilities"] = [{"id": "design.ui\n", "name": "UI"}]
    with pytest.raises(LocalError):
        AgentCard.from_dict(plain)


def test_an_omitted_key_is_signed_as_its_default() -> None:
    """data-model.md: the signature covers the complete form, defaults filled in."""
    owner = Identity(b"\x07" * 32)
    full = AgentCard(
        id="terse", name="T", version="1", public_key=owner.public_key, expires_at=10**12
    ).signed(owner)
    plain = full.to_dict()
    for key in ("description", "protocols", "endpoints", "addresses", "revision", "issuedAt"):
        assert key in plain
    # A signer that signed the complete form may leave out keys at their defaults.
    terse = {k: v for k, v in plain.items() if k not in {"description", "endpoints", "addresses"}}
    AgentCard.from_dict_untrusted(terse).verify()
    # A key left out whose signed value was not the default breaks the signature.
    other = AgentCard.from_dict_untrusted({**plain, "description": "said something"})
    with pytest.raises(RemoteError) as info:
        other.verify()
    assert info.value.code is ErrorCode.INVALID_SIGNATURE
