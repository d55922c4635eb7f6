"""Joining again once every contact is gone (dht.md §5.2): the schedule, and a node in
the simulator that loses its whole swarm and finds it again when it comes back."""

from __future__ import annotations

import random
from contextlib import AsyncExitStack

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import LocalError
from p2pnode.core.identity import Identity
from p2pnode.dht.node import DhtNode
from p2pnode.dht.rejoin import Rejoin, RejoinState
from p2pnode.simnet import SimHost, SimNetwork
from tests.sim import DEFAULT_LINK, FAST_DHT, virtual_ms, wait_until

SEED = ("10.0.0.1", 4000)


def _rejoin(**kw: float) -> Rejoin:
    return Rejoin(random.Random(1), first_delay=2.0, max_delay=300.0, **kw)  # type: ignore[arg-type]


def _state(rejoin: Rejoin) -> RejoinState:
    # Read through a call: mypy would keep a narrowed `rejoin.state` across calls.
    return rejoin.state


def test_nothing_to_join_from_means_no_attempts() -> None:
    rejoin = _rejoin()
    rejoin.observe(0, 0.0)
    assert _state(rejoin) is RejoinState.JOINED
    assert rejoin.next_deadline() == float("inf")
    assert not rejoin.handle_timer(1e9)


def test_an_empty_table_is_retried_with_doubling_delays_up_to_the_bound() -> None:
    rejoin = _rejoin()
    rejoin.remember_bootstrap([SEED])
    rejoin.observe(3, 0.0)
    assert rejoin.next_deadline() == float("inf")  # contacts: nothing to do
    rejoin.observe(0, 10.0)
    assert _state(rejoin) is RejoinState.WAITING
    now, gaps = 10.0, []
    for _ in range(12):
        due = rejoin.next_deadline()
        assert not rejoin.handle_timer(due - 0.01)
        gaps.append(due - now)
        assert rejoin.handle_timer(due)
        assert _state(rejoin) is RejoinState.RUNNING
        assert rejoin.next_deadline() == float("inf")
        rejoin.observe(0, due)  # still empty while it runs: nothing changes
        now = due + 5.0  # the attempt took 5 s and found nobody
        rejoin.finished(0, now)
    # 2, 4, 8, ... 256, then 300 s (each within ±25%).
    nominals = [2, 4, 8, 16, 32, 64, 128, 256, 300, 300, 300, 300]
    for gap, nominal in zip(gaps, nominals, strict=True):
        assert 0.75 * nominal <= gap <= 1.25 * nominal
    # A contact found ends the waiting, and the next emptying starts at 2 s again.
    rejoin.observe(1, now + 1.0)
    assert _state(rejoin) is RejoinState.JOINED
    rejoin.observe(0, now + 100.0)
    assert rejoin.next_deadline() <= now + 100.0 + 2.5


def test_an_attempt_that_finds_contacts_ends_it() -> None:
    rejoin = _rejoin()
    rejoin.remember_snapshot([SEED])
    rejoin.observe(0, 0.0)
    assert rejoin.handle_timer(rejoin.next_deadline())
    rejoin.finished(4, 3.0)
    assert _state(rejoin) is RejoinState.JOINED
    with pytest.raises(LocalError):
        rejoin.finished(0, 4.0)  # nothing running: an illegal transition
    assert _state(rejoin) is RejoinState.JOINED


def test_seeds_are_bounded_bootstrap_first() -> None:
    rejoin = Rejoin(random.Random(1), max_seeds=4)
    rejoin.remember_snapshot([("10.0.1.1", p) for p in range(10)])
    rejoin.remember_bootstrap([("10.0.0.1", 1), ("10.0.0.2", 1), ("10.0.0.1", 1)])
    assert rejoin.seeds == [("10.0.0.1", 1), ("10.0.0.2", 1), ("10.0.1.1", 0), ("10.0.1.1", 1)]
    with pytest.raises(LocalError):
        Rejoin(random.Random(1), first_delay=0.0)
    with pytest.raises(LocalError):
        Rejoin(random.Random(1), first_delay=10.0, max_delay=5.0)


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(
        st.tuples(st.sampled_from(["observe", "timer", "finish"]), st.integers(0, 3)),
        max_size=80,
    )
)
def test_the_schedule_never_runs_two_attempts_or_waits_with_contacts(
    events: list[tuple[str, int]],
) -> None:
    rejoin = _rejoin()
    rejoin.remember_bootstrap([SEED])
    now = 0.0
    for kind, contacts in events:
        now += 7.0
        if kind == "observe":
            rejoin.observe(contacts, now)
            if contacts and _state(rejoin) is not RejoinState.RUNNING:
                assert _state(rejoin) is RejoinState.JOINED
        elif kind == "timer":
            was = _state(rejoin)
            started = rejoin.handle_timer(now)
            assert not started or was is RejoinState.WAITING
        elif _state(rejoin) is RejoinState.RUNNING:
            rejoin.finished(contacts, now)
            assert _state(rejoin) is (RejoinState.JOINED if contacts else RejoinState.WAITING)
        # Waiting always has a due time within the bound; otherwise none.
        if _state(rejoin) is RejoinState.WAITING:
            assert rejoin.next_deadline() <= now + 1.25 * 300.0
        else:
            assert rejoin.next_deadline() == float("inf")


# ---------------------------------------------------------------------- in the simulator


async def _node(stack: AsyncExitStack, host: SimHost, identity: Identity) -> DhtNode:
    node = DhtNode(
        host,
        identity=identity,
        address=(host.host, 4000),
        config=FAST_DHT,
        rng=random.Random(identity.public_key),
        wall_clock_ms=virtual_ms,
    )
    return await stack.enter_async_context(node)


async def test_a_node_that_lost_every_contact_joins_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rng = random.Random(11)
    sim = SimNetwork(rng, default=DEFAULT_LINK)
    ids = [Identity(rng.randbytes(32)) for _ in range(4)]
    async with AsyncExitStack() as lone_stack:
        lone = await _node(lone_stack, sim.add_host(), ids[0])
        boot_host = sim.add_host()
        async with AsyncExitStack() as swarm:
            boot = await _node(swarm, boot_host, ids[1])
            others = [await _node(swarm, sim.add_host(), i) for i in ids[2:]]
            for node in others:
                assert await node.bootstrap([boot.address]) == 1
            assert await lone.bootstrap([boot.address]) == 1
            assert len(lone.table) == 3
        # The whole swarm is gone. The lone node finds out as its calls time out (a
        # lookup ends before that, its calls still count: two failures evict).
        for _ in range(2):
            assert await lone.find_node(rng.randbytes(20)) == []
        await wait_until(lambda: len(lone.table) == 0, timeout=30)
        gone_at = trio.current_time()
        # It tries its bootstrap address again, less and less often.
        await wait_until(lambda: lone.stats.rejoins >= 5, timeout=200)
        assert _state(lone.rejoin) is not RejoinState.JOINED
        assert trio.current_time() - gone_at >= 0.75 * (2 + 4 + 8 + 16)
        # The bootstrap node comes back at its address: the lone node is in again.
        async with AsyncExitStack() as back:
            boot = await _node(back, boot_host, ids[1])
            await wait_until(lambda: boot.node_id in lone.table, timeout=1.25 * 300 + 10)
            await wait_until(lambda: lone.node_id in boot.table, timeout=10)
            await wait_until(lambda: _state(lone.rejoin) is RejoinState.JOINED, timeout=30)
            elapsed = trio.current_time() - gone_at
            # Bounded: 2, 4, 8, ... 300 s apart, never more often.
            assert lone.stats.rejoins <= 9 + elapsed / (0.75 * 300)
