"""A 100-node swarm on a lossy, partitioned virtual network converges with nothing lost."""

from __future__ import annotations

import random

from p2pnode.crdt.gossip import GossipConfig
from p2pnode.crdt.ops import CounterAdd, RegisterSet, SetAdd, SetRemove
from p2pnode.crdt.replica import Delta
from p2pnode.crdt.simulate import GossipSimulation, NetConfig
from p2pnode.crdt.types import DocState


def test_hundred_nodes_loss_partition_heal_converge() -> None:
    n = 100
    sim = GossipSimulation(
        n,
        seed=20261121,
        gossip=GossipConfig(fanout=4, interval=0.5),
        net=NetConfig(latency=(0.01, 0.05), loss=0.10),
        docs=("tasks", "chat"),
        max_log=64,
    )
    rng = sim.rng
    acked: list[Delta] = []

    def burst(writers: list[int], count: int, tag: str) -> None:
        for k in range(count):
            i = rng.choice(writers)
            task = f"task{rng.randrange(8)}"
            choice = rng.randrange(4)
            # Writers pick among four kinds of task-state update.
            if choice == 0:
                stamp = int(sim.now * 1000) + 1
                acked.append(
                    sim.update(i, "tasks", RegisterSet((task, "status"), f"{tag}{k}", stamp))
                )
            elif choice == 1:
                acked.append(sim.update(i, "tasks", SetAdd((task, "assignees"), f"n{i}")))
            elif choice == 2:
                who = f"n{rng.randrange(n)}"
                acked.append(sim.update(i, "tasks", SetRemove((task, "assignees"), who)))
            else:
                step = rng.choice([5, -1])
                acked.append(sim.update(i, "tasks", CounterAdd((task, "progress"), step)))
            if rng.random() < 0.3:
                acked.append(sim.update(i, "chat", SetAdd(("lines",), f"{tag}-{k}-n{i}")))
            sim.run_until(sim.now + rng.uniform(0.0, 0.02))

    # Phase 1: 50 writers, concurrent updates, 10 % loss.
    burst(list(range(0, 100, 2)), 150, "a")
    sim.run_until(sim.now + 2.0)
    # Phase 2: the swarm splits in two; both sides keep writing.
    left, right = list(range(50)), list(range(50, 100))
    sim.partition([left, right])
    burst(left[:20], 80, "left")
    burst(right[:20], 80, "right")
    sim.run_until(sim.now + 3.0)
    assert not sim.converged()  # the partition really separated the halves
    # Phase 3: heal; anti-entropy repairs everything (within 15 s; checked every half
    # second, the gossip interval, rather than running out the 15 s).
    sim.heal()
    deadline = sim.now + 15.0
    while not sim.converged() and sim.now < deadline:
        sim.run_until(min(sim.now + 0.5, deadline))

    assert sim.converged()
    assert sim.lost > 0
    reference = {"tasks": DocState(), "chat": DocState()}
    for d in acked:
        reference[d.doc].join(d.state)
    for node in sim.nodes:
        r = node.replica
        assert not r.errors
        for doc, ref in reference.items():
            assert r.document(doc).state == ref
            applied = r.document(doc).applied
            assert all((d.origin, d.seq) in applied for d in acked if d.doc == doc)
    lines = sim.nodes[0].replica.value("chat")["lines"]
    assert len(lines) == sum(1 for d in acked if d.doc == "chat")


def test_simulation_is_deterministic() -> None:
    def run() -> tuple[int, float, list[int]]:
        sim = GossipSimulation(30, seed=7, net=NetConfig(loss=0.2))
        for i in range(10):
            sim.update(i, "doc", CounterAdd(("n",), 1))
        sim.run_until(5.0)
        return sim.lost, sim.now, [c.bytes_sent for c in sim.counters]

    assert run() == run()


def test_three_hundred_nodes_tree_reaches_all_quickly_with_few_duplicates() -> None:
    # The default configuration: a broadcast tree with anti-entropy behind it. Once the
    # first updates have pruned the redundant links, each update reaches every node
    # within a few hundred ms, and nodes receive few copies twice.
    n = 300
    sim = GossipSimulation(n, seed=5, net=NetConfig(latency=(0.01, 0.03)))
    sim.run_until(1.0)
    writers = [sim.rng.randrange(n) for _ in range(8)]
    per_update = []
    for k, i in enumerate(writers):
        dups = sum(node.statistics().duplicates for node in sim.nodes)
        start = sim.now
        delta = sim.update(i, "doc", CounterAdd(("n",), 1))
        reached = sim.run_until_all_have((delta.origin, delta.seq), deadline=start + 3.0)
        assert reached is not None
        sim.run_until(sim.now + 0.5)
        if k >= 2:
            assert reached - start < 0.5
            per_update.append(sum(node.statistics().duplicates for node in sim.nodes) - dups)
    assert sum(per_update) / len(per_update) / n <= 0.5
    trees = [node.links("doc") for node in sim.nodes]
    assert max(len(eager) + len(lazy) for eager, lazy in trees) <= GossipConfig().max_links


def test_with_fast_anti_entropy_every_update_still_reaches_every_node_by_push() -> None:
    # Anti-entropy every 0.2 s races the pushes (the first update builds the tree while
    # it spreads). A node may learn an update from a batch first, but its push must
    # still come (and is forwarded): no node depends on anti-entropy.
    n = 100
    for seed in (1, 2, 3):
        sim = GossipSimulation(n, seed=seed, gossip=GossipConfig(interval=0.2))
        sim.run_until(0.4)
        writers = random.Random(seed)  # seed 3 once cut the tree (mutual link requests)
        for k in range(6):
            stats = [node.statistics() for node in sim.nodes]
            before = sum(s.new_by_batch - s.pushes_after_batch for s in stats)
            dups = sum(s.duplicates for s in stats)
            delta = sim.update(writers.randrange(n), "doc", CounterAdd(("n",), 1))
            reached = sim.run_until_all_have((delta.origin, delta.seq), deadline=sim.now + 3.0)
            assert reached is not None
            sim.run_until(reached + 0.13)
            stats = [node.statistics() for node in sim.nodes]
            assert sum(s.new_by_batch - s.pushes_after_batch for s in stats) == before, (seed, k)
            assert sum(s.duplicates for s in stats) - dups <= 2 * n
