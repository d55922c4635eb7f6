"""Streams under the simulated network's driver: the driver wakes each reader when its
chunk is due (no cancel scope per chunk), with the bytes and times of the plain pipes."""

from __future__ import annotations

import math
import random
from functools import partial

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.simnet import LinkConditions, SimNetwork

Arrival = tuple[float, bytes]
#: Per connection: (pause before each send, bytes sent).
Plan = list[list[tuple[float, bytes]]]


async def _exchange(sim: SimNetwork, plan: Plan, *, drive: bool) -> list[list[Arrival]]:
    """Each connection of ``plan`` sends its chunks after their pauses, then EOF; what
    each reader got, and when (the reader takes at most 7 bytes a call)."""
    server = sim.add_host()
    listeners = [await server.listen_stream(("", 9000 + i)) for i in range(len(plan))]
    got: list[list[Arrival]] = [[] for _ in plan]

    async def read(i: int, stream: trio.abc.Stream) -> None:
        for _ in range(10_000):  # bounded: every plan sends far fewer reads' worth
            data = await stream.receive_some(7)
            got[i].append((trio.current_time(), bytes(data)))
            if not data:
                return

    async def write(i: int) -> None:
        stream = await sim.add_host().connect_stream(listeners[i].local_address)
        peer = await listeners[i].accept()
        nursery.start_soon(read, i, peer)
        for pause, data in plan[i]:
            await trio.sleep(pause)
            await stream.send_all(data)
        assert isinstance(stream, trio.abc.HalfCloseableStream)
        await stream.send_eof()

    async with trio.open_nursery() as outer:
        if drive:
            await outer.start(sim.drive)
        async with trio.open_nursery() as nursery:
            for i in range(len(plan)):
                nursery.start_soon(write, i)
        outer.cancel_scope.cancel()
    return got


def _net(tick: float = 0.0, jitter: float = 0.0) -> SimNetwork:
    """Without jitter (the default) the delays do not depend on the order in which
    concurrent connections draw them, which trio's scheduler does not fix."""
    return SimNetwork(
        random.Random(7), default=LinkConditions(latency=0.02, jitter=jitter), tick=tick
    )


plans = st.lists(
    st.lists(
        st.tuples(st.sampled_from([0.0, 0.001, 0.004, 0.03]), st.binary(min_size=1, max_size=20)),
        max_size=6,
    ),
    min_size=1,
    max_size=4,
)


@settings(max_examples=40, deadline=None)
@given(plans)
def test_driven_streams_deliver_what_plain_pipes_deliver(plan: Plan) -> None:
    """Without a tick the driver changes nothing: the same bytes, in the same reads, at
    the same times."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    plain = trio.run(partial(_exchange, _net(), plan, drive=False), clock=clock)
    clock = trio.testing.MockClock(autojump_threshold=0)
    driven = trio.run(partial(_exchange, _net(), plan, drive=True), clock=clock)
    assert [[d for _, d in reads] for reads in driven] == [[d for _, d in r] for r in plain]
    for got, expected in zip(driven, plain, strict=True):
        assert [t for t, _ in got] == pytest.approx([t for t, _ in expected], abs=1e-9)
    assert all(reads and reads[-1][1] == b"" for reads in driven)  # EOF reached each


@settings(max_examples=40, deadline=None)
@given(plans)
def test_a_tick_delays_stream_chunks_to_its_next_multiple(plan: Plan) -> None:
    """Under a tick each chunk arrives at most one tick after it would without (the
    same bytes in order), never before."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    plain = trio.run(partial(_exchange, _net(0.001), plan, drive=False), clock=clock)
    clock = trio.testing.MockClock(autojump_threshold=0)
    driven = trio.run(partial(_exchange, _net(0.001), plan, drive=True), clock=clock)
    for got, expected in zip(driven, plain, strict=True):
        assert b"".join(d for _, d in got) == b"".join(d for _, d in expected)
        # The first byte of each read of the plain run arrives no sooner driven.
        assert got[0][0] >= expected[0][0] - 1e-9
        assert got[-1][0] <= expected[-1][0] + 0.001 + 1e-9
        # Delivered on the tick: in the pass of the datagrams due then.
        assert all(t * 1000 == pytest.approx(round(t * 1000), abs=1e-6) for t, _ in got)


async def test_a_reader_waits_on_the_driver_not_on_a_trio_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """While the driver runs, a reader waiting for a chunk in flight holds no trio
    deadline (no cancel scope per chunk): the driver wakes it when the chunk is due."""
    sim = _net()
    listener = await sim.add_host().listen_stream(("", 9000))
    got: list[tuple[float, bytes]] = []
    arrived = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(sim.drive)
        stream = await sim.add_host().connect_stream(listener.local_address)
        peer = await listener.accept()

        async def read() -> None:
            data = await peer.receive_some()
            got.append((trio.current_time(), bytes(data)))
            arrived.set()

        nursery.start_soon(read)
        sent = trio.current_time()
        await stream.send_all(b"chunk")
        await trio.testing.wait_all_tasks_blocked()
        assert not got
        assert trio.lowlevel.current_statistics().seconds_to_next_deadline == math.inf
        with trio.fail_after(1):
            await arrived.wait()
        nursery.cancel_scope.cancel()
    assert [d for _, d in got] == [b"chunk"]
    assert got[0][0] == pytest.approx(sent + 0.02)


async def test_a_stopped_driver_leaves_chunks_in_flight_to_trio(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Chunks in flight when the driver stops still arrive, when due, on trio's timers;
    a reader parked for one wakes."""
    sim = _net(jitter=0.01)
    server = sim.add_host()
    listener = await server.listen_stream(("", 9000))
    got: list[tuple[float, bytes]] = []
    arrived = trio.Event()
    async with trio.open_nursery() as outer:
        driver = trio.CancelScope()

        async def drive() -> None:
            with driver:
                await sim.drive()

        outer.start_soon(drive)
        await trio.testing.wait_all_tasks_blocked()
        stream = await sim.add_host().connect_stream(listener.local_address)
        peer = await listener.accept()

        async def read() -> None:
            data = await peer.receive_some()
            got.append((trio.current_time(), bytes(data)))
            arrived.set()

        outer.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        sent = trio.current_time()
        await stream.send_all(b"late")
        driver.cancel()  # before the chunk is due (the link's delay is 10-30 ms)
        with trio.fail_after(1):
            await arrived.wait()
    assert got[0][1] == b"late"
    assert 0.01 <= got[0][0] - sent <= 0.03 + 1e-9
