"""Tool invocation records (Property 34): the JSON form round-trips exactly."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode, RemoteError
from p2pnode.services.tools.audit import ToolInvocation
from tests.strategies import ident_text, json_values

records = st.builds(
    ToolInvocation,
    tool=ident_text,
    agent_id=ident_text,
    arguments=json_values,
    result=json_values,
    error=st.none() | st.text(max_size=20),
    duration_ms=st.floats(0, 1e6, allow_nan=False) | st.integers(0, 10**6),
    started_at=st.integers(0, 2**45),
)


@settings(max_examples=200)
@given(records)
def test_invocation_record_json_round_trip(record: ToolInvocation) -> None:
    assert ToolInvocation.from_json_untrusted(record.to_json()) == record


@settings(max_examples=200)
@given(st.text(max_size=80))
def test_garbage_records_raise_remote_error(text: str) -> None:
    try:
        ToolInvocation.from_json_untrusted(text)
    except RemoteError as exc:
        assert exc.code is ErrorCode.MALFORMED_MESSAGE


def test_wrong_types_rejected() -> None:
    good = ToolInvocation("t", "a", {}, None, None, 1.0, 5).to_json()
    for bad in (
        good.replace('"startedAt":5', '"startedAt":"5"'),
        good.replace('"tool":"t"', '"tool":1'),
    ):
        with pytest.raises(RemoteError):
            ToolInvocation.from_json_untrusted(bad)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("result", "NaN"),
        ("result", "[1, -Infinity]"),
        ("arguments", '{"n": Infinity}'),
        ("arguments", "1" * 30),
        ("durationMs", "NaN"),
        ("durationMs", "1e999"),
        ("durationMs", "1" * 400),
    ],
)
def test_values_to_json_would_refuse_are_rejected(field: str, value: str) -> None:
    # An accepted record must encode again (the round trip of Property 34); these used to
    # pass, then to_json() raised LocalError; an integer durationMs past float range must
    # be refused too, without the OverflowError a float check on it would raise.
    good = ToolInvocation("t", "a", {}, None, None, 1.0, 5).to_json()
    defaults = {
        "result": '"result":null',
        "arguments": '"arguments":{}',
        "durationMs": '"durationMs":1.0',
    }
    bad = good.replace(defaults[field], f'"{field}":{value}')
    assert bad != good
    with pytest.raises(RemoteError) as info:
        ToolInvocation.from_json_untrusted(bad)
    assert info.value.code is ErrorCode.MALFORMED_MESSAGE
