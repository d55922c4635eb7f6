"""TcpStream: trio's stream conformance checks, and what it does differently (eager reads)."""

from __future__ import annotations

import socket
import struct

import pytest
import trio
import trio.testing

from p2pnode.transport.net import TrioNetwork
from p2pnode.transport.tcpstream import EAGER_RECEIVES, TcpStream

pytestmark = pytest.mark.slow  # real sockets


async def _tcp_pair(eager_receives: int = EAGER_RECEIVES) -> tuple[TcpStream, TcpStream]:
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    finally:
        listener.close()
    return (
        TcpStream(client, eager_receives=eager_receives),
        TcpStream(server, eager_receives=eager_receives),
    )


async def _full_checkpoint_pair() -> tuple[TcpStream, TcpStream]:
    # trio's checks hold every receive_some to being a checkpoint: eager_receives=1.
    return await _tcp_pair(eager_receives=1)


async def _clogged_pair() -> tuple[TcpStream, TcpStream]:
    left, right = await _full_checkpoint_pair()
    # Fill the kernel buffers both ways (the checks also run with the ends swapped), so
    # the next send_all blocks until the other end reads.
    for stream in (left, right):
        while True:
            try:
                stream._sock.send(b"x" * 65536)
            except BlockingIOError:
                break
    return left, right


async def test_conforms_to_trio_half_closeable_stream() -> None:
    await trio.testing.check_half_closeable_stream(_full_checkpoint_pair, _clogged_pair)


async def test_data_waiting_is_read_without_a_scheduler_pass() -> None:
    left, right = await _tcp_pair()
    async with left, right:
        await left.send_all(b"ping")
        await trio.sleep(0.05)  # let the bytes cross loopback
        task = trio.lowlevel.current_task()
        before = task._schedule_points
        assert await right.receive_some(100) == b"ping"
        assert task._schedule_points == before


async def test_eager_reads_yield_every_eager_receives() -> None:
    left, right = await _tcp_pair(eager_receives=4)
    async with left, right:
        await left.send_all(b"x" * 64)
        await trio.sleep(0.05)
        task = trio.lowlevel.current_task()
        passes = []
        for _ in range(8):
            before = task._schedule_points
            assert await right.receive_some(8) == b"x" * 8
            passes.append(task._schedule_points - before)
        assert passes == [0, 0, 0, 1, 0, 0, 0, 1]


async def test_a_flooding_peer_does_not_starve_other_tasks() -> None:
    left, right = await _tcp_pair()
    ticks = 0
    reads = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await trio.lowlevel.checkpoint()

    async with left, right, trio.open_nursery() as nursery:
        nursery.start_soon(ticker)
        await left.send_all(b"y" * 100_000)
        with trio.move_on_after(5):
            while reads < 1000:  # one byte at a time: data is always waiting
                await right.receive_some(1)
                reads += 1
        nursery.cancel_scope.cancel()
    assert reads == 1000
    assert ticks >= 1000 // EAGER_RECEIVES - 1


async def test_cancelled_receive_raises_even_with_data_waiting() -> None:
    left, right = await _tcp_pair()
    async with left, right:
        await left.send_all(b"z")
        await trio.sleep(0.05)
        with trio.CancelScope() as scope:
            scope.cancel()
            await right.receive_some(10)
            pytest.fail("a cancelled receive returned")  # pragma: no cover
        assert scope.cancelled_caught
        assert await right.receive_some(10) == b"z"  # nothing was lost


async def test_reset_by_peer_is_a_broken_resource() -> None:
    left, right = await _tcp_pair()
    async with right:
        # SO_LINGER 0: close sends a reset instead of a FIN.
        left._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await left.aclose()
        await trio.sleep(0.05)
        with pytest.raises(trio.BrokenResourceError):
            await right.receive_some(10)


async def test_trio_network_streams_are_tcp_streams_with_the_peer_address() -> None:
    network = TrioNetwork()
    listener = await network.listen_stream(("127.0.0.1", 0))
    accepted: list[trio.abc.Stream] = []
    async with trio.open_nursery() as nursery:

        async def accept() -> None:
            accepted.append(await listener.accept())

        nursery.start_soon(accept)
        client = await network.connect_stream(listener.local_address)
    server = accepted[0]
    assert isinstance(client, TcpStream) and isinstance(server, TcpStream)
    assert client.remote_address == listener.local_address
    assert server.remote_address is not None and server.remote_address[0] == "127.0.0.1"
    await client.send_all(b"hello")
    assert await server.receive_some(10) == b"hello"
    await client.aclose()
    await server.aclose()
    await listener.aclose()
