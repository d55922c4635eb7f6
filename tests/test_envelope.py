"""Envelopes: structure, uniqueness, codecs, type and version checks, threads (Properties 6-9)."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.envelope import (
    ENVELOPE_OVERHEAD,
    SCHEMA_VERSION,
    Envelope,
    EnvelopeError,
    EnvelopeFactory,
    MessageType,
    Metadata,
    _well_formed_envelope,
    envelope_problems,
    payload_envelope_size,
)
from p2pnode.core.errors import ErrorCode, RemoteError
from p2pnode.core.threadstore import ThreadStore
from p2pnode.core.wire import pack
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


odd_values = (
    st.none()
    | st.booleans()
    | st.integers(-3, 2**64)
    | st.text(max_size=3)
    | st.binary(max_size=3)
    | st.lists(st.integers(), max_size=2)
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
)
ID_EDGES = ["", "a", "x" * 128, "x" * 129, 7, None, b"id"]
EDGES: dict[str, list[object]] = {
    "id": ID_EDGES,
    "sender": ID_EDGES,
    "recipient": ID_EDGES,
    "correlationId": ID_EDGES,
    "type": [*ALL_TYPES, "Request", "", None, 1, [], {}],  # unhashable ones once crashed
    "timestamp": [0, 1, 2**63 - 1, 2**63, -1, True, 1.5, "1"],
    "payload": [None, {"a": [1]}, b"\x00"],
    "metadata": [None, {}, [], "m"],
    "extra": [1],
    "tier": [-1, 0, 3, 4, True, "3", None, 2.0],
    "sandboxId": ID_EDGES,
    "routingHint": ["capability", "Capability", "", None, 1],
    "escalationJustification": ["", "why", "x" * 4096, "x" * 4097, None, 5],
    "other": [1],
}


def edge_or_odd(draw: st.DrawFn, key: str) -> object:
    return draw(st.sampled_from(EDGES[key]) | odd_values)


@st.composite
def mutated_plain_forms(draw: st.DrawFn) -> dict[str, object]:
    """Valid plain forms with some fields removed, or set to edge and odd values."""
    plain: dict[str, object] = draw(envelopes).to_dict()
    top = ["id", "sender", "recipient", "type", "timestamp", "payload", "correlationId"]
    for key in draw(st.lists(st.sampled_from([*top, "metadata", "extra"]), max_size=3)):
        if key in plain and draw(st.booleans()):
            del plain[key]
        else:
            plain[key] = edge_or_odd(draw, key)
    if draw(st.booleans()):
        existing = plain.get("metadata")
        meta: dict[str, object] = dict(existing) if isinstance(existing, dict) else {}
        keys = ["tier", "sandboxId", "routingHint", "escalationJustification", "other"]
        for key in draw(st.lists(st.sampled_from(keys), min_size=1, max_size=2)):
            meta[key] = edge_or_odd(draw, key)
        plain["metadata"] = meta
    return plain


def assert_decoders_agree(plain: dict[str, object]) -> None:
    # The receive path accepts a common valid form in one pass; anything it does not
    # accept goes through envelope_problems. Both routes must give the same answer.
    fast = _well_formed_envelope(plain)
    problems = envelope_problems(plain)
    assert fast is None or problems == []
    version = plain.get("schemaVersion")
    if version != SCHEMA_VERSION or isinstance(version, bool):
        return
    if problems:
        with pytest.raises(EnvelopeError) as info:
            Envelope.from_dict_untrusted(plain)
        assert info.value.code is ErrorCode.INVALID_ENVELOPE
    else:
        decoded = Envelope.from_dict_untrusted(plain)
        assert decoded.to_dict() == {k: v for k, v in plain.items() if k != "metadata"} | (
            {"metadata": decoded.metadata.to_dict()} if decoded.metadata else {}
        )
        assert fast is None or fast == decoded


# 300 drawn forms: every edge value of EDGES is checked one by one below
# (test_fast_decode_agrees_on_each_edge_value), and the decoders' typed errors on
# arbitrary input are fuzzed by tests/test_fuzz.py (envelope.msgpack, envelope.json,
# envelope.dict) and by the random-bytes and truncation properties above.
@settings(max_examples=300)
@given(mutated_plain_forms())
def test_fast_decode_agrees_with_the_full_validator(plain: dict[str, object]) -> None:
    assert_decoders_agree(plain)


META_KEYS = {"tier", "sandboxId", "routingHint", "escalationJustification", "other"}


@pytest.mark.parametrize(("key", "value"), [(k, v) for k, values in EDGES.items() for v in values])
def test_fast_decode_agrees_on_each_edge_value(key: str, value: object) -> None:
    base = EnvelopeFactory().create(
        "a", "b", MessageType.REQUEST, {"q": 1}, correlation_id="c", metadata=Metadata(1, "s")
    )
    plain = base.to_dict()
    if key in META_KEYS:
        plain["metadata"] = {**plain["metadata"], key: value}
    else:
        plain[key] = value
    assert_decoders_agree(plain)
    del plain["metadata"]
    assert_decoders_agree(plain)


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


@pytest.mark.parametrize("payload", ["NaN", "[1, -Infinity]", '{"n": ' + "9" * 30 + "}", "1e999"])
def test_json_payload_no_encoder_could_send_is_rejected(payload: str) -> None:
    # JSON text can carry NaN and integers past 64 bits; an envelope holding them used to be
    # accepted and then fail with LocalError when encoded to be forwarded.
    env = EnvelopeFactory().create("a", "b", MessageType.NOTIFICATION, 0)
    text = env.to_json().replace('"payload":0', f'"payload":{payload}')
    with pytest.raises(EnvelopeError) as info:
        Envelope.from_json_untrusted(text)
    assert info.value.code is ErrorCode.INVALID_ENVELOPE


def test_json_payload_with_64_bit_extremes_is_accepted() -> None:
    payload = [-(2**63), 2**64 - 1, 1.5]
    env = EnvelopeFactory().create("a", "b", MessageType.NOTIFICATION, payload)
    decoded = Envelope.from_json_untrusted(env.to_json())
    assert decoded == env
    assert Envelope.from_msgpack_untrusted(decoded.to_msgpack()) == env


def _reference_size(value: object) -> int:
    """The size rule of docs and budgets, written plainly: strings and bytes by their
    length, a map by its keys and values, a list 16 plus its items, anything else 16."""
    if isinstance(value, str | bytes | bytearray):
        return len(value)
    if isinstance(value, dict):
        return sum(_reference_size(k) + _reference_size(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return 16 + sum(_reference_size(v) for v in value)
    return 16


@given(json_values | st.dictionaries(st.binary(max_size=4), json_values, max_size=4))
def test_payload_size_follows_the_reference_rule(payload: object) -> None:
    assert payload_envelope_size(payload) == ENVELOPE_OVERHEAD + _reference_size(payload)


def test_the_hand_written_init_takes_every_field_with_its_default_and_stays_frozen() -> None:
    parameters = list(inspect.signature(Envelope.__init__).parameters.values())[1:]
    fields = dataclasses.fields(Envelope)
    assert [p.name for p in parameters] == [f.name for f in fields]
    for parameter, field in zip(parameters, fields, strict=True):
        missing = field.default is dataclasses.MISSING
        assert parameter.default == (inspect.Parameter.empty if missing else field.default)
    env = Envelope("i", "s", "r", MessageType.REQUEST, 1, "payload", "c")
    assert env == dataclasses.replace(env) and hash(env) == hash(dataclasses.replace(env))
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.id = "other"  # type: ignore[misc]
