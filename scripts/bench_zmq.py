"""The ZeroMQ CURVE rows of scripts/bench_node.py: a DEALER sending to a ROUTER over
tcp://127.0.0.1 with pyzmq's ``zmq.asyncio``, CURVE keys on both ends, and a ZAP
authenticator (``zmq.auth.asyncio.AsyncioAuthenticator``) that admits only the
client's public key, as a deployment must: without a ZAP handler a CURVE server
admits every key. Before measuring, a client with another key is seen refused.

The rows mirror the node's rows of bench_node.py: the round trip p50 (an echo), the
pipelined rate (BATCH sends back to back, then a marker the server answers once all
before it were read) and BATCH tasks each sending one message at a time, with the
node's counts and its 200-byte payload, in its two layouts: both ends in one asyncio
loop ("1 process"), or the ROUTER in a child process ("2 processes").

pyzmq is the ``bench`` extra, not a dependency of the package; bench_node.py imports
this module only when pyzmq is installed. The child is ``python bench_zmq.py --serve
CLIENT_PUBLIC_KEY``: it prints ``PORT SERVER_PUBLIC_KEY`` once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

# pyzmq is typed; the ignores are for a type check without the bench extra installed.
import zmq  # type: ignore[import-not-found, unused-ignore]
import zmq.asyncio  # type: ignore[import-not-found, unused-ignore]
from bench_agents import HOST, quantiles, timed_round_trips
from bench_floors import BATCH
from zmq.auth.asyncio import (  # type: ignore[import-not-found, unused-ignore]
    AsyncioAuthenticator,
)
from zmq.utils.monitor import (  # type: ignore[import-not-found, unused-ignore]
    parse_monitor_message,
)

ECHO, SINK, DONE = b"e", b"s", b"x"  # first byte of a message: what the server does
MESSAGE_SIZE = 200  # the node rows' payload (bench_agents.PAYLOAD)
SERVE_SECONDS = 1800  # the child outlives a parent that died without killing it by this much
HANDSHAKE_TIMEOUT = 10.0  # seconds a stranger's CURVE handshake may take to be decided


@dataclass(frozen=True, slots=True)
class ZmqRows:
    """One layout's figures: round trip p50 (us), pipelined and BATCH-task rates (msgs/s)."""

    rtt_p50: float
    rate: float
    tasks_rate: float
    #: Cores this process kept busy during each rate (CPU time over wall time): the
    #: Python thread and libzmq's I/O thread, which encrypts and writes beside it.
    rate_cores: float
    tasks_cores: float
    #: A client with another key failed its handshake (ZAP said no) before the rows ran.
    stranger_refused: bool


def versions() -> str:
    return f"pyzmq {zmq.pyzmq_version()}, libzmq {zmq.zmq_version()}"


class OnlyKey:
    """A ZAP credentials provider that admits one CURVE public key (Z85) and no other."""

    def __init__(self, public: bytes) -> None:
        self._public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self._public


async def serve_messages(router: zmq.asyncio.Socket) -> None:
    """Echo ECHO messages, swallow SINK ones, answer DONE once all before it were read."""
    while True:
        frames: list[bytes] = await router.recv_multipart()
        peer, message = frames[0], frames[-1]
        if message[:1] == ECHO:
            await router.send_multipart([peer, message])
        elif message[:1] == DONE:
            await router.send_multipart([peer, DONE])


@contextlib.asynccontextmanager
async def zmq_server(client_public: bytes) -> AsyncIterator[tuple[int, bytes]]:
    """A CURVE ROUTER on 127.0.0.1 admitting only ``client_public``; yields (port, its key)."""
    public, secret = zmq.curve_keypair()
    context = zmq.asyncio.Context()
    auth = AsyncioAuthenticator(context)
    auth.start()
    auth.configure_curve_callback("*", OnlyKey(client_public))
    router = context.socket(zmq.ROUTER)
    router.curve_server = True
    router.curve_publickey = public
    router.curve_secretkey = secret
    port = router.bind_to_random_port(f"tcp://{HOST}")
    task = asyncio.create_task(serve_messages(router))
    try:
        yield port, public
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        auth.stop()
        router.close(linger=0)
        context.term()


def dealer(
    context: zmq.asyncio.Context, port: int, server_public: bytes, keys: tuple[bytes, bytes]
) -> zmq.asyncio.Socket:
    """A CURVE DEALER with ``keys`` (public, secret) connecting to the server."""
    sock = context.socket(zmq.DEALER)
    sock.curve_serverkey = server_public
    sock.curve_publickey, sock.curve_secretkey = keys
    sock.linger = 0
    sock.connect(f"tcp://{HOST}:{port}")
    return sock


async def stranger_refused(context: zmq.asyncio.Context, port: int, server_public: bytes) -> bool:
    """Whether a client with a key the server was not given fails its CURVE handshake."""
    sock = dealer(context, port, server_public, zmq.curve_keypair())
    events = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    monitor = sock.get_monitor_socket(events)
    try:
        async with asyncio.timeout(HANDSHAKE_TIMEOUT):
            event = parse_monitor_message(await monitor.recv_multipart())
        return bool(event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    except TimeoutError:
        return False
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)


async def rate(sock: zmq.asyncio.Socket, count: int, concurrent_sends: bool) -> tuple[float, float]:
    """Messages per second: BATCH sends back to back, or BATCH tasks each calling send();
    the answer to DONE (read after all before it) marks the end. With the cores this
    process kept busy meanwhile."""
    message = SINK + b"\0" * (MESSAGE_SIZE - 1)
    rounds = count // BATCH
    start, cpu = time.perf_counter(), time.process_time()
    if concurrent_sends:

        async def sender() -> None:
            for _ in range(rounds):
                await sock.send(message)

        async with asyncio.TaskGroup() as group:
            for _ in range(BATCH):
                group.create_task(sender())
    else:
        for _ in range(rounds):
            for _ in range(BATCH):
                await sock.send(message)
    await sock.send(DONE)
    await sock.recv()
    elapsed = time.perf_counter() - start
    return rounds * BATCH / elapsed, (time.process_time() - cpu) / elapsed


async def measure(
    port: int, server_public: bytes, keys: tuple[bytes, bytes], scale: float
) -> ZmqRows:
    """The rows against a server that admits ``keys``; counts as bench_node's node rows."""

    def n(base: int) -> int:
        return max(BATCH * 10, int(base * scale))

    context = zmq.asyncio.Context()
    try:
        refused = await stranger_refused(context, port, server_public)
        sock = dealer(context, port, server_public, keys)
        message = ECHO + b"\0" * (MESSAGE_SIZE - 1)

        async def once() -> None:
            await sock.send(message)
            await sock.recv()

        rtt = quantiles(await timed_round_trips(n(5000), once))
        pipelined = await rate(sock, n(100_000), concurrent_sends=False)
        tasks = await rate(sock, n(50_000), concurrent_sends=True)
        sock.close(linger=0)
        return ZmqRows(rtt[0], pipelined[0], tasks[0], pipelined[1], tasks[1], refused)
    finally:
        context.term()


async def _one_process(scale: float) -> ZmqRows:
    keys = zmq.curve_keypair()
    async with zmq_server(keys[0]) as (port, server_public):
        return await measure(port, server_public, keys, scale)


def in_one_process(scale: float) -> ZmqRows:
    """Both ends in one asyncio loop."""
    return asyncio.run(_one_process(scale))


def in_two_processes(scale: float) -> ZmqRows:
    """The ROUTER (and its authenticator) in a child process, the DEALER here."""
    keys = zmq.curve_keypair()
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", keys[0].decode()], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        port, server_public = server.stdout.readline().split()
        return asyncio.run(measure(int(port), server_public.encode(), keys, scale))
    finally:
        server.kill()
        server.wait()


async def serve_until_killed(client_public: bytes) -> None:
    async with zmq_server(client_public) as (port, public):
        print(port, public.decode(), flush=True)
        await asyncio.sleep(SERVE_SECONDS)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", metavar="CLIENT_PUBLIC_KEY", required=True)
    asyncio.run(serve_until_killed(parser.parse_args().serve.encode()))
