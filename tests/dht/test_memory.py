"""What one DHT node costs in memory before it runs (many share one process in the
simulator and the benchmarks)."""

from __future__ import annotations

import gc
import tracemalloc

from p2pnode.dht.peer import DhtPeer
from p2pnode.net import TrioNetwork


def test_a_node_without_an_rng_carries_no_generator_state() -> None:
    # A random.Random (SystemRandom included) holds a 2.5 KB Mersenne Twister state;
    # nodes built without an rng draw from the OS through one shared object.
    net = TrioNetwork()
    ids = [bytes([i % 256, i // 256]) + bytes(18) for i in range(1, 201)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        peers = [DhtPeer(net, node_id=node_id) for node_id in ids]
        gc.collect()
        per_node = (tracemalloc.get_traced_memory()[0] - before) / len(peers)
    finally:
        tracemalloc.stop()
    # About 4.7 KB today (tables, counters, admission and RPC state); one generator
    # of its own would add 2.9 KB.
    assert per_node < 6000, per_node
