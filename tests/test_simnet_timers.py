"""The driver's timers and datagrams in flight, kept in buckets by due time."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.simnet import LinkConditions, SimNetwork
from p2pnode.simnet.timers import BucketQueue, SimTimer, TimerWheel

# Due times that often coincide, fall in one granule or lie granules apart, and a few
# arbitrary ones.
_times = st.one_of(
    st.integers(0, 400).map(lambda k: k * 0.00025),
    st.floats(0, 0.1, allow_nan=False),
)
_deadlines = st.one_of(_times, st.just(math.inf))


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("push"), _times), st.tuples(st.just("pop"), st.floats(0, 0.02))
        ),
        max_size=80,
    )
)
def test_bucket_queue_gives_what_a_heap_of_due_and_sequence_gives(
    ops: list[tuple[str, float]],
) -> None:
    queue: BucketQueue[int] = BucketQueue()
    model: list[tuple[float, int]] = []  # (due, sequence): a heap's order
    now = 0.0
    for seq, (op, value) in enumerate(ops):
        if op == "push":
            head = queue.push(value, seq)
            model.append((value, seq))
            assert head == (min(model)[0] == value)
        else:
            now += value
            got: list[tuple[float, int]] = []
            while (bucket := queue.pop_due(now)) is not None:
                got.extend((bucket[0], item) for item in bucket[1])
            expected = sorted(m for m in model if m[0] <= now)
            model = [m for m in model if m[0] > now]
            assert got == expected
        assert queue.first() == min((m[0] for m in model), default=math.inf)
        assert bool(queue) == bool(model)
    assert queue.clear() == sorted(model)
    assert not queue


_timer_ops = st.lists(
    st.one_of(
        # A new timer at a deadline; firing re-arms it this much later (None: not).
        st.tuples(st.just("new"), _deadlines, st.one_of(st.none(), st.sampled_from([0.001, 0.03]))),
        st.tuples(st.just("set"), st.integers(0, 50), _deadlines),
        st.tuples(st.just("fire"), st.floats(0, 0.01)),
        st.tuples(st.just("peek")),
    ),
    max_size=120,
)


def _run_wheel(
    ops: list[tuple[Any, ...]], granule: float, slack: int
) -> list[list[tuple[int, float]]]:
    """Run ``ops`` on a wheel, checked against a model after each; what each fire fired."""
    wheel = TimerWheel(granule, prune_slack=slack)
    timers: list[SimTimer] = []
    fired: list[tuple[int, float]] = []
    log: list[list[tuple[int, float]]] = []
    model: list[float] = []  # each timer's deadline
    rearms: list[float | None] = []

    def due(i: int, rearm: float | None) -> Any:
        def on_due(now: float) -> None:
            fired.append((i, now))
            if rearm is not None:
                timers[i].deadline = now + rearm

        return on_due

    now = 0.0
    for op in ops:
        if op[0] == "new":
            model.append(op[1])
            rearms.append(op[2])
            timers.append(SimTimer(wheel, op[1], due(len(timers), op[2])))
        elif op[0] == "set" and timers:
            i = op[1] % len(timers)
            model[i] = op[2]
            timers[i].deadline = op[2]
        elif op[0] == "fire":
            now += op[1]
            fired.clear()
            wheel.fire_due(now)
            # Each timer due fires once (a re-armed one is due again only later), in
            # deadline order.
            was = list(model)
            assert sorted(i for i, _ in fired) == [i for i, d in enumerate(was) if d <= now]
            assert all(t == now for _, t in fired)
            assert [was[i] for i, _ in fired] == sorted(was[i] for i, _ in fired)
            for i, _ in fired:
                rearm = rearms[i]
                model[i] = math.inf if rearm is None else now + rearm
            log.append(list(fired))
        assert wheel.first() == min(model, default=math.inf)
        assert [t.deadline for t in timers] == model
        assert len(wheel) <= 2 * len(timers) + slack + 1
    return log


@settings(max_examples=300, deadline=None)
@given(ops=_timer_ops, granule=st.sampled_from([0.001, 0.0003, 0.01]), slack=st.integers(0, 5))
def test_timer_wheel_fires_as_a_model_does(
    ops: list[tuple[Any, ...]], granule: float, slack: int
) -> None:
    """Timers fire at ``fire_due(now)`` once their deadline is due, in deadline order;
    moved or cleared ones as last set. Equal deadlines fire in an order the
    operations fix: the same operations fire the same timers in the same order."""
    assert _run_wheel(ops, granule, slack) == _run_wheel(ops, granule, slack)


def test_stale_entries_are_pruned() -> None:
    # A timer moved sooner again and again leaves an entry at each later deadline.
    wheel = TimerWheel(0.001, prune_slack=10)
    timers = [SimTimer(wheel, 1.0, None) for _ in range(5)]
    for step in range(1, 200):
        for timer in timers:
            timer.deadline = 1.0 - step * 0.004
        assert len(wheel) <= 2 * len(timers) + 10 + 1
    assert wheel.first() == pytest.approx(1.0 - 199 * 0.004)


def test_a_wheel_granule_is_positive() -> None:
    with pytest.raises(ValueError, match="granule"):
        TimerWheel(0.0)


def _driven_net(tick: float = 0.0) -> SimNetwork:
    return SimNetwork(random.Random(1), default=LinkConditions(0.01, 0.0), tick=tick)


async def test_driven_timers_fire_at_their_deadlines_in_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sim = _driven_net(tick=0.001)
    fired: list[tuple[str, float]] = []
    got: list[tuple[bytes, float]] = []

    async def sleeper(name: str, deadline: float, move: float | None = None) -> None:
        with sim.move_on_at(deadline) as scope:
            assert isinstance(scope, SimTimer)
            if move is not None:
                scope.deadline = move
            await trio.sleep_forever()
        fired.append((name, trio.current_time() - t0))

    async def receive(ep: Any) -> None:
        while True:
            data, _ = await ep.recvfrom()
            got.append((data, trio.current_time() - t0))

    ea, eb = [await sim.add_host().bind_datagram(("", 0)) for _ in range(2)]
    async with trio.open_nursery() as nursery:
        await nursery.start(sim.drive)
        t0 = trio.current_time()
        nursery.start_soon(receive, eb)
        nursery.start_soon(sleeper, "late", t0 + 0.5)
        nursery.start_soon(sleeper, "moved in", t0 + 3.0, t0 + 0.0103)
        nursery.start_soon(sleeper, "moved out", t0 + 0.001, t0 + 0.7)
        nursery.start_soon(sleeper, "with the datagram", t0 + 0.01)
        nursery.start_soon(sleeper, "first", t0 + 0.0004)
        nursery.start_soon(sleeper, "cleared", t0 + 0.002, math.inf)
        await ea.sendto(b"x", eb.local_address)  # due at 0.01
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert [name for name, _ in fired] == [
        "first",
        "with the datagram",
        "moved in",
        "late",
        "moved out",
    ]
    assert [t for _, t in fired] == pytest.approx([0.0004, 0.01, 0.0103, 0.5, 0.7], abs=1e-9)
    assert [d for d, _ in got] == [b"x"]
    assert [t for _, t in got] == pytest.approx([0.01], abs=1e-9)


async def test_a_due_callback_runs_instead_of_a_wake_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sim = _driven_net()
    calls: list[float] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(sim.drive)
        t0 = trio.current_time()

        def on_due(now: float) -> None:
            calls.append(now - t0)
            if len(calls) < 3:
                scope.deadline = now + 0.25

        with sim.move_on_at(t0 + 0.25, on_due) as scope:
            await trio.sleep(2)  # the scope is never cancelled: the sleep ends
        assert not scope.cancelled_caught
        assert calls == pytest.approx([0.25, 0.5, 0.75])
        assert scope.deadline == math.inf
        nursery.cancel_scope.cancel()


async def test_a_failing_callback_is_raised_where_its_scope_exits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sim = _driven_net()

    def on_due(now: float) -> None:
        raise KeyError("timer")

    async with trio.open_nursery() as nursery:
        await nursery.start(sim.drive)
        t0 = trio.current_time()
        with pytest.raises(KeyError, match="timer"), sim.move_on_at(t0 + 1, on_due):
            await trio.sleep_forever()
        assert trio.current_time() - t0 == pytest.approx(1.0)
        nursery.cancel_scope.cancel()


async def test_timers_go_back_to_trio_when_the_driver_stops(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sim = _driven_net()
    woke: list[float] = []
    called: list[float] = []

    async def sleeper(deadline: float) -> None:
        with sim.move_on_at(deadline, called.append) as scope:
            await trio.sleep(0.5)
            scope.deadline = deadline + 1  # set after the driver stopped
            await trio.sleep_forever()
        woke.append(trio.current_time() - t0)

    with trio.fail_after(10):  # a timer left in the stopped driver would never fire
        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as nursery:
                await nursery.start(sim.drive)
                t0 = trio.current_time()
                outer.start_soon(sleeper, t0 + 2)
                await trio.sleep(0.25)
                nursery.cancel_scope.cancel()
            # Not driven: an ordinary cancel scope, due callback or not.
            assert isinstance(sim.move_on_at(t0 + 1, called.append), trio.CancelScope)
    assert woke == pytest.approx([3.0])
    assert called == []


async def test_an_idle_driver_wakes_for_a_new_timer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sim = _driven_net()
    called: list[float] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(sim.drive)
        # Nothing in flight, nothing timed: the driver waits...
        await trio.testing.wait_all_tasks_blocked()
        t0 = trio.current_time()
        with sim.move_on_at(t0 + 1, called.append):
            await trio.sleep(2)  # ...and must wake: trio's clock alone would not fire it
        assert called == pytest.approx([t0 + 1])
        nursery.cancel_scope.cancel()
