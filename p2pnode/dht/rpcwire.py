"""Datagram codec for the Kademlia RPC, wire-compatible with ``kademlia``/``rpcudp``.

Theory of operation (docs/protocol/dht.md §2): a datagram is one type byte
(``0x00`` request, ``0x01`` response), a 20-byte message id and a msgpack
body. A request body is ``[name, [args...]]``; a response body is the bare
return value. Every body is decoded with :func:`p2pnode.core.wire.unpack_untrusted`
under :data:`RPC_LIMITS`, and every argument and reply is type- and
length-checked here, so the node only ever sees well-formed values. Anything
wrong raises :class:`RpcError` (a RemoteError); the node drops the datagram
and logs it.

The body limit is the stock request limit, 8192 bytes; we apply it to
requests and responses in both directions.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any

from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.wire import WireError, WireLimits, array_header, pack, unpack_untrusted
from p2pnode.dht.contacts import ID_BYTES, Contact, make_contact

REQUEST = 0x00
RESPONSE = 0x01
MSG_ID_BYTES = 20
HEADER_BYTES = 1 + MSG_ID_BYTES
MAX_BODY_BYTES = 8192
MAX_DATAGRAM_BYTES = HEADER_BYTES + MAX_BODY_BYTES
MAX_CONTACTS = 32  # stock replies carry at most k = 20
MAX_HOST_CHARS = 64

RPC_LIMITS = WireLimits(
    max_size=MAX_BODY_BYTES,
    max_str_len=MAX_BODY_BYTES,
    max_bin_len=MAX_BODY_BYTES,
    max_array_len=256,
    max_map_len=16,
    max_depth=8,
)

METHODS = frozenset({"ping", "store", "find_node", "find_value", "stun"})


class RpcError(RemoteError):
    """A datagram, request or reply that is not valid Kademlia RPC."""


@dataclass(frozen=True, slots=True)
class Request:
    """A decoded request: ``method`` is one of :data:`METHODS`; args unchecked."""

    msg_id: bytes
    method: str
    args: list[Any]


@dataclass(frozen=True, slots=True)
class Response:
    """A decoded response: the bare msgpack value, still unchecked."""

    msg_id: bytes
    value: Any


def encode_request(msg_id: bytes, method: str, args: list[Any]) -> bytes:
    """One request datagram. Raises LocalError(MESSAGE_TOO_LARGE) past 8192 body bytes."""
    return _frame(REQUEST, msg_id, pack([method, args]))


@dataclass(frozen=True, slots=True)
class Encoded:
    """A response value already in msgpack: :func:`encode_response` sends ``body`` as it is."""

    body: bytes


def encode_response(msg_id: bytes, value: Any) -> bytes:
    """One response datagram (``value`` may be :class:`Encoded`). Raises
    LocalError(MESSAGE_TOO_LARGE) past 8192 body bytes."""
    return _frame(RESPONSE, msg_id, value.body if type(value) is Encoded else pack(value))


def contacts_reply(contacts: Sequence[Contact]) -> Encoded:
    """A ``find_node`` reply naming ``contacts``: the msgpack array of their
    ``[id, host, port]``, the very bytes ``pack`` makes of it, joined from each
    contact's own encoding (:attr:`Contact.wire`) instead of packed again."""
    return Encoded(array_header(len(contacts)) + b"".join([c.wire for c in contacts]))


def _frame(kind: int, msg_id: bytes, body: bytes) -> bytes:
    if len(msg_id) != MSG_ID_BYTES:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "message ids are 20 bytes")
    if len(body) > MAX_BODY_BYTES:
        raise LocalError(ErrorCode.MESSAGE_TOO_LARGE, f"RPC body of {len(body)} bytes exceeds 8192")
    return bytes([kind]) + msg_id + body


def decode_datagram_untrusted(data: bytes) -> Request | Response:
    """Decode one datagram. Raises RpcError (MALFORMED_MESSAGE / MESSAGE_TOO_LARGE)."""
    is_request, msg_id, body = decode_parts_untrusted(data)
    if is_request:
        return Request(msg_id, body[0], body[1])
    return Response(msg_id, body)


def decode_parts_untrusted(data: bytes) -> tuple[bool, bytes, Any]:
    """:func:`decode_datagram_untrusted` without its record (for the RPC core, which
    makes an event of every datagram): whether it is a request, the message id, and
    ``[method, args]`` of a request (checked as for :class:`Request`) or the bare value
    of a response. Raises RpcError (MALFORMED_MESSAGE / MESSAGE_TOO_LARGE)."""
    if len(data) > MAX_DATAGRAM_BYTES:
        raise RpcError(ErrorCode.MESSAGE_TOO_LARGE, f"datagram of {len(data)} bytes")
    if len(data) < HEADER_BYTES + 1:
        raise RpcError(ErrorCode.MALFORMED_MESSAGE, "datagram shorter than 22 bytes")
    kind = data[0]
    if kind not in (REQUEST, RESPONSE):
        raise RpcError(ErrorCode.MALFORMED_MESSAGE, f"unknown datagram type {kind:#04x}")
    msg_id = bytes(data[1:HEADER_BYTES])
    try:
        body = unpack_untrusted(bytes(data[HEADER_BYTES:]), RPC_LIMITS)
    except WireError as exc:
        raise RpcError(exc.code, exc.message) from None
    if kind == RESPONSE:
        return False, msg_id, body
    if not isinstance(body, list) or len(body) != 2:
        raise RpcError(ErrorCode.MALFORMED_MESSAGE, "request body is not [name, args]")
    method, args = body
    if not isinstance(method, str) or not isinstance(args, list):
        raise RpcError(ErrorCode.MALFORMED_MESSAGE, "request body is not [str, array]")
    if method not in METHODS:
        raise RpcError(ErrorCode.MALFORMED_MESSAGE, f"unknown RPC {method[:40]!r}")
    return True, msg_id, body


# ---------------------------------------------------------------------- arguments


def _node_id(value: Any, what: str = "node id") -> bytes:
    if not isinstance(value, bytes) or len(value) != ID_BYTES:
        raise RpcError(ErrorCode.MALFORMED_MESSAGE, f"{what} is not 20 bytes")
    return value


def _arity(args: list[Any], n: int, method: str) -> None:
    if len(args) != n:
        raise RpcError(ErrorCode.MALFORMED_MESSAGE, f"{method} takes {n} arguments")


def parse_ping_args_untrusted(args: list[Any]) -> bytes:
    """``ping [nodeid]`` -> the caller's id."""
    _arity(args, 1, "ping")
    return _node_id(args[0])


def parse_store_args_untrusted(args: list[Any]) -> tuple[bytes, bytes, Any]:
    """``store [nodeid, key, value]`` -> (caller id, key, value)."""
    _arity(args, 3, "store")
    return _node_id(args[0]), _node_id(args[1], "key"), args[2]


def parse_find_args_untrusted(args: list[Any]) -> tuple[bytes, bytes]:
    """``find_node``/``find_value [nodeid, key]`` -> (caller id, key)."""
    _arity(args, 2, "find")
    return _node_id(args[0]), _node_id(args[1], "key")


def parse_stun_args_untrusted(args: list[Any]) -> None:
    """``stun []``."""
    _arity(args, 0, "stun")


# ---------------------------------------------------------------------- replies


def contact_to_wire(c: Contact) -> tuple[bytes, str, int]:
    """A contact as ``[id, host, port]`` (a tuple: msgpack writes it as the same array)."""
    return (c.node_id, c.host, c.port)


def parse_ping_reply_untrusted(value: Any) -> bytes:
    """A ping reply is the callee's 20-byte id."""
    return _node_id(value, "ping reply")


def parse_store_reply_untrusted(value: Any) -> bool:
    """A store reply is a boolean (stock always sends true)."""
    if not isinstance(value, bool):
        raise RpcError(ErrorCode.MALFORMED_MESSAGE, "store reply is not a boolean")
    return value


def named_contacts_untrusted(value: Any, known: Container[bytes] = ()) -> list[Sequence[Any]]:
    """A ``find_node`` reply's entries, each ``[id, host, port]`` checked, those whose id
    is in ``known`` (a lookup's contacts so far) left out. No contact is made of them
    (:func:`~p2pnode.dht.routing.make_contact` does that): a lookup makes only those it
    asks, and late in a lookup most of a reply are known (the k nearest know one another).
    """
    if not isinstance(value, list) or len(value) > MAX_CONTACTS:
        raise RpcError(ErrorCode.MALFORMED_MESSAGE, "contacts reply is not a short array")
    out: list[Sequence[Any]] = []
    for item in value:
        if not isinstance(item, list) or len(item) != 3:
            raise RpcError(ErrorCode.MALFORMED_MESSAGE, "contact is not [id, host, port]")
        node_id, host, port = item
        _node_id(node_id, "contact id")
        if not isinstance(host, str) or not 0 < len(host) <= MAX_HOST_CHARS:
            raise RpcError(ErrorCode.MALFORMED_MESSAGE, "contact host is not a short string")
        if type(port) is not int or not 0 < port < 65536:
            raise RpcError(ErrorCode.MALFORMED_MESSAGE, "contact port out of range")
        if node_id not in known:
            out.append(item)
    return out


def parse_contacts_untrusted(value: Any, known: Container[bytes] = ()) -> list[Contact]:
    """A ``find_node`` reply: array of ``[id, host, port]``, as contacts (those whose id
    is in ``known`` left out, see :func:`named_contacts_untrusted`)."""
    # A contact this process holds already is reused, not built again.
    return [make_contact(*item) for item in named_contacts_untrusted(value, known)]


def named_find_value_untrusted(
    value: Any, known: Container[bytes] = ()
) -> tuple[Any, list[Sequence[Any]]]:
    """A ``find_value`` reply: ``({"value": v}, [])`` on a hit, ``(None, entries)`` otherwise
    (the entries as :func:`named_contacts_untrusted` gives them)."""
    if isinstance(value, dict):
        if set(value) != {"value"}:
            raise RpcError(ErrorCode.MALFORMED_MESSAGE, "find_value hit is not {'value': v}")
        return value["value"], []
    return None, named_contacts_untrusted(value, known)


def parse_find_value_reply_untrusted(
    value: Any, known: Container[bytes] = ()
) -> tuple[Any, list[Contact]]:
    """A ``find_value`` reply: ``({"value": v}, [])`` on a hit, ``(None, contacts)`` otherwise
    (``known``: as for :func:`parse_contacts_untrusted`)."""
    raw, named = named_find_value_untrusted(value, known)
    return raw, [make_contact(*item) for item in named]


def parse_stun_reply_untrusted(value: Any) -> tuple[str, int]:
    """A ``stun`` reply: ``[host, port]`` (IPv6 peers add flowinfo and scope id)."""
    if not isinstance(value, list) or len(value) not in (2, 4):
        raise RpcError(ErrorCode.MALFORMED_MESSAGE, "stun reply is not [host, port]")
    host, port = value[0], value[1]
    if not isinstance(host, str) or type(port) is not int or not 0 < port < 65536:
        raise RpcError(ErrorCode.MALFORMED_MESSAGE, "stun reply is not [host, port]")
    return host, port
