"""The sans-IO RPC core: two cores back to back in memory, time stepped by hand."""

from __future__ import annotations

import heapq
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.dht import rpcwire
from p2pnode.dht.rpc import (
    Address,
    CallState,
    CallTimedOut,
    DatagramDropped,
    DropReason,
    ReplyReceived,
    RequestReceived,
    RpcCore,
    RpcEvent,
)

A: Address = ("10.0.0.1", 4000)
B: Address = ("10.0.0.2", 4000)
EVIL: Address = ("10.0.0.66", 4000)
A_ID = b"\xaa" * 20
B_ID = b"\xbb" * 20

VECTORS = json.loads(
    (Path(__file__).parent.parent / "vectors" / "kademlia" / "rpcudp_datagrams.json").read_text()
)


def _vector(name: str) -> bytes:
    return bytes.fromhex(next(d["hex"] for d in VECTORS["datagrams"] if d["name"] == name))


class FixedIds(random.Random):
    """An RNG whose ``randbytes`` returns the given ids in turn."""

    def __init__(self, ids: list[bytes]) -> None:
        super().__init__(0)
        self._ids: Iterator[bytes] = iter(ids)

    def randbytes(self, n: int) -> bytes:
        return next(self._ids)


def core(seed: int = 1, **kw: Any) -> RpcCore:
    return RpcCore(rng=random.Random(seed), **kw)


def one(events: list[RpcEvent]) -> RpcEvent:
    assert len(events) == 1, events
    return events[0]


def answer(server: RpcCore, data: bytes, source: Address, now: float, value: Any) -> bytes:
    """``server`` takes one request datagram and answers ``value``; the reply datagram."""
    request = one(server.receive_datagram_untrusted(data, source, now))
    assert isinstance(request, RequestReceived)
    server.reply(request, value)
    [(reply, to)] = server.datagrams_to_send()
    assert to == source
    return reply


# ---------------------------------------------------------------------- bytes and events


def test_call_and_reply_back_to_back_are_the_stock_bytes() -> None:
    msg_id = bytes.fromhex(VECTORS["msg_id_hex"])
    node_id = bytes.fromhex(VECTORS["node_id_hex"])
    a, b = RpcCore(rng=FixedIds([msg_id])), core(2)
    call = a.call(B, "ping", [node_id], now=10.0)
    assert (call.msg_id, call.address, call.method, call.deadline) == (msg_id, B, "ping", 15.0)
    [(request, to)] = a.datagrams_to_send()
    assert (request, to) == (_vector("ping request"), B)
    assert a.datagrams_to_send() == []

    event = one(b.receive_datagram_untrusted(request, A, 10.1))
    assert event == RequestReceived(msg_id, "ping", [node_id], A)
    b.reply(event, node_id)
    [(reply, to)] = b.datagrams_to_send()
    assert (reply, to) == (_vector("ping response"), A)

    got = one(a.receive_datagram_untrusted(reply, B, 10.25))
    assert isinstance(got, ReplyReceived)
    assert (got.msg_id, got.method, got.address, got.value) == (msg_id, "ping", B, node_id)
    assert got.rtt == pytest.approx(0.25)
    assert a.pending == 0 and a.next_deadline() is None
    assert a.state_of(msg_id) is None  # answered calls are not remembered


def test_message_ids_come_from_the_injected_rng() -> None:
    ids = [core(7).call(B, "ping", [A_ID], 0.0).msg_id for _ in range(2)]
    assert ids[0] == ids[1]  # same seed, same id: nothing else draws them
    a = core(7)
    many = {a.call(B, "ping", [A_ID], 0.0).msg_id for _ in range(100)}
    assert len(many) == 100 and all(len(m) == 20 for m in many)


def test_an_id_in_use_is_drawn_again_and_a_stuck_generator_is_an_error() -> None:
    x, y = b"\x01" * 20, b"\x02" * 20
    a = RpcCore(rng=FixedIds([x, x, y]))
    assert a.call(B, "ping", [A_ID], 0.0).msg_id == x
    assert a.call(B, "ping", [A_ID], 0.0).msg_id == y
    stuck = RpcCore(rng=FixedIds([x] * 10))
    stuck.call(B, "ping", [A_ID], 0.0)
    with pytest.raises(LocalError) as err:
        stuck.call(B, "ping", [A_ID], 0.0)
    assert err.value.code is ErrorCode.INTERNAL
    assert stuck.pending == 1


def test_replies_are_matched_in_any_order() -> None:
    a, b = core(1), core(2)
    calls = [a.call(B, "find_node", [A_ID, bytes([i]) * 20], 0.0) for i in range(3)]
    requests = a.datagrams_to_send()
    replies = [answer(b, data, A, 0.1, [i]) for i, (data, _) in enumerate(requests)]
    for i in (2, 0, 1):
        got = one(a.receive_datagram_untrusted(replies[i], B, 0.2))
        assert isinstance(got, ReplyReceived)
        assert (got.msg_id, got.value) == (calls[i].msg_id, [i])
    assert a.pending == 0


# ---------------------------------------------------------------------- matching rules


def test_a_reply_from_another_address_is_dropped_and_the_call_stays_pending() -> None:
    a, b = core(1), core(2)
    call = a.call(B, "ping", [A_ID], 0.0)
    [(request, _)] = a.datagrams_to_send()
    reply = answer(b, request, A, 0.1, B_ID)
    # An attacker that learned the id answers first, from its own address.
    spoof = one(a.receive_datagram_untrusted(rpcwire.encode_response(call.msg_id, b"x"), EVIL, 0.1))
    assert isinstance(spoof, DatagramDropped)
    assert (spoof.source, spoof.reason) == (EVIL, DropReason.WRONG_ADDRESS)
    assert a.state_of(call.msg_id) is CallState.PENDING
    got = one(a.receive_datagram_untrusted(reply, B, 0.2))
    assert isinstance(got, ReplyReceived) and got.value == B_ID


def test_a_duplicate_reply_counts_once() -> None:
    a, b = core(1), core(2)
    a.call(B, "ping", [A_ID], 0.0)
    [(request, _)] = a.datagrams_to_send()
    reply = answer(b, request, A, 0.1, B_ID)
    assert isinstance(one(a.receive_datagram_untrusted(reply, B, 0.2)), ReplyReceived)
    again = one(a.receive_datagram_untrusted(reply, B, 0.3))
    assert isinstance(again, DatagramDropped) and again.reason is DropReason.UNKNOWN_ID


def test_a_reply_nobody_asked_for_is_dropped() -> None:
    a = core(1)
    stray = one(a.receive_datagram_untrusted(rpcwire.encode_response(b"\x05" * 20, 1), B, 0.0))
    assert stray == DatagramDropped(B, DropReason.UNKNOWN_ID, DropReason.UNKNOWN_ID.value)


def test_timeouts_are_hard_and_a_late_reply_is_dropped() -> None:
    a, b = core(1, timeout=5.0), core(2)
    call = a.call(B, "ping", [A_ID], 1.0)
    [(request, _)] = a.datagrams_to_send()
    reply = answer(b, request, A, 1.1, B_ID)
    assert a.next_deadline() == 6.0
    assert a.handle_timer(5.999) == []
    assert a.handle_timer(6.0) == [CallTimedOut(call.msg_id, "ping", B)]
    assert a.handle_timer(7.0) == []
    assert a.next_deadline() is None and a.pending == 0
    late = one(a.receive_datagram_untrusted(reply, B, 6.5))
    assert isinstance(late, DatagramDropped) and late.reason is DropReason.LATE
    assert a.state_of(call.msg_id) is CallState.TIMED_OUT


def test_a_reply_processed_after_its_deadline_is_late_even_before_the_timer_ran() -> None:
    a, b = core(1, timeout=2.0), core(2)
    call = a.call(B, "ping", [A_ID], 0.0)
    [(request, _)] = a.datagrams_to_send()
    reply = answer(b, request, A, 0.5, B_ID)
    events = a.receive_datagram_untrusted(reply, B, 2.0)
    assert events[0] == CallTimedOut(call.msg_id, "ping", B)
    assert isinstance(events[1], DatagramDropped) and events[1].reason is DropReason.LATE
    assert len(events) == 2


def test_without_memory_every_stray_reply_is_unknown() -> None:
    a, b = core(1, remember=0), core(2)
    a.call(B, "ping", [A_ID], 0.0)
    [(request, _)] = a.datagrams_to_send()
    reply = answer(b, request, A, 0.1, B_ID)
    a.handle_timer(10.0)
    dropped = one(a.receive_datagram_untrusted(reply, B, 10.0))
    assert isinstance(dropped, DatagramDropped) and dropped.reason is DropReason.UNKNOWN_ID


def test_the_memory_of_finished_calls_is_bounded() -> None:
    a = core(1, remember=3)
    ids = [a.call(B, "ping", [A_ID], 0.0).msg_id for _ in range(5)]
    for msg_id in ids:
        assert a.cancel(msg_id)
    assert [a.state_of(m) for m in ids] == [None, None] + [CallState.ABANDONED] * 3


def test_a_cancelled_call_reports_nothing_and_its_reply_is_dropped() -> None:
    a, b = core(1), core(2)
    call = a.call(B, "find_value", [A_ID, B_ID], 0.0)
    [(request, _)] = a.datagrams_to_send()
    reply = answer(b, request, A, 0.1, [])
    assert a.cancel(call.msg_id) is True
    assert a.cancel(call.msg_id) is False
    assert a.handle_timer(100.0) == []
    dropped = one(a.receive_datagram_untrusted(reply, B, 100.0))
    assert isinstance(dropped, DatagramDropped) and dropped.reason is DropReason.ABANDONED


def test_deadlines_stay_in_order_when_the_clock_steps_back() -> None:
    a = core(1, timeout=5.0)
    first = a.call(B, "ping", [A_ID], 10.0)
    second = a.call(B, "ping", [A_ID], 9.0)  # a clock that stepped back
    assert second.deadline == first.deadline == a.next_deadline() == 15.0
    assert [e.msg_id for e in a.handle_timer(15.0)] == [first.msg_id, second.msg_id]


# ---------------------------------------------------------------------- limits and misuse


def test_max_pending_is_enforced_and_freed_by_replies_and_timeouts() -> None:
    a, b = core(1, max_pending=2, timeout=1.0), core(2)
    a.call(B, "ping", [A_ID], 0.0)
    a.call(B, "ping", [A_ID], 0.5)
    with pytest.raises(LocalError) as busy:
        a.call(B, "ping", [A_ID], 0.6)
    assert busy.value.code is ErrorCode.BUSY
    first, _ = a.datagrams_to_send()
    assert len(a.datagrams_to_send()) == 0
    a.receive_datagram_untrusted(answer(b, first[0], A, 0.7, B_ID), B, 0.7)
    a.call(B, "ping", [A_ID], 0.8)
    assert a.pending == 2
    assert len(a.handle_timer(1.5)) == 1
    a.call(B, "ping", [A_ID], 1.5)
    assert a.pending == 2


_AWAIT_OP = st.tuples(
    st.sampled_from(["call", "reply", "stray", "cancel", "timer"]),
    st.sampled_from([A, B]),
    st.integers(0, 7),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_AWAIT_OP, max_size=60))
def test_awaiting_says_whether_a_call_to_the_address_is_pending(
    ops: list[tuple[str, Address, int]],
) -> None:
    """Admission skips checking an address while a call to it is pending (dht.md §5.1):
    the answer must follow every call, reply, cancel and timeout exactly."""
    a = core(1, timeout=1.0)
    calls: list[tuple[bytes, Address]] = []
    now = 0.0
    for op, address, i in ops:
        now += 0.125
        if op == "call":
            calls.append((a.call(address, "ping", [A_ID], now).msg_id, address))
        elif op == "timer":
            a.handle_timer(now)
        elif calls:
            msg_id, to = calls[i % len(calls)]
            if op == "cancel":
                a.cancel(msg_id)
            else:  # a reply from where the call went, or a stray one from elsewhere
                source = to if op == "reply" else (B if to == A else A)
                a.receive_datagram_untrusted(rpcwire.encode_response(msg_id, B_ID), source, now)
        for where in (A, B):
            pending = any(to == where and a.state_of(m) is CallState.PENDING for m, to in calls)
            assert a.awaiting(where) == pending


def test_bad_calls_and_replies_leave_nothing_behind() -> None:
    a, b = core(1), core(2)
    with pytest.raises(LocalError) as unknown:
        a.call(B, "get", [], 0.0)
    assert unknown.value.code is ErrorCode.INVALID_ARGUMENT
    with pytest.raises(LocalError) as big:
        a.call(B, "store", [A_ID, B_ID, b"x" * 9000], 0.0)
    assert big.value.code is ErrorCode.MESSAGE_TOO_LARGE
    assert a.pending == 0 and a.datagrams_to_send() == []
    a.call(B, "ping", [A_ID], 0.0)
    [(request, _)] = a.datagrams_to_send()
    event = one(b.receive_datagram_untrusted(request, A, 0.0))
    assert isinstance(event, RequestReceived)
    with pytest.raises(LocalError) as too_large:
        b.reply(event, b"y" * 9000)
    assert too_large.value.code is ErrorCode.MESSAGE_TOO_LARGE
    assert b.datagrams_to_send() == []
    with pytest.raises(LocalError):
        RpcCore(rng=random.Random(), timeout=0)


def test_unsent_datagrams_go_back_in_front() -> None:
    a = core(1)
    a.call(B, "ping", [A_ID], 0.0)
    a.call(A, "ping", [A_ID], 0.0)
    taken = a.datagrams_to_send()
    a.call(EVIL, "ping", [A_ID], 0.0)
    a.send_later(taken[1:])
    assert [to for _, to in a.datagrams_to_send()] == [A, EVIL]


def test_malformed_datagrams_are_dropped_with_a_reason() -> None:
    a = core(1)
    request = rpcwire.encode_request(b"\x01" * 20, "ping", [A_ID])
    for junk in (b"", b"\x00" * 5, b"\x07" + request[1:], request[:-3], b"\x00" * 9000):
        event = one(a.receive_datagram_untrusted(junk, EVIL, 0.0))
        assert isinstance(event, DatagramDropped)
        assert event.reason is DropReason.MALFORMED and event.detail


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 60), st.binary(max_size=8))
def test_any_bytes_become_exactly_one_event(junk: bytes, cut: int, tail: bytes) -> None:
    a = core(1)
    call = a.call(B, "find_node", [A_ID, B_ID], 0.0)
    genuine = rpcwire.encode_response(call.msg_id, [[B_ID, "10.0.0.9", 1]])
    for data in (junk, genuine[:cut] + tail, b"\x01" + call.msg_id + junk):
        event = one(a.receive_datagram_untrusted(data, B, 0.0))
        assert isinstance(event, ReplyReceived | DatagramDropped | RequestReceived)


# ---------------------------------------------------------------------- a terrible network


@dataclass(order=True)
class _Delivery:
    at: float
    seq: int
    data: bytes = field(compare=False)
    source: Address = field(compare=False)
    to: Address = field(compare=False)


class _TerribleNetwork:
    """A calls B over a network that drops, duplicates and delays each datagram on its
    own (so it reorders too); an attacker who sees every reply resends it from EVIL."""

    def __init__(self, data: st.DataObject, timeout: float) -> None:
        self.draw = data.draw
        self.timeout = timeout
        self.a, self.b = core(1, timeout=timeout), core(2)
        self.queue: list[_Delivery] = []
        self.seq = 0
        self.answers: dict[bytes, Any] = {}
        self.started: dict[bytes, float] = {}
        self.first_genuine: dict[bytes, float] = {}
        self.outcome: dict[bytes, RpcEvent] = {}

    def send(self, datagrams: list[tuple[bytes, Address]], source: Address, now: float) -> None:
        for payload, to in datagrams:
            for _ in range(self.draw(st.sampled_from([0, 1, 1, 1, 2]), label="copies")):
                delay = self.draw(st.sampled_from([0.01, 0.1, 0.4, 1.0, 3.0, 7.0]), label="delay")
                self._push(now + delay, payload, source, to)
                if source == B and self.draw(st.booleans(), label="spoof"):
                    self._push(now + delay / 2, payload, EVIL, A)

    def _push(self, at: float, payload: bytes, source: Address, to: Address) -> None:
        heapq.heappush(self.queue, _Delivery(at, self.seq, payload, source, to))
        self.seq += 1

    def call(self, i: int, now: float) -> None:
        call = self.a.call(B, "find_node", [A_ID, bytes([i]) * 20], now)
        self.started[call.msg_id] = now
        self.send(self.a.datagrams_to_send(), A, now)

    def record(self, events: Sequence[RpcEvent], now: float) -> None:
        for e in events:
            if isinstance(e, ReplyReceived | CallTimedOut):
                assert e.msg_id not in self.outcome, "a call ended twice"
                self.outcome[e.msg_id] = e
                expired = now >= self.started[e.msg_id] + self.timeout
                assert expired == isinstance(e, CallTimedOut)
            if isinstance(e, ReplyReceived):
                assert e.address == B and e.value == self.answers[e.msg_id]
                assert e.rtt == pytest.approx(now - self.started[e.msg_id])

    def step(self) -> bool:
        """Advance to the next timer or delivery; False when nothing is left."""
        due = [self.queue[0].at] if self.queue else []
        deadline = self.a.next_deadline()
        if deadline is not None:
            due.append(deadline)
        if not due:
            return False
        now = min(due)
        self.record(self.a.handle_timer(now), now)
        while self.queue and self.queue[0].at <= now:
            d = heapq.heappop(self.queue)
            if d.to == B:
                self.serve(d, now)
            else:
                self.deliver_to_a(d, now)
        return True

    def serve(self, d: _Delivery, now: float) -> None:
        request = one(self.b.receive_datagram_untrusted(d.data, d.source, now))
        assert isinstance(request, RequestReceived)
        self.answers[request.msg_id] = [request.args[1].hex()]
        self.b.reply(request, self.answers[request.msg_id])
        self.send(self.b.datagrams_to_send(), B, now)

    def deliver_to_a(self, d: _Delivery, now: float) -> None:
        msg_id = rpcwire.decode_datagram_untrusted(d.data).msg_id
        live = now < self.started[msg_id] + self.timeout
        pending = live and self.a.state_of(msg_id) is CallState.PENDING
        events = self.a.receive_datagram_untrusted(d.data, d.source, now)
        self.record(events, now)
        last = events[-1]
        if d.source == EVIL:
            assert isinstance(last, DatagramDropped)
            if pending:
                assert last.reason is DropReason.WRONG_ADDRESS
            return
        self.first_genuine.setdefault(msg_id, now)
        if pending:
            assert isinstance(last, ReplyReceived) and last.msg_id == msg_id
        else:
            assert isinstance(last, DatagramDropped)
            assert last.reason in (DropReason.UNKNOWN_ID, DropReason.LATE)


@settings(max_examples=150, deadline=None)
@given(st.data(), st.integers(1, 12), st.sampled_from([0.5, 2.0, 5.0]))
def test_calls_over_a_lossy_duplicating_reordering_network(
    data: st.DataObject, n: int, timeout: float
) -> None:
    """Every call ends exactly once: answered iff a genuine reply arrived before its
    deadline, whatever the network and the attacker did."""
    net = _TerribleNetwork(data, timeout)
    now = 0.0
    for i in range(n):
        now += data.draw(st.sampled_from([0.0, 0.05, 0.3]), label="gap")
        net.call(i, now)
    # Bounded: each delivery makes at most 2 (+2 spoofed) more, and only requests do.
    for _ in range(20 * n + 100):
        if not net.step():
            break
    assert not net.queue and net.a.pending == 0
    assert set(net.outcome) == set(net.started)
    for msg_id, e in net.outcome.items():
        arrived = net.first_genuine.get(msg_id)
        answered = arrived is not None and arrived < net.started[msg_id] + timeout
        assert isinstance(e, ReplyReceived) == answered
