"""Small helpers for the JSON forms of cards and envelopes."""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

JsonValue = Any

_MAX_JSON_DEPTH = 32


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
    None) nested at most 32 deep, so it survives a JSON round trip unchanged."""
    if depth > _MAX_JSON_DEPTH:
        return False
    if value is None or isinstance(value, bool | int | str):
        return True
    if isinstance(value, float):
        return value == value and value not in (float("inf"), float("-inf"))
    if isinstance(value, list):
        return all(is_json_value(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_json_value(v, depth + 1) for k, v in value.items())
    return False


def dumps(obj: JsonValue) -> str:
    """Compact, deterministic JSON text."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def loads_untrusted(text: str | bytes, max_size: int) -> JsonValue:
    """Parse JSON text of at most ``max_size`` bytes; ValueError on anything wrong."""
    if len(text) > max_size:
        raise ValueError(f"{len(text)} bytes exceeds the {max_size}-byte limit")
    try:
        return json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise ValueError(f"invalid JSON: {exc}") from exc
