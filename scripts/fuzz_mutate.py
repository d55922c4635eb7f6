"""Hostile inputs for the fuzzer: values, byte mutators and structural mutators.

Generators mix blind and structure-aware inputs:

* random bytes; truncations and bit flips of valid encodings;
* *structural* mutations: a valid encoding is decoded to plain data, one node
  of the tree is replaced (a value of the wrong type, an unhashable value
  where a key or scalar is expected, a map mixing ``bytes`` and ``str`` keys,
  deep nesting, extreme integers, NaN and infinities), a key is renamed to
  its ``bytes`` twin, removed, or joined by unknown keys, and the tree is
  encoded again; a ``bytes`` leaf that is itself an encoding is mutated
  inside;
* hostile encoder tricks: headers announcing huge lengths, deep nesting, and
  for JSON, integers past the parser's digit limit and nesting past the
  recursion limit.

Everything draws from the ``random.Random`` it is given, so a seed replays a run.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

Generator = Callable[[random.Random], Any]
BytesGenerator = Callable[[random.Random], bytes]


# --------------------------------------------------------------------------- hostile values

_DEEP = 40


def _deep_list(depth: int) -> Any:
    obj: Any = None
    for _ in range(depth):
        obj = [obj]
    return obj


def _deep_map(depth: int) -> Any:
    obj: Any = 0
    for _ in range(depth):
        obj = {"k": obj}
    return obj


def _has_bytes(value: Any) -> bool:
    if isinstance(value, bytes):
        return True
    if isinstance(value, list):
        return any(_has_bytes(v) for v in value)
    if isinstance(value, dict):
        return any(_has_bytes(k) or _has_bytes(v) for k, v in value.items())
    return False


#: Values msgpack can carry, chosen to break assumptions: wrong types, unhashable values
#: where a key or scalar is expected, maps mixing bytes and str keys, extremes, nesting.
WIRE_VALUES: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    -1,
    1,
    255,
    65536,
    2**31,
    2**63 - 1,
    2**63,
    2**64 - 1,
    -(2**63),
    0.0,
    -0.0,
    1.5,
    1e308,
    math.nan,
    math.inf,
    -math.inf,
    "",
    "a",
    "x" * 300,
    "\x00",
    "0",
    "*",
    "capability",
    "tcp+noise",
    "request",
    "10.0.0.1:99999",
    "[::1]:65536",
    "host:\u00b2",
    "h:0",
    b"",
    b"\x00",
    b"\x00" * 20,
    b"\xff" * 32,
    b"\x01" * 64,
    [],
    [None],
    [[]],
    [{}],
    [1, 2, 3],
    ["a", "b"],
    [b"a", "a"],
    {},
    {"a": 1},
    {"a": []},
    {b"a": 1, "a": 2},
    {b"k": [], "k": {}},
    {"": None},
    _deep_list(_DEEP),
    _deep_map(_DEEP),
    list(range(300)),
)

#: JSON cannot carry bytes but can carry integers of any size.
JSON_VALUES: tuple[Any, ...] = (
    *(v for v in WIRE_VALUES if not _has_bytes(v)),
    10**30,
    -(10**30),
    2**64,
    10**4000,
)


def wire_value(rng: random.Random) -> Any:
    """A hostile value msgpack can encode (fresh containers: callers may mutate them)."""
    return _fresh(rng.choice(WIRE_VALUES))


def json_value(rng: random.Random) -> Any:
    return _fresh(rng.choice(JSON_VALUES))


def _fresh(value: Any) -> Any:
    if isinstance(value, list | dict):
        return msgpack.unpackb(
            msgpack.packb(value, use_bin_type=True), raw=False, strict_map_key=False
        )
    return value


# --------------------------------------------------------------------------- byte mutators

#: Msgpack fragments that announce more than they carry, or nest deeply.
HOSTILE_FRAGMENTS: tuple[bytes, ...] = (
    b"\xdd\xff\xff\xff\xff",  # array 32 of 4G elements
    b"\xdf\xff\xff\xff\xff",  # map 32 of 4G pairs
    b"\xdb\xff\xff\xff\xff",  # str 32 of 4 GiB
    b"\xc6\xff\xff\xff\xff",  # bin 32 of 4 GiB
    b"\xc9\xff\xff\xff\xff\x01",  # ext 32
    b"\xd4\x00\x00",  # fixext 1
    b"\xc1",  # never used
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff",  # uint64 max
    b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00",  # int64 min
    b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00",  # NaN
    b"\xcb\x7f\xf0\x00\x00\x00\x00\x00\x00",  # +inf
    b"\x91" * 200 + b"\xc0",  # 200 nested arrays
    b"\x81\xa1k" * 100 + b"\xc0",  # 100 nested maps
    b"\x82\xc4\x01k\x01\xa1k\x02",  # {b"k": 1, "k": 2}
    b"\x81\x01\x02",  # {1: 2}: an int key
    b"\x81\x90\x01",  # {[]: 1}: an unhashable key
    b"\xa3\xff\xfe\xfd",  # invalid UTF-8
)


def random_bytes(rng: random.Random) -> bytes:
    roll = rng.random()
    size = rng.randrange(0, 8) if roll < 0.3 else rng.randrange(0, 128 if roll < 0.8 else 4096)
    return rng.randbytes(size)


def truncate(rng: random.Random, data: bytes) -> bytes:
    if not data:
        return data
    return (
        data[: rng.randrange(len(data))] if rng.random() < 0.8 else data[rng.randrange(len(data)) :]
    )


def flip(rng: random.Random, data: bytes) -> bytes:
    if not data:
        return rng.randbytes(1)
    out = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3, 8))):
        i = rng.randrange(len(out))
        if rng.random() < 0.5:
            out[i] ^= 1 << rng.randrange(8)
        else:
            out[i] = rng.choice(
                (0x00, 0xFF, 0x7F, 0x80, 0xC0, 0xC1, 0xDD, 0xDF, rng.randrange(256))
            )
    return bytes(out)


def splice(rng: random.Random, data: bytes) -> bytes:
    fragment = rng.choice(HOSTILE_FRAGMENTS)
    i = rng.randrange(len(data) + 1)
    if rng.random() < 0.5:
        return data[:i] + fragment + data[i:]
    return data[:i] + fragment + data[i + len(fragment) :]


def append_junk(rng: random.Random, data: bytes) -> bytes:
    return data + rng.choice((b"\x00", b"\xc0", rng.randbytes(rng.randrange(1, 16))))


_BYTE_MUTATORS: tuple[Callable[[random.Random, bytes], bytes], ...] = (
    truncate,
    flip,
    flip,
    splice,
    append_junk,
)


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    return rng.choice(_BYTE_MUTATORS)(rng, data)


# --------------------------------------------------------------------------- tree mutators

Path_ = tuple[Any, ...]
_MAX_NODES = 4096


def walk(obj: Any) -> list[Path_]:
    """Paths (keys from the root) of every node of a decoded tree, root first."""
    out: list[Path_] = [()]
    stack: list[tuple[Path_, Any]] = [((), obj)]
    while stack and len(out) < _MAX_NODES:
        path, node = stack.pop()
        items: Any = (
            node.items()
            if isinstance(node, dict)
            else enumerate(node)
            if isinstance(node, list)
            else ()
        )
        for key, child in items:
            child_path = (*path, key)
            out.append(child_path)
            stack.append((child_path, child))
    return out


def get_at(obj: Any, path: Path_) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def set_at(obj: Any, path: Path_, value: Any) -> Any:
    """``obj`` with the node at ``path`` replaced (in place below the root)."""
    if not path:
        return value
    get_at(obj, path[:-1])[path[-1]] = value
    return obj


Values = Callable[[random.Random], Any]


def _scalar_twist(rng: random.Random, value: Any, values: Values) -> Any:
    """A value of the same type but hostile content, when there is one."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        # Neighbours stay in the 64-bit range a decoder yields (JSON's larger integers
        # come from the hostile values).
        near = min(max(value + rng.choice((-1, 1)), -(2**63)), 2**64 - 1)
        return rng.choice((0, -1, near, 2**63 - 1, 2**64 - 1, -(2**63)))
    if isinstance(value, str):
        return rng.choice(("", value * 50, value + "\x00", value.upper(), "é" * 200, value[:1]))
    if isinstance(value, bytes):
        return rng.choice((b"", value[:-1], value + b"\x00", bytes(len(value)), value * 2))
    return values(rng)


def mutate_tree(
    rng: random.Random,
    obj: Any,
    values: Values,
    nested: Callable[[random.Random, bytes], bytes] | None = None,
) -> Any:
    """``obj`` (a fresh decoded tree) with one node changed; see the module docstring."""
    paths = walk(obj)
    path = rng.choice(paths)
    node = get_at(obj, path)
    parent = get_at(obj, path[:-1]) if path else None
    roll = rng.random()
    if nested is not None and isinstance(node, bytes) and roll < 0.3:
        return set_at(obj, path, nested(rng, node))
    if isinstance(parent, dict) and roll < 0.45:
        key = path[-1]
        choice = rng.randrange(4)
        if choice == 0 and isinstance(key, str):
            parent[key.encode()] = parent.pop(key)  # the bytes twin: mixed key types
        elif choice == 1:
            del parent[key]
        elif choice == 2:
            parent[rng.choice(("zz", b"zz", "", b""))] = values(rng)
            parent[rng.choice(("unknown", b"unknown2"))] = values(rng)
        else:
            parent[key] = _scalar_twist(rng, node, values)
        return obj
    if isinstance(parent, list) and roll < 0.5:
        if rng.random() < 0.5:
            del parent[path[-1]]
        else:
            parent.insert(path[-1], values(rng))
        return obj
    if roll < 0.65:
        return set_at(obj, path, _scalar_twist(rng, node, values))
    return set_at(obj, path, values(rng))


def unpack_plain(data: bytes) -> Any:
    """Decode msgpack as a peer's decoder would, but without limits (for mutation)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def pack_plain(obj: Any) -> bytes:
    packed: bytes = msgpack.packb(obj, use_bin_type=True)
    return packed


def mutate_msgpack(rng: random.Random, data: bytes, depth: int = 0) -> bytes:
    """A structural mutation of the msgpack encoding ``data`` (one or two nodes; a
    ``bytes`` leaf that decodes as msgpack may be mutated inside)."""
    try:
        obj = unpack_plain(data)
    except Exception:
        return mutate_bytes(rng, data)

    def nested(r: random.Random, inner: bytes) -> bytes:
        if depth < 3:
            return mutate_msgpack(r, inner, depth + 1)
        return mutate_bytes(r, inner)

    for _ in range(1 if rng.random() < 0.8 else 2):
        obj = mutate_tree(rng, obj, wire_value, nested)
    try:
        return pack_plain(obj)
    except Exception:  # a value msgpack cannot encode: fall back to bytes
        return mutate_bytes(rng, data)


def mutate_any(rng: random.Random, seed: bytes) -> bytes:
    """One hostile variant of a valid msgpack encoding (or random bytes)."""
    roll = rng.random()
    if roll < 0.08:
        return random_bytes(rng)
    if roll < 0.35:
        return mutate_bytes(rng, seed)
    return mutate_msgpack(rng, seed)


def from_seeds(seeds: Sequence[bytes]) -> BytesGenerator:
    """A generator mutating msgpack ``seeds`` (valid encodings)."""

    def generate(rng: random.Random) -> bytes:
        seed = rng.choice(seeds)
        return seed if rng.random() < 0.02 else mutate_any(rng, seed)

    return generate


# --------------------------------------------------------------------------- JSON

_JSON_TRICKS: tuple[str, ...] = (
    "[" * 100_000,
    '{"a":' * 50_000,
    "1" * 5000,
    "-" + "9" * 4400,
    "1e999999",
    "NaN",
    "-Infinity",
    '"\\ud800"',
    '"\\u0000"',
    "\ufeff{}",
    "[1,]",
    "{}" * 2,
    "",
    " ",
)


def mutate_json(rng: random.Random, seed: str) -> str | bytes:
    """One hostile variant of a JSON text (structural, textual or raw bytes)."""
    roll = rng.random()
    if roll < 0.05:
        return random_bytes(rng)
    if roll < 0.12:
        return rng.choice(_JSON_TRICKS)
    if roll < 0.3:
        raw = seed.encode()
        out = mutate_bytes(rng, raw)
        return out if rng.random() < 0.5 else out.decode("utf-8", "replace")
    obj = json.loads(seed)
    for _ in range(1 if rng.random() < 0.8 else 2):
        obj = mutate_tree(rng, obj, json_value)
    text = json.dumps(_jsonable(obj), allow_nan=True)
    return text.encode() if rng.random() < 0.3 else text


def _jsonable(obj: Any) -> Any:
    # The tree mutator renames keys to bytes; JSON keys are text, so decode them back.
    if isinstance(obj, dict):
        return {
            (k.decode("latin-1") if isinstance(k, bytes) else k): _jsonable(v)
            for k, v in obj.items()
        }
    if isinstance(obj, list):
        return [_jsonable(v) for v in obj]
    return obj


def from_json_seeds(seeds: Sequence[str]) -> Generator:
    def generate(rng: random.Random) -> str | bytes:
        seed = rng.choice(seeds)
        return seed if rng.random() < 0.02 else mutate_json(rng, seed)

    return generate
