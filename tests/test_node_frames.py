"""Node frames: HELLO, ENVELOPE and ENVELOPES round trips; bad bytes are typed errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.card import AgentCard
from p2pnode.core.envelope import Envelope, EnvelopeFactory, MessageType
from p2pnode.core.errors import ErrorCode, RemoteError
from p2pnode.core.identity import Identity
from p2pnode.core.wire import array_header, pack
from p2pnode.node.channels import frame_cost
from p2pnode.node.frames import (
    MAX_INCARNATION,
    EnvelopeBatch,
    FrameKind,
    Hello,
    decode_frame_untrusted,
    encode_envelope,
    encode_envelopes,
    encode_hello,
    merge_envelope_frames,
)
from tests.strategies import addresses, cards, envelopes

OWNER = Identity(bytes(range(32)))


@settings(max_examples=200)
@given(envelopes)
def test_envelope_frame_round_trip(envelope: Envelope) -> None:
    assert decode_frame_untrusted(encode_envelope(envelope)) == envelope


@settings(max_examples=200)
@given(st.lists(envelopes, max_size=20))
def test_envelopes_frame_round_trip_keeps_order(batch: list[Envelope]) -> None:
    decoded = decode_frame_untrusted(encode_envelopes(batch))
    assert decoded == EnvelopeBatch(tuple(batch))


@settings(max_examples=50, deadline=None)
@given(
    st.lists(cards(OWNER), max_size=3),
    st.lists(addresses, max_size=3),
    st.none() | st.binary(min_size=1, max_size=MAX_INCARNATION),
)
def test_hello_frame_round_trip(
    hello_cards: list[AgentCard], hello_addresses: list[str], incarnation: bytes | None
) -> None:
    frame = encode_hello(hello_cards, hello_addresses, None, incarnation)
    decoded = decode_frame_untrusted(frame)
    assert decoded == Hello(tuple(hello_cards), tuple(hello_addresses), (), incarnation)


@given(st.one_of(
    st.just(b""), st.binary(min_size=MAX_INCARNATION + 1, max_size=64),
    st.integers(-(2**63), 2**64 - 1), st.text(max_size=8), st.lists(st.booleans(), max_size=2),
))  # fmt: skip
def test_a_hello_whose_incarnation_is_not_1_to_32_bytes_is_malformed(bad: object) -> None:
    with pytest.raises(RemoteError) as info:
        decode_frame_untrusted(pack([FrameKind.HELLO, {"cards": [], "incarnation": bad}]))
    assert info.value.code is ErrorCode.MALFORMED_MESSAGE
    assert "incarnation" in info.value.message


@settings(max_examples=200)
@given(st.lists(envelopes, min_size=1, max_size=8), st.data())
def test_bad_members_of_an_envelopes_frame_are_reported_and_the_rest_kept(
    batch: list[Envelope], data: st.DataObject
) -> None:
    plain: list[object] = [e.to_dict() for e in batch]
    bad_at = data.draw(st.sets(st.integers(0, len(plain) - 1)))
    for i in bad_at:
        plain[i] = data.draw(
            st.sampled_from([{"schemaVersion": 1}, {**batch[i].to_dict(), "type": "x"}, 7, []])
        )
    decoded = decode_frame_untrusted(pack([FrameKind.ENVELOPES, plain]))
    assert isinstance(decoded, EnvelopeBatch)
    assert decoded.envelopes == tuple(e for i, e in enumerate(batch) if i not in bad_at)
    assert len(decoded.rejected) == len(bad_at)
    assert all(isinstance(exc, RemoteError) for exc in decoded.rejected)


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_random_bytes_raise_only_remote_errors(data: bytes) -> None:
    try:
        decode_frame_untrusted(data)
    except RemoteError:
        pass


@pytest.mark.parametrize(
    "obj",
    [
        [9, {}],  # unknown kind
        [FrameKind.ENVELOPES, {"not": "a list"}],
        [FrameKind.HELLO, []],
        [FrameKind.HELLO, {"cards": [b"junk"]}],
        [FrameKind.ENVELOPE],
        {"kind": 1},
    ],
)
def test_malformed_frames_are_typed_errors(obj: object) -> None:
    with pytest.raises(RemoteError) as info:
        decode_frame_untrusted(pack(obj))
    assert info.value.code is ErrorCode.MALFORMED_MESSAGE


def test_hello_keeps_only_addresses_a_node_can_dial() -> None:
    # "host:²" passed str.isdigit() and then made int() raise ValueError in the node's
    # address parser; a port past 65535 made dialing raise CONFIG_ERROR.
    announced = ["10.0.0.1:7000", "host:\u00b2", "host:\u0663", "10.0.0.1:65536", ":7000",
                 "[::1]:7001", "h:1\n", "10.0.0.2:"]  # fmt: skip
    decoded = decode_frame_untrusted(encode_hello([], announced))
    assert decoded == Hello((), ("10.0.0.1:7000", "[::1]:7001"))


def _delivered(frames: list[bytes]) -> list[object]:
    """What a receiver gets from ``frames``: envelopes one by one, other frames whole."""
    out: list[object] = []
    for frame in frames:
        decoded = decode_frame_untrusted(frame)
        out.extend(decoded.envelopes if isinstance(decoded, EnvelopeBatch) else [decoded])
    return out


_frames = st.lists(
    st.one_of(
        envelopes.map(encode_envelope),
        envelopes.map(encode_envelope),
        st.lists(envelopes, min_size=2, max_size=3).map(encode_envelopes),
        st.just(encode_hello([], ["127.0.0.1:1"])),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(_frames, st.integers(200, 5_000))
def test_merged_frames_deliver_the_same_in_the_same_order(frames: list[bytes], limit: int) -> None:
    merged = merge_envelope_frames(frames, limit)
    assert _delivered(merged) == _delivered(frames)
    # Only runs of ENVELOPE frames merge, and never past the limit (unless one alone is).
    assert len(merged) <= len(frames)
    for frame in merged:
        assert len(frame) <= limit or frame in frames
    others = [f for f in frames if f[1] != FrameKind.ENVELOPE]
    assert [f for f in merged if f in others] == others


def test_a_long_run_of_envelope_frames_becomes_one_frame() -> None:
    factory = EnvelopeFactory()
    batch = [factory.create("a", "b", MessageType.NOTIFICATION, i) for i in range(300)]
    merged = merge_envelope_frames([encode_envelope(e) for e in batch])
    assert len(merged) == 1
    assert decode_frame_untrusted(merged[0]) == EnvelopeBatch(tuple(batch))
    assert frame_cost(merged[0]) == 300  # the receiver's bucket reads the count


@pytest.mark.parametrize("count", [0, 1, 15, 16, 65_535, 65_536])
def test_array_header_joins_packed_items_as_pack_would(count: int) -> None:
    items = [i % 7 for i in range(count)]
    joined = array_header(count) + b"".join(pack(i) for i in items)
    assert joined == pack(items)
