"""RPC datagram codec: known answers from stock rpcudp, and hostile input."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import LocalError
from p2pnode.core.wire import pack
from p2pnode.dht import rpcwire
from p2pnode.dht.routing import Contact

# Produced by u-msgpack-python exactly as rpcudp 5.0.1 frames them (see WIRE.md beside).
VECTORS = json.loads(
    (Path(__file__).parent.parent / "vectors" / "kademlia" / "rpcudp_datagrams.json").read_text()
)
MSG_ID = bytes.fromhex(VECTORS["msg_id_hex"])
NODE_ID = bytes.fromhex(VECTORS["node_id_hex"])
KEY = bytes.fromhex(VECTORS["key_hex"])
HEX = {d["name"]: bytes.fromhex(d["hex"]) for d in VECTORS["datagrams"]}
HERE = Contact(NODE_ID, "127.0.0.1", 8468)


def test_vector_ids_are_what_they_claim() -> None:
    assert hashlib.sha1(b"node-a").digest() == NODE_ID
    assert hashlib.sha1(b"some-key").digest() == KEY


ENCODED: list[tuple[str, bytes]] = [
    ("ping request", rpcwire.encode_request(MSG_ID, "ping", [NODE_ID])),
    ("ping response", rpcwire.encode_response(MSG_ID, NODE_ID)),
    (
        "store request (value 'hello')",
        rpcwire.encode_request(MSG_ID, "store", [NODE_ID, KEY, "hello"]),
    ),
    ("store response", rpcwire.encode_response(MSG_ID, True)),
    ("find_node request", rpcwire.encode_request(MSG_ID, "find_node", [NODE_ID, KEY])),
    (
        "find_node response (one contact)",
        rpcwire.encode_response(MSG_ID, [rpcwire.contact_to_wire(HERE)]),
    ),
    ("find_value request", rpcwire.encode_request(MSG_ID, "find_value", [NODE_ID, KEY])),
    ("find_value response, hit", rpcwire.encode_response(MSG_ID, {"value": "hello"})),
    ("find_value response, miss (no contacts)", rpcwire.encode_response(MSG_ID, [])),
    ("stun request", rpcwire.encode_request(MSG_ID, "stun", [])),
    ("stun response", rpcwire.encode_response(MSG_ID, ["127.0.0.1", 8468])),
]


@pytest.mark.parametrize(("name", "encoded"), ENCODED, ids=[n for n, _ in ENCODED])
def test_encodings_match_stock_bytes(name: str, encoded: bytes) -> None:
    assert encoded == HEX[name]


def test_every_vector_is_covered() -> None:
    assert {n for n, _ in ENCODED} == set(HEX)


def test_decode_vectors() -> None:
    req = rpcwire.decode_datagram_untrusted(HEX["store request (value 'hello')"])
    assert isinstance(req, rpcwire.Request)
    assert req.msg_id == MSG_ID
    assert rpcwire.parse_store_args_untrusted(req.args) == (NODE_ID, KEY, "hello")
    req = rpcwire.decode_datagram_untrusted(HEX["find_value request"])
    assert isinstance(req, rpcwire.Request)
    assert rpcwire.parse_find_args_untrusted(req.args) == (NODE_ID, KEY)
    req = rpcwire.decode_datagram_untrusted(HEX["ping request"])
    assert isinstance(req, rpcwire.Request)
    assert rpcwire.parse_ping_args_untrusted(req.args) == NODE_ID
    req = rpcwire.decode_datagram_untrusted(HEX["stun request"])
    assert isinstance(req, rpcwire.Request)
    rpcwire.parse_stun_args_untrusted(req.args)

    def reply(name: str) -> Any:
        resp = rpcwire.decode_datagram_untrusted(HEX[name])
        assert isinstance(resp, rpcwire.Response)
        assert resp.msg_id == MSG_ID
        return resp.value

    assert rpcwire.parse_ping_reply_untrusted(reply("ping response")) == NODE_ID
    assert rpcwire.parse_store_reply_untrusted(reply("store response")) is True
    assert rpcwire.parse_contacts_untrusted(reply("find_node response (one contact)")) == [HERE]
    assert rpcwire.parse_find_value_reply_untrusted(reply("find_value response, hit")) == (
        "hello",
        [],
    )
    assert rpcwire.parse_find_value_reply_untrusted(
        reply("find_value response, miss (no contacts)")
    ) == (None, [])
    assert rpcwire.parse_stun_reply_untrusted(reply("stun response")) == ("127.0.0.1", 8468)


BAD_DATAGRAMS = [
    b"",
    b"\x00" * 21,  # no body
    b"\x02" + MSG_ID + b"\x90",  # unknown type
    b"\x00" + MSG_ID + b"\xc1",  # invalid msgpack
    b"\x00" + MSG_ID + b"\x90",  # request not [name, args]
    b"\x00" + MSG_ID + b"\x92\x01\x90",  # name not str
    rpcwire.REQUEST.to_bytes() + MSG_ID + b"\x92\xa4evil\x90",  # unknown RPC
    b"\x01" + MSG_ID + b"\xc4\x01",  # truncated bin
    b"\x01" + MSG_ID + b"\x90\x90",  # trailing bytes
    b"\x01" + MSG_ID + b"\xd4\x01\x00",  # ext type
    b"\x01" + MSG_ID + b"\xc5\x30\x00" + b"x" * 0x3000,  # oversize
]


@pytest.mark.parametrize("data", BAD_DATAGRAMS)
def test_bad_datagrams_raise_rpc_error(data: bytes) -> None:
    with pytest.raises(rpcwire.RpcError):
        rpcwire.decode_datagram_untrusted(data)


@settings(max_examples=300)
@given(st.binary(max_size=120))
def test_random_bytes_only_raise_rpc_error(data: bytes) -> None:
    try:
        rpcwire.decode_datagram_untrusted(data)
    except rpcwire.RpcError:
        pass


@settings(max_examples=300)
@given(st.one_of(st.binary(max_size=120), st.sampled_from(sorted(HEX.values()))))
def test_decode_parts_is_decode_without_its_record(data: bytes) -> None:
    """The RPC core's decoder accepts and refuses what decode_datagram_untrusted does."""
    try:
        whole = rpcwire.decode_datagram_untrusted(data)
    except rpcwire.RpcError as exc:
        with pytest.raises(rpcwire.RpcError) as again:
            rpcwire.decode_parts_untrusted(data)
        assert (again.value.code, again.value.message) == (exc.code, exc.message)
        return
    is_request, msg_id, body = rpcwire.decode_parts_untrusted(data)
    if is_request:
        assert whole == rpcwire.Request(msg_id, body[0], body[1])
    else:
        assert whole == rpcwire.Response(msg_id, body)


anything = st.recursive(
    st.none() | st.booleans() | st.integers() | st.binary(max_size=24) | st.text(max_size=8),
    lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=5), ch, max_size=3),
    max_leaves=12,
)


@settings(max_examples=300)
@given(anything)
def test_reply_parsers_only_raise_rpc_error(value: Any) -> None:
    for parser in (
        rpcwire.parse_ping_reply_untrusted,
        rpcwire.parse_store_reply_untrusted,
        rpcwire.parse_contacts_untrusted,
        rpcwire.parse_find_value_reply_untrusted,
        rpcwire.named_contacts_untrusted,
        rpcwire.named_find_value_untrusted,
        rpcwire.parse_stun_reply_untrusted,
    ):
        try:
            parser(value)
        except rpcwire.RpcError:
            pass


@settings(max_examples=200)
@given(st.lists(anything, max_size=4))
def test_arg_parsers_only_raise_rpc_error(args: list[Any]) -> None:
    for parser in (
        rpcwire.parse_ping_args_untrusted,
        rpcwire.parse_store_args_untrusted,
        rpcwire.parse_find_args_untrusted,
        rpcwire.parse_stun_args_untrusted,
    ):
        try:
            parser(args)
        except rpcwire.RpcError:
            pass


def test_contact_fields_checked() -> None:
    for bad in (
        [[NODE_ID, "h", 0]],
        [[NODE_ID, "h", 70000]],
        [[NODE_ID, "", 1]],
        [[NODE_ID[:19], "h", 1]],
        [[NODE_ID, "h", True]],
        [[NODE_ID, "h", 1]] * 33,
    ):
        with pytest.raises(rpcwire.RpcError):
            rpcwire.parse_contacts_untrusted(bad)


def test_known_contacts_are_checked_all_the_same() -> None:
    # A bad entry fails the reply even when its id is one the caller knows.
    for bad in ([[NODE_ID, "h", 0]], [[NODE_ID, "", 1]], [[NODE_ID, "h", True]]):
        with pytest.raises(rpcwire.RpcError):
            rpcwire.parse_contacts_untrusted(bad, {NODE_ID})
        with pytest.raises(rpcwire.RpcError):
            rpcwire.parse_find_value_reply_untrusted(bad, {NODE_ID})


entries = st.lists(
    st.tuples(
        st.binary(min_size=20, max_size=20),
        st.text(min_size=1, max_size=8),
        st.integers(1, 65535),
    ),
    max_size=32,
)


@settings(max_examples=200)
@given(entries, st.sets(st.integers(0, 31)))
def test_known_contacts_are_left_out_and_nothing_else(
    items: list[tuple[bytes, str, int]], known_at: set[int]
) -> None:
    """With ``known`` the reply parses to the same contacts, those ids left out."""
    value = [list(item) for item in items]
    known = {items[i][0] for i in known_at if i < len(items)}
    everyone = rpcwire.parse_contacts_untrusted(value)
    assert rpcwire.parse_contacts_untrusted(value, known) == [
        c for c in everyone if c.node_id not in known
    ]
    assert rpcwire.parse_find_value_reply_untrusted(value, known) == (
        None,
        [c for c in everyone if c.node_id not in known],
    )


@settings(max_examples=200)
@given(entries)
def test_a_contacts_reply_is_the_packed_list_of_its_contacts(
    items: list[tuple[bytes, str, int]],
) -> None:
    """The reply joined from each contact's own encoding is byte for byte what packing
    the list of ``[id, host, port]`` makes (fixarray up to 15 entries, array 16 after)."""
    contacts = [Contact(*item) for item in items]
    wire = [rpcwire.contact_to_wire(c) for c in contacts]
    assert rpcwire.contacts_reply(contacts).body == pack(wire)
    datagram = rpcwire.encode_response(MSG_ID, rpcwire.contacts_reply(contacts))
    assert datagram == rpcwire.encode_response(MSG_ID, wire)


def test_oversize_request_is_refused_locally() -> None:
    with pytest.raises(LocalError):
        rpcwire.encode_request(MSG_ID, "store", [NODE_ID, KEY, b"x" * 8200])
    # 8137 value bytes is the largest store that fits the stock limit.
    assert len(rpcwire.encode_request(MSG_ID, "store", [NODE_ID, KEY, b"x" * 8137])) == 8213
    with pytest.raises(LocalError):
        rpcwire.encode_request(MSG_ID, "store", [NODE_ID, KEY, b"x" * 8138])
