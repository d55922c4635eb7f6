"""``p2pnode mcp serve --http HOST:PORT``: the swarm's MCP server over streamable HTTP.

The SDK's own ASGI app (``Server.streamable_http_app``, with its DNS
rebinding protection for loopback hosts) served by uvicorn, which the SDK
depends on already, on asyncio: the process talks to its node over
``agent.sock`` with the anyio client, so it needs no trio, and no second
ASGI server (hypercorn's trio worker) is added for it.

Loopback only, and every request must carry ``Authorization: Bearer
<token>``: ``agent.sock`` is reachable by its owner alone, while a loopback
port is reachable by every local user, so without the token any of them
would use the swarm as this agent. The token is drawn at start and written
(mode 0600) to ``token_file``; the ready line on stdout names the URL and
that file.
"""

from __future__ import annotations

import hmac
import json
import secrets
from pathlib import Path
from typing import Any

import anyio
import uvicorn

from p2pnode.bridges.mcp.serve import SwarmServer
from p2pnode.core.identity import write_private_file

Scope = dict[str, Any]


class BearerGuard:
    """An ASGI app refusing every HTTP request without ``Authorization: Bearer <token>``
    (401), passing the others and the lifespan to ``app``."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            given = dict(scope.get("headers") or ()).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                body = json.dumps({"error": "a bearer token is required"}).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": 401,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"www-authenticate", b"Bearer"),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


async def serve_http(server: SwarmServer, host: str, port: int, *, token_file: Path) -> None:
    """Serve ``server`` on ``http://host:port/mcp`` until SIGINT or SIGTERM (uvicorn's),
    watching the swarm for list changes. Prints the ready line once listening."""
    token = secrets.token_urlsafe(32)
    write_private_file(token_file, (token + "\n").encode())
    app = BearerGuard(server.server.streamable_http_app(host=host), token)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
    web = _Announcing(config, token_file)
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(server.watch)
        await web.serve()
        tasks.cancel_scope.cancel()


class _Announcing(uvicorn.Server):
    """uvicorn's server, printing the ready line (URL and token file) once it listens."""

    def __init__(self, config: uvicorn.Config, token_file: Path) -> None:
        super().__init__(config)
        self.token_file = token_file

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.should_exit:  # it could not bind: uvicorn said why
            return
        host = self.config.host
        bound = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
        where = f"[{host}]" if ":" in host else host
        ready = {"event": "ready", "url": f"http://{where}:{bound}/mcp",
                 "tokenFile": str(self.token_file)}  # fmt: skip
        print(json.dumps(ready), flush=True)


__all__ = ["BearerGuard", "serve_http"]
