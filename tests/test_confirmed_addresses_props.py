"""The rules of the automatic checks (reachability.md §6) as properties: when the
schedule calls the next check, its backoff, its illegal transitions, and the direct
addresses a verdict lets a card list."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.services.reachability import Candidate, NatMapping, Reachability, Transport, Verdict
from p2pnode.services.reachability.auto import (
    CheckSchedule,
    Phase,
    ScheduleConfig,
    card_addresses,
)

CONFIG = ScheduleConfig()
events = st.lists(
    st.one_of(
        st.tuples(st.just("peers"), st.integers(0, 5)),
        st.tuples(st.just("changed"), st.just(0)),
        st.tuples(st.just("check"), st.booleans()),
    ),
    max_size=40,
)


@given(events, st.integers(0, 2**32 - 1), st.floats(0.1, 100.0))
def test_a_check_is_due_only_as_the_schedule_says(
    steps: list[tuple[str, object]], seed: int, step: float
) -> None:
    schedule = CheckSchedule(CONFIG, random.Random(seed))
    now, retry = 0.0, CONFIG.retry_min
    for kind, arg in steps:
        now += step
        if kind == "peers":
            assert isinstance(arg, int)
            waiting = schedule.phase is Phase.WAIT_PEERS
            schedule.peers_seen(now, arg)
            if waiting and arg >= CONFIG.min_peers:
                assert schedule.next_deadline() == now + CONFIG.settle
            elif waiting:  # no check before a quorum of peers is there
                assert schedule.next_deadline() == float("inf")
        elif kind == "changed":
            before = schedule.next_deadline()
            schedule.addresses_changed(now)
            assert schedule.next_deadline() <= before
        elif schedule.phase is Phase.WAIT_TIMER:
            due = schedule.next_deadline()
            assert not schedule.start(due - 0.001)  # never early
            assert schedule.start(max(now, due))
            now = max(now, due)
            assert schedule.next_deadline() == float("inf")  # one check at a time
            nxt = schedule.finished(now, decided=bool(arg)) - now
            if arg:
                spread = CONFIG.interval * CONFIG.jitter + 1e-6
                assert abs(nxt - CONFIG.interval) <= spread
                retry = CONFIG.retry_min
            else:
                assert nxt == pytest.approx(retry)  # doubling, capped
                retry = min(2 * retry, CONFIG.retry_max)
            assert schedule.next_deadline() == pytest.approx(now + nxt)


def test_illegal_transitions_raise_and_leave_the_phase() -> None:
    schedule = CheckSchedule(CONFIG, random.Random(1))
    with pytest.raises(LocalError) as caught:
        schedule.finished(0.0, decided=True)  # no check ran
    assert caught.value.code is ErrorCode.INVALID_ARGUMENT
    assert schedule.phase is Phase.WAIT_PEERS
    assert not schedule.start(1e9)  # no peers yet: never due


def test_a_change_during_a_check_calls_for_another_soon() -> None:
    schedule = CheckSchedule(CONFIG, random.Random(1))
    schedule.peers_seen(0.0, 3)
    assert schedule.start(CONFIG.settle)
    schedule.addresses_changed(10.0)
    assert schedule.finished(20.0, decided=True) == 20.0 + CONFIG.settle


@pytest.mark.parametrize(
    "config",
    [
        {"interval": 0.0},
        {"jitter": 1.0},
        {"retry_min": 700.0},
        {"min_peers": 0},
        {"check_timeout": -1.0},
    ],
)
def test_bad_schedules_are_refused(config: dict[str, float]) -> None:
    with pytest.raises(LocalError) as caught:
        ScheduleConfig(**config)  # type: ignore[arg-type]
    assert caught.value.code is ErrorCode.CONFIG_ERROR


hosts = st.sampled_from(["203.0.113.5", "192.168.1.2", "2001:db8::1"])
candidates = st.builds(
    Candidate, st.sampled_from(list(Transport)), hosts, st.integers(1, 65535)
)


@given(
    st.sampled_from(list(Reachability)),
    st.lists(candidates, max_size=4, unique=True),
    st.lists(candidates, max_size=4, unique=True),
)
def test_a_card_lists_exactly_the_confirmed_tcp_addresses_of_a_decisive_verdict(
    reachability: Reachability, confirmed: list[Candidate], denied: list[Candidate]
) -> None:
    verdict = Verdict(
        reachability,
        tuple(confirmed),
        tuple(denied),
        None,
        NatMapping.UNKNOWN,
        None,
        ("c1", "c2", "c3"),
    )
    listed = card_addresses(verdict)
    if reachability is Reachability.UNKNOWN:
        assert listed is None  # the node's own addresses stay
        return
    assert listed is not None
    tcp = [c for c in confirmed if c.transport is Transport.TCP]
    parsed = []
    for text in listed:
        host, _, port = text.rpartition(":")
        parsed.append((host.strip("[]"), int(port)))
    assert parsed == [(c.host, c.port) for c in tcp]
    denied_tcp = {(c.host, c.port) for c in denied if c.transport is Transport.TCP}
    assert not (denied_tcp - {(c.host, c.port) for c in tcp}) & set(parsed)


def test_no_verdict_keeps_the_nodes_own_addresses() -> None:
    assert card_addresses(None) is None
