"""Benchmark: how CRDT updates spread through N simulated gossip nodes.

Runs the sans-IO gossip core in the deterministic simulator (no network) and
compares, in the same run, four dissemination strategies:

* ``tree``       broadcast tree (eager push on pruned links, lazy IHave and
                 Graft) + push-pull anti-entropy: the design (the default config);
* ``random``     rumor push to ``fanout`` random peers, forwarded once, +
                 anti-entropy (gossip version 2's design, a baseline);
* ``push-only``  the tree without anti-entropy;
* ``flood``      forward every new delta to all peers (baseline: naive flooding).

Each seed makes ``--updates`` updates by random writers, one after the other.
The first one builds the tree (each node is pushed to by the peers it asked
until the first push prunes the rest): its redundant deliveries are shown apart
("cold"), and the verdict checks it and whether it reached every node by push;
traffic and redundancy are the means over the later ones. A *round* is one anti-entropy period
(``--interval``); a stricter *hop round* is one maximal link latency (30 ms).
Push hops (depth of the tree) and nodes reached only by anti-entropy are
shown too. "by-push%" is the share of updates that reached every node by
push: a node that got the update from an anti-entropy batch first got its
push afterwards too (for ``random``, which has no such count, only updates no
batch brought anyone count). Frames and bytes per node count
everything sent until the last node has the update, plus 130 ms so copies in
flight and batched announcements are counted. Redundant deliveries per node
are copies of the update a node received after it already had it.

Usage: python scripts/bench_gossip_sim.py [--sizes 100 1000] [--fanout 4] [--seeds 1 2 3]
       [--updates 6]
"""

from __future__ import annotations

import argparse
import math
import random
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
    #: Redundant deliveries per node of the first update (links not yet pruned to a tree).
    cold_redundant: float = math.nan
    #: Percentage of the measured updates every node had before any anti-entropy batch.
    by_push: float = math.nan
    #: The same for the first update (100 or 0; worst case over seeds when aggregated).
    cold_by_push: float = math.nan


VARIANTS = ("tree", "random", "push-only", "flood")


def config(variant: str, n: int, fanout: int, interval: float) -> GossipConfig:
    return {
        "tree": GossipConfig(fanout=fanout, interval=interval),
        "random": GossipConfig(fanout=fanout, interval=interval, tree=False),
        "push-only": GossipConfig(fanout=fanout, interval=interval, anti_entropy=False),
        "flood": GossipConfig(
            fanout=n - 1, interval=interval, anti_entropy=False, tree=False, max_links=n
        ),
    }[variant]


@dataclass(slots=True)
class _Totals:
    frames: int
    nbytes: int
    dups: int
    by_batch: int
    pushed_too: int

    @classmethod
    def of(cls, sim: GossipSimulation) -> _Totals:
        stats = [node.statistics() for node in sim.nodes]
        return cls(
            sum(c.frames_sent for c in sim.counters),
            sum(c.bytes_sent for c in sim.counters),
            sum(s.duplicates for s in stats),
            sum(s.new_by_batch for s in stats),
            sum(s.pushes_after_batch for s in stats),
        )


def run(n: int, variant: str, fanout: int, interval: float, seed: int, updates: int = 1) -> Row:
    """``updates`` updates by random writers, one after the other (each until every node
    has it, or 60 rounds); traffic is the mean over all but the first, which builds the
    tree (all of them when there is one)."""
    start = time.perf_counter()
    sim = GossipSimulation(
        n, seed=seed, gossip=config(variant, n, fanout, interval),
        net=NetConfig(latency=(0.01, MAX_LATENCY)),
    )  # fmt: skip
    # Let anti-entropy timers reach their steady, jittered phase first.
    sim.run_until(2 * interval)
    writers = random.Random(seed)
    times, hops, healed, have, redundant, pushed = [], [], [], [], [], []
    measured: list[tuple[_Totals, _Totals]] = []
    for _ in range(updates):
        before, t0 = _Totals.of(sim), sim.now
        delta = sim.update(writers.randrange(n), "doc", CounterAdd(("progress",), 1))
        op = (delta.origin, delta.seq)
        sim.tracked = {op}
        t_all = sim.run_until_all_have(op, deadline=t0 + 60 * interval)
        # Let copies in flight and the batched announcements land.
        sim.run_until(max(t_all or sim.now, sim.now) + MAX_LATENCY + 0.1)
        after = _Totals.of(sim)
        measured.append((before, after))
        have.append(sum(1 for i in range(n) if sim.has(i, op)))
        times.append(math.nan if t_all is None else t_all - t0)
        first = [c.first_hops.get(op) for c in sim.counters]
        hops.append(max((h for h in first if h is not None and h >= 0), default=0))
        healed.append(sum(1 for h in first if h == -1))
        redundant.append((after.dups - before.dups) / n)
        # Every node got a push of it (where a batch came first, the push afterwards).
        learnt = after.by_batch - before.by_batch
        pushed.append(have[-1] == n and learnt == after.pushed_too - before.pushed_too)
    steady = measured[1:] or measured
    k = len(steady)
    t_all = max(times)
    done = all(h == n for h in have)
    return Row(
        n=n,
        variant=variant,
        reached=100.0 * min(have) / n,
        rounds=math.ceil(t_all / interval) if done else math.nan,
        hop_rounds=math.ceil(t_all / MAX_LATENCY) if done else math.nan,
        hops=max(hops),
        healed_by_ae=max(healed),
        t_all=t_all if done else math.nan,
        frames_per_node=sum(a.frames - b.frames for b, a in steady) / k / n,
        bytes_per_node=sum(a.nbytes - b.nbytes for b, a in steady) / k / n,
        redundant_per_node=sum(redundant[1:] or redundant) / k,
        wall=time.perf_counter() - start,
        cold_redundant=redundant[0],
        by_push=100.0 * sum(pushed[1:] or pushed) / k,
        cold_by_push=100.0 * pushed[0],
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
        cold_redundant=mean([r.cold_redundant for r in rows]),
        by_push=min(r.by_push for r in rows),
        cold_by_push=min(r.cold_by_push for r in rows),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--fanout", type=int, default=4)
    ap.add_argument("--interval", type=float, default=0.2, help="anti-entropy period, s")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--updates", type=int, default=6, help="updates per seed")
    args = ap.parse_args()
    print(
        f"fanout={args.fanout} round=anti-entropy period={args.interval}s "
        f"hop-round=max latency {MAX_LATENCY}s latency=10-30ms seeds={args.seeds} "
        f"updates/seed={args.updates} (worst case of reach/rounds/time/by-push, mean of "
        f"traffic; flood: first seed, one update)"
    )
    print(HEADER)
    for n in args.sizes:
        rows: dict[str, Row] = {}
        for v in VARIANTS:
            seeds, k = (args.seeds[:1], 1) if v == "flood" else (args.seeds, args.updates)
            rows[v] = aggregate([run(n, v, args.fanout, args.interval, s, k) for s in seeds])
        for r in rows.values():
            print(format_row(r))
        print(verdict(rows, n))


HEADER = (
    f"{'N':>5} {'variant':<9} {'reached%':>8} {'by-push%':>8} {'rounds':>6} {'hop-rnds':>8} "
    f"{'hops':>4} {'AE-healed':>9} {'t_all(s)':>8} {'frames/node':>11} {'bytes/node':>10} "
    f"{'redund/node':>11} {'cold':>5} {'wall(s)':>7}"
)


def format_row(r: Row) -> str:
    return (
        f"{r.n:>5} {r.variant:<9} {r.reached:>8.1f} {r.by_push:>8.1f} {r.rounds:>6} "
        f"{r.hop_rounds:>8} {r.hops:>4} {r.healed_by_ae:>9} {r.t_all:>8.3f} "
        f"{r.frames_per_node:>11.1f} {r.bytes_per_node:>10.0f} {r.redundant_per_node:>11.2f} "
        f"{r.cold_redundant:>5.2f} {r.wall:>7.1f}"
    )


def verdict(rows: dict[str, Row], n: int) -> str:
    g, f, r = rows["tree"], rows["flood"], rows["random"]
    target = 2 * math.log2(n)
    met_rounds = "met" if max(g.rounds, g.hop_rounds) <= target else "MISSED"
    met_redundant = "met" if g.redundant_per_node <= REDUNDANT_TARGET else "MISSED"
    met_cold = "met" if g.cold_redundant <= REDUNDANT_TARGET else "MISSED"
    met_push = "met" if min(g.by_push, g.cold_by_push) >= BY_PUSH_TARGET else "MISSED"
    return (
        f"  N={n}: flood/tree frames x{f.frames_per_node / g.frames_per_node:.1f}, "
        f"random/tree frames x{r.frames_per_node / g.frames_per_node:.1f}; "
        f"push-only reached {rows['push-only'].reached:.1f}% (worst seed) vs tree "
        f"{g.reached:.1f}%; rounds <= 2*log2(N) = {target:.1f}: {met_rounds} "
        f"({g.rounds} AE rounds, {g.hop_rounds} hop rounds); redundant/node "
        f"{g.redundant_per_node:.2f} <= {REDUNDANT_TARGET}: {met_redundant}\n"
        f"  N={n}: first update (tree being built) redundant/node {g.cold_redundant:.2f} <= "
        f"{REDUNDANT_TARGET}: {met_cold}; by push: first update {g.cold_by_push:.0f}% (worst "
        f"seed), later ones {g.by_push:.1f}%, >= {BY_PUSH_TARGET:.0f}%: {met_push}"
    )


#: Redundant deliveries per node and update the tree must stay under (the first too).
REDUNDANT_TARGET = 2
#: Percentage of updates that must reach every node by push alone.
BY_PUSH_TARGET = 99.0


if __name__ == "__main__":
    main()
