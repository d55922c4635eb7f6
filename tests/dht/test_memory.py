"""What one DHT node costs in memory before it runs (many share one process in the
simulator and the benchmarks)."""

from __future__ import annotations

import gc
import random
import tracemalloc

from p2pnode.dht.peer import DhtPeer
from p2pnode.dht.rpc import RpcCore
from p2pnode.transport.net import TrioNetwork


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


def test_an_rpc_core_gives_back_the_table_of_a_burst_of_calls() -> None:
    # A publisher's burst of stores grows the pending table; once every call ended,
    # what the core holds is what it held before (a dict never shrinks by itself).
    core = RpcCore(rng=random.Random(1), timeout=1.0, remember=0)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(200):
            core.call(("10.0.0.1", 1000 + i), "ping", [bytes(20)], 0.0)
        core.datagrams_to_send()
        assert len(core.handle_timer(2.0)) == 200
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert core.pending == 0
    assert held < 1024, held
