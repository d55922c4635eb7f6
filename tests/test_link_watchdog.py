"""A link's watchdog: keepalives timed like any write, checks on a shared grid."""

from __future__ import annotations

import random
from typing import Any, cast

import pytest
import trio
import trio.testing

from p2pnode.core.identity import Identity
from p2pnode.node.channels import (
    ChannelState,
    PeerLink,
    RetryPolicy,
    tick_on_grid,
    watch_interval,
)
from p2pnode.simnet import SimNetwork
from p2pnode.transport.channel import SecureChannel
from p2pnode.transport.net import trio_move_on_at


class _StuckChannel:
    """A channel whose peer reads nothing: every write blocks, nothing arrives."""

    relayed = False
    remote_address = None

    def __init__(self) -> None:
        self.sends = 0
        self.closed = trio.Event()

    async def send_message(self, message: bytes) -> None:
        self.sends += 1
        await self.closed.wait()
        raise trio.ClosedResourceError("closed")

    async def receive_message(self) -> bytes:
        await self.closed.wait()
        raise trio.ClosedResourceError("closed")

    async def aclose(self) -> None:
        self.closed.set()
        await trio.lowlevel.checkpoint()


async def test_a_stuck_keepalive_drops_the_channel_after_the_write_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A keepalive whose write never ends counts as a write: the channel is dropped
    ``write_timeout`` after it started (checked every watch interval), with one keepalive
    in flight, not one more per check."""
    me, peer = Identity.generate().peer_id, Identity.generate().peer_id
    retry = RetryPolicy(write_timeout=8.0, max_redials=0, redial_window=0.5)
    states: list[tuple[float, ChannelState]] = []
    stuck = _StuckChannel()

    async def dial() -> SecureChannel:
        raise trio.BrokenResourceError("no second channel")

    async def on_frame(_peer: Any, _data: bytes) -> None:
        raise AssertionError("nothing arrives")

    async with trio.open_nursery() as nursery:
        link = PeerLink(
            me, peer, nursery, dial, on_frame,
            lambda _link, state: states.append((trio.current_time(), state)),
            retry, idle_timeout=30.0,
        )  # fmt: skip
        start = trio.current_time()
        link.adopt(cast(SecureChannel, stuck), me)
        interval = watch_interval(retry, 30.0)
        assert interval == 2.0
        with trio.fail_after(60):
            await stuck.closed.wait()
        dropped = [at for at, state in states if state is ChannelState.RECONNECTING]
        # The keepalive starts after 10 s of silence (a third of idle_timeout), at a
        # check (up to one interval late); the drop comes 8 s after, at a check too.
        assert 10.0 + 8.0 <= dropped[0] - start <= 10.0 + 8.0 + 2 * interval + 1e-9
        assert link.loss is not None and "read nothing" in link.loss
        assert stuck.sends == 1
        await link.aclose()
        nursery.cancel_scope.cancel()


async def test_watchdogs_wake_on_one_grid(autojump_clock: trio.testing.MockClock) -> None:
    """Links made at different times check at the same instants: multiples of the
    watch interval on trio's clock."""
    retry = RetryPolicy(write_timeout=8.0)
    checks: list[float] = []

    async def dial() -> SecureChannel:
        await trio.sleep_forever()
        raise AssertionError

    async def on_frame(_peer: Any, _data: bytes) -> None:
        raise AssertionError

    class Counting(PeerLink):
        def watch(self, now: float) -> None:
            checks.append(now)
            super().watch(now)

    async with trio.open_nursery() as nursery:
        for delay in (0.3, 0.7, 1.9):
            await trio.sleep(delay)
            peer = Identity.generate().peer_id
            Counting(peer, peer, nursery, dial, on_frame, lambda _l, _s: None, retry, 30.0)
        await trio.sleep(10.0)
        nursery.cancel_scope.cancel()
    assert checks
    assert all(abs(t / 2.0 - round(t / 2.0)) < 1e-9 for t in checks)
    assert len(set(checks)) < len(checks)  # shared instants


@pytest.mark.parametrize("driven", [False, True])
async def test_tick_on_grid_ticks_at_each_multiple_of_its_interval(
    autojump_clock: trio.testing.MockClock, driven: bool
) -> None:
    """The same ticks whether the task wakes for them (trio's timer) or the simulated
    network's driver calls them from its task (the task does not wake)."""
    sim = SimNetwork(random.Random(1))
    host = sim.add_host()
    ticks: list[float] = []
    async with trio.open_nursery() as nursery:
        if driven:
            await nursery.start(sim.drive)
        await trio.sleep(0.7)
        nursery.start_soon(tick_on_grid, host.move_on_at, 1.25, ticks.append)
        await trio.sleep(6.0)
        nursery.cancel_scope.cancel()
    assert ticks == pytest.approx([1.25, 2.5, 3.75, 5.0, 6.25], abs=1e-9)


async def test_tick_on_grid_does_not_catch_up_missed_ticks(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A tick that takes longer than the interval skips the grid points it covered."""
    ticks: list[float] = []

    def slow(now: float) -> None:
        ticks.append(now)
        autojump_clock.jump(2.6)  # as if the tick ran that long

    async with trio.open_nursery() as nursery:
        nursery.start_soon(tick_on_grid, trio_move_on_at, 1.0, slow)
        await trio.sleep(7.5)
        nursery.cancel_scope.cancel()
    assert ticks == pytest.approx([1.0, 4.0, 7.0], abs=1e-9)
