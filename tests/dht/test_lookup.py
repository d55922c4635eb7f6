"""Lookup core driven by a discrete-event model of a network (no trio)."""

from __future__ import annotations

import heapq
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.dht.lookup import Lookup, PeerState, RttEstimator
from p2pnode.dht.routing import Contact, distance


def _contacts(rng: random.Random, n: int) -> list[Contact]:
    return [Contact(rng.randbytes(20), "10.0.0.1", i + 1) for i in range(n)]


def _drive(
    lookup: Lookup,
    everyone: list[Contact],
    latency: dict[bytes, float | None],
    k: int,
    alpha: int,
    *,
    as_named: bool = False,
    asked: list[tuple[float, Contact]] | None = None,
) -> float:
    """Run ``lookup`` to completion; each node answers with its true k closest (as
    contacts, or with ``as_named`` as a reply names them); ``asked`` records requests."""
    now = 0.0
    events: list[tuple[float, int, bytes]] = []
    seq = 0
    while not lookup.done:
        for c in lookup.next_requests(now):
            if asked is not None:
                asked.append((now, c))
            lat = latency[c.node_id]
            if lat is not None:
                heapq.heappush(events, (now + lat, seq, c.node_id))
                seq += 1
        in_flight = sum(1 for c in everyone if lookup.state_of(c.node_id) is PeerState.IN_FLIGHT)
        assert in_flight <= alpha
        deadline = lookup.next_deadline()
        if lookup.done:
            break
        if events and (deadline is None or events[0][0] <= deadline):
            now, _, nid = heapq.heappop(events)
            # A node names the k closest it knows, dead ones included, plus the
            # k closest live ones (its table is partly refreshed).
            ranked = sorted(everyone, key=lambda c: distance(c.node_id, lookup.target))
            live = [c for c in ranked if latency[c.node_id] is not None]
            named = [c for c in ranked[:k] + live[:k] if c.node_id != nid]
            if as_named:
                entries = [[c.node_id, c.host, c.port] for c in named]
                lookup.handle_response(nid, [], now, named=entries)
            else:
                lookup.handle_response(nid, named, now)
        elif deadline is not None:
            now = deadline
            lookup.handle_timer(now)
        else:
            break
    return now


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), n=st.integers(1, 150))
def test_finds_true_closest_when_all_alive(seed: int, n: int) -> None:
    rng = random.Random(seed)
    everyone = _contacts(rng, n)
    target = rng.randbytes(20)
    latency: dict[bytes, float | None] = {c.node_id: rng.uniform(0.01, 0.2) for c in everyone}
    # The floor exceeds every latency, so no node is ever declared slow.
    rtt = RttEstimator(initial=1.0, floor=0.5)
    lookup = Lookup(target, [rng.choice(everyone)], rtt=rtt, k=8, alpha=3)
    _drive(lookup, everyone, latency, k=8, alpha=3)
    truth = sorted(everyone, key=lambda c: distance(c.node_id, target))[:8]
    assert lookup.closest_answered() == truth


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_dead_nodes_cost_at_most_their_timeout(seed: int) -> None:
    rng = random.Random(seed)
    everyone = _contacts(rng, 120)
    target = rng.randbytes(20)
    dead = set(rng.sample([c.node_id for c in everyone], 24))
    latency: dict[bytes, float | None] = {
        c.node_id: None if c.node_id in dead else 0.02 for c in everyone
    }
    rtt = RttEstimator(initial=0.5, floor=0.05, ceiling=2.0)
    for _ in range(10):
        rtt.sample(0.02)
    alive_seed = next(c for c in everyone if c.node_id not in dead)
    lookup = Lookup(target, [alive_seed], rtt=rtt, k=8, alpha=3)
    elapsed = _drive(lookup, everyone, latency, k=8, alpha=3)
    truth = [
        c
        for c in sorted(everyone, key=lambda c: distance(c.node_id, target))
        if c.node_id not in dead
    ][:8]
    assert lookup.closest_answered() == truth
    # Lockstep rounds with 5 s timeouts would take many seconds; adaptive timeouts
    # (here 0.05 s) keep the whole lookup well under one second.
    assert elapsed < 1.0


def test_keeps_alpha_in_flight_while_one_is_slow() -> None:
    rng = random.Random(5)
    everyone = _contacts(rng, 10)
    lookup = Lookup(rng.randbytes(20), everyone, rtt=RttEstimator(initial=1.0), k=20, alpha=3)
    first = lookup.next_requests(0.0)
    assert len(first) == 3
    lookup.handle_response(first[0].node_id, [], 0.1)
    again = lookup.next_requests(0.1)
    assert len(again) == 1  # refilled at once, not after the round
    # The first answer (0.1 s) lowered the timeout for the new request.
    assert lookup.next_deadline() == 0.1 + 0.1 + 4 * 0.05
    lookup.handle_timer(1.0)
    assert lookup.state_of(first[1].node_id) is PeerState.SLOW
    assert len(lookup.next_requests(1.0)) == 3
    # A late answer from a slow node still counts.
    lookup.handle_response(first[1].node_id, [], 1.5)
    assert lookup.state_of(first[1].node_id) is PeerState.ANSWERED


def test_hostile_replies_are_bounded_by_max_queries() -> None:
    rng = random.Random(9)
    target = rng.randbytes(20)
    lookup = Lookup(target, _contacts(rng, 3), rtt=RttEstimator(), k=4, alpha=3, max_queries=30)
    now = 0.0
    t = int.from_bytes(target, "big")
    reach = 1 << 160

    def nearer() -> list[Contact]:
        # Every reply invents ids nearer the target than anything seen so far.
        nonlocal reach
        reach = max(reach >> 2, 2)
        ids = [(t ^ rng.randrange(1, reach)).to_bytes(20, "big") for _ in range(20)]
        return [Contact(i, "10.6.6.6", 1) for i in ids]

    while not lookup.done:
        for c in lookup.next_requests(now):
            lookup.handle_response(c.node_id, nearer(), now)
        now += 0.01
        assert now < 100
    assert lookup.queries == 30


def test_rtt_estimator_clamps() -> None:
    rtt = RttEstimator(initial=1.0, floor=0.1, ceiling=3.0)
    assert rtt.timeout() == 1.0
    for _ in range(20):
        rtt.sample(0.001)
    assert rtt.timeout() == 0.1
    for _ in range(5):
        rtt.sample(50.0)
    assert rtt.timeout() == 3.0


def test_everyone_slow_is_waited_for_not_a_result() -> None:
    # An overloaded process: every request passes its soft timeout. The lookup
    # must not end with nothing; a late answer carries it on.
    rng = random.Random(11)
    seeds = _contacts(rng, 4)
    later = _contacts(rng, 3)
    lookup = Lookup(rng.randbytes(20), seeds, rtt=RttEstimator(initial=0.1), k=4, alpha=2)
    now = 0.0
    for _ in range(10):
        lookup.next_requests(now)
        deadline = lookup.next_deadline()
        if deadline is None:
            break
        now = deadline
        lookup.handle_timer(now)
    assert all(lookup.state_of(c.node_id) is PeerState.SLOW for c in seeds)
    assert not lookup.done
    assert lookup.next_deadline() is None  # nothing left to time out: wait for replies
    lookup.handle_response(seeds[2].node_id, later, now + 1.0)
    assert not lookup.done
    asked = lookup.next_requests(now + 1.0)
    assert len(asked) == 2
    for c in seeds:
        lookup.handle_failure(c.node_id)
    while asked:
        for c in asked:
            lookup.handle_response(c.node_id, [], now + 1.1)
        asked = lookup.next_requests(now + 1.1)
    assert lookup.done
    assert set(lookup.closest_answered()) == {seeds[2], *later}


def test_all_failed_ends_the_lookup() -> None:
    rng = random.Random(12)
    seeds = _contacts(rng, 3)
    lookup = Lookup(rng.randbytes(20), seeds, rtt=RttEstimator(initial=0.1), k=4, alpha=3)
    lookup.next_requests(0.0)
    lookup.handle_timer(1.0)
    assert not lookup.done
    for c in seeds:
        lookup.handle_failure(c.node_id)
    assert lookup.done
    assert lookup.closest_answered() == []


@settings(max_examples=100, deadline=None)
@given(
    samples=st.lists(st.floats(0.0, 10.0), max_size=20),
    backoffs=st.integers(0, 12),
    floor=st.floats(0.001, 1.0),
    span=st.floats(0.0, 10.0),
)
def test_rtt_backoff_doubles_within_bounds_until_the_next_sample(
    samples: list[float], backoffs: int, floor: float, span: float
) -> None:
    rtt = RttEstimator(initial=1.0, floor=floor, ceiling=floor + span)
    for s in samples:
        rtt.sample(s)
    base = rtt.timeout()
    for _ in range(backoffs):
        before = rtt.timeout()
        rtt.backoff()
        after = rtt.timeout()
        assert rtt.floor <= after <= rtt.ceiling
        assert after == min(rtt.ceiling, 2 * before) or before == rtt.ceiling
        assert after >= base
    rtt.sample(samples[-1] if samples else 0.5)
    again = RttEstimator(initial=1.0, floor=floor, ceiling=floor + span)
    for s in [*samples, samples[-1] if samples else 0.5]:
        again.sample(s)
    assert rtt.timeout() == again.timeout()  # a sample ends the back-off


def _reference_short(lookup: Lookup, known: list[Contact]) -> list[Contact]:
    """The k nearest contacts neither slow nor failed, by scanning every contact."""
    states = {c.node_id: lookup.state_of(c.node_id) for c in known}
    ranked = sorted(
        (c for c in known if states[c.node_id] is not None),
        key=lambda c: distance(c.node_id, lookup.target),
    )
    shortlisted = [PeerState.CANDIDATE, PeerState.IN_FLIGHT, PeerState.ANSWERED]
    return [c for c in ranked if states[c.node_id] in shortlisted][: lookup.k]


def _reference_done(lookup: Lookup, known: list[Contact]) -> bool:
    """dht.md §6's end rule, computed by scanning every contact."""
    states = {c.node_id: lookup.state_of(c.node_id) for c in known}
    short = _reference_short(lookup, known)
    values = list(states.values())
    if all(states[c.node_id] is PeerState.ANSWERED for c in short):
        return bool(short) or PeerState.SLOW not in values
    return PeerState.IN_FLIGHT not in values and (
        lookup.queries >= lookup.max_queries
        or not any(states[c.node_id] is PeerState.CANDIDATE for c in short)
    )


@settings(max_examples=150, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    ops=st.lists(st.sampled_from(["ask", "tick", "answer", "fail", "late"]), max_size=60),
    soft=st.booleans(),
)
def test_bookkeeping_matches_a_full_scan(seed: int, ops: list[str], soft: bool) -> None:
    rng = random.Random(seed)
    everyone = _contacts(rng, 40)
    lookup = Lookup(
        rng.randbytes(20),
        everyone[:5],
        rtt=RttEstimator(initial=0.2),
        k=6,
        alpha=3,
        soft_timeouts=soft,
    )
    now = 0.0
    asked: list[Contact] = []
    for op in ops:
        if op == "ask":
            # The nearest contacts not asked yet, as many as free slots, unless done.
            short = _reference_short(lookup, everyone)
            free = lookup.alpha - sum(
                1 for c in everyone if lookup.state_of(c.node_id) is PeerState.IN_FLIGHT
            )
            fresh = [c for c in short if lookup.state_of(c.node_id) is PeerState.CANDIDATE]
            done = lookup.done
            sent = lookup.next_requests(now)
            if not done and lookup.queries < lookup.max_queries:
                assert sent == fresh[: max(0, free)]
            asked += sent
        elif op == "tick":
            now += rng.uniform(0.0, 0.5)
            lookup.handle_timer(now)
        elif asked:
            c = asked.pop(rng.randrange(len(asked)))
            if op == "fail":
                lookup.handle_failure(c.node_id)
            else:  # a late answer may name nobody new: it (re-)enters the shortlist alone
                named = rng.sample(everyone, 4) if op == "answer" else []
                lookup.handle_response(c.node_id, named, now)
        flying = [c for c in everyone if lookup.state_of(c.node_id) is PeerState.IN_FLIGHT]
        assert len(flying) <= lookup.alpha
        assert (lookup.next_deadline() is None) == (not flying or not soft)
        assert lookup.done == _reference_done(lookup, everyone)
        if not soft:
            assert lookup.next_deadline() is None
            assert not any(lookup.state_of(c.node_id) is PeerState.SLOW for c in everyone)


def test_without_soft_timeouts_a_slow_nearest_contact_is_waited_for() -> None:
    # Where records are stored: a slow node among the k closest keeps its slot and
    # its place until it answers or fails, and no request is added meanwhile.
    rng = random.Random(13)
    everyone = _contacts(rng, 6)
    target = rng.randbytes(20)
    ranked = sorted(everyone, key=lambda c: distance(c.node_id, target))
    for soft in (True, False):
        lookup = Lookup(
            target, ranked, rtt=RttEstimator(initial=0.1), k=3, alpha=3, soft_timeouts=soft
        )
        assert lookup.next_requests(0.0) == ranked[:3]
        lookup.handle_timer(0.2)
        lookup.handle_response(ranked[1].node_id, [], 0.3)
        lookup.handle_response(ranked[2].node_id, [], 0.3)
        more = lookup.next_requests(0.3)
        for c in more:
            lookup.handle_response(c.node_id, [], 0.35)
        if soft:
            # The nearest went slow at 0.1 s; the next one took its place.
            assert more == [ranked[3]]
            assert lookup.done
            assert ranked[0] not in lookup.closest_answered()
            continue
        assert more == []  # the nearest holds its slot and its place
        assert not lookup.done
        lookup.handle_response(ranked[0].node_id, [], 0.9)
        assert lookup.done
        assert lookup.closest_answered() == ranked[:3]


def test_a_late_answer_puts_its_contact_back_among_the_k_closest() -> None:
    # k = 2: A is slow, so B and C are the shortlist; A answers late and is one of
    # the two closest again, so once B answers the lookup is done, C never asked.
    a, b, c = (Contact(bytes([i]) + bytes(19), "10.0.0.1", i) for i in (1, 2, 3))
    lookup = Lookup(bytes(20), [a, b, c], rtt=RttEstimator(initial=0.2), k=2, alpha=1)
    assert lookup.next_requests(0.0) == [a]
    lookup.handle_timer(0.5)
    assert lookup.state_of(a.node_id) is PeerState.SLOW
    assert lookup.next_requests(0.5) == [b]
    lookup.handle_response(a.node_id, [], 0.6)
    lookup.handle_response(b.node_id, [], 0.7)
    assert lookup.done
    assert lookup.next_requests(0.7) == []
    assert lookup.closest_answered() == [a, b]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), n=st.integers(1, 120), soft=st.booleans())
def test_contacts_named_in_replies_run_the_lookup_as_contacts_do(
    seed: int, n: int, soft: bool
) -> None:
    """Replies whose contacts are made only when asked (add_named) ask the same contacts
    at the same times and end with the same result as replies of contacts."""
    runs = []
    for as_named in (False, True):
        rng = random.Random(seed)
        everyone = _contacts(rng, n)
        target = rng.randbytes(20)
        latency: dict[bytes, float | None] = {
            c.node_id: None if rng.random() < 0.2 else rng.uniform(0.01, 0.6) for c in everyone
        }
        rtt = RttEstimator(initial=0.3, floor=0.05, ceiling=2.0)
        seeds = rng.sample(everyone, min(3, n))
        lookup = Lookup(target, seeds, rtt=rtt, k=8, alpha=3, soft_timeouts=soft)
        asked: list[tuple[float, Contact]] = []
        end = _drive(lookup, everyone, latency, k=8, alpha=3, as_named=as_named, asked=asked)
        runs.append((end, asked, lookup.closest_answered(), lookup.queries))
    assert runs[0] == runs[1]
