"""Benchmark: SendMessage through ``a2a serve``'s gateway beside the A2A SDK's own server.

Usage: python scripts/bench_a2a.py [--calls 300] [--concurrent 64] [--burst 640]

Both rows use the A2A SDK's Python client over loopback HTTP (JSON-RPC binding, blocking
SendMessage of one text part, the answer a completed task with one artifact), on one
asyncio loop:

(a) the SDK's server (its DefaultRequestHandler and routes, uvicorn) with an echo
    executor in the same process: the message is answered at once;
(b) the gateway (p2pnode.bridges.a2a, same SDK handler and routes, uvicorn) whose agent
    is an echo agent on another node: each message also becomes a request over a
    Noise channel between two in-process nodes on loopback TCP, and back.

Both rows do the same SDK work: the same client and client config, the SDK's handler
and routes behind the same bearer guard, and the same four events per message (the
task, working, the artifact, completed), kept in an in-memory task store.

Rows: p50 and p90 of one message at a time (``--calls``, after a warm-up), and messages
per second with ``--concurrent`` in flight (``--burst`` messages). Both servers run at
once and the one-at-a-time calls alternate between them (an SDK call, a gateway call,
the order swapped each round), so a load that comes and goes on a shared host weighs on
both rows alike; run one after the other, the ratio swung from 0.95 to 2.07 with the
load. ``cpu_ms`` is the CPU time per message of the process serving the row (with the
client's, in the one-process layout), ``client_cpu_ms`` the client's in the
two-process layout. Target: (b) p50 <= 1.3x (a) p50, what the swarm hop may add to the
SDK's own cost. Needs the a2a extra.

``--layout two`` (the default) serves each row from a child process (``--serve
sdk|gateway``; the gateway's process holds both nodes), as a deployment does: the
client's work and the server's do not share one loop. ``one`` serves both in this
process, on the client's loop; ``both`` measures the two layouts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from a2a.client import Client, ClientConfig, create_client
from a2a.helpers.proto_helpers import new_task_from_user_message
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import InMemoryTaskStore, TaskUpdater
from a2a.types import AgentCard, Message, Part, Role, SendMessageRequest
from google.protobuf.json_format import ParseDict
from starlette.applications import Starlette

from p2pnode import Agent, Identity, NodeConfig, TrioNetwork, aio
from p2pnode.agent.definition import Message as AgentMessage
from p2pnode.bridges.a2a.gateway import CARD_PATH, Gateway, NodeSwarm
from p2pnode.bridges.a2a.http import BearerGuard, base_url, listen, serve
from p2pnode.core.envelope import Envelope

HOST = "127.0.0.1"
TOKEN = "bench"
TARGET_RATIO = 1.3
#: The rows, in the order of the first round of interleaved calls.
ROWS = ("sdk", "gateway")

Rows = dict[str, dict[str, float]]


class EchoExecutor(AgentExecutor):
    """The SDK-only row's agent: the same events the gateway sends (task, working,
    artifact, completed), the text echoed."""

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.message is not None and context.task_id and context.context_id
        updater = TaskUpdater(event_queue, context.task_id, context.context_id)
        await event_queue.enqueue_event(new_task_from_user_message(context.message))
        await updater.start_work()
        await updater.add_artifact(list(context.message.parts), name="response")
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        raise NotImplementedError


def _sdk_app(url: str) -> Starlette:
    card = AgentCard()
    ParseDict(
        {
            "name": "echo",
            "description": "echo",
            "version": "1",
            "supportedInterfaces": [
                {"url": f"{url}/jsonrpc", "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}
            ],
            "capabilities": {"streaming": True},
            "defaultInputModes": ["text/plain"],
            "defaultOutputModes": ["text/plain"],
            "skills": [{"id": "echo", "name": "echo", "description": "echo", "tags": ["echo"]}],
        },
        card,
    )
    handler = DefaultRequestHandler(
        agent_executor=EchoExecutor(), task_store=InMemoryTaskStore(), agent_card=card
    )
    routes = [*create_agent_card_routes(card, card_url=CARD_PATH)]
    return Starlette(routes=routes + create_jsonrpc_routes(handler, "/jsonrpc"))


@asynccontextmanager
async def served(build: Callable[[str], Any]) -> AsyncIterator[str]:
    """Serve ``build(base URL)`` behind the bearer guard; yields the base URL."""
    sock = listen(HOST, 0)
    url = base_url(HOST, sock.getsockname()[1])
    ready = asyncio.Event()
    server = asyncio.create_task(serve(BearerGuard(build(url), TOKEN), sock, ready.set))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        yield url
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        sock.close()


async def _ignore(envelope: Envelope) -> None:
    """The gateway's agent only asks."""


@asynccontextmanager
async def gateway_echo() -> AsyncIterator[str]:
    """An echo agent on one node, the gateway on another; yields the agent's A2A URL."""
    echo = Agent("echo", tier=1)

    @echo.on_request("echo.back")
    async def back(message: AgentMessage) -> Any:
        return message.payload

    network, config = TrioNetwork(), NodeConfig(listen=(HOST, 0))
    async with (
        aio.open_node(Identity.generate(), network, config) as owner,
        aio.open_node(Identity.generate(), network, config) as node,
    ):
        await owner.add_agent(echo)
        await node.add_agent("gateway", _ignore, tier=1)
        await node.connect((HOST, owner.listen_address[1]))
        swarm = NodeSwarm(node, "gateway")
        async with served(lambda url: Gateway(swarm, url)) as url:
            yield f"{url}/agents/echo"


async def one(client: Client, text: str) -> None:
    msg = Message(message_id=text, role=Role.ROLE_USER, parts=[Part(text=text)])
    async for event in client.send_message(SendMessageRequest(message=msg)):
        assert event.task.artifacts[0].parts[0].text == text


@asynccontextmanager
async def a2a_client(url: str, width: int) -> AsyncIterator[Client]:
    """The SDK's client of ``url`` (bearer token, up to ``width`` connections), warmed up."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    limits = httpx.Limits(max_connections=width)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=30) as http:
        config = ClientConfig(httpx_client=http, streaming=False)
        client = await create_client(url, client_config=config)
        for i in range(20):  # warm-up
            await one(client, f"w{i}")
        yield client


async def interleaved(servers: dict[str, Server], clients: dict[str, Client], calls: int) -> Rows:
    """p50, p90 and CPU per message of ``calls`` one-at-a-time messages to each row,
    alternating between the rows (the order swapped each round)."""
    times: dict[str, list[float]] = {row: [] for row in clients}
    cpu = {row: 0.0 for row in clients}
    client_cpu = 0.0
    order = list(clients)
    for i in range(calls):
        for row in order if i % 2 == 0 else order[::-1]:
            server_cpu, own_cpu = servers[row].cpu(), time.process_time()
            start = time.perf_counter()
            await one(clients[row], f"m{i}")
            times[row].append(time.perf_counter() - start)
            cpu[row] += servers[row].cpu() - server_cpu
            client_cpu += time.process_time() - own_cpu
    rows: Rows = {}
    for row, samples in times.items():
        quantiles = statistics.quantiles(samples, n=10)
        rows[row] = {"p50_ms": quantiles[4] * 1e3, "p90_ms": quantiles[8] * 1e3}
        rows[row]["cpu_ms"] = cpu[row] / calls * 1e3
        if servers[row].child:
            rows[row]["client_cpu_ms"] = client_cpu / (calls * len(times)) * 1e3
    return rows


async def _burst(call: Callable[[int], Awaitable[None]], total: int, width: int) -> float:
    """Messages per second of ``total`` calls with ``width`` in flight."""
    slots = asyncio.Semaphore(width)

    async def bounded(i: int) -> None:
        async with slots:
            await call(i)

    start = time.perf_counter()
    await asyncio.gather(*(bounded(i) for i in range(total)))
    return total / (time.perf_counter() - start)


@dataclass(frozen=True, slots=True)
class Server:
    """A row's server: its client URL and where its CPU time is read."""

    url: str
    #: The child process serving it, or None when it is this process.
    child: int | None = None

    def cpu(self) -> float:
        """CPU seconds used so far by the process serving the row."""
        if self.child is None:
            return time.process_time()
        fields = Path(f"/proc/{self.child}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


@asynccontextmanager
async def in_process(row: str) -> AsyncIterator[Server]:
    """The server of ``row`` ("sdk" or "gateway") in this process."""
    async with served(_sdk_app) if row == "sdk" else gateway_echo() as url:
        yield Server(url)


@asynccontextmanager
async def in_child(row: str) -> AsyncIterator[Server]:
    """The server of ``row`` in a child process (``--serve``). The child serves until it
    is killed (it keeps nothing: its nodes live in memory)."""
    child = await asyncio.create_subprocess_exec(
        sys.executable, __file__, "--serve", row, stdout=asyncio.subprocess.PIPE
    )
    assert child.stdout is not None
    try:
        line = await asyncio.wait_for(child.stdout.readline(), 60)
        if not line:
            raise RuntimeError(f"the {row} server did not start")
        yield Server(line.decode().strip(), child.pid)
    finally:
        child.kill()
        await child.wait()


async def serve_row(row: str) -> None:
    """``--serve``: serve ``row`` and print its client URL, until killed."""
    async with in_process(row) as server:
        print(server.url, flush=True)
        await asyncio.Event().wait()


async def measure(where: Callable[[str], Any], args: argparse.Namespace) -> Rows:
    """Both rows served by ``where``: their interleaved calls, then each row's burst."""
    async with AsyncExitStack() as stack:
        servers = {row: await stack.enter_async_context(where(row)) for row in ROWS}
        clients = {
            row: await stack.enter_async_context(a2a_client(server.url, args.concurrent))
            for row, server in servers.items()
        }
        rows = await interleaved(servers, clients, args.calls)
        for row, client in clients.items():
            calls = partial(_burst_call, client)
            rows[row]["per_s"] = await _burst(calls, args.burst, args.concurrent)
    return rows


async def _burst_call(client: Client, i: int) -> None:
    await one(client, f"b{i}")


async def main(args: argparse.Namespace) -> dict[str, Any]:
    layouts = {"one": [("", in_process)], "two": [("_two", in_child)]}
    # The child processes first: once a server of this process has stopped, a child
    # started after it was seen to lose its pipes (the rows then fail or hang).
    layouts["both"] = layouts["two"] + layouts["one"]
    result: dict[str, Any] = {"target": TARGET_RATIO}
    for suffix, where in layouts[args.layout]:
        rows = await measure(where, args)
        for row in ROWS:
            result[row + suffix] = rows[row]
        ratio = rows["gateway"]["p50_ms"] / rows["sdk"]["p50_ms"]
        result["p50_ratio" + suffix] = ratio
        result["met" + suffix] = ratio <= TARGET_RATIO
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--concurrent", type=int, default=64)
    parser.add_argument("--burst", type=int, default=640)
    parser.add_argument("--layout", choices=["one", "two", "both"], default="two")
    parser.add_argument("--serve", choices=["sdk", "gateway"], help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.serve is not None:
        asyncio.run(serve_row(arguments.serve))
        sys.exit(0)
    result = asyncio.run(main(arguments))
    for key, value in result.items():
        if isinstance(value, dict):
            print(key, {k: round(v, 2) for k, v in value.items()})
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, dict)}))
