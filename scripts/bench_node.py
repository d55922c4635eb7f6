"""Benchmark: node-to-node envelopes vs a bare secure channel vs raw TCP, on 127.0.0.1.

Usage: python scripts/bench_node.py [--scale 1.0]

Two nodes in one trio process talk over real TCP on 127.0.0.1. The full
path is measured: envelope creation and encoding, egress policy, routing
events, the Noise channel, frame and envelope decoding with limits, sender
authentication, ingress policy, the agent's inbox and handler, and (for
round trips) the response coming back the same way. Baselines measured in
the same run: raw TCP with a 4-byte length prefix, and the secure channel
alone (same 256-byte payload), both through the helpers of bench_channel.py.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from bench_channel import Harness, fmt, round_trips, stream_rate

from p2pnode.envelope import Envelope, MessageType
from p2pnode.identity import Identity
from p2pnode.net import TrioNetwork
from p2pnode.node.node import Node

PAYLOAD = "p" * 200  # a 256-byte-ish envelope body once ids and headers are added


async def echo(envelope: Envelope) -> Any:
    return envelope.payload


class Counter:
    def __init__(self, target: int) -> None:
        self.count = 0
        self.target = target
        self.done = trio.Event()

    async def __call__(self, envelope: Envelope) -> Any:
        self.count += 1
        if self.count >= self.target:
            self.done.set()
        return None


async def setup_pair(a: Node, b: Node) -> None:
    await a.add_agent("client", echo, tier=3)
    await b.add_agent("server", echo, tier=3)
    await a.connect(b.listen_address)
    await trio.sleep(0.2)


async def node_round_trips(a: Node, count: int) -> tuple[float, float]:
    samples = []
    for i in range(count + 200):
        start = time.perf_counter()
        await a.request("client", "server", PAYLOAD)
        if i >= 200:
            samples.append((time.perf_counter() - start) * 1e6)
    q = statistics.quantiles(samples, n=100)
    return q[49], q[98]


async def node_pipelined(a: Node, b: Node, count: int, senders: int) -> float:
    counter = Counter(count)
    await b.add_agent("sink", counter, tier=3)
    await trio.sleep(0.2)
    per = count // senders
    counter.target = per * senders
    start = time.perf_counter()
    async with trio.open_nursery() as nursery:

        async def produce() -> None:
            for _ in range(per):
                await a.send(a.envelope("client", "sink", MessageType.NOTIFICATION, PAYLOAD))

        for _ in range(senders):
            nursery.start_soon(produce)
        await counter.done.wait()
    return counter.count / (time.perf_counter() - start)


async def main(scale: float) -> None:
    def n(base: int) -> int:
        return max(200, int(base * scale))

    rows: list[tuple[str, float, float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
        async with trio.open_nursery() as nursery:
            harness = Harness(nursery, listener, Path(tmp))
            raw_p50, raw_p99 = await round_trips(harness.raw, n(5000))
            ch_p50, ch_p99 = await round_trips(harness.noise, n(5000))
            raw_rate = await stream_rate(harness.raw, b"s" * 256, n(200_000), 64)
            ch_rate = await stream_rate(harness.noise, b"s" * 256, n(200_000), 64)
            nursery.cancel_scope.cancel()
        network = TrioNetwork()
        async with Node(Identity.generate(), network) as a, Node(Identity.generate(), network) as b:
            await setup_pair(a, b)
            node_p50, node_p99 = await node_round_trips(a, n(5000))
            node_rate = await node_pipelined(a, b, n(100_000), 64)
    rows.append(("round trip p50 (us)", raw_p50, ch_p50, node_p50))
    rows.append(("round trip p99 (us)", raw_p99, ch_p99, node_p99))
    rows.append(("pipelined 256 B msgs/s", raw_rate, ch_rate, node_rate))
    print(f"{'row':<26}{'raw TCP':>12}{'channel':>12}{'node':>12}{'node/raw':>10}{'node/chan':>10}")
    for name, raw, chan, node in rows:
        print(
            f"{name:<26}{fmt(raw):>12}{fmt(chan):>12}{fmt(node):>12}"
            f"{node / raw:>10.2f}{node / chan:>10.2f}"
        )
    print("targets: node round trip p50 <= 200 us; node pipelined >= 100,000 envelopes/s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply message counts")
    trio.run(main, parser.parse_args().scale)
