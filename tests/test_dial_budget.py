"""The dial budget's rules (node/limits.py ``DialBudget``) and the summary of repeated
failures (``FailureSummary``): what a peer that announces dead addresses may cost, and
how soon a peer that comes back may be tried again (docs/protocol/node.md "Channels")."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import LocalError
from p2pnode.node.limits import DialBudget, FailureSummary

PEER = b"p"

# Times are whole quarter seconds (exact in binary floating point), so a bound like
# "T / probe_interval" is compared without rounding noise.
QUARTER = 0.25


@st.composite
def operations(draw: st.DrawFn) -> list[tuple[str, float]]:
    """A run of attempts, resets and refunds at non-decreasing times (seconds)."""
    steps = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["attempt"] * 8 + ["reset", "refund"]),
                st.integers(min_value=0, max_value=40),  # quarter seconds since the last step
            ),
            max_size=120,
        )
    )
    now, out = 0.0, []
    for kind, gap in steps:
        now += gap * QUARTER
        out.append((kind, now))
    return out


def run(budget: DialBudget, ops: list[tuple[str, float]]) -> list[list[float]]:
    """The times of the attempts allowed, split at each reset; asserts that an attempt
    right after a reset always passes."""
    runs: list[list[float]] = [[]]
    after_reset = False
    for kind, now in ops:
        if kind == "reset":
            budget.reset(PEER)
            runs.append([])
            after_reset = True
        elif kind == "refund":
            budget.refund(PEER)
            if runs[-1]:
                runs[-1].pop()  # given back: it reached the peer, so it cost nothing
        else:
            allowed = budget.allow(PEER, now)
            assert allowed or not after_reset, "the first attempt after a reset must pass"
            after_reset = False
            if allowed:
                runs[-1].append(now)
    return runs


@settings(max_examples=300, deadline=None)
@given(
    ops=operations(),
    per_window=st.integers(min_value=1, max_value=10),
    probe_quarters=st.integers(min_value=1, max_value=12),
)
def test_attempts_in_any_span_are_bounded_by_the_window_and_the_probes(
    ops: list[tuple[str, float]], per_window: int, probe_quarters: int
) -> None:
    window, probe = 20.0, probe_quarters * QUARTER
    budget = DialBudget(per_window, window, probe_interval=probe)
    for times in run(budget, ops):
        for i, start in enumerate(times):
            for j in range(i, len(times)):
                span = times[j] - start
                if span >= window:
                    break
                assert j - i + 1 <= per_window + span // probe, (times, i, j)
        # Memory per peer stays bounded too: the window's attempts and its probes.
        assert len(budget._attempts.get(PEER, ())) <= per_window + window / probe + 1


@settings(max_examples=200, deadline=None)
@given(ops=operations(), per_window=st.integers(min_value=1, max_value=10))
def test_without_probes_a_window_holds_at_most_its_budget(
    ops: list[tuple[str, float]], per_window: int
) -> None:
    window = 20.0
    budget = DialBudget(per_window, window)
    for times in run(budget, ops):
        for i, start in enumerate(times):
            inside = [t for t in times[i:] if t - start < window]
            assert len(inside) <= per_window


@settings(max_examples=200, deadline=None)
@given(ops=operations(), per_window=st.integers(min_value=1, max_value=6))
def test_next_allowed_is_when_an_attempt_passes_again(
    ops: list[tuple[str, float]], per_window: int
) -> None:
    budget = DialBudget(per_window, 20.0, probe_interval=1.0)
    run(budget, ops)
    now = ops[-1][1] if ops else 0.0
    at = budget.next_allowed(PEER, now)
    assert at >= now
    if at > now:
        assert not budget.allow(PEER, now)  # refused now (and counted as refused)
    assert budget.allow(PEER, at)


def test_a_spent_budget_still_lets_one_probe_through_per_interval() -> None:
    budget = DialBudget(3, 60.0, probe_interval=1.0)
    assert all(budget.allow(PEER, 0.0) for _ in range(3))
    assert not budget.allow(PEER, 0.5)  # spent, and tried less than a second ago
    assert budget.allow(PEER, 1.0)  # the probe
    assert not budget.allow(PEER, 1.9)
    assert budget.allow(PEER, 2.0) and not budget.allow(PEER, 2.0)
    assert budget.refused == 3
    budget.reset(PEER)  # the peer showed it is back
    assert all(budget.allow(PEER, 2.1) for _ in range(3))
    with pytest.raises(LocalError):
        DialBudget(3, 60.0, probe_interval=0.0)
    with pytest.raises(LocalError):
        DialBudget(3, 60.0, probe_interval=61.0)


def test_repeated_failures_make_one_line_per_interval_with_a_count() -> None:
    summary = FailureSummary(60.0, max_sources=2)
    assert summary.note("a", 0.0) == 1  # the first failure is told at once
    assert [summary.note("a", t) for t in (1.0, 2.0, 59.0)] == [0, 0, 0]
    assert summary.note("a", 60.0) == 4  # then the ones since, a minute later
    # A line that said it all (a departure) holds the next summary a minute.
    assert summary.hold("b", 100.0) == 0
    assert summary.note("b", 101.0) == 0 and summary.note("b", 159.0) == 0
    assert summary.note("b", 160.0) == 3
    summary.note("c", 0.0)
    summary.note("d", 0.0)  # sources are bounded: the oldest are forgotten
    assert len(summary._counts) <= 2
