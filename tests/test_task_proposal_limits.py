"""Task proposals from one peer are bounded like requests: a rate, open threads and bytes
per peer (PeerQuota, TaskConfig.quota), and a refused proposal is answered ``task-reject``
``BUSY`` with ``retryAfterMs`` (docs/protocol/tasks.md §3.6).

The attack: one peer proposed 100,000 tasks to an agent in 29 s, and each proposal the
agent accepted held a thread and a task until the award timeout: memory grew without a
bound. Here a flooding peer keeps at most its share, gets BUSY answers with a retry hint,
an honest peer's tasks run meanwhile, and what the flood held is gone once it stops.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.agent.definition import Agent
from p2pnode.agent.task import Accepted, Rejected, RejectReason, Task, proposal_payload
from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.node.limits import PeerQuota
from p2pnode.services.tasks.negotiation import ProposerThread, TaskConfig
from tests.sim import connect_all, swarm, wait_until
from tests.test_tasks_sim import FAST_TASKS, SUM, summer

# -- the quota, sans-IO ---------------------------------------------------------------------------

RATE, MAX_HELD, MAX_BYTES = 5.0, 4, 1000
ops = st.lists(
    st.tuples(
        st.sampled_from(["admit", "release", "wait"]),
        st.integers(0, 5),  # peer
        st.integers(0, 600),  # bytes, or tenths of a second to wait
    ),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_a_peer_never_holds_more_than_its_quota(steps: list[tuple[str, int, int]]) -> None:
    quota = PeerQuota(RATE, 10, MAX_HELD, MAX_BYTES, max_total_bytes=2500, max_peers=4)
    held: dict[str, list[int]] = {}  # the model: sizes admitted and not released, per peer
    now = 0.0
    for op, peer_no, n in steps:
        peer = f"p{peer_no}"
        if op == "wait":
            now += n / 10
        elif op == "release":
            if held.get(peer):
                quota.release(peer, held[peer].pop())
        else:
            retry = quota.admit(peer, n, now)
            if retry is None:
                held.setdefault(peer, []).append(n)
            else:
                assert 0 < retry <= max(1.0, 1 / RATE)  # a hint, never "now"
        for p, sizes in held.items():
            assert quota.held(p) == (len(sizes), sum(sizes))
            assert len(sizes) <= MAX_HELD and sum(sizes) <= MAX_BYTES
        assert quota.total_bytes == sum(map(sum, held.values())) <= 2500
        assert len(quota) <= 4


def test_the_rate_refuses_with_the_time_to_the_next_token() -> None:
    quota = PeerQuota(2.0, 3, 100, 10_000, max_total_bytes=10_000)
    assert [quota.admit("p", 1, 0.0) for _ in range(3)] == [None, None, None]
    assert quota.admit("p", 1, 0.0) == pytest.approx(0.5)
    assert quota.admit("p", 1, 0.25) == pytest.approx(0.25)
    assert quota.admit("p", 1, 0.5) is None
    assert quota.admit("other", 1, 0.5) is None  # another peer has its own bucket
    assert quota.refused == 2
    with pytest.raises(LocalError):
        PeerQuota(0, 1, 1, 1, max_total_bytes=1)
    with pytest.raises(LocalError):
        TaskConfig(max_proposals_per_peer=0)


def test_a_full_table_forgets_idle_peers_and_refuses_new_ones_while_all_hold() -> None:
    quota = PeerQuota(100.0, 100, 10, 100, max_total_bytes=1000, max_peers=2)
    assert quota.admit("a", 1, 0) is None and quota.admit("b", 1, 0) is None
    assert quota.admit("c", 1, 0) == quota.busy_retry  # both hold work: no room
    quota.release("a", 1)
    assert quota.admit("c", 1, 0) is None and len(quota) == 2  # idle "a" was forgotten


# -- the proposer's matching of answers, sans-IO --------------------------------------------------

PEERS = ["a" * 32, "b" * 32, "c" * 32]
answers = st.lists(
    st.tuples(st.booleans(), st.sampled_from(["w", "x"]), st.sampled_from([*PEERS, None])),
    max_size=20,
)


@settings(max_examples=200, deadline=None)
@given(answers, st.sampled_from(["w", f"w@{PEERS[0]}", f"x@{PEERS[1]}"]))
def test_answers_count_only_for_the_target_they_answer(
    sequence: list[tuple[bool, str, str | None]], extra: str
) -> None:
    targets = tuple(dict.fromkeys((f"w@{PEERS[0]}", extra)))
    thread = ProposerThread("t", targets, deadline=10.0)
    for accept, agent, peer in sequence:
        expected = thread.target_of(agent, peer)
        if expected is not None:
            # agent@peer is matched only from that peer; a bare target from anyone.
            assert expected == f"{agent}@{peer}" or expected == agent
        if accept:
            thread.on_accept(Accepted("t", agent, 1, 0, 1), 1.0, peer)
        else:
            thread.on_reject(Rejected("t", agent, "DECLINED"), 1.0, peer)
    assert set(thread.accepts) | set(thread.rejects) <= set(targets)
    assert len(thread.answered) == len(set(thread.answered))
    assert thread.assignee is None or thread.assignee in thread.accepts


def test_a_rejection_carries_its_retry_hint_and_bad_hints_are_refused() -> None:
    refusal = Rejected("t", "w", RejectReason.BUSY, "full", retry_after_ms=1500)
    assert refusal.to_payload()["retryAfterMs"] == 1500
    assert Rejected.from_payload_untrusted(refusal.to_payload()) == refusal
    for bad in (-1, 1.5, "1", True, 3_600_001):
        with pytest.raises(RemoteError):
            Rejected.from_payload_untrusted(refusal.to_payload() | {"retryAfterMs": bad})


# -- a flooding peer in the simulator -------------------------------------------------------------

FLOOD = dataclasses.replace(
    FAST_TASKS.tasks,
    proposal_rate=5.0,
    proposal_burst=10,
    max_proposals_per_peer=6,
    award_timeout=3.0,
)


async def test_a_flood_of_proposals_is_answered_busy_and_honest_tasks_run(
    autojump_clock: Any,
) -> None:
    config = dataclasses.replace(FAST_TASKS, tasks=FLOOD)
    async with swarm(3, config) as (_, (victim, honest, evil)):
        await victim.add_agent(summer("worker", delay=0.1))
        boss = Agent("boss", tier=0)
        await honest.add_agent(boss)
        answers: list[Envelope] = []

        async def mallory_inbox(envelope: Envelope) -> None:
            answers.append(envelope)

        await evil.add_agent("mallory", mallory_inbox, tier=3)
        await connect_all([victim, honest, evil])
        target = f"worker@{victim.peer_id}"
        sent = 60
        for n in range(sent):  # 50 a second, 10 times the rate; never awarded
            task_id = f"flood-{n:04d}"
            payload = proposal_payload(task_id, Task("x", ("sum",), 1.0, [n]), 2**50)
            proposal = evil.envelope(
                "mallory", target, MessageType.TASK_PROPOSAL, payload, correlation_id=task_id
            )
            await evil.send(proposal)
            await trio.sleep(0.02)
            executor = victim.tasks.executor
            assert executor.quota.held(str(evil.peer_id))[0] <= FLOOD.max_proposals_per_peer
            assert victim.tasks.statistics()["open"] <= FLOOD.max_proposals_per_peer
        # Meanwhile an honest peer's task is awarded, worked and completed.
        handle = await boss.propose(target, Task("add", ("sum",), 1.0, [20, 22]))
        assert await handle.result() == 42
        await wait_until(lambda: len(answers) == sent)  # every proposal was answered
        kinds = [e.type for e in answers]
        accepted = kinds.count(MessageType.TASK_ACCEPT)
        assert 0 < accepted <= FLOOD.proposal_burst
        refusals = [e.payload for e in answers if e.type is MessageType.TASK_REJECT]
        assert len(refusals) == sent - accepted
        assert all(r["reason"] == "BUSY" and r["retryAfterMs"] > 0 for r in refusals)
        stats = victim.tasks.statistics()
        assert stats["proposalsRefused"] == len(refusals)
        # The flood held its threads only until the award timeout: all given back.
        await wait_until(lambda: victim.tasks.statistics()["open"] == 0)
        assert victim.tasks.executor.quota.held(str(evil.peer_id)) == (0, 0)
        assert victim.tasks.executor.quota.total_bytes == 0
        busy = [e for e in victim.events.recent() if e.code == ErrorCode.BUSY]
        assert len(busy) == 1  # one security event for the flood, not one per proposal


async def test_a_refused_proposer_sees_busy_and_its_retry_hint(autojump_clock: Any) -> None:
    limits = dataclasses.replace(FAST_TASKS.tasks, proposal_rate=0.5, proposal_burst=1)
    async with swarm(2, dataclasses.replace(FAST_TASKS, tasks=limits)) as (_, (a, b)):
        boss = Agent("boss", tier=0)
        await a.add_agent(boss)
        await b.add_agent(summer("worker", delay=0.1))
        worker = Agent("helper", capabilities=(SUM,))
        await b.add_agent(worker)
        await connect_all([a, b])
        first = await boss.propose("worker", Task("x", ("sum",), 1.0, [1]))
        assert await first.result() == 1
        with pytest.raises(RemoteError) as info:
            await boss.propose("worker", Task("x", ("sum",), 1.0, [1]))
        assert info.value.code is ErrorCode.TASK_REJECTED
        (rejection,) = info.value.details["rejections"]
        assert rejection["reason"] == "BUSY" and 0 < rejection["retryAfterMs"] <= 2000
        assert info.value.details["retryAfterMs"] == rejection["retryAfterMs"]
        await trio.sleep(rejection["retryAfterMs"] / 1000)  # as the hint says: it passes
        again = await boss.propose("worker", Task("x", ("sum",), 1.0, [2]))
        assert await again.result() == 2
