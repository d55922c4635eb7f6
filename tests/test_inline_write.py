"""The bound on replies an agent's task writes itself (p2pnode.node.agents.InlineWatch), on the
virtual clock: a stuck write is cut within the wait, a quick one never is, and the
watcher sleeps while nothing is written."""

from __future__ import annotations

from typing import Any

import trio

from p2pnode.core.lifetime import TaskOwner
from p2pnode.node.agents import InlineWatch

WAIT = 0.25


class _Owner(TaskOwner):
    pass


async def _write(watch: InlineWatch, key: str, seconds: float, log: list[str]) -> None:
    """One task writing once, for ``seconds``, inside its own writer scope."""
    with trio.CancelScope() as scope:
        writer = watch.open(key, scope)
        watch.begin(writer)
        try:
            await trio.sleep(seconds)
        finally:
            InlineWatch.end(writer)
            watch.close(key, writer)
        log.append(f"{key} done")
    if scope.cancelled_caught:
        log.append(f"{key} cut at {trio.current_time():.3f}")


async def test_a_stuck_write_is_cut_within_the_wait_and_a_quick_one_is_not(
    autojump_clock: Any,
) -> None:
    cut: list[str] = []
    log: list[str] = []
    async with _Owner() as owner:
        watch = InlineWatch(owner, WAIT, cut.append)
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_write, watch, "stuck", 10.0, log)
            for n in range(20):  # quick writes all along: none is cut
                nursery.start_soon(_write, watch, f"quick{n}", 0.01, log)
                await trio.sleep(0.05)
    assert cut == ["stuck"]
    assert sum(entry.endswith("done") for entry in log) == 20
    [when] = [float(e.split(" at ")[1]) for e in log if e.startswith("stuck cut")]
    assert WAIT / 2 <= when - start <= WAIT + 1e-9


async def test_the_watcher_sleeps_while_nothing_is_written_and_wakes_for_a_write(
    autojump_clock: Any,
) -> None:
    cut: list[str] = []
    log: list[str] = []
    async with _Owner() as owner:
        watch = InlineWatch(owner, WAIT, cut.append)
        await _write(watch, "first", 0.01, log)
        await trio.sleep(WAIT * 4)  # the watcher's looks stop once writes stop
        stats = trio.lowlevel.current_statistics()
        assert stats.seconds_to_next_deadline == float("inf")  # no timer left running
        await _write(watch, "later", 5.0, log)
        assert cut == ["later"]
