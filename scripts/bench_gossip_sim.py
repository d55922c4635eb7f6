"""Benchmark: how one CRDT update spreads through N simulated gossip nodes.

Runs the sans-IO gossip core in the deterministic simulator (no network) and
compares, in the same run, three dissemination strategies for a single update:

* ``gossip``     rumor push with fanout f + push-pull anti-entropy (the design);
* ``push-only``  the same rumor push without anti-entropy (baseline: loses nodes);
* ``flood``      forward every new delta to all peers (baseline: naive flooding).

A *round* is one anti-entropy period (``--interval``); push hops are also
reported (each hop takes one link latency, well under a round). Frames and
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


@dataclass(frozen=True, slots=True)
class Row:
    n: int
    variant: str
    reached: float
    rounds: float
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
        n, seed=seed, gossip=configs[variant], net=NetConfig(latency=(0.01, 0.03))
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
    sim.run_until(max(t_all, sim.now) + 0.03)
    have = sum(1 for i in range(n) if sim.has(i, op))
    hops = [c.first_hops.get(op) for c in sim.counters[1:]]
    frames = sum(c.frames_sent for c in sim.counters) - base_frames
    nbytes = sum(c.bytes_sent for c in sim.counters) - base_bytes
    dups = sum(node.statistics().duplicates for node in sim.nodes) - base_dups
    return Row(
        n=n,
        variant=variant,
        reached=100.0 * have / n,
        rounds=math.ceil((t_all - t0) / interval) if have == n else float("nan"),
        hops=max((h for h in hops if h is not None and h >= 0), default=0),
        healed_by_ae=sum(1 for h in hops if h == -1),
        t_all=t_all - t0,
        frames_per_node=frames / n,
        bytes_per_node=nbytes / n,
        redundant_per_node=dups / n,
        wall=time.perf_counter() - start,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--fanout", type=int, default=4)
    ap.add_argument("--interval", type=float, default=0.2, help="anti-entropy period, s")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    head = (
        f"{'N':>5} {'variant':<9} {'reached%':>8} {'rounds':>6} {'hops':>4} {'AE-healed':>9} "
        f"{'t_all(s)':>8} {'frames/node':>11} {'bytes/node':>10} {'redund/node':>11} {'wall(s)':>7}"
    )
    print(
        f"fanout={args.fanout} round=anti-entropy period={args.interval}s "
        f"latency=10-30ms seed={args.seed}"
    )
    print(head)
    for n in args.sizes:
        rows = {
            v: run(n, v, args.fanout, args.interval, args.seed)
            for v in ("gossip", "push-only", "flood")
        }
        for r in rows.values():
            print(
                f"{r.n:>5} {r.variant:<9} {r.reached:>8.1f} {r.rounds:>6} {r.hops:>4} "
                f"{r.healed_by_ae:>9} {r.t_all:>8.3f} {r.frames_per_node:>11.1f} "
                f"{r.bytes_per_node:>10.0f} {r.redundant_per_node:>11.2f} {r.wall:>7.1f}"
            )
        g, f = rows["gossip"], rows["flood"]
        target = 2 * math.log2(n)
        met_rounds = "met" if g.rounds <= target else "MISSED"
        print(
            f"  N={n}: flood/gossip frames x{f.frames_per_node / g.frames_per_node:.1f}, "
            f"bytes x{f.bytes_per_node / g.bytes_per_node:.1f}, "
            f"redundant x{f.redundant_per_node / max(g.redundant_per_node, 1e-9):.1f}; "
            f"push-only reached {rows['push-only'].reached:.1f}% vs gossip {g.reached:.1f}%; "
            f"target rounds <= 2*log2(N) = {target:.1f}: {met_rounds} "
            f"({g.rounds}); redundant/node <= fanout {args.fanout}: "
            f"{'met' if g.redundant_per_node <= args.fanout else 'MISSED'}"
        )


if __name__ == "__main__":
    main()
