"""Benchmark: node-to-node envelopes vs a bare secure channel vs raw TCP, on 127.0.0.1.

Usage: python scripts/bench_node.py [--scale 1.0] [--only embedded|attach|zmq]

``--only embedded`` or ``--only attach`` runs just those rows (with their baselines and
floors), to iterate on the agent runtime faster; ``--only zmq`` runs the main table and
the ZeroMQ comparison alone, to iterate on the send path.

The node path is measured in full: envelope creation and encoding, egress
policy, routing events, the Noise channel, frame and envelope decoding with
limits, sender authentication, ingress policy, the agent's inbox and
handler, and (for round trips) the response coming back the same way. The
baselines, measured in the same run over the same loopback: raw TCP with a
4-byte length prefix (on trio's own SocketStream), and the secure channel
alone as the node configures it (on the node's TcpStream);
both carry the same 256-byte messages. After the targets come two floors
(scripts/bench_floors.py), measured in the same run: the envelope alone, with no
trio, channel, policy, events or inbox, and trio's task switch; the node's rows can
never beat them.

An agent's request round trip is also measured with the agent embedded in a
trio program and in an asyncio program (p2pnode.hosting.aio: the node runs as a trio
guest on the asyncio loop and the agent's handlers run as asyncio tasks), in
one process, from a node to a node and from an agent to an agent of the same
node.

The node's request round trip is also measured to an agent in another OS
process attached to the server node over its agent socket (p2pnode.hosting.client,
asyncio), beside the in-process agent, in the same run: what attaching adds.

ZeroMQ CURVE is measured in the same run, in the same two layouts, with the node's counts
and payload size (scripts/bench_zmq.py: zmq.asyncio DEALER -> ROUTER, CURVE keys on both
ends, a ZAP authenticator that admits only the client's key), and the node's rows are
printed as ratios to it, with the channel's and raw TCP's beside them: the floors a node
row cannot pass. Without pyzmq (the ``bench`` extra) one line says the rows were skipped.

Every measurement but the embedded one runs in two layouts. "1 process": both ends share one
trio loop (and so one core's worth of Python). "2 processes": the receiving
end runs in a child process, as two nodes on one machine do, so each end has
a core. The client code is the same in both; only where the server runs
differs.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio
from bench_agents import (
    ATTACH_TIMEOUT,
    HOST,
    PAYLOAD,
    Floors,
    echo,
    embedded_rows,
    measure_floors,
    print_embedded,
    quantiles,
    timed_round_trips,
)
from bench_channel import ChannelEndpoint, Endpoint, FramedStream, fmt
from bench_floors import BATCH, envelope_rate, task_switch_rate

from p2pnode.core.envelope import Envelope, EnvelopeFactory, MessageType
from p2pnode.core.errors import P2PError
from p2pnode.core.identity import Identity
from p2pnode.core.wire import pack
from p2pnode.runtime import Node
from p2pnode.services.attach.service import AgentSocket
from p2pnode.services.attach.wire import AGENT_SOCKET_NAME
from p2pnode.transport.channel import ChannelConfig, accept_secure, connect_secure
from p2pnode.transport.net import TrioNetwork
from p2pnode.transport.secure import SecureIdentity
from p2pnode.transport.tcpstream import TcpStream

if TYPE_CHECKING:
    from bench_zmq import ZmqRows

ECHO, SINK, DONE = b"e", b"s", b"x"  # first byte of a baseline message: what the server does
MESSAGE = b"\0" * 255
# The node's channels enforce the idle timeout in the link (one watchdog), not per read.
CHANNEL_CONFIG = ChannelConfig(idle_timeout=None)


# -- the receiving end ------------------------------------------------------------------------


async def serve_messages(endpoint: Endpoint) -> None:
    """Echo ECHO messages, swallow SINK ones, answer DONE once all before it were read."""
    try:
        while True:
            message = await endpoint.receive()
            if message[:1] == ECHO:
                await endpoint.send(message)
            elif message[:1] == DONE:
                await endpoint.send(DONE)
    except (EOFError, P2PError, trio.BrokenResourceError, trio.ClosedResourceError):
        await endpoint.aclose()


async def serve_raw(stream: trio.SocketStream) -> None:
    await serve_messages(FramedStream(stream))


class ChannelServer:
    def __init__(self) -> None:
        self.identity = SecureIdentity(Identity.generate())

    async def __call__(self, stream: trio.SocketStream) -> None:
        # The channel baseline runs on the node's own TCP streams; raw TCP stays on trio's.
        channel = await accept_secure(TcpStream.adopt(stream), self.identity, config=CHANNEL_CONFIG)
        await serve_messages(ChannelEndpoint(channel))


class Sink:
    """Counts envelopes; answers a request with the count so far (inbox order)."""

    def __init__(self) -> None:
        self.count = 0

    async def __call__(self, envelope: Envelope) -> Any:
        self.count += 1
        return self.count


@dataclass(frozen=True)
class Ports:
    raw: int
    channel: int
    node: int

    def line(self) -> str:
        return f"{self.raw} {self.channel} {self.node}"

    @classmethod
    def parse(cls, line: str) -> Ports:
        raw, channel, node = map(int, line.split())
        return cls(raw, channel, node)


# The attached agent's process: the same echo as "server", through p2pnode.hosting.client.
ATTACHED_AGENT = """
import sys
from p2pnode import Agent
from p2pnode.hosting.client import run_agent

agent = Agent("attached", tier=3)


@agent.on_request()
async def echo_payload(message):
    return message.payload


run_agent(agent, path=sys.argv[1])
"""


async def serve_node(*, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    with tempfile.TemporaryDirectory() as data_dir:
        path = Path(data_dir) / AGENT_SOCKET_NAME
        async with Node(Identity.generate(), TrioNetwork()) as node:
            await node.add_agent("server", echo, tier=3)
            await node.add_agent("sink", Sink(), tier=3)
            agents = AgentSocket(node, path)
            await node.start_service(agents)
            attached = await trio.lowlevel.open_process(
                [sys.executable, "-c", ATTACHED_AGENT, str(path)], stdin=subprocess.DEVNULL
            )
            try:
                with trio.fail_after(ATTACH_TIMEOUT):
                    while not agents.attached():  # noqa: ASYNC110 - the service has no event
                        await trio.sleep(0.01)
                task_status.started(node.listen_address[1])
                await trio.sleep_forever()
            finally:
                attached.kill()
                with trio.CancelScope(shield=True):
                    await attached.wait()


async def start_servers(nursery: trio.Nursery) -> Ports:
    """The three receiving ends, listening on 127.0.0.1."""
    raw = (await nursery.start(partial(trio.serve_tcp, serve_raw, 0, host=HOST)))[0]
    channel = (await nursery.start(partial(trio.serve_tcp, ChannelServer(), 0, host=HOST)))[0]
    node_port = await nursery.start(serve_node)
    return Ports(raw.socket.getsockname()[1], channel.socket.getsockname()[1], node_port)


SERVE_SECONDS = 1800  # the child outlives a parent that died without killing it by this much


async def serve_until_killed() -> None:
    with trio.move_on_after(SERVE_SECONDS):
        async with trio.open_nursery() as nursery:
            ports = await start_servers(nursery)
            print(ports.line(), flush=True)


# -- the sending end --------------------------------------------------------------------------


async def connect_raw(ports: Ports) -> Endpoint:
    return FramedStream(await trio.open_tcp_stream(HOST, ports.raw))


async def connect_channel(ports: Ports) -> Endpoint:
    stream = TcpStream.adopt(await trio.open_tcp_stream(HOST, ports.channel))
    identity = SecureIdentity(Identity.generate())
    return ChannelEndpoint(await connect_secure(stream, identity, config=CHANNEL_CONFIG))


async def message_round_trips(endpoint: Endpoint, count: int) -> tuple[float, float]:
    message = ECHO + MESSAGE

    async def once() -> None:
        await endpoint.send(message)
        await endpoint.receive()

    return quantiles(await timed_round_trips(count, once))


async def message_rate(endpoint: Endpoint, count: int, concurrent_sends: bool) -> float:
    """Messages per second: send_batch of BATCH messages at a time, or BATCH tasks each
    calling send(); the answer to DONE (read after all before it) marks the end."""
    message = SINK + MESSAGE
    rounds = count // BATCH
    start = time.perf_counter()
    if concurrent_sends:

        async def sender() -> None:
            for _ in range(rounds):
                await endpoint.send(message)

        async with trio.open_nursery() as nursery:
            for _ in range(BATCH):
                nursery.start_soon(sender)
    else:
        for _ in range(rounds):
            await endpoint.send_batch([message] * BATCH)
    await endpoint.send(DONE)
    await endpoint.receive()
    return rounds * BATCH / (time.perf_counter() - start)


async def node_round_trips(node: Node, count: int, agent: str = "server") -> tuple[float, float]:
    return quantiles(await timed_round_trips(count, lambda: node.request("client", agent, PAYLOAD)))


async def node_rate(node: Node, count: int, concurrent_sends: bool) -> float:
    """Envelopes per second into the sink: send_many of BATCH envelopes at a time, or
    BATCH tasks each calling send(); the sink's answer to a final request (it
    reads its inbox in order) marks the end."""

    def notification() -> Envelope:
        return node.envelope("client", "sink", MessageType.NOTIFICATION, PAYLOAD)

    rounds = count // BATCH
    start = time.perf_counter()
    if concurrent_sends:

        async def sender() -> None:
            for _ in range(rounds):
                await node.send(notification())

        async with trio.open_nursery() as nursery:
            for _ in range(BATCH):
                nursery.start_soon(sender)
    else:
        for _ in range(rounds):
            await node.send_many([notification() for _ in range(BATCH)])
    await node.request("client", "sink", None)
    return rounds * BATCH / (time.perf_counter() - start)


Row = tuple[str, float, float, float]
TARGET_RTT_P50_US = 200.0
TARGET_RTT_RATIO = 2.0
TARGET_RATE = 100_000.0
TARGET_TASKS_RATE = 50_000.0
#: What attaching may add to the round trip, in JSON-lines echo floors (measured in the run).
TARGET_ATTACH_FLOORS = 2.0


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


@dataclass(frozen=True)
class Layout:
    name: str
    rows: list[Row]
    rtt_p50: float
    rate: float
    #: Round trip p50 to the agent attached over agent.sock (in another process).
    attached_p50: float
    tasks_rate: float = 0.0
    raw_rtt_p50: float = 0.0

    def verdict(self) -> str:
        ratio = self.rtt_p50 / self.raw_rtt_p50
        return (
            f"  {self.name + ':':<13} round trip p50 {fmt(self.rtt_p50)} us "
            f"{met(self.rtt_p50 <= TARGET_RTT_P50_US)}, {ratio:.2f}x raw "
            f"{met(ratio <= TARGET_RTT_RATIO)}; pipelined {fmt(self.rate)} "
            f"{met(self.rate >= TARGET_RATE)}; {BATCH} tasks {fmt(self.tasks_rate)} "
            f"{met(self.tasks_rate >= TARGET_TASKS_RATE)}"
        )


async def measure(ports: Ports, layout: str, scale: float, attach_only: bool = False) -> Layout:
    def n(base: int) -> int:
        return max(BATCH * 10, int(base * scale))

    rows: list[Row] = []
    if attach_only:
        async with Node(Identity.generate(), TrioNetwork()) as node:
            await node.add_agent("client", echo, tier=3)
            await node.connect((HOST, ports.node))
            node_rtt = await node_round_trips(node, n(5000))
            attached_rtt = await node_round_trips(node, n(5000), "attached")
        return Layout(layout, rows, node_rtt[0], 0.0, attached_rtt[0])
    raw, channel = await connect_raw(ports), await connect_channel(ports)
    raw_rtt = await message_round_trips(raw, n(5000))
    channel_rtt = await message_round_trips(channel, n(5000))
    raw_rate = await message_rate(raw, n(200_000), concurrent_sends=False)
    channel_rate = await message_rate(channel, n(200_000), concurrent_sends=False)
    raw_tasks_rate = await message_rate(raw, n(50_000), concurrent_sends=True)
    channel_tasks_rate = await message_rate(channel, n(50_000), concurrent_sends=True)
    await raw.aclose()
    await channel.aclose()
    async with Node(Identity.generate(), TrioNetwork()) as node:
        await node.add_agent("client", echo, tier=3)
        await node.connect((HOST, ports.node))
        node_rtt = await node_round_trips(node, n(5000))
        attached_rtt = await node_round_trips(node, n(5000), "attached")
        batch_rate = await node_rate(node, n(100_000), concurrent_sends=False)
        tasks_rate = await node_rate(node, n(50_000), concurrent_sends=True)
    rows.append((f"round trip p50 (us), {layout}", raw_rtt[0], channel_rtt[0], node_rtt[0]))
    rows.append((f"round trip p99 (us), {layout}", raw_rtt[1], channel_rtt[1], node_rtt[1]))
    rows.append((f"pipelined msgs/s, {layout}", raw_rate, channel_rate, batch_rate))
    rows.append(
        (
            f"{BATCH} tasks each send(), {layout}",
            raw_tasks_rate,
            channel_tasks_rate,
            tasks_rate,
        )
    )
    return Layout(layout, rows, node_rtt[0], batch_rate, attached_rtt[0], tasks_rate, raw_rtt[0])


async def in_one_process(scale: float, attach_only: bool = False) -> Layout:
    async with trio.open_nursery() as nursery:
        ports = await start_servers(nursery)
        layout = await measure(ports, "1 process", scale, attach_only)
        nursery.cancel_scope.cancel()
    return layout


def in_two_processes(scale: float, attach_only: bool = False) -> Layout:
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        ports = Ports.parse(server.stdout.readline())
        return trio.run(measure, ports, "2 processes", scale, attach_only)
    finally:
        server.kill()
        server.wait()


def print_attached(layouts: list[Layout], floors: Floors) -> None:
    header = (
        f"{'attached agent process (agent.sock)':<42}{'in-process':>11}{'attached':>10}{'added':>8}"
    )
    print(header)
    print("-" * len(header))
    for layout in layouts:
        added = layout.attached_p50 - layout.rtt_p50
        name = f"request round trip p50 (us), {layout.name}"
        print(f"{name:<42}{fmt(layout.rtt_p50):>11}{fmt(layout.attached_p50):>10}{added:>8.1f}")
    print(
        f"floor: a line to another process and back over a Unix socket, p50 {floors.echo:.1f} us "
        "(the two process hops attaching adds, with no work at either end)"
    )
    print(
        f"floor: the same, the child parsing the JSON line and writing it back with a minimal "
        f"asyncio Protocol, p50 {floors.json_echo:.1f} us"
    )
    bound = TARGET_ATTACH_FLOORS * floors.json_echo
    print(
        f"target: attaching adds <= {TARGET_ATTACH_FLOORS}x the JSON-lines echo floor "
        f"({bound:.1f} us) to the p50 round trip"
    )
    for layout in layouts:
        added = layout.attached_p50 - layout.rtt_p50
        ratio = added / floors.json_echo
        print(f"  {layout.name + ':':<13} +{added:.1f} us ({ratio:.2f}x) {met(added <= bound)}")


@dataclass(frozen=True)
class EnvelopeFloors:
    """The envelope's own work, in envelopes per second, with no trio, channel or node."""

    #: Made, encoded, decoded, validated, checked for a repeat and handed over: both ends.
    whole: float
    #: Made and encoded BATCH to a frame: the sending end's share.
    sending: float


def envelope_send_rate(count: int, payload: Any) -> float:
    """Envelopes per second made as the node makes them and encoded BATCH to a frame."""
    factory = EnvelopeFactory()
    rounds = max(1, count // BATCH)
    start = time.perf_counter()
    for _ in range(rounds):
        make = factory.create
        pack(
            [
                make("client", "sink", MessageType.NOTIFICATION, payload).to_dict()
                for _ in range(BATCH)
            ]
        )
    return rounds * BATCH / (time.perf_counter() - start)


def print_floors(scale: float) -> EnvelopeFloors:
    count = max(BATCH * 10, int(100_000 * scale))
    floors = EnvelopeFloors(envelope_rate(count, PAYLOAD), envelope_send_rate(count, PAYLOAD))
    print(
        f"floor: the envelope alone in one process (made, encoded {BATCH} to a frame, decoded, "
        f"validated, checked for a repeat, handed to a function; no trio, channel, policy, "
        f"events or inbox): {fmt(floors.whole)} envelopes/s; made and encoded only (the "
        f"sending end's share): {fmt(floors.sending)} envelopes/s"
    )
    print(
        f"floor: trio task switches among {BATCH} tasks that each yield in turn: "
        f"{fmt(task_switch_rate(count))} switches/s"
    )
    return floors


def measure_zmq(scale: float) -> list[ZmqRows] | None:
    """ZeroMQ CURVE's rows in both layouts, or None without pyzmq."""
    if importlib.util.find_spec("zmq") is None:
        return None
    import bench_zmq

    return [bench_zmq.in_one_process(scale), bench_zmq.in_two_processes(scale)]


def floor_of(name: str, raw: float, chan: float, floors: EnvelopeFloors) -> float:
    """The least a node row can be: the channel alone (or raw TCP, when it is the better
    of the two) plus the envelope's own work, added per message. A round trip carries
    two envelopes, each made at one end and read at the other; a rate in one process
    does both ends' work on one core, in two processes the sender's share bounds it."""
    if name.startswith("round trip"):
        return min(raw, chan) + 2e6 / floors.whole
    envelope = floors.whole if name.endswith("1 process") else floors.sending
    return 1 / (1 / max(raw, chan) + 1 / envelope)


def print_zmq(layouts: list[Layout], zmq_rows: list[ZmqRows], floors: EnvelopeFloors) -> None:
    """The node's rows as ratios to ZeroMQ's, and the floors a node row cannot pass."""
    import bench_zmq

    print(
        f"ZeroMQ CURVE ({bench_zmq.versions()}): zmq.asyncio DEALER -> ROUTER on {HOST}, "
        f"{bench_zmq.MESSAGE_SIZE}-byte messages, ZAP admitting only the client's key"
    )
    header = (
        f"{'metric':<38}{'zmq':>11}{'node':>11}{'node/zmq':>10}{'level':>7}"
        f"{'chan/zmq':>10}{'raw/zmq':>9}{'floor/zmq':>11}{'zmq cores':>11}"
    )
    print(header)
    print("-" * len(header))
    for layout, zmq in zip(layouts, zmq_rows, strict=True):
        rtt, _p99, pipelined, tasks = layout.rows
        for (name, raw, chan, node), theirs, cores in (
            (rtt, zmq.rtt_p50, None),
            (pipelined, zmq.rate, zmq.rate_cores),
            (tasks, zmq.tasks_rate, zmq.tasks_cores),
        ):
            lower = cores is None
            ratio = node / theirs
            level = ratio <= 1.0 if lower else ratio >= 1.0
            floor = floor_of(name, raw, chan, floors)
            print(
                f"{name:<38}{fmt(theirs):>11}{fmt(node):>11}{ratio:>10.2f}"
                f"{'yes' if level else 'NO':>7}{chan / theirs:>10.2f}{raw / theirs:>9.2f}"
                f"{floor / theirs:>11.2f}{'' if cores is None else f'{cores:.2f}':>11}"
            )
    print(
        "level: node/zmq <= 1.00 for the round trip, >= 1.00 for rates. chan/zmq, raw/zmq: "
        "the channel alone and raw trio TCP (256-byte messages). floor/zmq: the better of "
        "the two plus the envelope floor per message (two per round trip; both ends' share "
        "in 1 process, the sender's in 2), which no node row can pass: a floor not level "
        "means that row cannot be. zmq cores: CPU time over wall time of the sending "
        "process (in 1 process both ends), libzmq's I/O thread beside Python's; the node "
        "runs on one trio thread, at most 1.00"
    )
    refused = all(zmq.stranger_refused for zmq in zmq_rows)
    print(f"ZAP refused a client with another key in both layouts: {'yes' if refused else 'NO'}")


def main(scale: float, only: str | None) -> None:
    if only == "embedded":
        print_embedded(embedded_rows(scale))
        return
    if only == "attach":
        layouts = [trio.run(in_one_process, scale, True), in_two_processes(scale, True)]
        print_attached(layouts, measure_floors(scale))
        return
    layouts = [trio.run(in_one_process, scale), in_two_processes(scale)]
    zmq_rows = measure_zmq(scale)
    header = (
        f"{'metric':<38}{'raw TCP':>11}{'channel':>11}{'node':>11}{'node/raw':>10}{'node/chan':>10}"
    )
    print(header)
    print("-" * len(header))
    for name, raw, chan, node in (row for layout in layouts for row in layout.rows):
        print(
            f"{name:<38}{fmt(raw):>11}{fmt(chan):>11}{fmt(node):>11}"
            f"{node / raw:>10.2f}{node / chan:>10.2f}"
        )
    print(
        f"pipelined: {BATCH} messages per send_batch / send_many call; "
        f"{BATCH} tasks: each calls send / send_message for one message at a time"
    )
    print(
        f"targets: node round trip p50 <= {TARGET_RTT_P50_US:.0f} us and <= "
        f"{TARGET_RTT_RATIO:.1f}x raw TCP; pipelined >= {TARGET_RATE:,.0f} envelopes/s; "
        f"{BATCH} tasks each send() >= {TARGET_TASKS_RATE:,.0f} envelopes/s"
    )
    for layout in layouts:
        print(layout.verdict())
    floors = print_floors(scale)
    print()
    if zmq_rows is None:
        print("ZeroMQ CURVE rows skipped: pyzmq is not installed (pip install -e '.[bench]')")
    else:
        print_zmq(layouts, zmq_rows, floors)
    if only == "zmq":
        return
    print()
    print_attached(layouts, measure_floors(scale))
    print()
    print_embedded(embedded_rows(scale))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply message counts")
    parser.add_argument(
        "--only",
        choices=["embedded", "attach", "zmq"],
        help="run only the agent runtime's rows, or the main table and ZeroMQ's",
    )
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        trio.run(serve_until_killed)
    else:
        main(args.scale, args.only)
