"""Benchmark: a secure channel through a circuit relay vs a direct one, on 127.0.0.1 in
one trio process.

Usage: python scripts/bench_relay.py [--megabytes 64] [--pings 300] [--setups 100]

Both rows are measured in the same run, between the same two identities: the
target accepts secure channels on its own listener (direct) and through a
reservation on a relay (p2pnode.transport.relayserve) in the same process. The
relay's limits are lifted for the run (no pacing, no byte budget, no request rate)
so the rows measure the relay's copying, not its policy. Each figure is the median
of 3 rounds:

* bulk: ``--megabytes`` of 64 KiB messages one way, then one reply (MB/s);
  target: relayed >= 0.5x direct;
* round trip: p50 of ``--pings`` 64-byte request/echo exchanges, one at a time;
  target: relayed <= 2.0x direct;
* setups: channels a second, each CONNECT (or TCP connect), Noise XX handshake,
  one round trip and close, one after another (no target; printed).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Awaitable, Callable

import trio

from p2pnode.core.identity import Identity
from p2pnode.transport.channel import SecureChannel, accept_secure, connect_secure
from p2pnode.transport.net import TrioNetwork
from p2pnode.transport.relay import RelayAddress, RelayLimits
from p2pnode.transport.relayserve import RelayServer, connect_via_relay, reserve
from p2pnode.transport.secure import SecureIdentity

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


async def round_trip(opener: Opener, pings: int) -> float:
    """p50 of one 64-byte exchange (ms)."""
    async with await open_channel(opener) as channel:
        times = []
        for i in range(pings):
            message = i.to_bytes(8, "big") * 8
            start = time.perf_counter()
            await channel.send_message(message)
            assert await channel.receive_message() == message
            times.append(time.perf_counter() - start)
        return statistics.median(times[pings // 10 :]) * 1000  # after a warm-up


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


async def main(megabytes: int, pings: int, setup_count: int) -> None:
    net = TrioNetwork()
    server = RelayServer(net, RELAY.peer_id, OPEN_LIMITS)
    async with trio.open_nursery() as nursery:
        relay = RelayAddress(await nursery.start(server.serve, (HOST, 0)), RELAY.peer_id)
        listener = await net.listen_stream((HOST, 0))
        nursery.start_soon(serve_streams, listener.accept)

        async def direct() -> trio.abc.Stream:
            return await net.connect_stream(listener.local_address)

        async def relayed() -> trio.abc.Stream:
            return await connect_via_relay(net, relay, TARGET.peer_id)

        async with (
            reserve(net, relay, TARGET.identity, backlog=64) as reservation,
            trio.open_nursery() as relayed_side,
        ):
            relayed_side.start_soon(serve_streams, reservation.accept)
            rows = {
                "bulk 64 KiB msgs (MB/s)": [
                    (await bulk(direct, megabytes), await bulk(relayed, megabytes))
                    for _ in range(ROUNDS)
                ],
                "round trip p50 (ms)": [
                    (await round_trip(direct, pings), await round_trip(relayed, pings))
                    for _ in range(ROUNDS)
                ],
                "setups (channels/s)": [
                    (await setups(direct, setup_count), await setups(relayed, setup_count))
                    for _ in range(ROUNDS)
                ],
            }
            relayed_side.cancel_scope.cancel()
        report(rows, server)
        nursery.cancel_scope.cancel()


def report(rows: dict[str, list[tuple[float, float]]], server: RelayServer) -> None:
    header = f"{'row (median of 3)':<26}{'direct':>10}{'relayed':>10}{'ratio':>8}  target"
    print(header)
    print("-" * len(header))
    targets = {
        "bulk 64 KiB msgs (MB/s)": (">=", BULK_TARGET),
        "round trip p50 (ms)": ("<=", RTT_TARGET),
    }
    for name, pairs in rows.items():
        direct = statistics.median(p[0] for p in pairs)
        relayed = statistics.median(p[1] for p in pairs)
        ratio = relayed / direct
        verdict = ""
        if name in targets:
            op, bound = targets[name]
            met = ratio >= bound if op == ">=" else ratio <= bound
            verdict = f"{op} {bound:g}x: {'met' if met else 'NOT met'}"
        print(f"{name:<26}{direct:>10.2f}{relayed:>10.2f}{ratio:>7.2f}x  {verdict}")
    stats = server.statistics()
    print(f"relay: {stats.circuits_opened} circuits, {stats.bytes_relayed / 1e6:.1f} MB relayed")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--megabytes", type=int, default=64)
    parser.add_argument("--pings", type=int, default=300)
    parser.add_argument("--setups", type=int, default=100)
    args = parser.parse_args()
    wall = time.perf_counter()
    trio.run(main, args.megabytes, args.pings, args.setups)
    print(f"(total {time.perf_counter() - wall:.1f} s)")
