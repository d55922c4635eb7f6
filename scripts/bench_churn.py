"""Benchmark: presence under churn, in the simulator on trio's virtual clock.

``--nodes`` devices (one node each, with its DHT and default settings, card lifetime
600 s) each host one agent offering one of ``--capabilities`` capabilities. Every
device, about every ``--period`` virtual seconds (exponential), stops gracefully or
crashes (half each), stays down 10-60 s and comes back on the same host and port,
with a new key claiming the same agent id in ``--new-key`` of the returns. Meanwhile
requests by capability go out at ``--rate`` a second from random running devices,
and a random running node calls ``find`` every ``--find-every`` seconds.

Measured against what really happened (which devices run, under which key):

* request success: the share of requests answered, among those whose capability had
  a running provider besides the sender when sent (target >= 99.5%);
* stale find results: cards of agents withdrawn or whose device is down, as a share
  of all cards ``find`` returned (target <= 1%);
* graceful stop: seconds until every node with a channel to it dropped the agent
  (target 2 s), and whether ``find`` on five random nodes skips it 30 s later;
* crash: seconds until every node with a channel to it dropped it (target 30 s), and
  whether every node dropped it once its card expired (target: the lifetime).

Renewal traffic (``--renewal-nodes`` devices, no churn, ``--renewal-minutes``): DHT
datagrams and bytes per node per minute in a quiet swarm renewing 600 s cards at half
their lifetime, and the HELLO bytes each renewal sends to connected peers.

Usage: python scripts/bench_churn.py [--nodes 200] [--minutes 60] [--seeds 1 2 3]
       [--renewal-nodes 200] [--renewal-minutes 20]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import math
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import trio
import trio.testing

from p2pnode.core.card import AgentCard, Capability
from p2pnode.core.envelope import Envelope
from p2pnode.core.errors import P2PError
from p2pnode.core.identity import Identity, PeerId
from p2pnode.node.channels import ChannelState
from p2pnode.node.frames import encode_hello
from p2pnode.runtime import Node, NodeConfig, open_node
from p2pnode.simnet import LinkConditions, SimHost, SimNetwork
from p2pnode.transport.net import Address

PORT = 7000
EPOCH_MS = 1_800_000_000_000
#: Noise transport overhead of one frame on a channel: the AEAD tag and the length prefix.
FRAME_OVERHEAD = 16 + 2


def virtual_ms() -> int:
    return EPOCH_MS + int(trio.current_time() * 1000)


class CountingNetwork(SimNetwork):
    """The simulated network, counting the bytes of datagrams sent too."""

    datagram_bytes = 0

    def _send_datagram(self, src: Address, dst: Address, data: bytes) -> None:
        self.datagram_bytes += len(data)
        super()._send_datagram(src, dst, data)


@dataclasses.dataclass(eq=False)
class Device:
    index: int
    network: SimHost
    identity: Identity
    agent: str
    capability: str
    node: Node | None = None
    scope: trio.CancelScope | None = None
    closing: trio.Event = dataclasses.field(default_factory=trio.Event)
    stopped: trio.Event = dataclasses.field(default_factory=trio.Event)
    #: Running with its agent hosted and joined: it sends requests and calls find.
    up: bool = False
    #: Its node hosts its agent (set before the node joined): the ground truth of "live".
    serving: bool = False

    @property
    def key(self) -> tuple[str, bytes]:
        return (self.agent, self.identity.peer_id.raw)


async def answer(envelope: Envelope) -> Any:
    return envelope.payload


class Swarm:
    """The devices, started and ended in ``nursery`` (see the module docstring)."""

    def __init__(self, sim: CountingNetwork, nursery: trio.Nursery, config: NodeConfig) -> None:
        self.sim, self.nursery, self.config = sim, nursery, config
        self.devices: list[Device] = []
        self.by_agent: dict[str, Device] = {}

    def running(self) -> list[Device]:
        return [d for d in self.devices if d.up]

    async def add(self, rng: random.Random, capability: str) -> Device:
        index = len(self.devices)
        device = Device(
            index, self.sim.add_host(), Identity(rng.randbytes(32)), f"a{index}", capability
        )
        self.devices.append(device)
        self.by_agent[device.agent] = device
        await self.start(device)
        return device

    async def start(self, device: Device) -> None:
        device.closing, device.stopped = trio.Event(), trio.Event()
        device.node = await self.nursery.start(self._run, device)
        device.up = True

    async def _run(self, device: Device, *, task_status: trio.TaskStatus[Node]) -> None:
        host = device.network.host
        first = self.devices[0].network.host
        config = dataclasses.replace(
            self.config,
            listen=(host, PORT),
            dht_listen=(host, 0),
            bootstrap=((first, PORT),) if first != host else (),
        )
        try:
            with trio.CancelScope() as device.scope:
                async with open_node(
                    device.identity, device.network, config, clock_ms=virtual_ms
                ) as node:
                    cap = Capability(device.capability, device.capability)
                    await node.add_agent(device.agent, answer, capabilities=(cap,))
                    device.serving = True  # its agent answers from here on, joined or not
                    await node.join()
                    task_status.started(node)
                    await device.closing.wait()
        finally:
            device.stopped.set()

    async def stop(self, device: Device) -> None:
        device.up = device.serving = False
        device.closing.set()
        await device.stopped.wait()

    async def crash(self, device: Device) -> None:
        device.up = device.serving = False
        self.sim.kill(device.network.host)
        assert device.scope is not None
        device.scope.cancel()
        await device.stopped.wait()

    async def restart(self, device: Device, identity: Identity | None) -> None:
        self.sim.revive(device.network.host)
        if identity is not None:
            device.identity = identity
        await self.start(device)


def claims(node: Node, agent: str, owner: PeerId, revision: int) -> bool:
    """``node`` holds a live claim of ``owner`` on ``agent`` by a card of ``revision`` or
    older: the incarnation that ended, not a later one of the same key (a device that came
    back and ended again is watched for that end on its own)."""
    registry, now = node.registry, node.now_ms()
    return any(
        c.peer_id == owner and c.revision <= revision and registry.is_live(c, now)
        for c in registry.owners(agent, now)
    )


def linked(node: Node, owner: PeerId) -> bool:
    link = node.links.get(owner)
    return link is not None and link.state is ChannelState.OPEN


@dataclasses.dataclass
class Tally:
    """What one run measured."""

    asked: int = 0
    answered: int = 0
    found: int = 0
    stale: int = 0
    #: Of the stale cards, those of agents withdrawn (the others' devices crashed).
    stale_withdrawn: int = 0
    leave_s: list[float] = dataclasses.field(default_factory=list)
    leave_find_stale: int = 0
    leave_find_checks: int = 0
    crash_s: list[float] = dataclasses.field(default_factory=list)
    crash_expired_stale: int = 0
    crash_expired_checks: int = 0
    events: dict[str, int] = dataclasses.field(default_factory=dict)
    #: CPU seconds building the swarm, and running the churn.
    build_cpu: float = 0.0
    churn_cpu: float = 0.0
    minutes: float = 0.0

    def count(self, kind: str) -> None:
        self.events[kind] = self.events.get(kind, 0) + 1


class Churn:
    """One run: the churn of every device but the bootstrap one, requests and finds."""

    def __init__(self, swarm: Swarm, rng: random.Random, args: argparse.Namespace) -> None:
        self.swarm, self.rng, self.args = swarm, rng, args
        self.tally = Tally()
        self.end = trio.current_time() + args.minutes * 60
        self.capabilities = sorted({d.capability for d in swarm.devices})
        #: Agents (id, owner) withdrawn by a graceful stop.
        self.left: set[tuple[str, bytes]] = set()

    def live_keys(self) -> set[tuple[str, bytes]]:
        """The agents hosted now: a restarting device's too, from the moment its node
        hosts the agent (its join, which follows, may take a while)."""
        return {d.key for d in self.swarm.devices if d.serving}

    def is_live(self, agent: str, owner: PeerId) -> bool:
        """``(agent, owner)`` is among :meth:`live_keys` (only the device hosting
        ``agent`` can hold it: looked up by name instead of building the set)."""
        device = self.swarm.by_agent.get(agent)
        return device is not None and device.serving and device.key == (agent, owner.raw)

    def still(self, device: Device, node: Node) -> bool:
        """``device`` still runs ``node`` (a stopped node's registry is frozen)."""
        return device.up and device.node is node

    async def run(self, nursery: trio.Nursery) -> None:
        for device in self.swarm.devices[1:]:
            nursery.start_soon(self.churn, device, nursery)
        nursery.start_soon(self.requests, nursery)
        nursery.start_soon(self.finds)
        await trio.sleep_until(self.end)

    async def churn(self, device: Device, nursery: trio.Nursery) -> None:
        rng, args = self.rng, self.args
        while True:
            await trio.sleep(rng.expovariate(1 / args.period))
            if trio.current_time() >= self.end:
                return
            assert device.node is not None
            owner, node = device.identity.peer_id, device.node
            holders = [
                (d, d.node)
                for d in self.swarm.running()
                if d is not device and d.node is not None and linked(d.node, owner)
            ]
            graceful = rng.random() < 0.5
            card = node.local_agent(device.agent)
            self.tally.count("stop" if graceful else "crash")
            if graceful:
                self.left.add(device.key)
            watch = self.watch_leave if graceful else self.watch_crash
            nursery.start_soon(watch, device.agent, device.capability, owner, holders, card)
            await (self.swarm.stop if graceful else self.swarm.crash)(device)
            await trio.sleep(rng.uniform(10, 60))
            new_key = rng.random() < args.new_key
            self.tally.count("restart, new key" if new_key else "restart")
            await self.swarm.restart(device, Identity(rng.randbytes(32)) if new_key else None)

    @staticmethod
    def note(times: list[float], seconds: float) -> None:
        if not math.isnan(seconds):
            times.append(seconds)

    async def dropped_after(
        self,
        agent: str,
        owner: PeerId,
        revision: int,
        holders: Sequence[tuple[Device, Node]],
        limit: float,
    ) -> float:
        """Seconds until no running holder claims ``agent`` of ``owner`` (inf: not in
        ``limit``)."""
        start = trio.current_time()
        for _ in range(math.ceil(limit / 0.1) + 1):  # bounded
            if self.is_live(agent, owner):
                return math.nan  # back with that key before all noticed: not counted
            if not any(self.still(d, n) and claims(n, agent, owner, revision) for d, n in holders):
                return trio.current_time() - start
            await trio.sleep(0.1)
        return math.inf

    async def watch_leave(
        self,
        agent: str,
        capability: str,
        owner: PeerId,
        holders: Sequence[tuple[Device, Node]],
        card: AgentCard,
    ) -> None:
        start = trio.current_time()
        revision = card.revision
        self.note(
            self.tally.leave_s, await self.dropped_after(agent, owner, revision, holders, 5.0)
        )
        await trio.sleep_until(start + 30.0)
        running = self.swarm.running()
        for device in self.rng.sample(running, min(5, len(running))):
            node = device.node
            assert node is not None
            try:
                cards = await node.find(capability)
            except P2PError:
                continue  # that node stopped meanwhile
            if not self.still(device, node):
                continue
            self.tally.leave_find_checks += 1
            gone = (agent, owner.raw) not in self.live_keys()
            if gone and any(
                c.id == agent and c.peer_id == owner and c.revision <= revision for c in cards
            ):
                self.tally.leave_find_stale += 1

    async def watch_crash(
        self,
        agent: str,
        capability: str,
        owner: PeerId,
        holders: Sequence[tuple[Device, Node]],
        card: AgentCard,
    ) -> None:
        revision = card.revision
        self.note(
            self.tally.crash_s, await self.dropped_after(agent, owner, revision, holders, 40.0)
        )
        # Every node, channel or not, drops it once its card expired.
        due = (card.expires_at - virtual_ms()) / 1000 + 1.0
        if trio.current_time() + due >= self.end:
            return
        await trio.sleep(due)
        if (agent, owner.raw) in self.live_keys():
            return  # back with that key: live again, rightly
        for device in self.swarm.running():
            assert device.node is not None
            self.tally.crash_expired_checks += 1
            self.tally.crash_expired_stale += claims(device.node, agent, owner, revision)

    async def requests(self, nursery: trio.Nursery) -> None:
        rng = self.rng
        for _ in range(int(self.args.minutes * 60 * self.args.rate * 3) + 10):  # bounded
            await trio.sleep(rng.expovariate(self.args.rate))
            if trio.current_time() >= self.end:
                return
            running = self.swarm.running()
            sender = rng.choice(running)
            capability = rng.choice(self.capabilities)
            if any(d.capability == capability and d is not sender for d in running):
                nursery.start_soon(self.ask, sender, capability)

    async def ask(self, sender: Device, capability: str) -> None:
        node = sender.node
        assert node is not None
        try:
            await node.request(sender.agent, capability, None, capability=True)
        except P2PError as exc:
            if self.still(sender, node):  # a sender stopping meanwhile is no failure
                self.tally.asked += 1
                self.tally.count(f"request failed {exc.code.value}")
            return
        self.tally.asked += 1
        self.tally.answered += 1

    async def finds(self) -> None:
        rng = self.rng
        while trio.current_time() < self.end:  # bounded by the virtual end time
            await trio.sleep(self.args.find_every)
            device = rng.choice(self.swarm.running())
            node = device.node
            assert node is not None
            try:
                cards = await node.find(rng.choice(self.capabilities))
            except P2PError:
                continue  # that node stopped meanwhile
            live = self.live_keys()
            self.tally.found += len(cards)
            stale = [c for c in cards if (c.id, c.peer_id.raw) not in live]
            self.tally.stale += len(stale)
            left = self.left
            self.tally.stale_withdrawn += sum(1 for c in stale if (c.id, c.peer_id.raw) in left)


async def build(
    sim: CountingNetwork, nursery: trio.Nursery, count: int, caps: int, rng: random.Random
) -> Swarm:
    swarm = Swarm(sim, nursery, NodeConfig())
    for i in range(count):
        await swarm.add(rng, f"svc{i % caps}")
    return swarm


async def churn_run(args: argparse.Namespace, seed: int) -> Tally:
    rng = random.Random(seed)
    sim = CountingNetwork(rng, default=LinkConditions(latency=0.02, jitter=0.01), tick=0.001)
    cpu = time.process_time()
    async with trio.open_nursery() as nursery:
        await nursery.start(sim.drive)
        swarm = await build(sim, nursery, args.nodes, args.capabilities, rng)
        churn = Churn(swarm, rng, args)
        churn.tally.build_cpu = time.process_time() - cpu
        async with trio.open_nursery() as inner:
            await churn.run(inner)
            inner.cancel_scope.cancel()
        churn.tally.churn_cpu = time.process_time() - cpu - churn.tally.build_cpu
        churn.tally.minutes = args.minutes
        nursery.cancel_scope.cancel()
    return churn.tally


@dataclasses.dataclass
class Renewal:
    nodes: int
    minutes: float
    datagrams: float  # DHT datagrams per node per minute
    kbytes: float  # DHT kB per node per minute
    renewals: float  # card renewals per node per minute
    channels: float  # open channels per node
    hello_bytes: float  # HELLO bytes per node per minute (renewals x channels x HELLO size)
    cpu_per_minute: float = 0.0  # CPU seconds per quiet virtual minute measured


def open_channels(node: Node) -> int:
    return sum(1 for link in node.links if link.state is ChannelState.OPEN)


async def renewal_run(nodes: int, minutes: float, seed: int) -> Renewal:
    rng = random.Random(seed)
    sim = CountingNetwork(rng, default=LinkConditions(latency=0.02, jitter=0.01), tick=0.001)
    async with trio.open_nursery() as nursery:
        await nursery.start(sim.drive)
        swarm = await build(sim, nursery, nodes, 20, rng)
        await trio.sleep(60.0)  # joined and settled
        live = [(d, d.node) for d in swarm.devices if d.node is not None]
        before = [n.local_agent(d.agent).revision for d, n in live]
        sent, sent_bytes = sim.datagrams_sent, sim.datagram_bytes
        quiet_cpu = time.process_time()
        await trio.sleep(minutes * 60)
        quiet_cpu = time.process_time() - quiet_cpu
        after = [n.local_agent(d.agent).revision for d, n in live]
        renewed = [a - b for a, b in zip(after, before, strict=True)]
        hellos = []
        for (d, n), count in zip(live, renewed, strict=True):
            card = n.local_agent(d.agent)
            size = len(encode_hello([card], list(card.addresses))) + FRAME_OVERHEAD
            hellos.append(count * open_channels(n) * size)
        per = nodes * minutes
        result = Renewal(
            nodes,
            minutes,
            (sim.datagrams_sent - sent) / per,
            (sim.datagram_bytes - sent_bytes) / per / 1000,
            sum(renewed) / per,
            statistics.mean(open_channels(n) for _, n in live),
            sum(hellos) / per,
            cpu_per_minute=quiet_cpu / minutes,
        )
        nursery.cancel_scope.cancel()
    return result


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def row(tally: Tally) -> dict[str, float]:
    finite_leave = [t for t in tally.leave_s if math.isfinite(t)]
    finite_crash = [t for t in tally.crash_s if math.isfinite(t)]
    return {
        "success": tally.answered / max(1, tally.asked),
        "stale": tally.stale / max(1, tally.found),
        "leave_max": max(tally.leave_s, default=0.0),
        "leave_p50": statistics.median(finite_leave) if finite_leave else math.inf,
        "leave_find_stale": tally.leave_find_stale / max(1, tally.leave_find_checks),
        "crash_max": max(tally.crash_s, default=0.0),
        "crash_p50": statistics.median(finite_crash) if finite_crash else math.inf,
        "crash_expired_stale": tally.crash_expired_stale / max(1, tally.crash_expired_checks),
    }


def print_run(seed: int, tally: Tally, r: dict[str, float], cpu: float) -> None:
    events = ", ".join(f"{k} {v}" for k, v in sorted(tally.events.items()))
    print(f"seed {seed}: {events}; CPU {cpu:.0f} s")
    print(
        f"  CPU: building the swarm {tally.build_cpu:.0f} s, then "
        f"{tally.churn_cpu / max(1e-9, tally.minutes):.1f} s per virtual minute of churn"
    )
    print(
        f"  requests {tally.answered}/{tally.asked} answered ({r['success']:.4f}); "
        f"find cards {tally.found}, stale {tally.stale} ({r['stale']:.4f}; withdrawn "
        f"{tally.stale_withdrawn}, the others crashed)"
    )
    print(
        f"  graceful: connected nodes dropped it in p50 {r['leave_p50']:.2f} s, max "
        f"{r['leave_max']:.2f} s; find 30 s later stale {tally.leave_find_stale}/"
        f"{tally.leave_find_checks}"
    )
    print(
        f"  crash: nodes with a channel dropped it in p50 {r['crash_p50']:.2f} s, max "
        f"{r['crash_max']:.2f} s; after expiry stale {tally.crash_expired_stale}/"
        f"{tally.crash_expired_checks}"
    )


def print_targets(rows: Sequence[dict[str, float]]) -> None:
    median = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"medians of {len(rows)} seeds:")
    checks = [
        ("request success >= 99.5%", f"{median['success']:.4f}", median["success"] >= 0.995),
        ("stale find results <= 1%", f"{median['stale']:.4f}", median["stale"] <= 0.01),
        ("graceful: connected drop <= 2 s", f"{median['leave_max']:.2f}", median["leave_max"] <= 2),
        (
            "graceful: find skips it at 30 s",
            f"{median['leave_find_stale']:.4f}",
            median["leave_find_stale"] == 0,
        ),
        ("crash: channel drop <= 30 s", f"{median['crash_max']:.2f}", median["crash_max"] <= 30),
        (
            "crash: all drop by card expiry",
            f"{median['crash_expired_stale']:.4f}",
            median["crash_expired_stale"] == 0,
        ),
    ]
    for name, value, ok in checks:
        print(f"target {name:<36} {value:>10} {met(ok):>8}")


def print_renewal(r: Renewal) -> None:
    print(f"renewal traffic, {r.nodes} nodes, {r.minutes:.0f} quiet virtual minutes, 600 s cards:")
    print(f"  DHT datagrams per node per minute   {r.datagrams:10.1f}")
    print(f"  DHT kB per node per minute          {r.kbytes:10.2f}")
    print(f"  card renewals per node per minute   {r.renewals:10.3f}")
    print(f"  open channels per node              {r.channels:10.1f}")
    print(f"  HELLO bytes per node per minute     {r.hello_bytes:10.1f}")
    print(f"  (CPU per quiet virtual minute       {r.cpu_per_minute:10.1f} s)")


def run_seed(args: argparse.Namespace, seed: int) -> tuple[Tally, float]:
    """One churn run on its own virtual clock, and the CPU seconds it took."""
    cpu = time.process_time()
    tally = trio.run(churn_run, args, seed, clock=trio.testing.MockClock(autojump_threshold=0))
    return tally, time.process_time() - cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--minutes", type=float, default=60.0, help="virtual minutes of churn")
    ap.add_argument("--period", type=float, default=300.0, help="mean s between a device's ends")
    ap.add_argument("--new-key", type=float, default=0.25, help="share of returns with a new key")
    ap.add_argument("--capabilities", type=int, default=20)
    ap.add_argument("--rate", type=float, default=2.0, help="requests a virtual second")
    ap.add_argument("--find-every", type=float, default=5.0, help="virtual s between finds")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--jobs", type=int, default=1, help="seeds run at once, one process each")
    ap.add_argument("--renewal-nodes", type=int, default=200, help="0: no renewal run")
    ap.add_argument("--renewal-minutes", type=float, default=20.0)
    args = ap.parse_args()
    rows = []
    if args.nodes > 0:
        print(
            f"{args.nodes} nodes, {args.minutes:.0f} virtual minutes, an end per device about "
            f"every {args.period:.0f} s, {args.rate} requests/s"
        )
        # Seeds are independent runs: with --jobs > 1 each runs in a process of its own
        # (one virtual hour at 200 nodes is about 45 CPU-minutes).
        with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            runs = pool.map(run_seed, [args] * len(args.seeds), args.seeds)
            for seed, (tally, cpu) in zip(args.seeds, runs, strict=True):
                rows.append(row(tally))
                print_run(seed, tally, rows[-1], cpu)
        print_targets(rows)
    if args.renewal_nodes > 0:
        cpu = time.process_time()
        r = trio.run(
            renewal_run,
            args.renewal_nodes,
            args.renewal_minutes,
            args.seeds[0],
            clock=trio.testing.MockClock(autojump_threshold=0),
        )
        print_renewal(r)
        print(f"  (CPU {time.process_time() - cpu:.0f} s)")


if __name__ == "__main__":
    main()
