"""The hole-punch messages (docs/protocol/holepunch.md §2): what encodes decodes to the
same message, and any payload a peer sends is a message or a HolePunchError
(MALFORMED_MESSAGE), never another exception."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode
from p2pnode.node.holepunch import (
    MAX_ADDRESSES,
    Connect,
    HolePunchError,
    Message,
    Observe,
    Observed,
    Sync,
    encode_message,
    format_address,
    parse_address_untrusted,
    parse_message_untrusted,
)
from p2pnode.transport.net import Address

ports = st.integers(1, 65535)
ipv4 = st.ip_addresses(v=4).map(str)
ipv6 = st.ip_addresses(v=6).map(lambda ip: str(ipaddress.IPv6Address(ip)))
addresses: st.SearchStrategy[Address] = st.tuples(st.one_of(ipv4, ipv6), ports)
messages: st.SearchStrategy[Message] = st.one_of(
    st.lists(addresses, max_size=MAX_ADDRESSES, unique=True).map(lambda a: Connect(tuple(a))),
    st.just(Sync()),
    st.just(Observe()),
    addresses.map(Observed),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=80),
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=10), inner, max_size=6)
    ),
    max_leaves=20,
)


@given(messages)
def test_encoded_messages_decode_to_themselves(message: Message) -> None:
    assert parse_message_untrusted(encode_message(message)) == message


@given(
    messages,
    st.dictionaries(st.text(max_size=8).filter(lambda k: k != "type"), json_values, max_size=4),
)
def test_unknown_keys_are_ignored(message: Message, extra: dict[str, Any]) -> None:
    payload = encode_message(message)
    known = set(payload)
    assert parse_message_untrusted({**{k: v for k, v in extra.items() if k not in known},
                                    **payload}) == message  # fmt: skip


@given(addresses)
def test_addresses_round_trip(address: Address) -> None:
    assert parse_address_untrusted(format_address(address)) == address


@given(json_values)
def test_any_payload_is_a_message_or_malformed(payload: Any) -> None:
    try:
        parse_message_untrusted(payload)
    except HolePunchError as exc:
        assert exc.code is ErrorCode.MALFORMED_MESSAGE
        assert exc.details["reason"] == "MALFORMED"


@given(st.sampled_from(["connect", "observed"]), json_values)
def test_any_address_field_is_parsed_or_malformed(kind: str, value: Any) -> None:
    payload = {"type": kind, "addresses": value, "address": value}
    try:
        message = parse_message_untrusted(payload)
    except HolePunchError as exc:
        assert exc.code is ErrorCode.MALFORMED_MESSAGE
        return
    match message:  # what passed is well-formed
        case Connect(found):
            assert len(found) <= MAX_ADDRESSES
            assert all(0 < port < 65536 for _, port in found)
        case Observed((host, port)):
            ipaddress.ip_address(host)
            assert 0 < port < 65536


@given(st.lists(addresses, min_size=MAX_ADDRESSES + 1, max_size=20, unique=True))
def test_too_many_candidates_are_refused(many: list[Address]) -> None:
    payload = {"type": "connect", "addresses": [format_address(a) for a in many]}
    with pytest.raises(HolePunchError) as raised:
        parse_message_untrusted(payload)
    assert raised.value.code is ErrorCode.MALFORMED_MESSAGE


@given(st.lists(addresses, min_size=1, max_size=4))
def test_repeated_candidates_are_kept_once_in_order(some: list[Address]) -> None:
    texts = [format_address(a) for a in some + some]
    parsed = parse_message_untrusted({"type": "connect", "addresses": texts})
    assert parsed == Connect(tuple(dict.fromkeys(some)))


@pytest.mark.parametrize(
    "text",
    [
        "example.org:7000",  # a name: nothing is resolved on a peer's word
        "10.0.0.1",
        "10.0.0.1:0",
        "10.0.0.1:65536",
        "10.0.0.1:-1",
        "10.0.0.1: 80",
        "::1:80",  # IPv6 without brackets
        "[10.0.0.1]:80",  # brackets around IPv4
        "[::1]:" + "9" * 70,
        "",
        7000,
        None,
    ],
)
def test_bad_addresses_are_malformed(text: object) -> None:
    with pytest.raises(HolePunchError) as raised:
        parse_address_untrusted(text)
    assert raised.value.code is ErrorCode.MALFORMED_MESSAGE


@pytest.mark.parametrize(
    "payload",
    [
        None,
        [],
        "connect",
        {},
        {"type": 3},
        {"type": "punch"},
        {"type": "connect"},  # addresses missing
        {"type": "connect", "addresses": "10.0.0.1:80"},
        {"type": "observed"},
    ],
)
def test_bad_payloads_are_malformed(payload: object) -> None:
    with pytest.raises(HolePunchError) as raised:
        parse_message_untrusted(payload)
    assert raised.value.code is ErrorCode.MALFORMED_MESSAGE
