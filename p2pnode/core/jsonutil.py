"""Small helpers for the JSON forms of cards and envelopes."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

JsonValue = Any

_MAX_JSON_DEPTH = 32
_MIN_INT = -(2**63)
_MAX_INT = 2**64 - 1
#: Nesting accepted by the parser: a whole document (a card holding schemas, a control
#: request holding a payload) may nest somewhat deeper than one JSON value inside it.
MAX_PARSE_DEPTH = 64


def b64encode(data: bytes) -> str:
    """Standard base64 text of ``data`` (used for keys and signatures in JSON forms)."""
    return base64.b64encode(data).decode("ascii")


def b64decode(text: object) -> bytes | None:
    """Bytes of a base64 string, or None when ``text`` is not valid base64."""
    if not isinstance(text, str):
        return None
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, ValueError, UnicodeEncodeError):
        return None


def is_json_value(value: object, depth: int = 0) -> bool:
    """True when ``value`` is plain JSON data (dict with str keys, list, str, int, float, bool,
    None) nested at most 32 deep, so it survives a JSON round trip unchanged.

    Integers must fit 64 bits (``-2**63 .. 2**64 - 1``) and floats be finite: the same data
    travels as msgpack too (cards are signed over it, envelopes forwarded in it), which
    carries no larger integer, and strict JSON has no NaN or infinity.
    """
    if depth > _MAX_JSON_DEPTH:
        return False
    if value is None or isinstance(value, bool | str):
        return True
    if isinstance(value, int):
        return _MIN_INT <= value <= _MAX_INT
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))
    if isinstance(value, list):
        return all(is_json_value(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_json_value(v, depth + 1) for k, v in value.items())
    return False


def is_flat_json_map(
    value: object, max_str_len: int, max_items: int, max_key_len: int | None = None
) -> bool:
    """True when ``value`` is a dict of at most ``max_items`` string keys (of at most
    ``max_key_len`` characters, when given) whose values are strings of at most
    ``max_str_len`` characters or JSON scalars: JSON data at a glance, with no recursive
    walk (most tool arguments). False says only "look closer"."""
    if type(value) is not dict or len(value) > max_items:
        return False
    for key, item in value.items():
        if type(key) is not str or (max_key_len is not None and len(key) > max_key_len):
            return False
        kind = type(item)
        if kind is str:
            if len(item) > max_str_len:
                return False
        elif kind is int:
            if not _MIN_INT <= item <= _MAX_INT:
                return False
        elif kind is float:
            if item != item or item in (float("inf"), float("-inf")):
                return False
        elif kind is not bool and item is not None:
            return False
    return True


def dumps(obj: JsonValue) -> str:
    """Compact, deterministic JSON text."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def loads_untrusted(
    text: str | bytes, max_size: int, max_depth: int = MAX_PARSE_DEPTH
) -> JsonValue:
    """Parse JSON text of at most ``max_size`` bytes nested at most ``max_depth`` deep;
    ValueError on anything wrong (including nesting deep enough to exhaust the stack)."""
    if len(text) > max_size:
        raise ValueError(f"{len(text)} bytes exceeds the {max_size}-byte limit")
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"invalid JSON: {str(exc)[:200]}") from None
    if _depth_exceeds(value, max_depth):
        raise ValueError(f"JSON nested deeper than {max_depth}")
    return value


def _depth_exceeds(value: JsonValue, limit: int) -> bool:
    # Iterative, so checking a deep value cannot exhaust the stack itself.
    stack: list[tuple[JsonValue, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth >= limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False
