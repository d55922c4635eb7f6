"""A node inside an asyncio program, next to a small HTTP front end (asyncio streams).

From this folder::

    python aio_http.py --port 8080 [--bootstrap HOST:PORT]
    curl -d '{"goal": "ship"}' http://127.0.0.1:8080/plan.strategy

``POST /<capability>`` with a JSON body sends the body as a request for that
capability, from the agent ``gateway``, to an agent offering it (here or in
the swarm), and answers with the reply as JSON. The planner agent of
planner.py runs in the same node, so the example answers on its own.

Errors map to statuses: a payload the capability's schema refuses is 400, an
unknown capability 404, no answer in time 504, any other failure 502; the
body is ``{"code": ..., "message": ...}``. Only what this needs of HTTP/1.1
is spoken: one request per connection, a ``Content-Length`` body, bounded
sizes and times.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from typing import Any

from planner import agent as planner

from p2pnode import Envelope, ErrorCode, Identity, NodeConfig, P2PError, TrioNetwork, aio
from p2pnode.node.config import parse_address

MAX_BODY = 1 << 20
MAX_HEADERS = 100
READ_SECONDS = 10.0
STATUS = {
    ErrorCode.INVALID_INPUT: (400, "Bad Request"),
    ErrorCode.CAPABILITY_NOT_FOUND: (404, "Not Found"),
    ErrorCode.AGENT_NOT_FOUND: (404, "Not Found"),
    ErrorCode.TIMEOUT: (504, "Gateway Timeout"),
}


class BadRequest(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason = status, reason


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes]:
    """Method, path and body of one request. Raises BadRequest."""
    try:
        method, path, _version = (await reader.readline()).decode("latin-1").split()
        length = 0
        for _ in range(MAX_HEADERS):
            line = (await reader.readline()).decode("latin-1").strip()
            if not line:
                break
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        else:
            raise BadRequest(431, "Request Header Fields Too Large", "too many headers")
        if not 0 <= length <= MAX_BODY:
            raise BadRequest(413, "Content Too Large", f"the body is over {MAX_BODY} bytes")
        body = await reader.readexactly(length)
    except (ValueError, asyncio.IncompleteReadError) as exc:  # includes an over-long line
        raise BadRequest(400, "Bad Request", f"malformed request: {exc}") from None
    return method, path, body


async def answer(node: aio.AioNode, method: str, path: str, body: bytes) -> Any:
    """The reply's payload to one request. Raises BadRequest or what the node raises."""
    if method != "POST":
        raise BadRequest(405, "Method Not Allowed", "POST /<capability> with a JSON body")
    try:
        payload = json.loads(body or b"null")
    except ValueError as exc:
        raise BadRequest(400, "Bad Request", f"the body is not JSON: {exc}") from None
    reply = await node.request("gateway", path.strip("/"), payload, capability=True)
    return reply.payload


async def handle(
    node: aio.AioNode, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    status, reason = 200, "OK"
    try:
        async with asyncio.timeout(READ_SECONDS):
            method, path, body = await read_request(reader)
        result = await answer(node, method, path, body)
    except BadRequest as exc:
        status, reason, result = (
            exc.status,
            exc.reason,
            {"code": "BAD_REQUEST", "message": str(exc)},
        )
    except P2PError as exc:
        status, reason = STATUS.get(exc.code, (502, "Bad Gateway"))
        result = {"code": exc.code.value, "message": exc.message}
    except TimeoutError:
        status, reason, result = 408, "Request Timeout", {"code": "TIMEOUT", "message": "too slow"}
    data = json.dumps(result).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    )
    try:
        writer.write(head.encode() + data)
        await writer.drain()
    except ConnectionError:
        pass  # the client left; nothing to answer
    finally:
        writer.close()


async def ignore(envelope: Envelope) -> None:
    """The gateway only asks; what it is sent is dropped."""


async def run(
    host: str,
    port: int,
    *,
    bootstrap: tuple[str, ...] = (),
    ready: Callable[[int], None] = lambda port: None,
) -> None:
    """Run the node and the HTTP front end until cancelled; ``ready`` gets the HTTP port."""
    config = NodeConfig(bootstrap=tuple(parse_address(a) for a in bootstrap))
    async with aio.open_node(Identity.generate(), TrioNetwork(), config) as node:
        await node.add_agent(planner)
        await node.add_agent("gateway", ignore, tier=3)
        if bootstrap:
            await node.join()

        async def on_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await handle(node, reader, writer)

        server = await asyncio.start_server(on_connection, host, port)
        async with server:
            ready(server.sockets[0].getsockname()[1])
            await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--bootstrap", action="append", default=[], metavar="HOST:PORT")
    args = parser.parse_args()

    def ready(port: int) -> None:
        print(f"listening on http://{args.host}:{port}/<capability>", flush=True)

    asyncio.run(run(args.host, args.port, bootstrap=tuple(args.bootstrap), ready=ready))


if __name__ == "__main__":
    main()
