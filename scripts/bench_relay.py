"""Benchmark: a secure channel through a circuit relay vs a direct one, on 127.0.0.1.

Usage: python scripts/bench_relay.py [--megabytes 64] [--pings 300] [--setups 100]
                                     [--layout one|apart|both]

Both rows of a layout are measured in the same run, between the same two identities:
the target accepts secure channels on its own listener (direct) and through a
reservation on a relay (p2pnode.transport.relayserve). The relay's limits are lifted
for the run (no pacing, no byte budget, no request rate) so the rows measure the
relay's copying, not its policy. Each figure is the median of 3 rounds:

* bulk: ``--megabytes`` of 64 KiB messages one way, then one reply (MB/s);
  target: relayed >= 0.5x direct;
* round trip: p50 of ``--pings`` 64-byte request/echo exchanges, one at a time,
  on a direct and a relayed channel opened together, their pings alternating so that
  both see the same machine (this host is shared: a load that came and went between
  a direct and a relayed run used to tilt the ratio); target: relayed <= 2.0x direct;
* setups: channels a second, each CONNECT (or TCP connect), Noise XX handshake,
  one round trip and close, one after another (no target; printed);
* echo (the floor): p50 of 64-byte round trips of a plain TCP echo at the target (no
  channel), direct, through a minimal byte splice (two tasks per connection,
  ``recv_into`` and ``send``, nothing counted) placed where the relay is, and through
  a relay circuit, the three alternating as above. The splice is what any trio relay
  adds at the least; the relay's echo row shows what the relay adds to the same
  bytes. "added" is relayed minus direct.

Layouts (``--layout``, both by default):

* ``one``: the dialer, the target and the relay in one trio process. Every relay hop
  is then paid by the thread that also runs both ends, and the two ends of a direct
  channel hand each other the turn without ever waiting for the kernel, so this
  layout shows the relay's cost at its heaviest. Its rows are printed with their
  floor and carry no verdict.
* ``apart``: the dialer here, the relay (and the floor's splice) and the target (and
  the echo) each in a child process of its own, as they are three devices in
  reality: every hop is then a hand-over between processes, direct (two a round
  trip) as relayed (four). **This layout's rows carry the targets.** On a machine
  with fewer free cores than processes its figures include the OS scheduler's
  wake-ups; the floor row shows how much.
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import trio

from p2pnode.core.identity import Identity
from p2pnode.transport.channel import SecureChannel, accept_secure, connect_secure
from p2pnode.transport.net import Address, StreamListener, TrioNetwork
from p2pnode.transport.relay import RelayAddress, RelayError, RelayLimits
from p2pnode.transport.relayserve import (
    RelayReservation,
    RelayServer,
    connect_via_relay,
    reserve,
)
from p2pnode.transport.secure import SecureIdentity
from p2pnode.transport.tcpstream import TcpStream

HOST = "127.0.0.1"
BULK = b"B" * 65536
END = b"END"
ROUNDS = 3
BULK_TARGET = 0.5  # relayed / direct MB/s, at least
RTT_TARGET = 2.0  # relayed / direct p50, at most
OPEN_LIMITS = RelayLimits(
    max_circuits=10_000,
    max_circuits_per_reservation=10_000,
    circuit_duration=86_400.0,
    circuit_data=2**62,
    circuit_rate=0,
    requests_per_ip=1e9,
    request_burst=10**9,
)

TARGET = SecureIdentity(Identity(b"\x71" * 32))
DIALER = SecureIdentity(Identity(b"\x72" * 32))
RELAY = Identity(b"\x70" * 32)
ECHO = Identity(b"\x73" * 32)  # the target's second reservation: relayed echo streams

Opener = Callable[[], Awaitable[trio.abc.Stream]]


async def serve_channel(stream: trio.abc.Stream) -> None:
    """The target's side: echo each message but bulk ones; answer END with the count."""
    received = 0
    try:
        async with await accept_secure(stream, TARGET) as channel:
            while True:
                message = await channel.receive_message()
                if message[:1] == b"B":
                    received += len(message)
                elif message == END:
                    await channel.send_message(str(received).encode())
                    received = 0
                else:
                    await channel.send_message(message)
    except Exception:  # the dialer closed: this bench's channels end so
        return


async def open_channel(opener: Opener) -> SecureChannel:
    return await connect_secure(await opener(), DIALER, expected_peer_id=TARGET.peer_id)


async def bulk(opener: Opener, megabytes: int) -> float:
    """MB/s of ``megabytes`` one way."""
    async with await open_channel(opener) as channel:
        count = megabytes * 16  # 64 KiB messages
        start = time.perf_counter()
        for _ in range(count):
            await channel.send_message(BULK)
        await channel.send_message(END)
        assert int(await channel.receive_message()) == count * len(BULK)
        return count * len(BULK) / 1e6 / (time.perf_counter() - start)


async def alternating(
    exchanges: tuple[Callable[[bytes], Awaitable[None]], ...], pings: int
) -> tuple[float, ...]:
    """p50 (ms) of each of ``exchanges`` (one 64-byte request and its echo), their pings
    alternating (and which goes first, too) so that all see the same machine: a load
    that comes and goes between two rounds no longer tilts a ratio."""
    times: list[list[float]] = [[] for _ in exchanges]
    for i in range(pings):
        message = i.to_bytes(8, "big") * 8
        order = range(len(exchanges)) if i % 2 else reversed(range(len(exchanges)))
        for k in order:
            start = time.perf_counter()
            await exchanges[k](message)
            times[k].append(time.perf_counter() - start)
    return tuple(statistics.median(t[pings // 10 :]) * 1000 for t in times)  # after a warm-up


async def round_trip(direct: Opener, relayed: Opener, pings: int) -> tuple[float, ...]:
    """p50 of one 64-byte exchange on a direct and on a relayed channel (ms)."""

    def exchange(channel: SecureChannel) -> Callable[[bytes], Awaitable[None]]:
        async def one(message: bytes) -> None:
            await channel.send_message(message)
            assert await channel.receive_message() == message

        return one

    async with await open_channel(direct) as one, await open_channel(relayed) as two:
        return await alternating((exchange(one), exchange(two)), pings)


async def setups(opener: Opener, count: int) -> float:
    """Channels opened, used once and closed a second."""
    start = time.perf_counter()
    for _ in range(count):
        async with await open_channel(opener) as channel:
            await channel.send_message(b"hi")
            await channel.receive_message()
    return count / (time.perf_counter() - start)


async def serve_streams(accept: Callable[[], Awaitable[trio.abc.Stream]]) -> None:
    async with trio.open_nursery() as nursery:
        while True:
            nursery.start_soon(serve_channel, await accept())


# --- the floor: a plain TCP echo, direct, through a minimal splice and a relay ------


async def echo(stream: trio.abc.Stream) -> None:
    """Echo every byte back until the stream ends."""
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        async with stream:
            while data := await stream.receive_some(65536):
                await stream.send_all(data)


async def serve_echo(sock: socket.socket, reservation: RelayReservation) -> None:
    """Echo on every connection accepted on the listening ``sock`` and on every stream
    relayed through ``reservation``."""
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))

    async def accept_relayed(nursery: trio.Nursery) -> None:
        with contextlib.suppress(RelayError):  # the reservation ended: the run is over
            while True:
                nursery.start_soon(echo, await reservation.accept())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept_relayed, nursery)
        while True:
            nursery.start_soon(echo, TcpStream.adopt(await listener.accept()))


async def splice_one_way(source: socket.socket, sink: socket.socket) -> None:
    """The least a trio relay can do per chunk: read, write, wait when there is none."""
    buffer = bytearray(65536)
    view = memoryview(buffer)
    with contextlib.suppress(OSError, trio.ClosedResourceError):
        while True:
            try:
                n = source.recv_into(buffer)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(source)
                continue
            if not n:
                return
            sent = 0
            while sent < n:
                try:
                    sent += sink.send(view[sent:n])
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(sink)


async def serve_splices(net: TrioNetwork, listener: StreamListener, to: Address) -> None:
    """Splice every accepted connection to a new connection to ``to``."""

    async def splice(a: trio.abc.Stream) -> None:
        async with a, await net.connect_stream(to) as b:
            assert isinstance(a, TcpStream) and isinstance(b, TcpStream)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(splice_one_way, a.socket, b.socket)
                await splice_one_way(b.socket, a.socket)
                nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        while True:
            nursery.start_soon(splice, await listener.accept())


async def echo_round_trip(
    direct: Opener, spliced: Opener, relayed: Opener, pings: int
) -> tuple[float, ...]:
    """p50 of one 64-byte exchange with the echo, direct, through the minimal splice and
    through a relay circuit (ms)."""

    def exchange(stream: trio.abc.Stream) -> Callable[[bytes], Awaitable[None]]:
        async def one(message: bytes) -> None:
            await stream.send_all(message)
            got = b""
            while len(got) < len(message):
                got += await stream.receive_some(65536)
            assert got == message

        return one

    async with await direct() as one, await spliced() as two, await relayed() as three:
        return await alternating((exchange(one), exchange(two), exchange(three)), pings)


# --- the parties -----------------------------------------------------------------------


def echo_socket() -> socket.socket:
    """The floor's echo listener, bound before any child starts so they can be told
    its port (and the target's child inherits it)."""
    sock = socket.socket()
    sock.bind((HOST, 0))
    sock.listen(64)
    return sock


async def serve_relay(
    server: RelayServer,
    net: TrioNetwork,
    echo: Address,
    *,
    task_status: trio.TaskStatus[tuple[Address, Address]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The relay and, beside it, the floor's splice to ``echo``; started: both addresses."""
    async with trio.open_nursery() as nursery:
        relay_address = await nursery.start(server.serve, (HOST, 0))
        splicer = await net.listen_stream((HOST, 0))
        nursery.start_soon(serve_splices, net, splicer, echo)
        task_status.started((relay_address, splicer.local_address))


async def serve_target(
    net: TrioNetwork,
    relay: RelayAddress,
    echo_sock: socket.socket,
    *,
    task_status: trio.TaskStatus[Address] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The target: channels on its own listener and through its reservation on
    ``relay``, and the floor's echo; started (once reserved): its direct address."""
    async with trio.open_nursery() as nursery:
        listener = await net.listen_stream((HOST, 0))
        nursery.start_soon(serve_streams, listener.accept)
        async with (
            reserve(net, relay, TARGET.identity, backlog=64) as reservation,
            reserve(net, relay, ECHO, backlog=64) as echo_reservation,
        ):
            nursery.start_soon(serve_echo, echo_sock, echo_reservation)
            nursery.start_soon(serve_streams, reservation.accept)
            task_status.started(listener.local_address)
            await trio.sleep_forever()


# --- the layouts ----------------------------------------------------------------------

Rows = dict[str, list[tuple[float, ...]]]
#: A row's (direct, relayed) figures of one round, from the two openers and a size.
Pair = Callable[[Opener, Opener, int], Awaitable[tuple[float, ...]]]


async def measure(
    net: TrioNetwork, direct: Address, relay: RelayAddress, floor: tuple[Address, Address],
    args: argparse.Namespace,
) -> Rows:  # fmt: skip
    """Each row's (direct, relayed) figures, round by round, the two alternating."""

    def opener(address: Address) -> Opener:
        return lambda: net.connect_stream(address)

    async def relayed() -> trio.abc.Stream:
        return await connect_via_relay(net, relay, TARGET.peer_id)

    async def relayed_echo() -> trio.abc.Stream:
        return await connect_via_relay(net, relay, ECHO.peer_id)

    def one_then_other(run: Callable[[Opener, int], Awaitable[float]]) -> Pair:
        async def pair(first: Opener, second: Opener, size: int) -> tuple[float, ...]:
            return await run(first, size), await run(second, size)

        return pair

    runs: dict[str, tuple[Pair, int, Opener, Opener]] = {
        BULK_ROW: (one_then_other(bulk), args.megabytes, opener(direct), relayed),
        RTT_ROW: (round_trip, args.pings, opener(direct), relayed),
        SETUP_ROW: (one_then_other(setups), args.setups, opener(direct), relayed),
    }
    rows: Rows = {name: [] for name in (*runs, SPLICE_ROW, ECHO_ROW)}
    for _ in range(ROUNDS):
        for name, (run, size, first, second) in runs.items():
            rows[name].append(await run(first, second, size))
        plain, spliced, relayed_ = await echo_round_trip(
            opener(floor[0]), opener(floor[1]), relayed_echo, args.pings
        )
        rows[SPLICE_ROW].append((plain, spliced))
        rows[ECHO_ROW].append((plain, relayed_))
    return rows


async def one_process(args: argparse.Namespace) -> None:
    """The ``one`` layout: every party in this trio process."""
    net = TrioNetwork()
    server = RelayServer(net, RELAY.peer_id, OPEN_LIMITS)
    echo_sock = echo_socket()
    echo: Address = echo_sock.getsockname()
    async with trio.open_nursery() as nursery:
        relay_address, splice = await nursery.start(serve_relay, server, net, echo)
        relay = RelayAddress(relay_address, RELAY.peer_id)
        direct = await nursery.start(serve_target, net, relay, echo_sock)
        rows = await measure(net, direct, relay, (echo, splice), args)
        report(rows, server, verdicts=False)
        nursery.cancel_scope.cancel()


def apart(args: argparse.Namespace) -> None:
    """The ``apart`` layout: the relay and the target in child processes (killed at the
    end: they keep nothing), the dialer in this one."""
    echo_sock = echo_socket()
    echo_port = echo_sock.getsockname()[1]
    children: list[subprocess.Popen[str]] = []

    def child(*argv: str, fds: tuple[int, ...] = ()) -> list[int]:
        """Start a child; its first line: the ports it serves on."""
        process = subprocess.Popen(
            [sys.executable, __file__, *argv], stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, text=True, pass_fds=fds,
        )  # fmt: skip
        children.append(process)
        assert process.stdout is not None
        return [int(word) for word in process.stdout.readline().split()]

    try:
        relay_port, splice_port = child("--serve-relay", str(echo_port))
        fd = echo_sock.fileno()
        (direct_port,) = child("--serve-target", str(relay_port), str(fd), fds=(fd,))
        echo_sock.close()  # the target's child has it
        relay = RelayAddress((HOST, relay_port), RELAY.peer_id)
        floor = ((HOST, echo_port), (HOST, splice_port))
        rows = trio.run(measure, TrioNetwork(), (HOST, direct_port), relay, floor, args)
        report(rows, None, verdicts=True)
    finally:
        for process in reversed(children):  # the target first: it holds reservations
            process.kill()
            process.wait()


async def child_relay(echo_port: int) -> None:
    """``--serve-relay``: the relay and the splice; print their ports, serve until killed."""
    net = TrioNetwork()
    server = RelayServer(net, RELAY.peer_id, OPEN_LIMITS)
    async with trio.open_nursery() as nursery:
        relay, splice = await nursery.start(serve_relay, server, net, (HOST, echo_port))
        print(relay[1], splice[1], flush=True)


async def child_target(relay_port: int, echo_fd: int) -> None:
    """``--serve-target``: the target (reserved on the relay) and the echo on the
    inherited socket; print the direct port, serve until killed."""
    net = TrioNetwork()
    relay = RelayAddress((HOST, relay_port), RELAY.peer_id)
    async with trio.open_nursery() as nursery:
        direct = await nursery.start(serve_target, net, relay, socket.socket(fileno=echo_fd))
        print(direct[1], flush=True)


BULK_ROW = "bulk 64 KiB msgs (MB/s)"
RTT_ROW = "round trip p50 (ms)"
SETUP_ROW = "setups (channels/s)"
SPLICE_ROW = "echo, min. splice p50 (ms)"
ECHO_ROW = "echo, relay p50 (ms)"
TARGETS = {BULK_ROW: (">=", BULK_TARGET), RTT_ROW: ("<=", RTT_TARGET)}


def report(rows: Rows, server: RelayServer | None, *, verdicts: bool) -> None:
    header = f"{'row (median of 3)':<26}{'direct':>10}{'relayed':>10}{'ratio':>8}  target"
    print(header)
    print("-" * len(header))
    medians = {}
    for name, pairs in rows.items():
        direct = statistics.median(p[0] for p in pairs)
        relayed = statistics.median(p[1] for p in pairs)
        medians[name] = (direct, relayed)
        ratio = relayed / direct
        verdict = ""
        if name in TARGETS:
            op, bound = TARGETS[name]
            met = ratio >= bound if op == ">=" else ratio <= bound
            shown = ("met" if met else "NOT met") if verdicts else "(not this layout's)"
            verdict = f"{op} {bound:g}x: {shown}"
        print(f"{name:<26}{direct:>10.3f}{relayed:>10.3f}{ratio:>7.2f}x  {verdict}")
    added = {name: medians[name][1] - medians[name][0] for name in (RTT_ROW, ECHO_ROW, SPLICE_ROW)}
    print(
        f"added per round trip (ms): channel through the relay {added[RTT_ROW]:.3f}; "
        f"echo through the relay {added[ECHO_ROW]:.3f}, "
        f"through the minimal splice {added[SPLICE_ROW]:.3f}"
    )
    if server is not None:
        stats = server.statistics()
        megabytes = stats.bytes_relayed / 1e6
        print(f"relay: {stats.circuits_opened} circuits, {megabytes:.1f} MB relayed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--megabytes", type=int, default=64)
    parser.add_argument("--pings", type=int, default=300)
    parser.add_argument("--setups", type=int, default=100)
    parser.add_argument("--layout", choices=("one", "apart", "both"), default="both")
    parser.add_argument("--serve-relay", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--serve-target", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_relay is not None:
        trio.run(child_relay, args.serve_relay)
        return
    if args.serve_target is not None:
        trio.run(child_target, *args.serve_target)
        return
    wall = time.perf_counter()
    if args.layout in ("one", "both"):
        print("layout one: dialer, target and relay in one process")
        trio.run(one_process, args)
    if args.layout in ("apart", "both"):
        print("layout apart: dialer, relay and target in three processes (the targets)")
        apart(args)
    print(f"(total {time.perf_counter() - wall:.1f} s)")


if __name__ == "__main__":
    main()
