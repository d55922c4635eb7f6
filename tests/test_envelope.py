"""Envelopes: structure, uniqueness, codecs, type and version checks, threads (Properties 6-9)."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.envelope import (
    SCHEMA_VERSION,
    Envelope,
    EnvelopeError,
    EnvelopeFactory,
    MessageType,
    Metadata,
    ThreadStore,
)
from p2pnode.errors import ErrorCode, RemoteError
from p2pnode.wire import pack
from tests.strategies import envelopes, ident_text, json_values

ALL_TYPES = [
    "request", "response", "notification", "task-proposal", "task-accept", "task-reject",
    "stream-start", "stream-data", "stream-end", "error",
]  # fmt: skip


def test_the_ten_message_types() -> None:
    assert sorted(t.value for t in MessageType) == sorted(ALL_TYPES)


@settings(max_examples=100)
@given(st.lists(st.tuples(ident_text, ident_text, st.sampled_from(list(MessageType))), max_size=50))
def test_factory_ids_unique_and_fields_present(specs: list[tuple[str, str, MessageType]]) -> None:
    ticks = itertools.count(1_700_000_000_000)
    factory = EnvelopeFactory(clock_ms=lambda: next(ticks))
    made = [factory.create(s, r, t, {"n": i}) for i, (s, r, t) in enumerate(specs)]
    assert len({e.id for e in made}) == len(made)
    for env in made:
        assert env.timestamp > 0
        assert env.schema_version == SCHEMA_VERSION
        assert set(env.to_dict()) >= {"id", "schemaVersion", "sender", "recipient", "type"}


def test_two_factories_do_not_collide() -> None:
    a, b = EnvelopeFactory(), EnvelopeFactory()
    ids = {a.create("x", "y", MessageType.REQUEST).id for _ in range(100)}
    ids |= {b.create("x", "y", MessageType.REQUEST).id for _ in range(100)}
    assert len(ids) == 200


@settings(max_examples=200)
@given(envelopes)
def test_json_round_trip(env: Envelope) -> None:
    decoded = Envelope.from_json_untrusted(env.to_json())
    assert decoded == env
    assert decoded.schema_version == SCHEMA_VERSION


@settings(max_examples=200)
@given(envelopes)
def test_msgpack_round_trip(env: Envelope) -> None:
    assert Envelope.from_msgpack_untrusted(env.to_msgpack()) == env


@given(envelopes, st.integers().filter(lambda v: v != SCHEMA_VERSION) | st.text(max_size=3))
def test_unknown_schema_version_names_expected_and_actual(env: Envelope, version: object) -> None:
    plain = env.to_dict()
    plain["schemaVersion"] = version
    with pytest.raises(EnvelopeError) as info:
        Envelope.from_dict_untrusted(plain)
    assert info.value.code is ErrorCode.SCHEMA_VERSION_MISMATCH
    assert info.value.details == {"expected": SCHEMA_VERSION, "actual": version}


@given(envelopes, st.text(max_size=15).filter(lambda t: t not in ALL_TYPES))
def test_unknown_type_is_rejected(env: Envelope, bad_type: str) -> None:
    plain = env.to_dict()
    plain["type"] = bad_type
    with pytest.raises(EnvelopeError) as info:
        Envelope.from_dict_untrusted(plain)
    assert info.value.code is ErrorCode.INVALID_ENVELOPE


@given(envelopes, st.sampled_from(["id", "sender", "recipient", "type", "timestamp", "payload"]))
def test_missing_field_is_rejected(env: Envelope, field: str) -> None:
    plain = env.to_dict()
    del plain[field]
    with pytest.raises(EnvelopeError, match=field):
        Envelope.from_dict_untrusted(plain)


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_remote_errors(data: bytes) -> None:
    with pytest.raises(RemoteError):
        Envelope.from_msgpack_untrusted(data)


@given(envelopes)
def test_truncations_raise_only_remote_errors(env: Envelope) -> None:
    data = env.to_msgpack()
    for cut in range(len(data)):
        with pytest.raises(RemoteError):
            Envelope.from_msgpack_untrusted(data[:cut])


@pytest.mark.parametrize(
    "patch",
    [
        {"timestamp": -5},
        {"timestamp": True},
        {"sender": ""},
        {"recipient": "r" * 500},
        {"metadata": {"tier": 7}},
        {"metadata": {"routingHint": "teleport"}},
        {"metadata": "nope"},
        {"extra": 1},
    ],
)
def test_wrongly_typed_fields_rejected(patch: dict[str, object]) -> None:
    env = EnvelopeFactory().create("a", "b", MessageType.NOTIFICATION, None)
    plain = env.to_dict() | patch
    with pytest.raises(EnvelopeError):
        Envelope.from_msgpack_untrusted(pack(plain))


def test_oversized_envelope_rejected() -> None:
    with pytest.raises(RemoteError) as info:
        Envelope.from_msgpack_untrusted(b"\xc6" + (5 * 1024 * 1024).to_bytes(4, "big") + b"x" * 10)
    assert info.value.code in (ErrorCode.MESSAGE_TOO_LARGE, ErrorCode.MALFORMED_MESSAGE)
    with pytest.raises(RemoteError):
        Envelope.from_json_untrusted("x" * (5 * 1024 * 1024))


def test_reply_threads_to_the_request() -> None:
    factory = EnvelopeFactory()
    request = factory.create("a", "b", MessageType.REQUEST, {"q": 1})
    response = factory.reply(request, "b", MessageType.RESPONSE, {"a": 2})
    assert response.recipient == "a"
    assert response.correlation_id == request.id


def test_non_json_payload_cannot_be_json_encoded() -> None:
    env = EnvelopeFactory().create("a", "b", MessageType.REQUEST, b"bytes")
    assert Envelope.from_msgpack_untrusted(env.to_msgpack()).payload == b"bytes"
    with pytest.raises(Exception, match="JSON"):
        env.to_json()
    json.loads(EnvelopeFactory().create("a", "b", MessageType.REQUEST, [1]).to_json())


@settings(max_examples=100)
@given(
    st.lists(
        st.tuples(st.sampled_from(["c1", "c2", "c3", None]), st.integers(1, 50), json_values),
        max_size=40,
    )
)
def test_thread_store_returns_exactly_the_thread_in_timestamp_order(
    items: list[tuple[str | None, int, object]],
) -> None:
    store = ThreadStore()
    made = []
    for i, (corr, ts, payload) in enumerate(items):
        env = Envelope(f"id{i}", "a", "b", MessageType.NOTIFICATION, ts, payload, corr)
        made.append(env)
        store.add(env)
    for corr in ("c1", "c2", "c3"):
        thread = store.thread(corr)
        expected = sorted((e for e in made if e.correlation_id == corr), key=lambda e: e.timestamp)
        assert thread == expected  # sorted() is stable: ties stay in arrival order


def test_thread_store_is_bounded() -> None:
    store = ThreadStore(max_threads=3, max_per_thread=2)
    for i in range(10):
        store.add(Envelope(f"{i}", "a", "b", MessageType.REQUEST, i + 1, None, f"t{i % 5}"))
    assert len(store) == 3
    assert all(len(store.thread(f"t{i}")) <= 2 for i in range(5))


def test_metadata_round_trip_keeps_escalation_justification() -> None:
    meta = Metadata(
        tier=3, sandbox_id="sb", routing_hint="capability", escalation_justification="why"
    )
    env = EnvelopeFactory().create("a", "b", MessageType.TASK_PROPOSAL, {}, metadata=meta)
    assert Envelope.from_json_untrusted(env.to_json()).metadata == meta
