"""Every refusal is answered: an envelope over the decoder's limits (a string over 1 MiB, an
array or map over 65,536 items, nesting past 32 levels) fails at once at an honest sender,
before anything is written, and a receiver that gets one anyway (from another
implementation) answers a request it can attribute with the limit's typed error instead of
leaving the requester to time out (docs/protocol/node.md, "Refusals")."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.agent.definition import Agent
from p2pnode.core.envelope import (
    MAX_PAYLOAD_DEPTH,
    Envelope,
    EnvelopeFactory,
    MessageType,
    Metadata,
    envelope_header_untrusted,
    payload_limit_error,
)
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.wire import DEFAULT_LIMITS, pack
from p2pnode.node.events import EventKind
from p2pnode.node.frames import (
    EnvelopeBatch,
    Refused,
    decode_frame_untrusted,
    encode_envelope,
    encode_envelopes,
)
from p2pnode.node.routing import PendingRequest
from p2pnode.runtime import Node
from tests.sim import FAST_NODE, Inbox, met, open_swarm, wait_until
from tests.strategies import envelopes

MIB = 1024 * 1024


def nested(depth: int) -> Any:
    """A payload of ``depth`` nested arrays (0: a scalar)."""
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


#: A request's metadata naming the capability a ``tools/call`` payload is for.
TOOLS_CALL = Metadata(capability="tools/call")


def tool_call(argument: Any) -> dict[str, Any]:
    """A ``tools/call`` request's payload (its params) with ``argument`` in its arguments."""
    return {"name": "echo", "arguments": {"s": argument}}


#: The three findings: each is over exactly one limit, with the code it is refused with.
OVER_LIMITS = [
    pytest.param("x" * 1_500_000, ErrorCode.MESSAGE_TOO_LARGE, "string", id="string-1.5MB"),
    pytest.param(nested(40), ErrorCode.NESTING_TOO_DEEP, "depth", id="nesting-40"),
    pytest.param([0] * 70_000, ErrorCode.TOO_MANY_ITEMS, "array", id="items-70000"),
]


class Pair(NamedTuple):
    owner: Node  # hosts "calc" (and "quiet", an inbox)
    caller: Node  # hosts "user"


def calc_agent() -> Agent:
    calc = Agent("calc", tier=2)

    @calc.tool()
    def echo(s: Any) -> Any:
        return s

    return calc


@asynccontextmanager
async def pair() -> AsyncIterator[Pair]:
    async with open_swarm(2) as sw:
        owner, caller = sw.nodes
        await owner.add_agent(calc_agent())
        await owner.add_agent("quiet", Inbox(), tier=2)
        await caller.add_agent("user", Inbox(), tier=2)
        await caller.connect(owner.listen_address)
        await wait_until(lambda: met(owner, caller))
        yield Pair(owner, caller)


def security_codes(node: Node) -> list[str | None]:
    return [e.code for e in node.events.recent(kind=EventKind.SECURITY)]


# -- an honest sender refuses at once, before anything is written --------------------------------


@pytest.mark.parametrize(("argument", "code", "bound"), OVER_LIMITS)
async def test_an_over_limit_request_fails_at_the_sender_before_anything_is_sent(
    autojump_clock: Any, argument: Any, code: ErrorCode, bound: str
) -> None:
    async with pair() as nodes:
        received = nodes.owner.events.metrics().to_dict()["totalMessagesReceived"]
        for payload in ({"s": argument}, tool_call(argument)):
            started = trio.current_time()
            with pytest.raises(LocalError) as info:
                await nodes.caller.request("user", "calc", payload, metadata=TOOLS_CALL)
            assert trio.current_time() - started < 0.01  # no wait for a timeout
            assert info.value.code is code
            assert info.value.details["bound"] == bound
            assert info.value.details["limit"] in (DEFAULT_LIMITS.max_str_len, 65_536, 29)
        # Nothing reached the owner: no message, no blame.
        assert nodes.owner.events.metrics().to_dict()["totalMessagesReceived"] == received
        assert security_codes(nodes.owner) == []
        answer = await nodes.caller.request("user", "calc", tool_call("ok"), metadata=TOOLS_CALL)
        assert answer.type is MessageType.RESPONSE


async def test_an_over_limit_notification_and_broadcast_fail_at_the_sender(
    autojump_clock: Any,
) -> None:
    async with pair() as nodes:
        for recipient in ("quiet", "*"):
            note = nodes.caller.envelope("user", recipient, MessageType.NOTIFICATION, nested(40))
            with pytest.raises(LocalError) as info:
                await nodes.caller.send(note)
            assert info.value.code is ErrorCode.NESTING_TOO_DEEP
        with pytest.raises(LocalError) as info:
            await nodes.caller.send_many(
                [
                    nodes.caller.envelope("user", "quiet", MessageType.NOTIFICATION, "fine"),
                    nodes.caller.envelope("user", "quiet", MessageType.NOTIFICATION, [0] * 70_000),
                ]
            )
        assert info.value.code is ErrorCode.TOO_MANY_ITEMS
        assert security_codes(nodes.owner) == []


# -- a receiver answers what another implementation sends anyway -----------------------------------


async def raw_request(nodes: Pair, payloads: list[Any], batch: bool) -> list[Envelope]:
    """Requests from "user" to "calc" written straight to the channel, past the sender's
    checks (as a peer of another implementation would), and the replies they get."""
    caller = nodes.caller
    requests = [
        caller.envelope("user", "calc", MessageType.REQUEST, p, metadata=TOOLS_CALL)
        for p in payloads
    ]
    pendings = []
    for request in requests:
        pending = caller.routing.pending[request.id] = PendingRequest()
        pending.deadline = trio.current_time() + FAST_NODE.request_timeout
        pendings.append(pending)
    link = caller.links.link(nodes.owner.peer_id)
    frames = [encode_envelopes(requests)] if batch else [encode_envelope(r) for r in requests]
    for frame in frames:
        await link.send(frame)
    replies = []
    for request, pending in zip(requests, pendings, strict=True):
        await pending.event.wait()
        del caller.routing.pending[request.id]
        assert pending.reply is not None, f"no reply to {request.payload!r:.40}"
        replies.append(pending.reply)
    return replies


@pytest.mark.parametrize("batch", [False, True], ids=["envelope", "envelopes"])
@pytest.mark.parametrize(("argument", "code", "bound"), OVER_LIMITS)
async def test_an_over_limit_request_from_another_implementation_is_answered(
    autojump_clock: Any, argument: Any, code: ErrorCode, bound: str, batch: bool
) -> None:
    async with pair() as nodes:
        started = trio.current_time()
        with trio.fail_after(FAST_NODE.request_timeout / 2):
            refused, answered = await raw_request(
                nodes, [tool_call(argument), tool_call("fine")], batch
            )
        assert trio.current_time() - started < 0.5  # answered, not timed out
        assert refused.type is MessageType.ERROR and refused.sender == "calc"
        assert refused.payload["code"] == code
        assert refused.payload["details"]["bound"] == bound
        assert refused.payload["details"]["limit"] in (DEFAULT_LIMITS.max_str_len, 65_536, 32)
        # The other request of the same frame (or of the next one) is served as usual.
        assert answered.type is MessageType.RESPONSE
        assert code in security_codes(nodes.owner)
        assert nodes.owner.boundary.stats.unexpected == {}


async def test_an_over_limit_envelope_that_cannot_be_attributed_gets_no_reply(
    autojump_clock: Any,
) -> None:
    async with pair() as nodes:
        link = nodes.caller.links.link(nodes.owner.peer_id)
        factory = EnvelopeFactory()
        forged = factory.create("calc", "quiet", MessageType.REQUEST, nested(40))  # not its agent
        note = factory.create("user", "quiet", MessageType.NOTIFICATION, nested(40))
        junk = pack([1, {"id": ["not", "an", "id"], "payload": nested(40)}])
        before = nodes.caller.events.metrics().to_dict()["totalMessagesReceived"]
        for frame in (encode_envelope(forged), encode_envelope(note), junk):
            await link.send(frame)
        await wait_until(lambda: len(security_codes(nodes.owner)) >= 4)
        codes = security_codes(nodes.owner)
        assert codes.count("NESTING_TOO_DEEP") == 2  # the forged request and the note
        assert "SENDER_MISMATCH" in codes  # the forged request's sender
        assert "MALFORMED_MESSAGE" in codes  # the junk, as before
        await trio.sleep(FAST_NODE.request_timeout / 4)
        assert nodes.caller.events.metrics().to_dict()["totalMessagesReceived"] == before
        assert nodes.owner.boundary.stats.unexpected == {}


async def test_a_refused_request_written_twice_is_answered_once(autojump_clock: Any) -> None:
    async with pair() as nodes:
        request = nodes.caller.envelope("user", "calc", MessageType.REQUEST, nested(40))
        link = nodes.caller.links.link(nodes.owner.peer_id)
        await link.send(encode_envelope(request))
        await link.send(encode_envelope(request))
        await wait_until(lambda: security_codes(nodes.owner).count("NESTING_TOO_DEEP") == 2)
        refusals = [
            e
            for e in nodes.owner.events.recent(kind=EventKind.MESSAGE_SENT)
            if e.recipient == "user"
        ]
        assert len(refusals) == 1


# -- the sender's check and the receiver's decoder agree -------------------------------------------


@pytest.mark.parametrize("depth", range(MAX_PAYLOAD_DEPTH - 2, MAX_PAYLOAD_DEPTH + 4))
@pytest.mark.parametrize("batch", [False, True], ids=["envelope", "envelopes"])
def test_what_the_sender_admits_every_frame_kind_carries(depth: int, batch: bool) -> None:
    factory = EnvelopeFactory()
    envelope = factory.create("user", "calc", MessageType.REQUEST, nested(depth))
    frame = encode_envelopes([envelope] * 2) if batch else encode_envelope(envelope)
    decoded = decode_frame_untrusted(frame)
    admitted = payload_limit_error(envelope.payload) is None
    assert admitted == (depth <= MAX_PAYLOAD_DEPTH)
    if admitted:  # whatever the sender lets go, the receiver decodes, in either kind
        assert decoded == (EnvelopeBatch((envelope, envelope)) if batch else envelope)


@pytest.mark.parametrize(
    ("payload", "admitted"),
    [
        pytest.param("x" * MIB, True, id="string-at-limit"),
        pytest.param("x" * (MIB + 1), False, id="string-over"),
        pytest.param("é" * (MIB // 2), True, id="two-byte-string-at-limit"),
        pytest.param("é" * (MIB // 2 + 1), False, id="two-byte-string-over"),
        pytest.param(b"x" * (MIB + 1), True, id="binary-within-4MiB"),
        pytest.param([0] * 65_536, True, id="array-at-limit"),
        pytest.param({"a": [0] * 65_537}, False, id="array-over"),
        pytest.param({str(i): 0 for i in range(65_537)}, False, id="map-over"),
    ],
)
def test_the_senders_length_checks_match_the_decoder(payload: Any, admitted: bool) -> None:
    envelope = EnvelopeFactory().create("user", "calc", MessageType.REQUEST, payload)
    assert (payload_limit_error(payload) is None) == admitted
    decoded = decode_frame_untrusted(encode_envelope(envelope))
    assert (decoded == envelope) == admitted


# -- the attribution decoder: any bytes, never an untyped exception --------------------------------


def over_limit(payload: Any) -> Any:
    return st.sampled_from(["x" * (MIB + 1), nested(33), [0] * 65_537]).map(
        lambda bad: {"ok": payload, "bad": bad}
    )


@settings(max_examples=150, deadline=None)
@given(st.lists(envelopes, min_size=1, max_size=4), st.data())
def test_over_limit_members_are_refused_by_header_and_the_rest_kept_untrusted(
    batch: list[Envelope], data: st.DataObject
) -> None:
    bad_at = data.draw(st.sets(st.integers(0, len(batch) - 1), min_size=1))
    sent = [
        Envelope(**{**_fields(e), "payload": data.draw(over_limit(e.payload))})
        if i in bad_at
        else e
        for i, e in enumerate(batch)
    ]
    frame = encode_envelopes(sent) if len(sent) > 1 else encode_envelope(sent[0])
    if len(frame) > DEFAULT_LIMITS.max_size:
        # Over the frame's own size no member is read: the frame is refused whole.
        with pytest.raises(RemoteError) as info:
            decode_frame_untrusted(frame)
        assert info.value.code is ErrorCode.MESSAGE_TOO_LARGE
        assert info.value.details["bound"] == "size"
        return
    decoded = decode_frame_untrusted(frame)
    assert isinstance(decoded, EnvelopeBatch)
    assert decoded.envelopes == tuple(e for i, e in enumerate(sent) if i not in bad_at)
    assert [r.envelope.id for r in decoded.refused] == [sent[i].id for i in sorted(bad_at)]
    for refused in decoded.refused:
        assert isinstance(refused, Refused) and refused.envelope.payload is None
        assert refused.error.code in (
            ErrorCode.MESSAGE_TOO_LARGE,
            ErrorCode.NESTING_TOO_DEEP,
            ErrorCode.TOO_MANY_ITEMS,
        )


def _fields(envelope: Envelope) -> dict[str, Any]:
    return {name: getattr(envelope, name) for name in Envelope.__dataclass_fields__}


@settings(max_examples=400, deadline=None)
@given(envelopes, st.data())
def test_any_bytes_are_a_frame_a_refusal_or_a_remote_error_untrusted(
    envelope: Envelope, data: st.DataObject
) -> None:
    frame = bytearray(encode_envelope(Envelope(**{**_fields(envelope), "payload": nested(40)})))
    for _ in range(data.draw(st.integers(0, 4))):  # tamper: flip, cut or insert bytes
        at = data.draw(st.integers(0, max(len(frame) - 1, 0)))
        action = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip" and frame:
            frame[at] ^= data.draw(st.integers(1, 255))
        elif action == "cut":
            del frame[at:]
        else:
            frame[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    raw = bytes(frame) if data.draw(st.booleans()) else data.draw(st.binary(max_size=64))
    try:
        decoded = decode_frame_untrusted(raw)
    except RemoteError:
        pass
    else:
        if isinstance(decoded, EnvelopeBatch):
            assert all(r.envelope.payload is None for r in decoded.refused)
    header = envelope_header_untrusted(raw)  # never raises
    assert header is None or isinstance(header, Envelope)
