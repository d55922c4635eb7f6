"""The gateway over HTTP: uvicorn on the loopback, every request with a bearer token.

A loopback port is reachable by every local user, while the node's own sockets
are its owner's alone: without the token any of them would use the swarm as
the gateway's agent. The token is drawn at start and written (mode 0600) to
``token_file``; the cards declare it (``securitySchemes.bearer``). A request
without it is answered 401 before the SDK sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import secrets
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import uvicorn

from p2pnode.core.identity import write_private_file

#: The loopback hosts ``--http`` accepts.
LOOPBACK: frozenset[str] = frozenset({"127.0.0.1", "::1", "localhost"})
#: Seconds an idle keep-alive connection stays open. Longer than clients keep theirs
#: (httpx and so the A2A SDK 5 s, aiohttp 15 s, Go 90 s): the client must be the one that
#: closes an idle connection. With uvicorn's 5 s the server closed connections the
#: SDK's client still held, and a request sent as the FIN left met a reset (the client's
#: "Network communication error"), seen under load when a connection idled 5 s.
KEEP_ALIVE: Final = 120


class BearerGuard:
    """An ASGI app refusing every HTTP request without ``Authorization: Bearer <token>``
    (401), passing the others and the lifespan to ``app``."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                body = json.dumps({"error": "a bearer token is required"}).encode()
                headers = [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]
                await send({"type": "http.response.start", "status": 401, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def new_token(token_file: Path) -> str:
    """Draw a token and write it, mode 0600, to ``token_file``."""
    token = secrets.token_urlsafe(32)
    write_private_file(token_file, (token + "\n").encode())
    return token


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any), bound before the gateway is
    built so its cards name the port. Raises OSError."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP,
    # and accepted sockets inherit it. Without it uvicorn's headers and body go out as
    # two segments, Nagle holds the body for the client's delayed ACK, and every
    # response took 40 ms more on loopback.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


class Announcing(uvicorn.Server):
    """uvicorn's server calling ``ready()`` once it serves. SIGINT and SIGTERM stop it
    gracefully and are not raised again after (uvicorn's own handling re-raises them, so
    the process would die of the signal instead of exiting 0)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach the main thread only: whoever runs this one stops it
            return
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle_exit, sig, None)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)

    def __init__(self, config: uvicorn.Config, ready: Callable[[], None]) -> None:
        super().__init__(config)
        self.ready = ready

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:  # else it could not start: uvicorn said why
            self.ready()


def server_config(app: Any, *, keep_alive: int = KEEP_ALIVE) -> uvicorn.Config:
    """uvicorn's configuration for ``app``: warnings only, no lifespan, idle keep-alive
    connections closed after ``keep_alive`` seconds."""
    return uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=keep_alive)


async def serve(
    app: Any,
    sock: socket.socket,
    ready: Callable[[], None] = lambda: None,
    *,
    keep_alive: int = KEEP_ALIVE,
) -> None:
    """Serve ``app`` (already guarded) on the listening ``sock`` until cancelled, or
    SIGINT or SIGTERM (uvicorn's handlers); an idle connection is closed after
    ``keep_alive`` seconds."""
    await Announcing(server_config(app, keep_alive=keep_alive), ready).serve(sockets=[sock])


def base_url(host: str, port: int) -> str:
    """``http://host:port`` (an IPv6 host in brackets)."""
    where = f"[{host}]" if ":" in host else host
    return f"http://{where}:{port}"


__all__ = [
    "KEEP_ALIVE",
    "LOOPBACK",
    "Announcing",
    "BearerGuard",
    "base_url",
    "listen",
    "new_token",
    "serve",
    "server_config",
]
