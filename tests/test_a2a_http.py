"""The gateway's HTTP listener (p2pnode.bridges.a2a.http)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from p2pnode.bridges.a2a.http import listen

pytestmark = pytest.mark.slow


def test_connections_the_listener_accepts_send_without_nagle_delay() -> None:
    """An accepted connection has TCP_NODELAY: a response written as headers then body
    must not wait for the client's delayed ACK (40 ms a response on Linux)."""

    async def main() -> int:
        sock = listen("127.0.0.1", 0)
        accepted: asyncio.Future[asyncio.BaseTransport] = asyncio.get_running_loop().create_future()

        class Capture(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                accepted.set_result(transport)

        server = await asyncio.get_running_loop().create_server(Capture, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            transport = await asyncio.wait_for(accepted, 10)
            option = transport.get_extra_info("socket").getsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY
            )
            writer.close()
            transport.close()
            return int(option)

    assert asyncio.run(main()) != 0
