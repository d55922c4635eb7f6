"""The simulated network's driver: one task delivers every datagram, as the heaps would."""

from __future__ import annotations

import random
from functools import partial

import pytest
import trio
import trio.testing

from p2pnode.simnet import LinkConditions, SimNetwork
from p2pnode.transport.net import Address, DatagramEndpoint

Arrival = tuple[float, bytes, Address]


def _net(seed: int = 1, **kw: float) -> SimNetwork:
    return SimNetwork(random.Random(seed), default=LinkConditions(**kw))


async def _exchange(
    sim: SimNetwork, *, drive: bool, handlers: bool = False
) -> tuple[list[list[Arrival]], list[float]]:
    """One sender, 20 receivers that answer some datagrams, a sleeper, a host killed
    halfway: what arrived where and when, and when the sleeper woke. ``handlers``:
    the receivers take their datagrams in a callback (receive_with), not recvfrom."""
    eps = [await sim.add_host().bind_datagram(("", 0)) for _ in range(21)]
    arrivals: list[list[Arrival]] = [[] for _ in eps]
    woke: list[float] = []

    def take(i: int, ep: DatagramEndpoint, data: bytes, src: Address) -> None:
        arrivals[i].append((trio.current_time() - t0, data, src))
        if len(data) == 2 and data[0] % 3 == 0:
            ep.sendto_nowait(b"re" + data, src)

    async def receive(i: int, ep: DatagramEndpoint) -> None:
        if handlers:
            ep.receive_with(partial(take, i, ep))  # type: ignore[attr-defined]
        while True:
            data, src = await ep.recvfrom()
            take(i, ep, data, src)
            await trio.lowlevel.checkpoint()

    async def sleeper() -> None:
        for pause in (0.013, 0.2, 0.0, 1.7):
            await trio.sleep(pause)
            woke.append(trio.current_time() - t0)

    rng = random.Random(3)
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        if drive:
            await nursery.start(sim.drive)
        for i, ep in enumerate(eps):
            nursery.start_soon(receive, i, ep)
        nursery.start_soon(sleeper)
        for n in range(300):
            if n == 150:
                sim.kill(eps[5].local_address[0])
            await eps[0].sendto(bytes([n % 256, n // 256]), eps[rng.randrange(1, 21)].local_address)
            await trio.sleep(rng.choice([0.0, 0.001, 0.01]))
        await trio.sleep(5)
        nursery.cancel_scope.cancel()
    return arrivals, woke


@pytest.mark.parametrize("loss", [0.0, 0.2])
async def test_driven_deliveries_are_those_of_the_heaps(
    autojump_clock: trio.testing.MockClock, loss: float
) -> None:
    plain = await _exchange(_net(4, latency=0.02, jitter=0.01, loss=loss), drive=False)
    driven = await _exchange(_net(4, latency=0.02, jitter=0.01, loss=loss), drive=True)
    for got, expected in zip(driven[0], plain[0], strict=True):
        assert [(d, s) for _, d, s in got] == [(d, s) for _, d, s in expected]
        assert [t for t, _, _ in got] == pytest.approx([t for t, _, _ in expected], abs=1e-9)
    assert driven[1] == pytest.approx(plain[1], abs=1e-9)
    assert not driven[0][5][150:]  # nothing reaches the killed host
    assert sum(len(a) for a in driven[0]) > 300 * (1 - loss) * 0.8


async def test_driven_handlers_get_what_the_heaps_deliver(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The DHT takes datagrams in a callback under the driver (no receiver wakes per
    # datagram): the same datagrams, at the same times, in the same order.
    plain = await _exchange(_net(5, latency=0.02, jitter=0.01, loss=0.1), drive=False)
    handed = await _exchange(
        _net(5, latency=0.02, jitter=0.01, loss=0.1), drive=True, handlers=True
    )
    for got, expected in zip(handed[0], plain[0], strict=True):
        assert [(d, s) for _, d, s in got] == [(d, s) for _, d, s in expected]
        assert [t for t, _, _ in got] == pytest.approx([t for t, _, _ in expected], abs=1e-9)
    assert handed[1] == pytest.approx(plain[1], abs=1e-9)
    assert not handed[0][5][150:]  # nothing reaches the killed host


async def test_a_handler_endpoint_reads_what_a_stopped_driver_hands_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sim = _net(latency=1.0, jitter=0.0)
    a, b = sim.add_host(), sim.add_host()
    ea, eb = await a.bind_datagram(("", 0)), await b.bind_datagram(("", 0))
    handed: list[bytes] = []
    eb.receive_with(lambda data, src: handed.append(data))  # type: ignore[attr-defined]
    async with trio.open_nursery() as nursery:
        await nursery.start(sim.drive)
        await ea.sendto(b"1", eb.local_address)
        await trio.sleep(1.5)
        await ea.sendto(b"2", eb.local_address)
        await trio.sleep(0.5)
        nursery.cancel_scope.cancel()
    assert handed == [b"1"]
    assert (await eb.recvfrom())[0] == b"2"
    eb.close()
    await ea.sendto(b"3", eb.local_address)
    assert handed == [b"1"]


def _arrivals(tick: float, drive: bool) -> list[tuple[float, bytes]]:
    """Times (from 0) and contents of 100 datagrams from one host to another."""

    async def main() -> list[tuple[float, bytes]]:
        sim = SimNetwork(random.Random(4), default=LinkConditions(0.02, 0.01), tick=tick)
        ea, eb = [await sim.add_host().bind_datagram(("", 0)) for _ in range(2)]
        got: list[tuple[float, bytes]] = []

        async def receive() -> None:
            while len(got) < 100:
                data, _ = await eb.recvfrom()
                got.append((trio.current_time(), data))

        async with trio.open_nursery() as nursery:
            if drive:
                await nursery.start(sim.drive)
            nursery.start_soon(receive)
            for i in range(100):
                await ea.sendto(bytes([i]), eb.local_address)
                await trio.sleep(0.0013)
            await trio.sleep(1)
            nursery.cancel_scope.cancel()
        return got

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


@pytest.mark.parametrize("drive", [False, True])
def test_a_tick_delivers_at_the_next_multiple(drive: bool) -> None:
    exact, ticked = _arrivals(0.0, drive), _arrivals(0.004, drive)
    # The tick draws nothing from the rng: the same delays, each rounded up to a tick.
    assert sorted(exact, key=lambda a: a[1]) != exact  # jitter reorders some
    by_data = dict((d, t) for t, d in exact)
    for t, d in ticked:
        assert abs(t / 0.004 - round(t / 0.004)) < 1e-6
        assert 0 <= t - by_data[d] < 0.004 + 1e-9
    # Datagrams that fall due in one tick arrive together, in the order sent.
    assert [d for _, d in ticked] == [d for _, d in sorted(ticked, key=lambda a: (a[0], a[1]))]


def test_a_tick_is_not_negative() -> None:
    with pytest.raises(ValueError, match="tick"):
        SimNetwork(random.Random(1), tick=-0.001)


async def test_driver_keeps_trio_deadlines(autojump_clock: trio.testing.MockClock) -> None:
    sim = _net(latency=1.0, jitter=0.0)
    a, b = sim.add_host(), sim.add_host()
    ea, eb = await a.bind_datagram(("", 0)), await b.bind_datagram(("", 0))
    async with trio.open_nursery() as nursery:
        await nursery.start(sim.drive)
        t0 = trio.current_time()
        await ea.sendto(b"x", eb.local_address)
        with trio.move_on_after(0.25):
            await eb.recvfrom()
        assert trio.current_time() - t0 == pytest.approx(0.25)
        await eb.recvfrom()
        assert trio.current_time() - t0 == pytest.approx(1.0)
        # Nothing in flight and nothing timed: the driver waits for the next datagram.
        await trio.testing.wait_all_tasks_blocked()
        await ea.sendto(b"y", eb.local_address)
        assert (await eb.recvfrom())[0] == b"y"
        assert trio.current_time() - t0 == pytest.approx(2.0)
        nursery.cancel_scope.cancel()


async def test_stopped_driver_hands_datagrams_back(autojump_clock: trio.testing.MockClock) -> None:
    sim = _net(latency=1.0, jitter=0.0)
    a, b = sim.add_host(), sim.add_host()
    ea, eb = await a.bind_datagram(("", 0)), await b.bind_datagram(("", 0))
    t0 = trio.current_time()
    async with trio.open_nursery() as nursery:
        await nursery.start(sim.drive)
        for i in range(3):
            await ea.sendto(bytes([i]), eb.local_address)
        await trio.sleep(0.5)
        nursery.cancel_scope.cancel()
    got = [(await eb.recvfrom())[0] for _ in range(3)]
    assert got == [b"\x00", b"\x01", b"\x02"]
    assert trio.current_time() - t0 == pytest.approx(1.0)


async def test_driver_bounds_and_drops(autojump_clock: trio.testing.MockClock) -> None:
    sim = _net(latency=0.05, jitter=0.0)
    a, b, c = sim.add_host(), sim.add_host(), sim.add_host()
    ea, eb, ec = [await h.bind_datagram(("", 0)) for h in (a, b, c)]
    async with trio.open_nursery() as nursery:
        await nursery.start(sim.drive)
        for _ in range(600):  # nobody reads: the receive buffer holds 512
            await ea.sendto(b"q", eb.local_address)
        await ea.sendto(b"gone", ec.local_address)
        ec.close()  # closed with a datagram in flight: dropped, nothing raised
        await trio.sleep(1)
        assert sim.datagrams_dropped == 600 - 512
        got = 0
        with trio.move_on_after(1):
            while True:
                await eb.recvfrom()
                got += 1
        assert got == 512
        nursery.cancel_scope.cancel()


async def test_cancelled_driven_receives_never_lose_data(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sim = _net(latency=0.1, jitter=0.05)
    a, b = sim.add_host(), sim.add_host()
    ea, eb = await a.bind_datagram(("", 0)), await b.bind_datagram(("", 0))
    got: list[bytes] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(sim.drive)
        for i in range(50):
            await ea.sendto(bytes([i]), eb.local_address)
        timeouts = [0.0, 0.001, 0.01, 0.03]
        for i in range(10_000):
            if len(got) == 50:
                break
            with trio.move_on_after(timeouts[i % 4]):
                got.append((await eb.recvfrom())[0])
        nursery.cancel_scope.cancel()
    assert sorted(got) == [bytes([i]) for i in range(50)]


async def test_one_driver_under_a_mock_clock(autojump_clock: trio.testing.MockClock) -> None:
    sim = _net()
    async with trio.open_nursery() as nursery:
        await nursery.start(sim.drive)
        with pytest.raises(RuntimeError, match="running already"):
            await sim.drive()
        nursery.cancel_scope.cancel()


def test_driver_needs_a_mock_clock() -> None:
    with pytest.raises(RuntimeError, match="MockClock"):
        trio.run(_net().drive)
