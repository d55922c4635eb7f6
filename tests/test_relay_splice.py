"""The relay's splice between two TCP sockets (TrioNetwork's streams) on 127.0.0.1:
bytes intact both ways (also those sent with CONNECT, before the OK), every circuit
limit (bytes, duration, rate) and every way a circuit ends; and the meter's rules as
properties. The simulator's streams take the generic splice (tests/test_relay_sim.py);
these take the socket one."""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.core.identity import Identity
from p2pnode.transport.net import TrioNetwork
from p2pnode.transport.relay import (
    CircuitEnd,
    CircuitMeter,
    Connect,
    ControlReader,
    Ok,
    RelayAddress,
    RelayLimits,
    encode_message,
)
from p2pnode.transport.relayserve import RelayReservation, RelayServer, connect_via_relay, reserve
from p2pnode.transport.tcpstream import TcpStream
from tests.sim.waiting import wait_until

RELAY = Identity(b"\x60" * 32)
TARGET = Identity(b"\x61" * 32)
#: No pacing and no request rate unless a test sets them.
OPEN = RelayLimits(circuit_rate=0, requests_per_ip=1e6, request_burst=10**6)


@dataclass
class Loopback:
    net: TrioNetwork
    server: RelayServer
    relay: RelayAddress
    reservation: RelayReservation

    async def circuit(self) -> tuple[trio.abc.Stream, trio.abc.Stream]:
        """A relayed stream pair: (the dialer's, the target's)."""
        dialer = await connect_via_relay(self.net, self.relay, TARGET.peer_id)
        return dialer, await self.reservation.accept()

    async def raw_circuit(self, early: bytes = b"") -> tuple[TcpStream, bytes]:
        """A dialer's plain TCP stream that sent CONNECT (and ``early`` after it) and
        read the OK: the stream and the relayed bytes that came with the OK."""
        raw = await self.net.connect_stream(self.relay.address)
        assert isinstance(raw, TcpStream)
        await raw.send_all(encode_message(Connect(TARGET.peer_id)) + early)
        reader = ControlReader()
        while (reply := reader.next_message_untrusted()) is None:
            reader.receive_data_untrusted(await raw.receive_some(1024))
        assert isinstance(reply, Ok) and reply.data == self.server.limits.circuit_data
        return raw, reader.take_rest()

    def ends(self, end: CircuitEnd) -> int:
        return self.server.statistics().circuit_ends.get(end, 0)


@asynccontextmanager
async def loopback(**limits: Any) -> AsyncIterator[Loopback]:
    """A relay on 127.0.0.1 (OPEN but for ``limits``) with TARGET's reservation on it."""
    net = TrioNetwork()
    server = RelayServer(net, RELAY.peer_id, replace(OPEN, **limits))
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            relay = RelayAddress(await nursery.start(server.serve, ("127.0.0.1", 0)), RELAY.peer_id)
            async with reserve(net, relay, TARGET) as reservation:
                yield Loopback(net, server, relay, reservation)
            nursery.cancel_scope.cancel()


async def read_exactly(stream: trio.abc.Stream, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = await stream.receive_some(size - len(data))
        assert chunk, f"stream ended after {len(data)} of {size} bytes"
        data += chunk
    return bytes(data)


async def read_until_end(stream: trio.abc.Stream) -> int:
    """Bytes read until the stream ends (EOF or a reset)."""
    total = 0
    try:
        while chunk := await stream.receive_some(65536):
            total += len(chunk)
    except trio.BrokenResourceError:
        pass
    return total


@pytest.mark.slow
async def test_bytes_cross_intact_both_ways_at_once() -> None:
    up, down = os.urandom(3_000_000), os.urandom(2_000_000)
    async with loopback() as lo:
        dialer, target = await lo.circuit()
        assert isinstance(dialer, trio.abc.Stream) and isinstance(target, trio.abc.Stream)
        got: dict[str, bytes] = {}

        async def read(name: str, stream: trio.abc.Stream, size: int) -> None:
            got[name] = await read_exactly(stream, size)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(dialer.send_all, up)
            nursery.start_soon(target.send_all, down)
            nursery.start_soon(read, "up", target, len(up))
            nursery.start_soon(read, "down", dialer, len(down))
        assert got == {"up": up, "down": down}
        assert lo.server.statistics().bytes_relayed == len(up) + len(down)
        await dialer.aclose()
        assert await read_until_end(target) == 0  # the dialer's close reaches the target
        await target.aclose()
        await wait_until(lambda: lo.ends(CircuitEnd.CLOSED) == 1)
        assert lo.server.statistics().circuits == 0


@pytest.mark.slow
async def test_bytes_sent_with_connect_arrive_first() -> None:
    """A dialer may send relayed data right after CONNECT (relay.md §1)."""
    async with loopback() as lo:
        raw, rest = await lo.raw_circuit(b"early bytes")  # the target ACCEPTs by itself
        target = await lo.reservation.accept()
        assert await read_exactly(target, 11) == b"early bytes"
        await target.send_all(b"late")
        assert rest + await read_exactly(raw, 4 - len(rest)) == b"late"
        await raw.aclose()
        await target.aclose()


@pytest.mark.slow
async def test_data_limit_forwards_no_byte_past_the_budget() -> None:
    async with loopback(circuit_data=100_000) as lo:
        dialer, target = await lo.circuit()
        async with trio.open_nursery() as nursery:
            # The relay closes the circuit mid-transfer: the writer may see it break.
            async def send() -> None:
                try:
                    await dialer.send_all(b"x" * 40_000)
                    await trio.sleep(0.05)  # a chunk of its own past the budget
                    await dialer.send_all(b"y" * 80_000)
                except trio.BrokenResourceError:
                    pass

            nursery.start_soon(send)
            assert await read_until_end(target) == 40_000
        await wait_until(lambda: lo.ends(CircuitEnd.DATA_LIMIT) == 1)
        assert lo.server.statistics().bytes_relayed == 40_000
        await dialer.aclose()
        await target.aclose()


@pytest.mark.slow
async def test_duration_limit_closes_an_idle_circuit() -> None:
    async with loopback(circuit_duration=0.3) as lo:
        dialer, target = await lo.circuit()
        start = time.monotonic()
        assert await read_until_end(dialer) == 0
        assert 0.25 <= time.monotonic() - start <= 5.0
        assert await read_until_end(target) == 0
        await wait_until(lambda: lo.ends(CircuitEnd.DURATION_LIMIT) == 1)
        await dialer.aclose()
        await target.aclose()


@pytest.mark.slow
async def test_duration_limit_closes_a_busy_circuit() -> None:
    """Bytes that never stop coming do not keep the splice from its deadline."""
    async with loopback(circuit_duration=0.5, circuit_data=2**40) as lo:
        dialer, target = await lo.circuit()

        async def flood() -> None:
            try:
                for _ in range(100_000):  # bounded: ~6.5 GB, far more than 0.5 s carries
                    await dialer.send_all(b"f" * 65536)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        start = time.monotonic()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood)
            carried = await read_until_end(target)
        assert carried > 0
        assert time.monotonic() - start <= 5.0
        assert lo.server.statistics().circuit_ends == {CircuitEnd.DURATION_LIMIT: 1}
        await dialer.aclose()
        await target.aclose()


@pytest.mark.slow
async def test_rate_paces_each_direction() -> None:
    async with loopback(circuit_rate=200_000, circuit_burst=20_000) as lo:
        dialer, target = await lo.circuit()
        start = time.monotonic()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(dialer.send_all, b"r" * 100_000)
            assert await read_exactly(target, 100_000) == b"r" * 100_000
        # 80 KB past the burst at 200 KB/s: 0.4 s at the least.
        assert time.monotonic() - start >= 0.35
        await dialer.aclose()
        await target.aclose()


@pytest.mark.slow
async def test_a_reset_ends_the_circuit() -> None:
    async with loopback() as lo:
        raw, rest = await lo.raw_circuit()
        target = await lo.reservation.accept()
        await target.send_all(b"before")
        assert rest + await read_exactly(raw, 6 - len(rest)) == b"before"
        raw.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await raw.aclose()  # an RST, not a FIN
        assert await read_until_end(target) == 0
        await wait_until(lambda: lo.ends(CircuitEnd.CLOSED) == 1)
        assert lo.server.statistics().circuits == 0
        await target.aclose()


class EndlessSource:
    """A socket that always has more waiting than a read takes (up to ``limit`` reads,
    then EOF): which tick of the other task each read saw."""

    def __init__(self, ticks: list[int], limit: int) -> None:
        self.ticks, self.limit, self.seen = ticks, limit, list[int]()

    def recv_into(self, buffer: bytearray) -> int:
        if len(self.seen) >= self.limit:
            return 0
        self.seen.append(self.ticks[0])
        return len(buffer)


class EndlessSink:
    """A socket with room for anything."""

    def send(self, data: memoryview) -> int:
        return len(data)


async def test_a_full_pipe_yields_to_other_tasks_and_to_cancellation() -> None:
    """Bytes that never stop coming and a sink that never fills: the socket splice
    still lets other tasks run every 16 chunks, and a cancel stops it."""
    server = RelayServer(TrioNetwork(), RELAY.peer_id, OPEN)
    ticks = [0]
    source = EndlessSource(ticks, limit=100_000)
    async with trio.open_nursery() as nursery:

        async def ticker() -> None:
            for _ in range(1000):  # bounded; cancels the splice after 20 turns
                await trio.lowlevel.checkpoint()
                ticks[0] += 1
                if ticks[0] == 20:
                    nursery.cancel_scope.cancel()

        nursery.start_soon(ticker)
        ends: list[CircuitEnd] = []
        pump = server._pump_sockets(source, EndlessSink(), b"", nursery.cancel_scope, ends)  # type: ignore[arg-type]
        nursery.start_soon(lambda: pump)
    assert 0 < len(source.seen) < 1000  # cancelled long before the source ran dry
    # Chunks read between two turns of the ticker: 16 a batch, and trio may run the
    # splice first in one batch and last in the one before.
    runs = [source.seen.count(tick) for tick in set(source.seen)]
    assert max(runs) <= 2 * 16 and len(runs) > 1
    assert server.statistics().bytes_relayed == 65536 * len(source.seen)


class CountingSocket(socket.socket):
    """A socket that counts its reads that found nothing."""

    failed_reads = 0

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        try:
            return super().recv_into(buffer, nbytes, flags)
        except BlockingIOError:
            self.failed_reads += 1
            raise


async def test_a_read_that_took_all_waits_before_reading_again() -> None:
    """After a read that did not fill its buffer the splice waits for the socket
    instead of trying a read that fails (one per message, before)."""
    server = RelayServer(TrioNetwork(), RELAY.peer_id, OPEN)
    source_peer, source_end = socket.socketpair()
    sink_end, sink_peer = socket.socketpair()
    source = CountingSocket(fileno=source_end.detach())
    for sock in (source_peer, source, sink_end, sink_peer):
        sock.setblocking(False)
    with source_peer, source, sink_end, sink_peer, trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            pump = server._pump_sockets
            nursery.start_soon(pump, source, sink_end, b"", nursery.cancel_scope, [])
            for i in range(10):
                source_peer.send(b"message %d" % i)
                await trio.lowlevel.wait_readable(sink_peer)
                assert sink_peer.recv(100) == b"message %d" % i
            nursery.cancel_scope.cancel()
    assert source.failed_reads <= 1  # a spurious wake-up, at most
    assert server.statistics().bytes_relayed == sum(len(b"message %d" % i) for i in range(10))


# --- the meter ------------------------------------------------------------------------


@given(
    budget=st.integers(1, 10**6),
    chunks=st.lists(st.tuples(st.integers(1, 70_000), st.floats(0, 1e6)), max_size=50),
)
def test_unpaced_meter_ignores_time_and_stops_at_the_budget(
    budget: int, chunks: list[tuple[int, float]]
) -> None:
    meter = CircuitMeter(RelayLimits(circuit_data=budget, circuit_rate=0), 0.0)
    assert not meter.paced
    forwarded = 0
    for size, now in chunks:
        answer = meter.admit(size, now)
        if forwarded + size > budget:
            assert answer == -1.0
            break
        assert answer == 0.0
        forwarded += size
    assert meter.sent == forwarded <= budget


@given(
    rate=st.integers(1, 10**7),
    burst=st.integers(1, 10**6),
    chunks=st.lists(st.tuples(st.integers(1, 70_000), st.floats(0, 10)), max_size=50),
)
def test_paced_meter_delays_but_never_refuses_within_the_budget(
    rate: int, burst: int, chunks: list[tuple[int, float]]
) -> None:
    limits = RelayLimits(circuit_data=2**40, circuit_rate=rate, circuit_burst=burst)
    meter = CircuitMeter(limits, 0.0)
    assert meter.paced
    now, sent = 0.0, 0
    for size, step in chunks:
        now += step
        delay = meter.admit(size, now)
        assert delay >= 0.0
        sent += size
        now += delay  # the splice waits this long before forwarding
        # Paced bytes never run ahead of the rate plus the burst.
        assert sent <= burst + rate * now + 1e-6 * sent + 1
