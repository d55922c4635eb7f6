"""The relay's control messages, relayed addresses and rules, sans-IO: round trips,
hostile bytes, signatures, timestamps and limits with a hand-stepped clock."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode, RemoteError
from p2pnode.core.identity import Identity, PeerId
from p2pnode.core.wire import canonical_pack
from p2pnode.transport.relay import (
    MAX_CONTROL_FRAME,
    TOKEN_BYTES,
    Accept,
    CircuitEnd,
    CircuitMeter,
    Connect,
    ControlMessage,
    ControlReader,
    Incoming,
    Ok,
    Refused,
    RelayCore,
    RelayError,
    RelayLimits,
    RelayRefusal,
    RelayRefusedError,
    Reserve,
    decode_message_untrusted,
    encode_message,
    format_relay_address,
    parse_relay_address,
    reserve_message,
)

RELAY = Identity(b"\x20" * 32).peer_id
TARGET = Identity(b"\x21" * 32)
WALL_MS = 1_750_000_000_000

peer_ids = st.binary(min_size=20, max_size=20).map(PeerId)
tokens = st.binary(min_size=TOKEN_BYTES, max_size=TOKEN_BYTES)
u32 = st.integers(0, 2**32 - 1)
messages: st.SearchStrategy[ControlMessage] = st.one_of(
    st.builds(
        Reserve,
        st.binary(min_size=32, max_size=32),
        st.integers(0, 2**63 - 1),
        st.binary(min_size=64, max_size=64),
    ),
    st.builds(Connect, peer_ids),
    st.builds(Accept, tokens),
    st.builds(Incoming, tokens),
    st.builds(Ok, u32, u32, st.integers(0, 2**63 - 1)),
    st.builds(Refused, st.sampled_from(RelayRefusal), u32),
)


@given(st.lists(messages, min_size=1, max_size=5), st.binary(max_size=64), st.integers(1, 40))
def test_messages_round_trip_in_any_chunking(
    sent: list[ControlMessage], rest: bytes, chunk: int
) -> None:
    data = b"".join(encode_message(m) for m in sent) + rest
    reader = ControlReader()
    got: list[ControlMessage] = []
    for i in range(0, len(data), chunk):
        reader.receive_data_untrusted(data[i : i + chunk])
        while len(got) < len(sent) and (message := reader.next_message_untrusted()) is not None:
            got.append(message)
    assert got == sent
    assert reader.take_rest() == rest  # what follows the frames is the relayed stream


@given(st.binary(max_size=600))
def test_any_body_decodes_or_raises_remote_error(body: bytes) -> None:
    try:
        decode_message_untrusted(body)
    except RemoteError as exc:
        assert exc.code in {
            ErrorCode.MALFORMED_MESSAGE,
            ErrorCode.MESSAGE_TOO_LARGE,
            ErrorCode.INVALID_PEER_ID,
            ErrorCode.NESTING_TOO_DEEP,
            ErrorCode.TOO_MANY_ITEMS,
        }


@given(messages, st.data())
def test_tampered_fields_raise_typed_errors(message: ControlMessage, data: st.DataObject) -> None:
    body = bytearray(encode_message(message)[2:])
    position = data.draw(st.integers(0, len(body) - 1))
    body[position] ^= data.draw(st.integers(1, 255))
    try:
        decode_message_untrusted(bytes(body))
    except RemoteError:
        pass


@given(st.binary(max_size=1200))
def test_reader_takes_any_bytes_with_typed_errors(data: bytes) -> None:
    reader = ControlReader()
    try:
        reader.receive_data_untrusted(data)
        for _ in range(len(data)):  # bounded: a frame takes at least 3 bytes
            if reader.next_message_untrusted() is None:
                break
    except RemoteError:
        pass


def test_oversized_and_empty_frames() -> None:
    reader = ControlReader()
    reader.receive_data_untrusted((MAX_CONTROL_FRAME + 1).to_bytes(2, "big"))
    with pytest.raises(RelayError) as caught:
        reader.next_message_untrusted()
    assert caught.value.code is ErrorCode.MESSAGE_TOO_LARGE
    reader = ControlReader()
    reader.receive_data_untrusted(b"\x00\x00" + b"x" * 10)
    with pytest.raises(RelayError) as caught:
        reader.next_message_untrusted()
    assert caught.value.code is ErrorCode.MALFORMED_MESSAGE


@pytest.mark.parametrize(
    "obj",
    [
        [1, 2],
        {"t": "nope"},
        {"t": "connect", "target": b"short"},
        {"t": "accept", "token": "text, not bytes"},
        {"t": "ok", "ttl": -1, "duration": 0, "data": 0},
        {"t": "ok", "ttl": True, "duration": 0, "data": 0},
        {"t": "refused", "reason": 7, "retry": 0},
        {"t": "reserve", "key": b"k" * 32, "ts": 1},  # no signature
    ],
)
def test_malformed_messages(obj: object) -> None:
    with pytest.raises(RelayError) as caught:
        decode_message_untrusted(canonical_pack(obj))
    assert caught.value.code is ErrorCode.MALFORMED_MESSAGE


def test_unknown_reason_and_unknown_keys() -> None:
    body = canonical_pack({"t": "refused", "reason": "SOMETHING_NEW", "retry": 3, "extra": 1})
    assert decode_message_untrusted(body) == Refused(RelayRefusal.OTHER, 3)


# --- relayed addresses --------------------------------------------------------------


@given(
    st.one_of(
        st.ip_addresses().map(str), st.from_regex(r"[a-z][a-z0-9.-]{0,20}", fullmatch=True)
    ),
    st.integers(0, 65535),
    peer_ids,
)
def test_relay_address_round_trip(host: str, port: int, relay_id: PeerId) -> None:
    text = format_relay_address((host, port), relay_id)
    parsed = parse_relay_address(text)
    assert parsed is not None
    assert parsed.address == (host, port) and parsed.relay_id == relay_id
    assert str(parsed) == text


@pytest.mark.parametrize(
    "text",
    [
        "10.0.0.1:4000",  # an ordinary address: not relayed
        "relay:10.0.0.1:4000",  # no relay id
        "relay:10.0.0.1:99999/" + str(RELAY),  # port out of range
        "relay:10.0.0.1:4000/not-a-peer-id",
        "relay:/" + str(RELAY),
        42,
        None,
    ],
)
def test_other_address_forms_are_skipped(text: object) -> None:
    assert parse_relay_address(text) is None


@given(st.text(max_size=80))
def test_parse_relay_address_never_raises(text: str) -> None:
    parse_relay_address(text)
    parse_relay_address("relay:" + text)


# --- the rules -------------------------------------------------------------------------


def core(**limits: float) -> RelayCore:
    counter = itertools.count()
    return RelayCore(
        RELAY,
        RelayLimits(**limits),  # type: ignore[arg-type]
        token_bytes=lambda n: next(counter).to_bytes(n, "big"),
    )


def refusal(reason: RelayRefusal) -> pytest.RaisesExc[RelayRefusedError]:
    return pytest.raises(RelayRefusedError, check=lambda e: e.reason is reason)


def test_reserve_signature_binds_relay_and_time() -> None:
    c = core()
    other_relay = Identity(b"\x22" * 32).peer_id
    with refusal(RelayRefusal.BAD_RESERVATION):  # signed for another relay
        c.reserve_untrusted(
            reserve_message(TARGET, other_relay, WALL_MS), "1.2.3.4", 0.0, WALL_MS, generation=None
        )
    stale = reserve_message(TARGET, RELAY, WALL_MS - 121_000)
    with refusal(RelayRefusal.BAD_RESERVATION):
        c.reserve_untrusted(stale, "1.2.3.4", 0.0, WALL_MS, generation=None)
    good = reserve_message(TARGET, RELAY, WALL_MS)
    forged = Reserve(good.public_key, good.timestamp_ms + 1, good.signature)
    with refusal(RelayRefusal.BAD_RESERVATION):
        c.reserve_untrusted(forged, "1.2.3.4", 0.0, WALL_MS, generation=None)
    granted = c.reserve_untrusted(good, "1.2.3.4", 0.0, WALL_MS, generation=None)
    assert granted.peer_id == TARGET.peer_id and granted.expires == 300.0
    with refusal(RelayRefusal.BAD_RESERVATION):  # a replay of the same RESERVE
        c.reserve_untrusted(good, "6.6.6.6", 1.0, WALL_MS, generation=None)
    assert c.holds(TARGET.peer_id, granted.generation)
    assert c.statistics().refusals == {RelayRefusal.BAD_RESERVATION: 4}


def test_renewal_extends_and_replacement_takes_over() -> None:
    c = core()
    first = c.reserve_untrusted(
        reserve_message(TARGET, RELAY, WALL_MS), "1.2.3.4", 0.0, WALL_MS, generation=None
    )
    renewed = c.reserve_untrusted(
        reserve_message(TARGET, RELAY, WALL_MS + 1),
        "1.2.3.4", 100.0, WALL_MS, generation=first.generation,
    )  # fmt: skip
    assert renewed.generation == first.generation and renewed.expires == 400.0
    newer = c.reserve_untrusted(
        reserve_message(TARGET, RELAY, WALL_MS + 2), "5.6.7.8", 101.0, WALL_MS, generation=None
    )
    assert not c.holds(TARGET.peer_id, first.generation)
    with refusal(RelayRefusal.BAD_RESERVATION):  # the replaced stream cannot renew
        c.reserve_untrusted(
            reserve_message(TARGET, RELAY, WALL_MS + 3),
            "1.2.3.4", 102.0, WALL_MS, generation=first.generation,
        )  # fmt: skip
    c.release(TARGET.peer_id, first.generation)  # the old stream ends: nothing changes
    assert c.holds(TARGET.peer_id, newer.generation)
    c.release(TARGET.peer_id, newer.generation)
    assert c.statistics().reservations == 0


def test_circuit_bookkeeping() -> None:
    c = core(max_circuits_per_reservation=2, pending_timeout=5.0)
    with refusal(RelayRefusal.NO_RESERVATION):
        c.connect(TARGET.peer_id, "9.9.9.9", 0.0)
    c.reserve_untrusted(
        reserve_message(TARGET, RELAY, WALL_MS), "1.2.3.4", 0.0, WALL_MS, generation=None
    )
    a = c.connect(TARGET.peer_id, "9.9.9.9", 1.0)
    b = c.connect(TARGET.peer_id, "9.9.9.9", 1.0)
    with refusal(RelayRefusal.CONNECTION_LIMIT):
        c.connect(TARGET.peer_id, "9.9.9.9", 1.0)
    assert c.accept(a.token, 2.0) == a
    with refusal(RelayRefusal.UNKNOWN_TOKEN):  # accepted once only
        c.accept(a.token, 2.0)
    with refusal(RelayRefusal.UNKNOWN_TOKEN):  # past its deadline
        c.accept(b.token, 6.5)
    c.abandon(b.token)
    c.circuit_closed(TARGET.peer_id, CircuitEnd.DATA_LIMIT)
    stats = c.statistics()
    assert stats.circuits == 0 and stats.circuits_opened == 1
    assert stats.circuit_ends == {CircuitEnd.DATA_LIMIT: 1}
    with refusal(RelayRefusal.NO_RESERVATION):  # expired reservation
        c.connect(TARGET.peer_id, "9.9.9.9", 301.0)


def test_rate_per_source_recovers() -> None:
    c = core(requests_per_ip=1.0, request_burst=2)
    for _ in range(2):
        with refusal(RelayRefusal.NO_RESERVATION):
            c.connect(TARGET.peer_id, "9.9.9.9", 0.0)
    with refusal(RelayRefusal.RATE_LIMITED):
        c.connect(TARGET.peer_id, "9.9.9.9", 0.0)
    with refusal(RelayRefusal.NO_RESERVATION):  # another source has its own bucket
        c.connect(TARGET.peer_id, "8.8.8.8", 0.0)
    with refusal(RelayRefusal.NO_RESERVATION):  # a second later, one more token
        c.connect(TARGET.peer_id, "9.9.9.9", 1.0)


def test_circuit_meter_budget_and_rate() -> None:
    meter = CircuitMeter(RelayLimits(circuit_data=1000, circuit_rate=100, circuit_burst=100), 0.0)
    assert meter.admit(100, 0.0) == 0.0
    assert meter.admit(50, 0.0) == pytest.approx(0.5)  # 50 bytes over the burst at 100 B/s
    assert meter.admit(900, 10.0) == -1.0  # past the 1000-byte budget
    unlimited = CircuitMeter(RelayLimits(circuit_rate=0), 0.0)
    assert unlimited.admit(10**6, 0.0) == 0.0


def test_limits_are_validated() -> None:
    with pytest.raises(Exception, match="must be positive"):
        RelayLimits(max_reservations=0)
    with pytest.raises(Exception, match="circuit_rate"):
        RelayLimits(circuit_rate=-1)
