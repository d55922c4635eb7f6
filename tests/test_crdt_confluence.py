"""Property 28: concurrent updates at 3-5 replicas, delivered in any order with
duplicates and drops, healed by anti-entropy, converge without losing any
acknowledged operation. Deltas travel signed; a log compacted past a peer's clock is
served as its origins' checkpoints."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import LocalError
from p2pnode.core.wire import canonical_pack
from p2pnode.crdt.delta import Delta
from p2pnode.crdt.gossip import GossipConfig
from p2pnode.crdt.ops import CounterAdd, MapRemove, Op, RegisterSet, SetAdd, SetRemove
from p2pnode.crdt.replica import Replica
from p2pnode.crdt.simulate import GossipSimulation, NetConfig
from p2pnode.crdt.types import DocState
from tests.crdtkeys import replica

paths = st.sampled_from([("t1", "status"), ("t1", "who"), ("t1", "n"), ("t2", "who"), ("t2",)])
ops: st.SearchStrategy[Op] = st.one_of(
    st.builds(CounterAdd, paths, st.integers(-3, 3).filter(bool)),
    st.builds(RegisterSet, paths, st.sampled_from(["open", "done"]), st.integers(1, 4)),
    st.builds(SetAdd, paths, st.sampled_from(["a", "b"])),
    st.builds(SetRemove, paths, st.sampled_from(["a", "b"])),
    st.builds(MapRemove, paths),
)


def anti_entropy(replicas: list[Replica], docs: list[str]) -> int:
    """Pairwise digest exchange until no replica learns anything; returns rounds."""
    for rounds in range(1, 50):
        learned = False
        for a in replicas:
            for b in replicas:
                if a is b:
                    continue
                for doc in docs:
                    for d in b.missing_for(doc, a.clock(doc)):
                        learned |= a.receive_delta_untrusted(d.sealed, source="peer") is not None
        if not learned:
            return rounds
    raise AssertionError("anti-entropy did not quiesce")


@settings(max_examples=120, deadline=None)
@given(
    n=st.integers(3, 5),
    max_log=st.sampled_from([2, 5, 1000]),
    script=st.lists(st.tuples(st.integers(0, 4), st.sampled_from(["d1", "d2"]), ops), max_size=30),
    rnd=st.randoms(use_true_random=False),
    drop=st.floats(0, 0.7),
)
def test_random_delivery_then_anti_entropy_converges(
    n: int, max_log: int, script: list[tuple[int, str, Op]], rnd: Any, drop: float
) -> None:
    replicas = [replica(f"r{i}", max_log=max_log) for i in range(n)]
    acked: list[Delta] = []
    in_flight: list[tuple[int, bytes]] = []
    for who, doc, op in script:
        src = replicas[who % n]
        try:
            delta = src.update(doc, op)
        except LocalError:
            continue  # a kind conflict the caller caused locally; nothing acknowledged
        acked.append(delta)
        for i in range(n):
            if i != who % n and rnd.random() >= drop:
                in_flight.append((i, delta.sealed))
                if rnd.random() < 0.2:
                    in_flight.append((i, delta.sealed))  # duplicate
        # Deliver a random part of what is in flight, in random order.
        rnd.shuffle(in_flight)
        cut = rnd.randrange(len(in_flight) + 1)
        for i, data in in_flight[:cut]:
            replicas[i].receive_delta_untrusted(data, source="peer")
        del in_flight[:cut]
    docs = ["d1", "d2"]
    anti_entropy(replicas, docs)
    reference = {doc: DocState() for doc in docs}
    for d in acked:
        reference[d.doc].join(d.state)
    for r in replicas:
        assert not r.errors
        for doc in docs:
            assert r.value(doc) == reference[doc].value()
            if doc in r.documents():
                assert r.document(doc).state == reference[doc]
                applied = r.document(doc).applied
                assert all((d.origin, d.seq) in applied for d in acked if d.doc == doc)
    # Stragglers still in flight arrive late: they change nothing.
    for i, data in in_flight:
        assert replicas[i].receive_delta_untrusted(data, source="peer") is None


@settings(max_examples=60, deadline=None)
@given(
    script=st.lists(st.tuples(st.integers(0, 2), ops), min_size=1, max_size=20),
    orders=st.lists(st.permutations(list(range(20))), min_size=2, max_size=3),
)
def test_confluence_under_permutations(
    script: list[tuple[int, Op]], orders: list[list[int]]
) -> None:
    """The same set of deltas in different orders gives byte-identical states."""
    writers = [Replica(f"w{i}") for i in range(3)]
    deltas: list[Delta] = []
    for who, op in script:
        try:
            deltas.append(writers[who].update("doc", op))
        except LocalError:
            continue
    encodings = set()
    for order in orders:
        r = Replica("reader")
        for idx in order:
            if idx < len(deltas):
                r.apply_delta(deltas[idx])
        encodings.add(canonical_pack(r.document("doc").state.to_wire()) if deltas else b"")
    assert len(encodings) == 1


@settings(max_examples=15, deadline=None)
@given(
    n=st.integers(3, 5),
    seed=st.integers(0, 2**32),
    loss=st.floats(0, 0.5),
    script=st.lists(st.tuples(st.integers(0, 4), ops), min_size=1, max_size=25),
)
def test_gossip_cores_converge_under_loss(
    n: int, seed: int, loss: float, script: list[tuple[int, Op]]
) -> None:
    """The same property through the gossip core: lossy network, then anti-entropy."""
    sim = GossipSimulation(
        n,
        seed=seed,
        gossip=GossipConfig(fanout=2, interval=0.2, max_outbox=8),
        net=NetConfig(latency=(0.001, 0.05), loss=loss),
        max_log=4,
    )
    acked: list[Delta] = []
    for who, op in script:
        try:
            acked.append(sim.update(who % n, "doc", op))
        except LocalError:
            continue
        sim.run_until(sim.now + sim.rng.uniform(0, 0.03))
    sim.net = NetConfig(latency=(0.001, 0.05), loss=0.0)  # the network recovers
    sim.run_until(sim.now + 10.0)
    assert sim.converged()
    reference = DocState()
    for d in acked:
        reference.join(d.state)
    for node in sim.nodes:
        assert node.replica.value("doc") == reference.value()
