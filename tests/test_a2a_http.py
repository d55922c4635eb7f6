"""The gateway's HTTP listener (p2pnode.bridges.a2a.http)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import httpx
import pytest

from p2pnode.bridges.a2a.http import KEEP_ALIVE, listen, serve, server_config

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


async def _ok(scope: Any, receive: Any, send: Any) -> None:
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


_GET = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


async def _answered(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Send a GET on an open connection: whether its 200 came back (not EOF or a reset)."""
    try:
        writer.write(_GET)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        await asyncio.wait_for(reader.readexactly(2), 10)  # the body, "ok"
    except (ConnectionError, asyncio.IncompleteReadError):
        return False
    return head.startswith(b"HTTP/1.1 200")


def test_the_server_keeps_idle_connections_longer_than_the_sdk_client_does() -> None:
    """The client must be the one closing an idle connection: a server closing first
    races the client's next request on it, which then meets a reset."""
    assert server_config(_ok).timeout_keep_alive == KEEP_ALIVE
    expiry = httpx.Limits().keepalive_expiry  # the A2A SDK client's transport
    assert expiry is not None
    assert expiry < KEEP_ALIVE


def test_an_idle_connection_stays_open_until_keep_alive() -> None:
    """With the default, a connection idle longer than a 1 s keep-alive server's still
    answers; the 1 s server has closed its own (so the wait was long enough)."""

    async def main() -> tuple[bool, bytes, bool]:
        short, default = listen("127.0.0.1", 0), listen("127.0.0.1", 0)
        started = [asyncio.Event(), asyncio.Event()]
        servers = [
            asyncio.create_task(serve(_ok, short, started[0].set, keep_alive=1)),
            asyncio.create_task(serve(_ok, default, started[1].set)),
        ]
        try:
            for event in started:
                await asyncio.wait_for(event.wait(), 10)
            short_conn = await asyncio.open_connection(*short.getsockname()[:2])
            kept_conn = await asyncio.open_connection(*default.getsockname()[:2])
            first = await _answered(*short_conn) and await _answered(*kept_conn)
            # b"" once closed: at 1 s, not at uvicorn's default 5 s
            closed = await asyncio.wait_for(short_conn[0].read(), 4)
            answered = await _answered(*kept_conn)
            for _, writer in (short_conn, kept_conn):
                writer.close()
            return first, closed, answered
        finally:
            for server in servers:
                server.cancel()
            await asyncio.gather(*servers, return_exceptions=True)
            short.close()
            default.close()

    first, closed, answered = asyncio.run(main())
    assert first
    assert closed == b""
    assert answered
