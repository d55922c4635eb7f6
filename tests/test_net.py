"""The real-socket network implementation on 127.0.0.1."""

from __future__ import annotations

import pytest
import trio

from p2pnode.transport.net import TrioNetwork

pytestmark = pytest.mark.slow  # real sockets on 127.0.0.1


async def test_udp_round_trip() -> None:
    net = TrioNetwork()
    a = await net.bind_datagram(("127.0.0.1", 0))
    b = await net.bind_datagram(("127.0.0.1", 0))
    assert a.local_address[1] != 0
    with trio.fail_after(5):
        await a.sendto(b"hello", b.local_address)
        data, src = await b.recvfrom()
    assert data == b"hello"
    assert src == a.local_address
    a.close()
    b.close()
    with pytest.raises(trio.ClosedResourceError):
        await a.sendto(b"x", b.local_address)


async def test_tcp_stream() -> None:
    net = TrioNetwork()
    listener = await net.listen_stream(("127.0.0.1", 0))
    with trio.fail_after(5):
        client = await net.connect_stream(listener.local_address)
        server = await listener.accept()
        await client.send_all(b"abc")
        assert await server.receive_some(10) == b"abc"
    await client.aclose()
    await server.aclose()
    await listener.aclose()


async def test_connect_refused() -> None:
    net = TrioNetwork()
    listener = await net.listen_stream(("127.0.0.1", 0))
    addr = listener.local_address
    await listener.aclose()
    with trio.fail_after(5), pytest.raises(OSError, match=r"\w"):
        await net.connect_stream(addr)
