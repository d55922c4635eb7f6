"""Property tests of the long-call rules (docs/protocol/node.md "Requests to an agent"):
``metadata.deadlineMs`` (1 ms to a day, an integer), the owner's min(requested, its own)
deadline, the progress payload any peer may send, and who may move a pending request's
deadline."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.core.envelope import (
    MAX_DEADLINE_MS,
    Envelope,
    EnvelopeError,
    MessageType,
    Metadata,
)
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.node.callcancel import owner_limit, requested_wait
from p2pnode.node.progress import PROGRESS_METADATA, Progress, progress_untrusted
from p2pnode.node.routing import PendingRequest

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)


def request(deadline: Any = None, *, present: bool = True) -> dict[str, Any]:
    meta: dict[str, Any] = {"capability": "tools/call"}
    if present:
        meta["deadlineMs"] = deadline
    return {
        "id": "r1", "schemaVersion": 1, "sender": "a", "recipient": "b", "type": "request",
        "timestamp": 1, "payload": None, "metadata": meta,
    }  # fmt: skip


@given(st.integers(min_value=1, max_value=MAX_DEADLINE_MS))
def test_an_integer_deadline_of_up_to_a_day_is_accepted_and_round_trips(ms: int) -> None:
    envelope = Envelope.from_dict_untrusted(request(ms))
    assert envelope.metadata is not None and envelope.metadata.deadline_ms == ms
    assert Envelope.from_dict_untrusted(envelope.to_dict()) == envelope


@given(
    st.integers(max_value=0)
    | st.integers(min_value=MAX_DEADLINE_MS + 1)
    | st.booleans()
    | st.floats()
    | st.text(max_size=4)
    | st.lists(st.integers(), max_size=2)
)
def test_any_other_deadline_is_an_invalid_envelope(value: Any) -> None:
    with pytest.raises(EnvelopeError) as caught:
        Envelope.from_dict_untrusted(request(value))
    assert caught.value.code is ErrorCode.INVALID_ENVELOPE
    assert "metadata.deadlineMs" in caught.value.message


def test_no_deadline_is_no_key_on_the_wire() -> None:
    envelope = Envelope.from_dict_untrusted(request(present=False))
    assert envelope.metadata is not None and envelope.metadata.deadline_ms is None
    assert "deadlineMs" not in envelope.to_dict()["metadata"]


@given(
    st.floats(min_value=0.001, max_value=86_400),
    st.none() | st.integers(min_value=1, max_value=MAX_DEADLINE_MS),
)
def test_the_owner_bounds_a_handler_by_the_shorter_deadline(own: float, asked: int | None) -> None:
    meta = Metadata(deadline_ms=asked)
    envelope = Envelope("r", "a", "b", MessageType.REQUEST, 1, None, None, meta)
    limit = owner_limit(own, envelope)
    assert limit == (own if asked is None else min(own, asked / 1000))


@given(st.floats(allow_nan=True) | st.integers() | st.booleans() | st.text(max_size=3))
def test_a_requested_wait_is_seconds_of_more_than_0_up_to_a_day(value: Any) -> None:
    valid = type(value) in (int, float) and 0 < value <= 86_400
    if valid:
        assert requested_wait(value) == float(value)
    else:
        with pytest.raises(LocalError) as caught:
            requested_wait(value)
        assert caught.value.code is ErrorCode.INVALID_ARGUMENT


def finite(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


@given(json_values)
def test_any_progress_payload_is_a_progress_or_dropped_never_an_exception(payload: Any) -> None:
    update = progress_untrusted(payload)
    shaped = (
        type(payload) is dict
        and finite(payload.get("progress"))
        and (payload.get("total") is None or finite(payload["total"]))
        and (payload.get("message") is None or type(payload["message"]) is str)
    )
    assert (update is not None) == shaped
    if update is not None:
        assert update.to_payload()["progress"] == payload["progress"]


def progress_from(sender: str, payload: Any) -> Envelope:
    return Envelope(
        "p1", sender, "asker", MessageType.NOTIFICATION, 1, payload, "r1", PROGRESS_METADATA
    )


@given(st.sampled_from(["owner", "stranger"]), json_values, st.floats(0, 1000))
def test_only_an_agent_the_request_went_to_moves_its_deadline(
    sender: str, payload: Any, now: float
) -> None:
    seen: list[Progress] = []
    pending = PendingRequest()
    pending.targets, pending.idle, pending.deadline = ("owner",), 10.0, now + 3
    pending.on_progress = seen.append
    pending.progressed(progress_from(sender, payload), now)
    moved = sender == "owner" and progress_untrusted(payload) is not None
    assert pending.deadline == (now + 10 if moved else now + 3)
    assert len(seen) == int(moved)
    assert not pending.event.is_set()  # progress never answers the request


def test_progress_after_the_reply_or_with_a_failing_callback_changes_nothing() -> None:
    def fail(update: Progress) -> None:
        raise RuntimeError("the caller's bug")

    pending = PendingRequest()
    pending.targets, pending.idle, pending.deadline = ("owner",), 10.0, 3.0
    pending.on_progress = fail
    pending.progressed(progress_from("owner", {"progress": 1}), 0.0)  # logged, not raised
    assert pending.deadline == 10.0
    pending.reply = progress_from("owner", None)
    pending.progressed(progress_from("owner", {"progress": 2}), 5.0)
    assert pending.deadline == 10.0


