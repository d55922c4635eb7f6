"""The broadcast tree of the gossip core (Plumtree): links, prune, lazy announce, graft,
bounds; and its properties in the simulator (push alone reaches all without loss,
anti-entropy repairs loss, redundancy bounded once the tree is built)."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pnode.core.wire import pack
from p2pnode.crdt.frames import (
    MAX_IDS,
    DeltaBatch,
    DeltaPush,
    GossipError,
    Graft,
    IHave,
    Prune,
    decode_untrusted,
)
from p2pnode.crdt.gossip import GossipConfig, GossipMessage, GossipNode
from p2pnode.crdt.ops import CounterAdd
from p2pnode.crdt.plumtree import Tree
from p2pnode.crdt.simulate import GossipSimulation, NetConfig
from tests.crdtkeys import replica, rid

A, B, C, D = rid("A"), rid("B"), rid("C"), rid("D")


def node(name: str, peers: list[str], **cfg: object) -> GossipNode:
    return GossipNode(
        replica(name),
        peers=[rid(p) for p in peers],
        docs=["doc"],
        rng=random.Random(0),
        now=0.0,
        config=GossipConfig(anti_entropy=False, **cfg),  # type: ignore[arg-type]
    )


def sent(n: GossipNode) -> list[tuple[str, GossipMessage]]:
    """What ``n`` queued, each frame through its encoding."""
    return [(p, GossipMessage.decode_untrusted(m.encode())) for p, m in n.take_outgoing()]


def test_a_publish_links_the_ring_successor_and_random_peers_eagerly() -> None:
    n = node("A", ["B", "C", "D"], fanout=2)
    _, targets = n.local_update("doc", CounterAdd(("n",), 1))
    eager, lazy = n.links("doc")
    assert len(eager) == 2 and lazy == ()
    assert set(targets) == set(eager)
    ring = sorted([A, B, C, D])
    assert ring[(ring.index(A) + 1) % 4] in eager  # the successor is always linked
    out = sent(n)
    assert sorted(p for p, m in out if m == Graft("doc")) == sorted(eager)  # link requests
    assert sorted(p for p, m in out if isinstance(m, DeltaPush)) == sorted(eager)


def test_a_link_request_links_back_and_a_full_node_refuses_it() -> None:
    b = node("B", ["A", "C", "D"], fanout=1, max_links=2)
    b.receive(A, Graft("doc"), 0.0)
    eager, lazy = b.links("doc")
    assert eager == (A,) and len(lazy) == 1  # and B's own link (its ring successor), asked
    assert (lazy[0], Graft("doc")) in sent(b)
    other = ({A, C, D} - {A, lazy[0]}).pop()
    b.receive(other, Graft("doc"), 0.0)  # full
    assert other not in b.links("doc")[0] + b.links("doc")[1]
    assert (other, Prune("doc")) in sent(b)


def test_a_duplicate_push_prunes_the_link_on_both_sides() -> None:
    a, b = node("A", ["B", "C"]), node("B", ["A", "C"])
    c = node("C", ["A", "B"])
    delta, _ = c.local_update("doc", CounterAdd(("n",), 1))
    push = DeltaPush.of(delta)
    assert b.receive(C, push, 0.0).new == 1
    b.receive(A, Graft("doc"), 0.0)
    b.take_outgoing()
    assert A in b.links("doc")[0]
    res = b.receive(A, DeltaPush.of(delta, hops=1), 0.0)  # the same delta by another link
    assert res.duplicate == 1
    assert A in b.links("doc")[1] and (A, Prune("doc")) in sent(b)
    a.receive(B, Graft("doc"), 0.0)
    a.receive(B, Prune("doc"), 0.0)
    assert B in a.links("doc")[1] and B not in a.links("doc")[0]
    # The link that brought the delta first stays eager.
    assert C in b.links("doc")[0]


def test_new_deltas_are_announced_lazily_after_the_delay() -> None:
    b = node("B", ["A", "C", "D"], lazy_delay=0.05)
    a = node("A", ["B"])
    delta, _ = a.local_update("doc", CounterAdd(("n",), 1))
    b.receive(D, Graft("doc"), 0.0)
    b.receive(D, Prune("doc"), 0.0)  # D is a lazy link of B
    b.take_outgoing()
    b.receive(A, DeltaPush.of(delta), 1.0)
    assert not any(isinstance(m, IHave) for _, m in sent(b))
    assert b.next_deadline() == 1.05
    b.handle_timer(1.04)
    assert sent(b) == []
    b.handle_timer(1.05)
    lazy = b.links("doc")[1]
    assert D in lazy and A not in lazy  # D was pruned; A pushed the delta (now eager)
    assert sorted(sent(b)) == sorted((p, IHave("doc", ((A, 1, 1),))) for p in lazy)
    assert b.next_deadline() == float("inf")


def test_a_missing_announced_delta_is_grafted_from_each_announcer_in_turn() -> None:
    a = node("A", ["B", "C"])
    delta, _ = a.local_update("doc", CounterAdd(("n",), 1))
    c = node("C", ["A", "B", "D"], graft_timeout=0.25)
    c.handle_timer(1.0)  # C links and asks its peers to push to it
    for peer in (B, D):  # which they refuse: no push is awaited from them
        c.receive(peer, Prune("doc"), 1.0)
    c.receive(B, IHave("doc", ((A, 1, 1),)), 2.0)
    c.receive(D, IHave("doc", ((A, 1, 1),)), 2.1)
    c.take_outgoing()
    assert c.next_deadline() == 2.25
    c.handle_timer(2.25)
    assert sent(c) == [(B, Graft("doc", ((A, 1, 1),)))]
    assert B in c.links("doc")[0]  # the graft repairs the tree through B
    c.handle_timer(2.5)
    assert sent(c) == [(D, Graft("doc", ((A, 1, 1),)))]
    # The delta arrives: nothing is awaited any more.
    assert c.receive(D, DeltaPush.of(delta), 2.6).new == 1
    c.take_outgoing()
    c.handle_timer(10.0)
    assert not any(isinstance(m, Graft) for _, m in sent(c))
    # A graft is answered with the delta, as a push.
    a.take_outgoing()
    a.receive(C, Graft("doc", ((A, 1, 1),)), 3.0)
    assert (C, DeltaPush.of(delta)) in sent(a)


def test_a_delta_learnt_by_batch_is_forwarded_when_its_push_comes_and_prunes_nothing() -> None:
    a = node("A", ["B"])
    delta, _ = a.local_update("doc", CounterAdd(("n",), 1))
    b = node("B", ["A", "C", "D"], fanout=3)
    assert b.receive(D, DeltaBatch((delta.sealed_bytes(),)), 0.0).new == 1
    assert not any(isinstance(m, DeltaPush) for _, m in sent(b))
    res = b.receive(C, DeltaPush.of(delta), 0.1)  # the push the batch overtook
    assert res.duplicate == 1 and set(res.forwarded_to) == set(b.links("doc")[0]) - {A, C}
    assert (b.statistics().new_by_batch, b.statistics().pushes_after_batch) == (1, 1)
    out = sent(b)
    assert (C, Prune("doc")) not in out
    assert {p for p, m in out if isinstance(m, DeltaPush)} == set(res.forwarded_to)
    # A second copy is an ordinary duplicate.
    assert b.receive(D, DeltaPush.of(delta), 0.2).forwarded_to == ()
    assert (D, Prune("doc")) in sent(b)


def test_every_table_is_bounded() -> None:
    tree = Tree(rng=random.Random(0), fanout=2, eager_fanout=1, max_links=3, lazy_delay=0.0,
                graft_timeout=1.0, max_missing=5, catch_up=1.0)  # fmt: skip
    for i in range(10):
        tree.announced((B, i + 1, i + 1), f"p{i}", 0.0)
    assert len(tree.missing_ids()) == 5
    assert tree.links == 3  # announcers beyond max_links are not remembered
    for peer in ("x", "y", "z"):
        assert not tree.make_eager(peer)
    assert tree.links == 3
    tree.make_lazy("p0")
    for i in range(MAX_IDS + 10):
        tree.delivered((C, i + 1, i + 1), None, 0.0)
    assert [len(ids) for ids in tree.take_announcements(0.0).values()] == [MAX_IDS] * 3


def run_updates(sim: GossipSimulation, writers: list[int], gap: float) -> list[int]:
    """Each writer updates in turn, ``gap`` seconds apart; returns the duplicate counts
    of the swarm after each one."""
    dups = []
    for i in writers:
        sim.update(i, "doc", CounterAdd(("n",), 1))
        sim.run_until(sim.now + gap)
        dups.append(sum(node.statistics().duplicates for node in sim.nodes))
    return dups


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(2, 14),
    fanout=st.integers(1, 4),
    seed=st.integers(0, 2**32),
    writers=st.lists(st.integers(0, 13), min_size=1, max_size=6),
    gap=st.sampled_from([0.0, 0.01, 0.5]),
)
def test_without_loss_push_alone_reaches_every_node(
    n: int, fanout: int, seed: int, writers: list[int], gap: float
) -> None:
    # Concurrent updates (gap 0) too: the tree may break, and the grafts repair it.
    cfg = GossipConfig(fanout=fanout, anti_entropy=False)
    sim = GossipSimulation(n, seed=seed, gossip=cfg, net=NetConfig(latency=(0.01, 0.03)))
    run_updates(sim, [w % n for w in writers], gap)
    sim.run_until(sim.now + 5.0)
    assert sim.converged()
    assert all(node.replica.clock("doc").get(sim.ids[w % n]) > 0 for node in sim.nodes
               for w in writers)  # fmt: skip
    assert sum(node.statistics().new_by_batch for node in sim.nodes) == 0


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(2, 12),
    seed=st.integers(0, 2**32),
    loss=st.floats(0.0, 0.5),
    writers=st.lists(st.integers(0, 11), min_size=1, max_size=6),
)
def test_with_loss_every_node_eventually_has_every_update(
    n: int, seed: int, loss: float, writers: list[int]
) -> None:
    cfg = GossipConfig(fanout=2, interval=0.2)
    sim = GossipSimulation(n, seed=seed, gossip=cfg, net=NetConfig(loss=loss))
    acked = [sim.update(w % n, "doc", CounterAdd(("n",), 1)) for w in writers]
    sim.run_until(60.0)
    assert sim.converged()
    for node in sim.nodes:
        assert all(node.replica.has_applied("doc", d.origin, d.seq) for d in acked)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(3, 40), fanout=st.integers(1, 5), seed=st.integers(0, 2**32))
def test_once_the_tree_is_built_updates_travel_it_without_duplicates(
    n: int, fanout: int, seed: int
) -> None:
    # One update at a time (each lands everywhere before the next). Every duplicate
    # prunes the link it came by on both sides, so the copies stop once the eager
    # links form a tree: a few updates (the first ones create the links as they
    # spread), and never more duplicates in all than there are link ends.
    # (The graft timeout exceeds the longest path: else a node far down the tree
    # grafts a lazy link before the push arrives, and the tree reshapes.)
    cfg = GossipConfig(fanout=fanout, anti_entropy=False, graft_timeout=2.0)
    sim = GossipSimulation(n, seed=seed, gossip=cfg)
    rng = random.Random(seed)
    dups = run_updates(sim, [rng.randrange(n) for _ in range(10)], 3.0)
    assert dups[-1] == dups[5]
    assert dups[-1] <= sum(len(e) + len(lz) for e, lz in (x.links("doc") for x in sim.nodes))


def test_without_the_tree_a_graft_is_only_served() -> None:
    a = node("A", ["B", "C"], tree=False)
    delta, _ = a.local_update("doc", CounterAdd(("n",), 1))
    a.take_outgoing()
    a.receive(B, Graft("doc", ((A, 1, 1), (A, 2, 2))), 0.0)  # operation 2 does not exist
    assert sent(a) == [(B, DeltaPush.of(delta))]
    assert a.links("doc") == ((), ())


def test_a_sender_that_is_not_a_peer_is_never_linked() -> None:
    # The driver adds a peer only when policy allows both ways; frames from others are
    # still handled, but their sender must not become a link to push to.
    a = node("A", ["B"])
    delta, _ = a.local_update("doc", CounterAdd(("n",), 1))
    b = node("B", ["C"])
    assert b.receive(A, DeltaPush.of(delta), 0.0).new == 1
    b.receive(A, DeltaPush.of(delta), 0.1)
    b.receive(A, Graft("doc"), 0.2)
    b.receive(A, IHave("doc", ((A, 2, 2),)), 0.3)
    assert A not in b.links("doc")[0] + b.links("doc")[1]
    assert all(p != A for p, _ in sent(b))


_ids = st.lists(
    st.tuples(st.sampled_from([A, B]), st.integers(1, 2**63 - 1)).map(lambda t: (t[0], t[1], t[1])),
    max_size=MAX_IDS,
)


@given(ids=_ids, doc=st.text(min_size=1, max_size=256))
def test_control_frames_round_trip(ids: list[tuple[str, int, int]], doc: str) -> None:
    for frame in (Graft(doc, tuple(ids)), Prune(doc)) + ((IHave(doc, tuple(ids)),) if ids else ()):
        assert decode_untrusted(frame.encode()) == frame


_junk = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-1, 2**64 - 1)
    | st.text(max_size=5)
    | st.binary(max_size=5),
    lambda inner: st.lists(inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=300)
@given(kind=st.sampled_from([5, 6, 7]), ids=_junk, doc=_junk)
def test_tampered_control_frames_raise_only_gossip_error(
    kind: int, ids: object, doc: object
) -> None:
    fields = (
        {"v": 3, "t": kind, "doc": doc}
        if kind == 7
        else {"v": 3, "t": kind, "doc": doc, "ids": ids}
    )
    try:
        msg = decode_untrusted(pack(fields))
    except GossipError:
        return
    assert isinstance(msg, (IHave, Graft, Prune))
    assert decode_untrusted(msg.encode()) == msg


def test_the_first_push_cancels_the_other_asks() -> None:
    x = node("A", ["B", "C", "D", "E", "F"], fanout=4)
    x.handle_timer(0.0)  # links made at once: three of them asked to push here
    asked = sorted(p for p, m in sent(x) if m == Graft("doc"))
    assert len(asked) == 3 and x.links("doc")[0] == ()
    other = ({rid(p) for p in "BCDEF"} - set(asked)).pop()
    x.receive(other, Graft("doc"), 0.05)  # a peer asks x to push to it
    first = asked[0]
    y = node("G", ["A"])
    delta, _ = y.local_update("doc", CounterAdd(("n",), 1))
    assert x.receive(first, DeltaPush.of(delta), 0.1).forwarded_to == (other,)
    assert sorted(p for p, m in sent(x) if m == Prune("doc")) == asked[1:]
    eager, lazy = x.links("doc")
    assert set(eager) == {first, other} and set(asked[1:]) <= set(lazy)


def test_a_node_no_one_asked_yet_pushes_to_the_peers_it_asked() -> None:
    # An update made before any link request arrived still leaves by push.
    x = node("A", ["B", "C", "D", "E"], fanout=4)
    _, targets = x.local_update("doc", CounterAdd(("n",), 1))
    asked = {p for p, m in sent(x) if m == Graft("doc")}
    assert len(asked) == 3 and set(targets) == asked == set(x.links("doc")[0])


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 40), fanout=st.integers(1, 5), seed=st.integers(0, 2**32))
def test_the_first_update_costs_each_node_fewer_copies_than_it_asked_for(
    n: int, fanout: int, seed: int
) -> None:
    # Each node asks min(eager_fanout, fanout) peers to push to it, and the first push
    # cancels the other asks: no node gets the first update more often than it asked
    # for it, and push alone reaches every node.
    # No timed graft comes within the run: the eager pushes alone must reach every node.
    cfg = GossipConfig(fanout=fanout, anti_entropy=False, graft_timeout=1000.0)
    sim = GossipSimulation(n, seed=seed, gossip=cfg)
    sim.run_until(0.1)  # the link requests land
    sim.update(random.Random(seed).randrange(n), "doc", CounterAdd(("n",), 1))
    sim.run_until(3.0)
    assert sim.converged()
    asked = min(cfg.eager_fanout, fanout)
    assert max(node.statistics().duplicates for node in sim.nodes) <= asked - 1
    assert sum(node.statistics().new_by_batch for node in sim.nodes) == 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(2, 30),
    fanout=st.integers(1, 5),
    seed=st.integers(0, 2**32),
    start=st.sampled_from([0.0, 0.005, 0.015]),
)
def test_an_update_made_while_the_link_requests_travel_still_reaches_every_node_by_push(
    n: int, fanout: int, seed: int, start: float
) -> None:
    # The requests take 10-30 ms, so some land after the first update passed their
    # receiver (which then announces it to the requester, who grafts it at once), and
    # peers that asked each other both push. No timed graft comes within the run.
    cfg = GossipConfig(fanout=fanout, anti_entropy=False, graft_timeout=1000.0)
    sim = GossipSimulation(n, seed=seed, gossip=cfg)
    sim.run_until(start)
    delta = sim.update(random.Random(seed).randrange(n), "doc", CounterAdd(("n",), 1))
    sim.run_until(start + 3.0)
    assert all(sim.has(i, (delta.origin, delta.seq)) for i in range(n))


def test_a_peer_that_asked_too_gets_the_first_push_instead_of_a_prune() -> None:
    # A asked B, C and D to push to it, and C asked A. The first push (from B) cancels
    # A's asks, but C may lack the delta: A pushes it there and prunes only D.
    x = node("A", ["B", "C", "D"], fanout=3)
    x.handle_timer(0.0)
    assert {p for p, m in sent(x) if m == Graft("doc")} == {B, C, D}
    x.receive(C, Graft("doc"), 0.01)
    delta, _ = node("E", ["A"]).local_update("doc", CounterAdd(("n",), 1))
    assert x.receive(B, DeltaPush.of(delta), 0.1).forwarded_to == (C,)
    assert [(p, m) for p, m in sent(x) if isinstance(m, Prune)] == [(D, Prune("doc"))]
    assert x.links("doc")[0] == (C, B)


def test_a_link_request_landing_after_a_delta_is_told_of_it_and_grafts_it_at_once() -> None:
    c = node("C", ["A", "B"])
    delta, _ = c.local_update("doc", CounterAdd(("n",), 1))
    did = (C, 1, 1)
    b = node("B", ["A", "C", "D"], catch_up=1.0)
    assert b.receive(C, DeltaPush.of(delta), 0.0).new == 1
    b.take_outgoing()
    a = node("A", ["B", "C", "D"])
    a.handle_timer(0.2)
    assert {p for p, m in sent(a) if m == Graft("doc")} == {B, C, D}
    # B applied the delta before A's request landed: it tells A (not C, its origin).
    b.receive(A, Graft("doc"), 0.5)
    b.receive(C, Graft("doc"), 0.5)
    assert sent(b) == [(A, IHave("doc", (did,)))]
    # A asked B to push, so no push is coming from B: A grafts at once, from B only.
    a.receive(B, IHave("doc", (did,)), 0.6)
    a.receive(D, IHave("doc", (did,)), 0.6)
    assert sent(a) == [(B, Graft("doc", (did,)))]
    b.receive(A, Graft("doc", (did,)), 0.7)
    [(peer, push)] = sent(b)
    assert peer == A and a.receive(B, push, 0.8).new == 1
    # A request landing more than catch_up seconds later is told nothing.
    b.receive(D, Graft("doc"), 1.1)
    assert sent(b) == []


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(2, 10),
    names=st.lists(st.text(min_size=1, max_size=6), min_size=10, max_size=10, unique=True),
)
def test_the_first_link_requests_form_one_ring_by_replica_id_whatever_peers_are_called(
    n: int, names: list[str]
) -> None:
    # A driver names peers its own way (a node: by agent id) and gives their replica ids:
    # each node's first link request goes to the peer with the next replica id, so these
    # requests form one cycle through every node and the first update reaches them all.
    ids = [rid(f"ring{i}") for i in range(n)]
    ring = sorted(ids)
    successor = {}
    for i in range(n):
        core = GossipNode(replica(f"ring{i}"), docs=["doc"], rng=random.Random(i), now=0.0,
                          config=GossipConfig(anti_entropy=False))  # fmt: skip
        for j in range(n):
            if j != i:
                core.add_peer(names[j], ids[j])
        core.handle_timer(0.0)
        first = next(p for p, m in core.take_outgoing() if isinstance(m, Graft))
        successor[i] = names.index(first)
        assert ids[successor[i]] == ring[(ring.index(ids[i]) + 1) % n]
    seen, k = set(), 0
    for _ in range(n):
        seen.add(k)
        k = successor[k]
    assert k == 0 and len(seen) == n


def test_a_new_ring_successor_is_asked_even_when_it_is_linked_already() -> None:
    # P asks only its successor. When that one leaves, the next one (which had asked P,
    # so its link exists) must be asked too, else no request of the ring reaches P.
    me = rid("P")
    config = GossipConfig(anti_entropy=False, fanout=1, eager_fanout=1)
    core = GossipNode(replica("P"), docs=["doc"], rng=random.Random(0), now=0.0, config=config)
    core.add_peer("s", me + "1")
    core.add_peer("z", me + "2")
    core.handle_timer(0.0)
    assert sent(core) == [("s", Graft("doc"))]
    core.receive("z", Graft("doc"), 0.1)
    core.remove_peer("s")
    core.handle_timer(0.2)
    assert sent(core) == [("z", Graft("doc"))]
    core.add_peer("s", me + "1")  # back: a new link, asked again
    core.handle_timer(0.3)
    assert sent(core) == [("s", Graft("doc"))]
