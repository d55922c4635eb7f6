"""The A2A gateway's mapping rules (docs/protocol/a2a.md §3, §5) as properties: parts and
payloads convert without loss both ways, through A2A's protobuf form too, and hostile
parts get RemoteError and nothing else."""

from __future__ import annotations

import base64
from typing import Any

import pytest
from a2a.types import Part
from google.protobuf.json_format import MessageToDict, ParseDict
from hypothesis import assume, given
from hypothesis import strategies as st

from p2pnode.bridges.a2a.mapping import (
    MAX_PARTS,
    MAX_RAW_BYTES,
    PARTS_KEY,
    Outcome,
    error_data,
    json_numbers,
    outcome_of,
    parts_of_payload,
    payload_of_parts_untrusted,
    skill_for_untrusted,
)
from p2pnode.core.errors import ErrorCode, RemoteError

# JSON as A2A's data parts carry it: numbers are doubles, so integers stay within 2**53.
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
extras = st.fixed_dictionaries(
    {},
    optional={
        "filename": st.text(min_size=1, max_size=12),
        "mediaType": st.sampled_from(["text/plain", "application/json", "image/png"]),
        "metadata": st.dictionaries(
            st.text(min_size=1, max_size=6), scalars, min_size=1, max_size=2
        ),
    },
)
contents = st.one_of(
    st.builds(lambda t: {"text": t}, st.text(max_size=30)),
    st.builds(lambda b: {"raw": base64.b64encode(b).decode()}, st.binary(min_size=1, max_size=64)),
    st.builds(lambda u: {"url": "https://example.org/" + u}, st.text("abc/xyz", max_size=12)),
    st.builds(lambda v: {"data": v}, json_values),
)
parts_lists = st.lists(st.builds(lambda c, e: {**c, **e}, contents, extras), min_size=1, max_size=5)


@given(parts_lists)
def test_parts_survive_a_trip_through_a_payload(parts: list[dict[str, Any]]) -> None:
    assert parts_of_payload(payload_of_parts_untrusted(parts)) == parts


@given(json_values)
def test_a_payload_survives_a_trip_through_parts(value: Any) -> None:
    assume(not (isinstance(value, dict) and set(value) == {PARTS_KEY}))  # the wrapper itself
    assert payload_of_parts_untrusted(parts_of_payload(value)) == value


@given(parts_lists)
def test_parts_survive_a2a_s_protobuf_form(parts: list[dict[str, Any]]) -> None:
    # What the gateway does to a message's parts (MessageToDict, then json_numbers).
    back = []
    for part in parts:
        converted = MessageToDict(ParseDict(part, Part()))
        for key in ("data", "metadata"):
            if key in converted:
                converted[key] = json_numbers(converted[key])
        back.append(converted)
    assert back == parts


def test_the_plain_forms_and_the_wrapper() -> None:
    assert payload_of_parts_untrusted([{"text": "hi"}]) == "hi"
    assert payload_of_parts_untrusted([{"data": {"a": 1}}]) == {"a": 1}
    named = [{"text": "hi", "mediaType": "text/markdown"}]
    assert payload_of_parts_untrusted(named) == {PARTS_KEY: named}
    # A data part that looks like the wrapper is wrapped, so it comes back as data.
    tricky = [{"data": {PARTS_KEY: [{"text": "x"}]}}]
    assert parts_of_payload(payload_of_parts_untrusted(tricky)) == tricky
    # A wrapper holding no valid parts is just data.
    assert parts_of_payload({PARTS_KEY: 5}) == [{"data": {PARTS_KEY: 5}}]


# Part-shaped objects with any of the keys a part may have (and one it may not), any values.
part_keys = st.sampled_from(
    ["text", "raw", "url", "data", "filename", "mediaType", "metadata", "x"]
)
hostile_parts = st.lists(
    st.dictionaries(
        part_keys,
        scalars | st.just("YQ==") | st.dictionaries(st.text(max_size=3), scalars, max_size=2),
        max_size=3,
    ),
    max_size=4,
)


@given(scalars | hostile_parts)
def test_hostile_parts_get_remote_error_only(parts: Any) -> None:
    try:
        payload_of_parts_untrusted(parts)
    except RemoteError as exc:
        assert exc.code in (ErrorCode.INVALID_INPUT, ErrorCode.MESSAGE_TOO_LARGE)


@pytest.mark.parametrize(
    ("parts", "code"),
    [
        ([], ErrorCode.INVALID_INPUT),
        ([{"text": "a", "raw": "YQ=="}], ErrorCode.INVALID_INPUT),
        ([{"raw": "not base64!"}], ErrorCode.INVALID_INPUT),
        ([{"text": 5}], ErrorCode.INVALID_INPUT),
        ([{"text": "a", "kind": "text"}], ErrorCode.INVALID_INPUT),
        ([{"url": "x" * 3000}], ErrorCode.INVALID_INPUT),
        ([{"text": "a"}] * (MAX_PARTS + 1), ErrorCode.MESSAGE_TOO_LARGE),
        (
            [{"raw": base64.b64encode(bytes(MAX_RAW_BYTES // 2 + 1)).decode()}] * 2,
            ErrorCode.MESSAGE_TOO_LARGE,
        ),
    ],
)
def test_refused_parts(parts: Any, code: ErrorCode) -> None:
    with pytest.raises(RemoteError) as refused:
        payload_of_parts_untrusted(parts)
    assert refused.value.code is code


@given(st.lists(st.text(min_size=1, max_size=8), min_size=0, max_size=4, unique=True), json_values)
def test_the_skill_is_the_named_one_or_the_only_one(skills: list[str], asked: Any) -> None:
    offered = tuple(skills)
    assert skill_for_untrusted(None, offered) == (offered[0] if len(offered) == 1 else None)
    for skill in offered:
        assert skill_for_untrusted({"skillId": skill}, offered) == skill
    if asked is not None and asked not in offered:
        with pytest.raises(RemoteError) as refused:
            skill_for_untrusted({"skillId": asked}, offered)
        assert refused.value.code is ErrorCode.CAPABILITY_NOT_FOUND


def test_every_code_has_an_outcome_and_refusals_reject() -> None:
    for code in ErrorCode:
        assert isinstance(outcome_of(code), Outcome)
    for code in (
        ErrorCode.PERMISSION_DENIED,
        ErrorCode.TIER_VIOLATION,
        ErrorCode.SANDBOX_VIOLATION,
    ):
        assert outcome_of(code) is Outcome.REJECTED
    assert outcome_of(ErrorCode.INVALID_INPUT) is Outcome.INVALID_PARAMS
    assert outcome_of(ErrorCode.TASK_CANCELED) is Outcome.CANCELED
    for code in (ErrorCode.TIMEOUT, ErrorCode.AGENT_NOT_FOUND, ErrorCode.HANDLER_FAILED):
        assert outcome_of(code) is Outcome.FAILED


def test_error_data_is_json_whatever_the_details_hold() -> None:
    exc = RemoteError(ErrorCode.INVALID_OUTPUT, "odd", blob=b"\x00", when=(1, 2))
    assert error_data(exc) == {
        "code": "INVALID_OUTPUT",
        "message": "odd",
        "details": {"blob": "b'\\x00'", "when": [1, 2]},
    }
