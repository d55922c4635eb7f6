"""The limited msgpack decoder: every bad input is a WireError."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.wire import WireError, WireLimits, canonical_pack, pack, unpack_untrusted

json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=200)
@given(json_like)
def test_round_trip(obj: Any) -> None:
    assert unpack_untrusted(pack(obj)) == obj


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_wire_error(data: bytes) -> None:
    try:
        unpack_untrusted(data)
    except WireError as exc:
        assert exc.code in (ErrorCode.MALFORMED_MESSAGE, ErrorCode.MESSAGE_TOO_LARGE)


@given(json_like)
def test_truncated_encodings_raise_wire_error(obj: Any) -> None:
    data = pack(obj)
    for cut in range(len(data)):
        try:
            unpack_untrusted(data[:cut])
        except WireError:
            continue


def test_total_size_limit() -> None:
    with pytest.raises(WireError) as info:
        unpack_untrusted(pack(b"x" * 100), WireLimits(max_size=50))
    assert info.value.code is ErrorCode.MESSAGE_TOO_LARGE


@pytest.mark.parametrize(
    ("obj", "limits"),
    [
        ("x" * 100, WireLimits(max_str_len=10)),
        (b"x" * 100, WireLimits(max_bin_len=10)),
        (list(range(100)), WireLimits(max_array_len=10)),
        ({str(i): i for i in range(100)}, WireLimits(max_map_len=10)),
    ],
)
def test_length_limits(obj: Any, limits: WireLimits) -> None:
    with pytest.raises(WireError):
        unpack_untrusted(pack(obj), limits)


def test_depth_limit() -> None:
    nested: Any = 1
    for _ in range(40):
        nested = [nested]
    with pytest.raises(WireError, match="nesting"):
        unpack_untrusted(pack(nested))
    # A hostile header claiming deep nesting without content.
    with pytest.raises(WireError):
        unpack_untrusted(b"\x91" * 100_000)


def nesting_depth(obj: Any) -> int:
    if isinstance(obj, list):
        return 1 + max(map(nesting_depth, obj), default=0)
    if isinstance(obj, dict):
        return 1 + max(map(nesting_depth, obj.values()), default=0)
    return 0


@settings(max_examples=300)
@given(json_like, st.integers(0, 6))
def test_depth_limit_is_exact(obj: Any, max_depth: int) -> None:
    # The byte-count shortcut in front of the walk must never change the verdict.
    data = pack(obj)
    for form in (data, bytearray(data), memoryview(data)):
        if nesting_depth(obj) > max_depth:
            with pytest.raises(WireError, match="nesting"):
                unpack_untrusted(form, WireLimits(max_depth=max_depth))
        else:
            assert unpack_untrusted(form, WireLimits(max_depth=max_depth)) == obj


def test_trailing_bytes_and_ext_types_rejected() -> None:
    with pytest.raises(WireError):
        unpack_untrusted(pack(1) + pack(2))
    with pytest.raises(WireError, match="ext"):
        unpack_untrusted(msgpack.packb(msgpack.ExtType(5, b"abc")))


def test_non_bytes_input() -> None:
    with pytest.raises(WireError):
        unpack_untrusted("text")  # type: ignore[arg-type]


def test_map_with_non_string_key_rejected() -> None:
    with pytest.raises(WireError):
        unpack_untrusted(msgpack.packb({1: 2}))


def test_pack_of_unencodable_is_local_error() -> None:
    with pytest.raises(LocalError):
        pack(object())


@given(st.dictionaries(st.text(max_size=5), st.integers(-(2**63), 2**63), max_size=8))
def test_canonical_pack_ignores_insertion_order(d: dict[str, int]) -> None:
    reversed_d = dict(reversed(list(d.items())))
    assert canonical_pack(d) == canonical_pack(reversed_d)
