"""The agent runtime's rows of scripts/bench_node.py: an agent embedded in a trio and in an
asyncio program (p2pnode.hosting.aio), and the floors the attach rows are read against (two
process hops with no node at either end). Shared helpers of the benchmark live here too.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio
from bench_channel import fmt

from p2pnode.agent.definition import Agent, Message
from p2pnode.core.envelope import Envelope
from p2pnode.core.identity import Identity
from p2pnode.hosting import aio
from p2pnode.runtime import Node, NodeConfig, open_node
from p2pnode.transport.net import TrioNetwork

PAYLOAD = "p" * 200  # a 256-byte-ish envelope body once ids and headers are added
HOST = "127.0.0.1"
ATTACH_TIMEOUT = 30.0
#: Round trips measured at least (the benchmark's smallest scale).
MIN_COUNT = 640


async def echo(envelope: Envelope) -> Any:
    return envelope.payload


def quantiles(samples: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(samples, n=100)
    return q[49], q[98]


async def timed_round_trips(count: int, once: Callable[[], Awaitable[object]]) -> list[float]:
    samples = []
    for i in range(count + 200):
        start = time.perf_counter()
        await once()
        if i >= 200:  # warm-up
            samples.append((time.perf_counter() - start) * 1e6)
    return samples


# The least two process hops cost: a child echoing over a Unix socket, read and written with
# anyio on asyncio as the attached agent's process does.
UNIX_ECHO = """
import sys, anyio

async def main(path):
    stream = await anyio.connect_unix(path)
    try:
        while True:  # until the parent closes the socket (then kills this process)
            await stream.send(await stream.receive(65536))
    except (anyio.EndOfStream, anyio.BrokenResourceError):
        pass

anyio.run(main, sys.argv[1])
"""
# The least a JSON-lines peer costs: a child with a minimal asyncio Protocol that parses
# each line and writes it back encoded (no validation, no handler, no task).
JSON_ECHO = """
import asyncio, json, sys

class Echo(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.buffer = transport, b""
    def data_received(self, data):
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\\n")
        for line in lines:
            self.transport.write(json.dumps(json.loads(line)).encode() + b"\\n")
    def connection_lost(self, exc):
        done.set_result(None)

async def main(path):
    global done
    done = asyncio.get_running_loop().create_future()
    await asyncio.get_running_loop().create_unix_connection(Echo, path)
    await done

asyncio.run(main(sys.argv[1]))
"""
ECHO_LINE = b"e" * 400 + b"\n"  # about the size of an envelope event with PAYLOAD
JSON_LINE = b'{"event":"envelope","payload":"' + b"e" * 370 + b'"}\n'  # the same, as JSON


async def unix_echo_round_trips(
    count: int, script: str = UNIX_ECHO, line: bytes = ECHO_LINE
) -> float:
    """Round trip p50 (us) of one line to a child process and back over a Unix socket."""
    with tempfile.TemporaryDirectory() as data_dir:
        path = Path(data_dir) / "echo.sock"
        listener = trio.socket.socket(trio.socket.AF_UNIX)
        await listener.bind(str(path))
        listener.listen(1)
        child = await trio.lowlevel.open_process(
            [sys.executable, "-c", script, str(path)], stdin=subprocess.DEVNULL
        )
        try:
            with trio.fail_after(ATTACH_TIMEOUT):
                sock, _ = await listener.accept()
            stream = trio.SocketStream(sock)

            async def once() -> None:
                await stream.send_all(line)
                received = 0
                while received < len(line):  # bounded: each read returns some bytes
                    received += len(await stream.receive_some(65536))

            p50 = quantiles(await timed_round_trips(count, once))[0]
            await stream.aclose()
            return p50
        finally:
            listener.close()
            child.kill()
            with trio.CancelScope(shield=True):
                await child.wait()


@dataclass(frozen=True)
class Floors:
    """What two process hops cost with no node at either end, measured in the same run."""

    #: A line echoed by anyio on asyncio (read, write), p50 us.
    echo: float
    #: A JSON line parsed and written back by a minimal asyncio Protocol, p50 us.
    json_echo: float


def measure_floors(scale: float) -> Floors:
    count = max(MIN_COUNT, int(5000 * scale))
    echo = trio.run(unix_echo_round_trips, count)
    json_echo = trio.run(unix_echo_round_trips, count, JSON_ECHO, JSON_LINE)
    return Floors(echo, json_echo)


# -- an agent embedded with trio vs with asyncio ------------------------------------------------

#: asyncio-embedded against trio-embedded, node to node; same node: within the guest-mode
#: plus one crossing floor, and TARGET_OVER_FLOOR of it.
TARGET_AIO_RATIO = 1.3
TARGET_OVER_FLOOR = 1.1


def echo_agent() -> Agent:
    """The same definition for both hosts: an async handler answering with the payload."""
    agent = Agent("server", tier=3)

    @agent.on_request()
    async def echo_payload(message: Message) -> Any:
        return message.payload

    return agent


async def trio_embedded(count: int, remote: bool) -> float:
    """Round trip p50 to an agent hosted by a node in a trio program."""
    async with open_node(Identity.generate(), TrioNetwork(), NodeConfig()) as server:
        await server.add_agent(echo_agent())
        if not remote:
            await server.add_agent("client", echo, tier=3)
            return quantiles(await timed_round_trips(count, partial(ask, server)))[0]
        async with open_node(Identity.generate(), TrioNetwork(), NodeConfig()) as client:
            await client.add_agent("client", echo, tier=3)
            await client.connect((HOST, server.listen_address[1]))
            return quantiles(await timed_round_trips(count, partial(ask, client)))[0]


async def asyncio_embedded(count: int, remote: bool) -> float:
    """The same, the nodes opened by an asyncio program (p2pnode.hosting.aio)."""
    async with aio.open_node(Identity.generate(), TrioNetwork(), NodeConfig()) as server:
        await server.add_agent(echo_agent())
        if not remote:
            await server.add_agent("client", echo, tier=3)
            return quantiles(await timed_round_trips(count, partial(ask, server)))[0]
        async with aio.open_node(Identity.generate(), TrioNetwork(), NodeConfig()) as client:
            await client.add_agent("client", echo, tier=3)
            await client.connect((HOST, server.listen_address[1]))
            return quantiles(await timed_round_trips(count, partial(ask, client)))[0]


async def ask(node: Node | aio.AioNode) -> Envelope:
    return await node.request("client", "server", PAYLOAD)


EmbeddedRow = tuple[str, float, float]


async def guest_same_node(count: int) -> float:
    """Floor of the asyncio row, same node: the trio node in guest mode on the asyncio loop,
    its agent a trio one and the requests made from trio: no crossing to asyncio, only
    what running trio as a guest costs."""
    async with aio.open_node(Identity.generate(), TrioNetwork(), NodeConfig()) as server:
        await server.run_trio(server.node.add_agent, echo_agent())
        await server.run_trio(server.node.add_agent, "client", echo)

        async def in_trio() -> float:
            return quantiles(await timed_round_trips(count, partial(ask, server.node)))[0]

        return await server.run_trio(in_trio)


async def guest_node_to_node(count: int) -> float:
    """Floor of the asyncio row, node to node: both nodes in guest mode on the asyncio loop,
    their agents trio ones and the requests made from trio: what guest mode costs between
    nodes, where it waits for sockets in a thread of its own and hands each readiness to
    the asyncio loop (between agents of one node it waits for no socket)."""
    async with aio.open_node(Identity.generate(), TrioNetwork(), NodeConfig()) as server:
        await server.run_trio(server.node.add_agent, echo_agent())
        async with aio.open_node(Identity.generate(), TrioNetwork(), NodeConfig()) as client:
            await client.run_trio(client.node.add_agent, "client", echo)
            await client.connect((HOST, server.listen_address[1]))

            async def in_trio() -> float:
                return quantiles(await timed_round_trips(count, partial(ask, client.node)))[0]

            return await client.run_trio(in_trio)


async def crossing(count: int) -> float:
    """Floor of the asyncio rows: one call from asyncio into the node's trio world and back
    (``run_trio`` of a function that does nothing)."""
    async with aio.open_node(Identity.generate(), TrioNetwork(), NodeConfig()) as node:
        return quantiles(
            await timed_round_trips(count, partial(node.run_trio, trio.lowlevel.checkpoint))
        )[0]


@dataclass(frozen=True)
class Embedded:
    rows: list[EmbeddedRow]
    #: p50 us: the same-node round trip in guest mode asked from trio; one crossing.
    guest: float
    crossing: float
    #: p50 us: the node-to-node round trip, both nodes in guest mode, asked from trio.
    guest_remote: float


def embedded_rows(scale: float) -> Embedded:
    count = max(MIN_COUNT, int(5000 * scale))
    rows = []
    for remote, name in ((True, "node to node"), (False, "same node")):
        trio_p50 = trio.run(trio_embedded, count, remote)
        asyncio_p50 = asyncio.run(asyncio_embedded(count, remote))
        rows.append((f"agent round trip p50 (us), {name}", trio_p50, asyncio_p50))
    guest = asyncio.run(guest_same_node(count))
    guest_remote = asyncio.run(guest_node_to_node(count))
    return Embedded(rows, guest, asyncio.run(crossing(count)), guest_remote)


def print_embedded(embedded: Embedded) -> None:
    rows = embedded.rows
    header = f"{'embedded agent, 1 process':<42}{'trio':>9}{'asyncio':>9}{'asyncio/trio':>14}"
    print(header)
    print("-" * len(header))
    for name, trio_p50, asyncio_p50 in rows:
        ratio = asyncio_p50 / trio_p50
        print(f"{name:<42}{fmt(trio_p50):>9}{fmt(asyncio_p50):>9}{ratio:>14.2f}")
    (_, remote_trio, remote_aio), (_, same_node, same_aio) = rows
    print(
        f"floor: the same node in trio guest mode on the asyncio loop, asked from trio, "
        f"p50 {embedded.guest:.1f} us ({embedded.guest / same_node:.2f}x trio)"
    )
    print(
        f"floor: the two nodes in trio guest mode on the asyncio loop, asked from trio, "
        f"p50 {embedded.guest_remote:.1f} us ({embedded.guest_remote / remote_trio:.2f}x trio)"
    )
    print(
        f"floor: one call from asyncio into the guest run and back (run_trio of a checkpoint), "
        f"p50 {embedded.crossing:.1f} us"
    )
    floor = (embedded.guest + embedded.crossing) / same_node
    remote_floor = (embedded.guest_remote + embedded.crossing) / remote_trio
    print(f"  guest mode + one crossing, same node: {floor:.2f}x trio")
    print(f"  guest mode + one crossing, node to node: {remote_floor:.2f}x trio")
    ratio = remote_aio / remote_trio
    met = "met" if ratio <= TARGET_AIO_RATIO else "NOT met"
    forbids = " (the floor alone is over it)" if remote_floor > TARGET_AIO_RATIO else ""
    print(f"target: node to node within {TARGET_AIO_RATIO}x of trio: {ratio:.2f}x {met}{forbids}")
    ratio, bound = same_aio / same_node, floor * TARGET_OVER_FLOOR
    met = "met" if ratio <= bound else "NOT met"
    print(
        f"target: same node within the floor + {TARGET_OVER_FLOOR - 1:.0%} "
        f"({bound:.2f}x trio): {ratio:.2f}x {met}"
    )


__all__ = [
    "ATTACH_TIMEOUT", "HOST", "PAYLOAD", "Embedded", "Floors", "echo", "embedded_rows",
    "measure_floors", "print_embedded", "quantiles", "timed_round_trips",
]  # fmt: skip
