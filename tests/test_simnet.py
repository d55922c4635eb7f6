"""The in-memory network: datagrams, streams, latency, loss, partitions, kills."""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

from p2pnode.simnet import LinkConditions, SimNetwork
from p2pnode.transport.net import Address


def _net(seed: int = 1, **kw: float) -> SimNetwork:
    return SimNetwork(random.Random(seed), default=LinkConditions(**kw))


async def test_datagram_latency_and_source(autojump_clock: trio.testing.MockClock) -> None:
    sim = _net(latency=0.05, jitter=0.0)
    a, b = sim.add_host(), sim.add_host()
    ea = await a.bind_datagram(("0.0.0.0", 0))
    eb = await b.bind_datagram((b.host, 9000))
    assert eb.local_address == (b.host, 9000)
    t0 = trio.current_time()
    await ea.sendto(b"hi", ("" + b.host, 9000))
    data, src = await eb.recvfrom()
    assert data == b"hi"
    assert src == ea.local_address
    assert trio.current_time() - t0 == pytest.approx(0.05)


async def test_bind_conflicts_and_foreign_address() -> None:
    sim = _net()
    a, b = sim.add_host(), sim.add_host()
    await a.bind_datagram((a.host, 5))
    with pytest.raises(OSError, match="in use"):
        await a.bind_datagram((a.host, 5))
    with pytest.raises(OSError, match="not an address"):
        await a.bind_datagram((b.host, 6))


async def test_loss_is_seeded_and_partial(autojump_clock: trio.testing.MockClock) -> None:
    async def run(seed: int) -> int:
        sim = _net(seed, loss=0.3)
        a, b = sim.add_host(), sim.add_host()
        ea, eb = await a.bind_datagram(("", 0)), await b.bind_datagram(("", 0))
        for i in range(200):
            await ea.sendto(bytes([i % 256]), eb.local_address)
        got = 0
        with trio.move_on_after(5):
            while True:
                await eb.recvfrom()
                got += 1
        return got

    n1, n2 = await run(7), await run(7)
    assert n1 == n2
    assert 100 < n1 < 180


async def test_partition_kill_and_heal(autojump_clock: trio.testing.MockClock) -> None:
    sim = _net()
    a, b = sim.add_host(), sim.add_host()
    ea, eb = await a.bind_datagram(("", 0)), await b.bind_datagram(("", 0))

    async def delivered() -> bool:
        await ea.sendto(b"x", eb.local_address)
        with trio.move_on_after(1):
            await eb.recvfrom()
            return True
        return False

    assert await delivered()
    sim.partition({a.host})
    assert not await delivered()
    sim.heal()
    assert await delivered()
    sim.kill(b.host)
    assert not await delivered()
    sim.revive(b.host)
    assert await delivered()


async def test_in_flight_datagram_dropped_when_killed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sim = _net(latency=0.5, jitter=0.0)
    a, b = sim.add_host(), sim.add_host()
    ea, eb = await a.bind_datagram(("", 0)), await b.bind_datagram(("", 0))
    await ea.sendto(b"x", eb.local_address)
    sim.kill(a.host)
    with trio.move_on_after(2) as scope:
        await eb.recvfrom()
    assert scope.cancelled_caught


async def test_close_wakes_receiver(autojump_clock: trio.testing.MockClock) -> None:
    sim = _net()
    ep = await sim.add_host().bind_datagram(("", 0))
    async with trio.open_nursery() as nursery:

        async def recv() -> None:
            with pytest.raises(trio.ClosedResourceError):
                await ep.recvfrom()

        nursery.start_soon(recv)
        await trio.testing.wait_all_tasks_blocked()  # the receiver waits in recvfrom
        ep.close()
    with pytest.raises(trio.ClosedResourceError):
        await ep.sendto(b"x", ("10.0.0.9", 1))


async def _stream_pair(sim: SimNetwork) -> tuple[trio.abc.Stream, trio.abc.Stream]:
    a, b = sim.add_host(), sim.add_host()
    listener = await b.listen_stream(("", 80))
    client = await a.connect_stream((b.host, 80))
    server = await listener.accept()
    return client, server


async def test_stream_ordered_under_jitter(autojump_clock: trio.testing.MockClock) -> None:
    sim = _net(latency=0.05, jitter=0.04)
    client, server = await _stream_pair(sim)
    payload = b"".join(i.to_bytes(2, "big") for i in range(2000))
    async with trio.open_nursery() as nursery:

        async def send() -> None:
            for i in range(0, len(payload), 100):
                await client.send_all(payload[i : i + 100])
            await client.aclose()

        nursery.start_soon(send)
        got = bytearray()
        while chunk := await server.receive_some(333):
            got += chunk
    assert bytes(got) == payload


async def test_connect_refused_and_partitioned(autojump_clock: trio.testing.MockClock) -> None:
    sim = _net()
    a, b = sim.add_host(), sim.add_host()
    with pytest.raises(OSError, match="refused"):
        await a.connect_stream((b.host, 1))
    await b.listen_stream(("", 1))
    sim.partition({a.host}, {b.host})
    t0 = trio.current_time()
    with pytest.raises(OSError, match="timed out"):
        await a.connect_stream((b.host, 1))
    assert trio.current_time() - t0 >= sim.connect_timeout


@pytest.mark.parametrize("fault", ["partition", "kill"])
async def test_stream_breaks_on_fault(autojump_clock: trio.testing.MockClock, fault: str) -> None:
    sim = _net()
    client, server = await _stream_pair(sim)
    await client.send_all(b"before")
    assert await server.receive_some() == b"before"
    host = server.local_address[0]  # type: ignore[attr-defined]
    if fault == "kill":
        sim.kill(host)
    else:
        sim.partition({host})
    with pytest.raises(trio.BrokenResourceError):
        await client.send_all(b"after")
    with pytest.raises(trio.BrokenResourceError):
        await server.receive_some()


async def test_check_half_closeable_stream(autojump_clock: trio.testing.MockClock) -> None:
    async def maker() -> tuple[trio.abc.HalfCloseableStream, trio.abc.HalfCloseableStream]:
        client, server = await _stream_pair(_net(latency=0.001, jitter=0.0))
        assert isinstance(client, trio.abc.HalfCloseableStream)
        assert isinstance(server, trio.abc.HalfCloseableStream)
        return client, server

    await trio.testing.check_half_closeable_stream(maker, None)


async def test_thousand_hosts_exchange(autojump_clock: trio.testing.MockClock) -> None:
    sim = _net(latency=0.02, jitter=0.01)
    eps = [await sim.add_host().bind_datagram(("", 0)) for _ in range(1000)]
    received = 0

    async def echo(ep_index: int) -> None:
        nonlocal received
        data, src = await eps[ep_index].recvfrom()
        received += 1
        await eps[ep_index].sendto(data, src)

    async with trio.open_nursery() as nursery:
        for i in range(1000):
            nursery.start_soon(echo, i)
        for i in range(1000):
            dst: Address = eps[(i + 1) % 1000].local_address
            await eps[i].sendto(b"ping", dst)
    assert received == 1000


async def test_cancelled_receives_never_lose_data(autojump_clock: trio.testing.MockClock) -> None:
    sim = _net(latency=0.1, jitter=0.05)
    a, b = sim.add_host(), sim.add_host()
    ea, eb = await a.bind_datagram(("", 0)), await b.bind_datagram(("", 0))
    for i in range(50):
        await ea.sendto(bytes([i]), eb.local_address)
    got: list[bytes] = []
    timeouts = [0.0, 0.001, 0.01, 0.03]
    for i in range(10_000):
        if len(got) == 50:
            break
        with trio.move_on_after(timeouts[i % 4]):
            got.append((await eb.recvfrom())[0])
    assert sorted(got) == [bytes([i]) for i in range(50)]
