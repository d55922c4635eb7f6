"""msgpack encoding with hard limits: the one decoder for bytes from the network.

Theory of operation: every later layer hands untrusted bytes to
:func:`unpack_untrusted`, which checks the total size before decoding, passes
string/bin/array/map length limits to the msgpack C decoder (so an attacker
cannot make it allocate), rejects ext types and trailing bytes, and finally
checks nesting depth. Anything wrong raises :class:`WireError` (a
:class:`~p2pnode.core.errors.RemoteError`), never a msgpack or Python exception.

:func:`canonical_pack` is the byte encoding that signatures cover: msgpack with
map keys sorted (by their encoded bytes) at every level, so two peers that hold
equal data produce identical bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from p2pnode.core.errors import ErrorCode, LocalError, RemoteError


class WireError(RemoteError):
    """Bytes from the network could not be decoded within the limits."""


@dataclass(frozen=True, slots=True)
class WireLimits:
    """Upper bounds applied while decoding untrusted msgpack."""

    max_size: int = 4 * 1024 * 1024
    max_str_len: int = 1024 * 1024
    max_bin_len: int = 4 * 1024 * 1024
    max_array_len: int = 65_536
    max_map_len: int = 65_536
    max_depth: int = 32


DEFAULT_LIMITS = WireLimits()


def array_header(count: int) -> bytes:
    """The msgpack header of an array of ``count`` items (fixarray, array 16 or 32): what
    precedes items already packed, to join them into an array without packing again."""
    if count < 16:
        return bytes([0x90 | count])
    if count < 1 << 16:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


def pack(obj: Any) -> bytes:
    """Encode ``obj`` as msgpack (str as str, bytes as bin).

    Raises LocalError(INVALID_ARGUMENT) if ``obj`` holds a type msgpack cannot encode.
    """
    try:
        data: bytes = msgpack.packb(obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"cannot encode: {exc}") from exc
    return data


def canonical(obj: Any) -> Any:
    """``obj`` with every map's keys in a deterministic order (for signing)."""
    if isinstance(obj, dict):
        items = sorted(obj.items(), key=lambda kv: pack(kv[0]))
        return {k: canonical(v) for k, v in items}
    if isinstance(obj, list | tuple):
        return [canonical(v) for v in obj]
    return obj


def canonical_pack(obj: Any) -> bytes:
    """Deterministic msgpack bytes of ``obj``: map keys sorted by their encoding."""
    return pack(canonical(obj))


#: The refusal code of each bound (a WireError's ``bound`` detail): what a node answers
#: for an envelope it refused (docs/protocol/node.md, "Limits").
LIMIT_CODES: dict[str, ErrorCode] = {
    "size": ErrorCode.MESSAGE_TOO_LARGE,
    "string": ErrorCode.MESSAGE_TOO_LARGE,
    "binary": ErrorCode.MESSAGE_TOO_LARGE,
    "array": ErrorCode.TOO_MANY_ITEMS,
    "map": ErrorCode.TOO_MANY_ITEMS,
    "depth": ErrorCode.NESTING_TOO_DEEP,
}
# msgpack names the limit in its message, "<n> exceeds max_str_len(<max>)".
_LENGTH_LIMITS = {
    "max_str_len": "string",
    "max_bin_len": "binary",
    "max_array_len": "array",
    "max_map_len": "map",
}


def _length_error(exc: Exception, limits: WireLimits) -> WireError | None:
    """The WireError of a msgpack length-limit error (None for any other error): string
    and binary lengths are MESSAGE_TOO_LARGE, item counts stay MALFORMED_MESSAGE as every
    layer documents them; the ``bound`` detail says which, ``limit`` its value."""
    text = str(exc)
    for field, bound in _LENGTH_LIMITS.items():
        if f"exceeds {field}(" in text:
            code = LIMIT_CODES[bound]
            if code is ErrorCode.TOO_MANY_ITEMS:
                code = ErrorCode.MALFORMED_MESSAGE
            return WireError(code, text, bound=bound, limit=getattr(limits, field))
    return None


def _reject_ext(code: int, data: bytes) -> Any:
    raise WireError(ErrorCode.MALFORMED_MESSAGE, f"msgpack ext type {code} not allowed")


# Bytes that can open a msgpack array or map. Nesting is never deeper than the number
# of such bytes in the data, and counting them (C speed) is far cheaper than walking the
# decoded object, so most messages skip the walk.
_CONTAINER_HEADERS = frozenset([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])
_OTHER_BYTES = bytes(b for b in range(256) if b not in _CONTAINER_HEADERS)


def _could_nest_deeper(data: bytes | bytearray | memoryview, max_depth: int) -> bool:
    if isinstance(data, memoryview):
        return True
    return len(data.translate(None, _OTHER_BYTES)) > max_depth


_CONTAINERS = (list, dict)


def _depth_exceeds(obj: Any, max_depth: int) -> bool:
    # Level by level, so a hostile nesting cannot exhaust the Python stack; each level
    # keeps only the containers (the decoder makes plain lists and dicts, nothing else).
    level = [obj] if type(obj) in _CONTAINERS else []
    for _ in range(max_depth):
        if not level:
            return False
        level = [
            child
            for item in level
            for child in (item.values() if type(item) is dict else item)
            if type(child) in _CONTAINERS
        ]
    return bool(level)


def unpack_untrusted(
    data: bytes | bytearray | memoryview, limits: WireLimits = DEFAULT_LIMITS
) -> Any:
    """Decode one msgpack object from peer bytes, enforcing ``limits``.

    Raises WireError with code MESSAGE_TOO_LARGE (the size, a string or binary over its
    limit) or MALFORMED_MESSAGE; a violated limit is named in the details (``bound``: ``size``,
    ``string``, ``binary``, ``array``, ``map`` or ``depth``; ``limit``: its value;
    :data:`LIMIT_CODES` maps the bound to the code a node answers with).
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise WireError(ErrorCode.MALFORMED_MESSAGE, "expected bytes")
    if len(data) > limits.max_size:
        raise WireError(
            ErrorCode.MESSAGE_TOO_LARGE,
            f"{len(data)} bytes exceeds the {limits.max_size}-byte limit",
            size=len(data),
            bound="size",
            limit=limits.max_size,
        )
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            ext_hook=_reject_ext,
            max_str_len=limits.max_str_len,
            max_bin_len=limits.max_bin_len,
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
            max_ext_len=0,
        )
    except WireError:
        raise
    except Exception as exc:  # msgpack raises many unrelated types; translate them all.
        length = _length_error(exc, limits) if isinstance(exc, ValueError) else None
        if length is not None:
            raise length from exc
        raise WireError(ErrorCode.MALFORMED_MESSAGE, f"undecodable msgpack: {exc!r}") from exc
    if _could_nest_deeper(data, limits.max_depth) and _depth_exceeds(obj, limits.max_depth):
        raise WireError(
            ErrorCode.MALFORMED_MESSAGE,
            f"nesting deeper than {limits.max_depth}",
            bound="depth",
            limit=limits.max_depth,
        )
    return obj
