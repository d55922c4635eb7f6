"""Shared documents at the node layer: names, the gossip payload, JSON operations.

A document name is 1-123 characters of ``A-Z a-z 0-9 . _ : / -`` so that
``crdt:<doc>``, the capability advertising interest in it, is a valid
capability id. A gossip frame of a document travels as the payload
``{"crdt": doc, "frame": bin}`` of a ``stream-data`` envelope
(docs/protocol/gossip.md §8).

For the control socket and the CLI, an operation is the JSON object
``{"op": NAME, "path": [key, ...], ...}`` (``path`` may also be one string,
a single key):

=================  ==========================================================
``counter.add``    ``amount`` (int, default 1; non-zero), ``growOnly`` (bool)
``register.set``   ``value`` (null, bool, number, string), ``timestamp``
                   (int ms, default: the node's clock)
``set.add``        ``element`` (int or string)
``set.remove``     ``element`` (int or string)
``map.remove``     nothing else: removes the key ``path[-1]``
=================  ==========================================================

Values come back as JSON: OR-Sets as sorted lists, bytes as base64 text.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.jsonutil import b64encode
from p2pnode.crdt.gossip import GossipError
from p2pnode.crdt.ops import CounterAdd, MapRemove, Op, RegisterSet, SetAdd, SetRemove

MAX_PATH = 8

#: Payload key that marks a gossip envelope (its value is the document name).
GOSSIP_MARKER = "crdt"
#: Capability prefix advertising interest in a document.
CAPABILITY_PREFIX = "crdt:"
# A capability id is at most 128 characters of [A-Za-z0-9._:/-] (card.py).
_DOC_PATTERN = re.compile(r"^[A-Za-z0-9._:/-]{1,123}$")


def check_doc_name(doc: object) -> str:
    """A document name usable in a capability id. Raises LocalError(INVALID_ARGUMENT)."""
    if not isinstance(doc, str) or not _DOC_PATTERN.match(doc):
        raise LocalError(
            ErrorCode.INVALID_ARGUMENT,
            f"document name {doc!r:.80} must be 1-123 characters of A-Z a-z 0-9 . _ : / -",
        )
    return doc


def doc_capability(doc: str) -> str:
    """The capability id that advertises interest in ``doc``."""
    return CAPABILITY_PREFIX + check_doc_name(doc)


def gossip_payload(doc: str, frame: bytes) -> dict[str, Any]:
    """The ``stream-data`` payload carrying one gossip frame of ``doc``."""
    return {GOSSIP_MARKER: doc, "frame": frame}


def decode_gossip_payload_untrusted(payload: object) -> tuple[str, bytes]:
    """``(doc, frame bytes)`` of a gossip payload. Raises GossipError(MALFORMED_MESSAGE)."""
    if not isinstance(payload, dict) or set(payload) != {GOSSIP_MARKER, "frame"}:
        raise GossipError(ErrorCode.MALFORMED_MESSAGE, "gossip payload is not {crdt, frame}")
    doc, frame = payload[GOSSIP_MARKER], payload["frame"]
    if not isinstance(doc, str) or not _DOC_PATTERN.match(doc) or not isinstance(frame, bytes):
        raise GossipError(ErrorCode.MALFORMED_MESSAGE, "gossip payload has a bad doc or frame")
    return doc, frame


def _fail(message: str) -> LocalError:
    return LocalError(ErrorCode.INVALID_ARGUMENT, message)


def _path(obj: dict[str, Any]) -> tuple[str, ...]:
    raw = obj.get("path")
    path = [raw] if isinstance(raw, str) else raw
    if not isinstance(path, list) or not 1 <= len(path) <= MAX_PATH:
        raise _fail(f"path must be a key or a list of 1-{MAX_PATH} keys")
    if not all(isinstance(k, str) and 0 < len(k) <= 256 for k in path):
        raise _fail("path keys must be strings of 1-256 characters")
    return tuple(path)


def _int(obj: dict[str, Any], key: str, default: int) -> int:
    value = obj.get(key, default)
    if type(value) is not int:
        raise _fail(f"{key} must be an integer")
    return value


def _element(obj: dict[str, Any]) -> int | str:
    element = obj.get("element")
    if type(element) is not int and not isinstance(element, str):
        raise _fail("element must be an integer or a string")
    return element


def _counter(obj: dict[str, Any], now_ms: int) -> Op:
    grow = obj.get("growOnly", False)
    if not isinstance(grow, bool):
        raise _fail("growOnly must be a boolean")
    return CounterAdd(_path(obj), _int(obj, "amount", 1), grow)


def _register(obj: dict[str, Any], now_ms: int) -> Op:
    value = obj.get("value")
    if value is not None and not isinstance(value, bool | int | float | str):
        raise _fail("value must be null, a boolean, a number or a string")
    return RegisterSet(_path(obj), value, _int(obj, "timestamp", now_ms))


_PARSERS: dict[str, Callable[[dict[str, Any], int], Op]] = {
    "counter.add": _counter,
    "register.set": _register,
    "set.add": lambda obj, now: SetAdd(_path(obj), _element(obj)),
    "set.remove": lambda obj, now: SetRemove(_path(obj), _element(obj)),
    "map.remove": lambda obj, now: MapRemove(_path(obj)),
}


def op_from_json(obj: object, *, now_ms: int) -> Op:
    """The operation an ``{"op": ...}`` object describes. Raises LocalError(INVALID_ARGUMENT)."""
    if not isinstance(obj, dict):
        raise _fail("an operation is a JSON object")
    parser = _PARSERS.get(str(obj.get("op")))
    if parser is None:
        raise _fail(f"op must be one of {sorted(_PARSERS)}")
    return parser(obj, now_ms)


def value_to_json(value: Any) -> Any:
    """A document value as JSON data (sets become sorted lists, bytes base64 text)."""
    if isinstance(value, dict):
        return {str(k): value_to_json(v) for k, v in value.items()}
    if isinstance(value, frozenset | set):
        return sorted((value_to_json(v) for v in value), key=lambda v: (type(v).__name__, v))
    if isinstance(value, bytes):
        return b64encode(value)
    return value


__all__ = [
    "CAPABILITY_PREFIX",
    "GOSSIP_MARKER",
    "check_doc_name",
    "decode_gossip_payload_untrusted",
    "doc_capability",
    "gossip_payload",
    "op_from_json",
    "value_to_json",
]
