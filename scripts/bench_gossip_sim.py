"""Benchmark: how one CRDT update spreads through N simulated gossip nodes.

Runs the sans-IO gossip core in the deterministic simulator (no network) and
compares, in the same run, three dissemination strategies for a single update:

* ``gossip``     rumor push with fanout f + push-pull anti-entropy (the design);
* ``push-only``  the same rumor push without anti-entropy (baseline: loses nodes);
* ``flood``      forward every new delta to all peers (baseline: naive flooding).

A *round* is one anti-entropy period (``--interval``); a stricter *hop round*
is one maximal link latency (30 ms), the time one push hop can take. Push hops
(depth of the rumor tree) and nodes reached only by anti-entropy are shown too. Frames and
bytes per node count everything sent until the last node has the update
(for push-only: until the network is quiet), plus one maximal link latency so
copies in flight are counted. Redundant deliveries per node are
copies of the update a node received after it already had it.

Usage: python scripts/bench_gossip_sim.py [--sizes 100 1000] [--fanout 4] [--seed 1]
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

from p2pnode.crdt.gossip import GossipConfig
from p2pnode.crdt.ops import CounterAdd
from p2pnode.crdt.simulate import GossipSimulation, NetConfig

MAX_LATENCY = 0.03


@dataclass(frozen=True, slots=True)
class Row:
    n: int
    variant: str
    reached: float
    rounds: float
    hop_rounds: float
    hops: int
    healed_by_ae: int
    t_all: float
    frames_per_node: float
    bytes_per_node: float
    redundant_per_node: float
    wall: float


def run(n: int, variant: str, fanout: int, interval: float, seed: int) -> Row:
    configs = {
        "gossip": GossipConfig(fanout=fanout, interval=interval),
        "push-only": GossipConfig(fanout=fanout, interval=interval, anti_entropy=False),
        "flood": GossipConfig(fanout=n - 1, interval=interval, anti_entropy=False),
    }
    start = time.perf_counter()
    sim = GossipSimulation(
        n, seed=seed, gossip=configs[variant], net=NetConfig(latency=(0.01, MAX_LATENCY))
    )
    # Let anti-entropy timers reach their steady, jittered phase first.
    sim.run_until(2 * interval)
    base_frames = sum(c.frames_sent for c in sim.counters)
    base_bytes = sum(c.bytes_sent for c in sim.counters)
    base_dups = sum(node.statistics().duplicates for node in sim.nodes)
    t0 = sim.now
    delta = sim.update(0, "doc", CounterAdd(("progress",), 1))
    op = (delta.origin, delta.seq)
    sim.track(op)
    t_all = sim.run_until_all_have(op, deadline=t0 + 60 * interval)
    if t_all is None:
        t_all = sim.now
    # Let copies already in flight land (no node forwards once all have the op).
    sim.run_until(max(t_all, sim.now) + MAX_LATENCY)
    have = sum(1 for i in range(n) if sim.has(i, op))
    hops = [c.first_hops.get(op) for c in sim.counters[1:]]
    frames = sum(c.frames_sent for c in sim.counters) - base_frames
    nbytes = sum(c.bytes_sent for c in sim.counters) - base_bytes
    dups = sum(node.statistics().duplicates for node in sim.nodes) - base_dups
    done = have == n
    return Row(
        n=n,
        variant=variant,
        reached=100.0 * have / n,
        rounds=math.ceil((t_all - t0) / interval) if done else math.nan,
        hop_rounds=math.ceil((t_all - t0) / MAX_LATENCY) if done else math.nan,
        hops=max((h for h in hops if h is not None and h >= 0), default=0),
        healed_by_ae=sum(1 for h in hops if h == -1),
        t_all=t_all - t0,
        frames_per_node=frames / n,
        bytes_per_node=nbytes / n,
        redundant_per_node=dups / n,
        wall=time.perf_counter() - start,
    )


def aggregate(rows: list[Row]) -> Row:
    """Worst case for reach and time, mean for traffic."""

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    def worst(xs: list[float]) -> float:
        # A run that never reached every node makes the worst case "never".
        return math.nan if any(math.isnan(x) for x in xs) else max(xs)

    return Row(
        n=rows[0].n,
        variant=rows[0].variant,
        reached=min(r.reached for r in rows),
        rounds=worst([r.rounds for r in rows]),
        hop_rounds=worst([r.hop_rounds for r in rows]),
        hops=max(r.hops for r in rows),
        healed_by_ae=round(mean([r.healed_by_ae for r in rows])),
        t_all=max(r.t_all for r in rows),
        frames_per_node=mean([r.frames_per_node for r in rows]),
        bytes_per_node=mean([r.bytes_per_node for r in rows]),
        redundant_per_node=mean([r.redundant_per_node for r in rows]),
        wall=sum(r.wall for r in rows),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--fanout", type=int, default=4)
    ap.add_argument("--interval", type=float, default=0.2, help="anti-entropy period, s")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    args = ap.parse_args()
    print(
        f"fanout={args.fanout} round=anti-entropy period={args.interval}s "
        f"hop-round=max latency {MAX_LATENCY}s latency=10-30ms seeds={args.seeds} "
        f"(worst case of reach/rounds/time, mean of traffic; flood: first seed only)"
    )
    print(
        f"{'N':>5} {'variant':<9} {'reached%':>8} {'rounds':>6} {'hop-rnds':>8} {'hops':>4} "
        f"{'AE-healed':>9} {'t_all(s)':>8} {'frames/node':>11} {'bytes/node':>10} "
        f"{'redund/node':>11} {'wall(s)':>7}"
    )
    for n in args.sizes:
        rows: dict[str, Row] = {}
        for v in ("gossip", "push-only", "flood"):
            seeds = args.seeds[:1] if v == "flood" else args.seeds
            rows[v] = aggregate([run(n, v, args.fanout, args.interval, s) for s in seeds])
        for r in rows.values():
            print(
                f"{r.n:>5} {r.variant:<9} {r.reached:>8.1f} {r.rounds:>6} {r.hop_rounds:>8} "
                f"{r.hops:>4} {r.healed_by_ae:>9} {r.t_all:>8.3f} {r.frames_per_node:>11.1f} "
                f"{r.bytes_per_node:>10.0f} {r.redundant_per_node:>11.2f} {r.wall:>7.1f}"
            )
        g, f = rows["gossip"], rows["flood"]
        target = 2 * math.log2(n)
        met_rounds = "met" if max(g.rounds, g.hop_rounds) <= target else "MISSED"
        met_redundant = "met" if g.redundant_per_node <= args.fanout else "MISSED"
        print(
            f"  N={n}: flood/gossip frames x{f.frames_per_node / g.frames_per_node:.1f}, "
            f"bytes x{f.bytes_per_node / g.bytes_per_node:.1f}, "
            f"redundant x{f.redundant_per_node / max(g.redundant_per_node, 1e-9):.1f}; "
            f"push-only reached {rows['push-only'].reached:.1f}% (worst seed) vs gossip "
            f"{g.reached:.1f}%; rounds <= 2*log2(N) = {target:.1f}: {met_rounds} "
            f"({g.rounds} AE rounds, {g.hop_rounds} hop rounds); "
            f"redundant/node <= fanout {args.fanout}: {met_redundant}"
        )


if __name__ == "__main__":
    main()
