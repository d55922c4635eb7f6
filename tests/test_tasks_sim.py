"""Task negotiation between real nodes in the simulator (seed R7; Properties 23-24):
accept and award, reject with a reason, PROPOSAL_TIMEOUT, one correlation thread per
task, calls for proposals with each selection policy, progress, input, cancel,
failures, a dead executor, escalation across tiers, agents on one node."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

from p2pnode.agent.definition import Agent
from p2pnode.agent.task import Accept, Proposal, Reject, RejectReason, Selection, Task, TaskState
from p2pnode.agent.taskwork import Work
from p2pnode.core.card import Capability
from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.runtime import Node
from p2pnode.services.tasks.negotiation import TaskConfig
from p2pnode.services.tasks.service import TaskHandle
from tests.sim import FAST_NODE, Inbox, connect_all, swarm, wait_until

FAST_TASKS = dataclasses.replace(
    FAST_NODE, tasks=TaskConfig(deadline=2.0, award_timeout=2.0, keepalive=1.0)
)
SUM = Capability("sum", "Sum", "adds numbers")


def summer(name: str, *, tier: int = 3, delay: float = 0.5, estimate: float | None = None) -> Agent:
    """An agent that adds the numbers of its task's input, reporting progress."""
    agent = Agent(name, tier=tier, capabilities=(SUM,))

    @agent.on_proposal
    def consider(proposal: Proposal) -> Accept:
        return Accept(estimate)

    @agent.on_task
    async def add(work: Work) -> int:
        await work.progress(0.5, "halfway")
        await trio.sleep(delay)
        return sum(work.input)

    return agent


@asynccontextmanager
async def pair(worker: Agent, boss_tier: int = 0) -> AsyncIterator[tuple[Node, Node, Agent]]:
    """Two connected nodes: the boss (an agent that proposes) on the first, ``worker`` on
    the second."""
    async with swarm(2, FAST_TASKS) as (_, (a, b)):
        boss = Agent("boss", tier=boss_tier)
        await a.add_agent(boss)
        await b.add_agent(worker)
        await connect_all([a, b])
        yield a, b, boss


async def test_an_accepted_task_is_awarded_worked_and_completed(autojump_clock: Any) -> None:
    async with pair(summer("worker")) as (a, b, boss):
        handle = await boss.propose("worker", Task("add", ("sum",), 1.0, [1, 2, 3]))
        assert handle.state is TaskState.WORKING
        assert handle.assignee == "worker"
        seen = [state async for state in handle.updates()]
        assert seen[-1] is TaskState.COMPLETED
        assert await handle.result() == 6
        assert handle.progress == 1.0
        stats, remote = a.tasks.statistics(), b.tasks.statistics()
        assert (stats["proposalsSent"], stats["proposalsAccepted"], stats["tasksCompleted"]) == (
            1,
            1,
            1,
        )
        assert remote["proposalsReceived"] == 1 and remote["open"] == 0
        assert a.status()["tasks"]["tasksCompleted"] == 1


async def test_p24_every_message_of_an_accepted_task_shares_its_correlation_id(
    autojump_clock: Any,
) -> None:
    async with pair(summer("worker")) as (a, b, boss):
        handle = await boss.propose("worker", Task("add", ("sum",), 1.0, [4]))
        assert await handle.result() == 4
        for node in (a, b):
            thread = node.threads.thread(handle.task_id)
            assert all(e.correlation_id == handle.task_id for e in thread)
            kinds = [e.type for e in thread]
            assert kinds[:2] == [MessageType.TASK_PROPOSAL, MessageType.TASK_ACCEPT]
            # The award, the reports (working, progress, completed): all on the thread.
            assert kinds.count(MessageType.STREAM_DATA) >= 4
        payloads = [e.payload for e in a.threads.thread(handle.task_id)]
        assert payloads[0]["taskId"] == handle.task_id
        assert payloads[1]["agentId"] == "worker" and payloads[1]["estimatedCompletion"] > 0
        assert payloads[-1] == {"task": handle.task_id, "state": "completed", "progress": 1.0,
                                "result": 4}  # fmt: skip


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 4), st.booleans())
def test_p24_the_thread_holds_whatever_the_work_reports(reports: int, fails: bool) -> None:
    worker = Agent("worker", capabilities=(SUM,))

    @worker.on_task
    async def work(work: Work) -> int:
        for i in range(reports):
            await work.progress(i / 4, f"step {i}")
        if fails:
            raise RemoteError(ErrorCode.INVALID_INPUT, "no numbers")
        return 1

    async def run() -> None:
        async with pair(worker) as (a, _, boss):
            handle = await boss.propose("worker", Task("x", ("sum",)))
            with pytest.raises(RemoteError) if fails else contextlib.nullcontext():
                await handle.result()
            thread = a.threads.thread(handle.task_id)
            assert {e.correlation_id for e in thread} == {handle.task_id}
            # proposal, accept, award, "working", the reports and the end
            assert len(thread) == 5 + reports

    trio.run(run, clock=MockClock(autojump_threshold=0))


async def test_a_rejection_carries_its_reason_and_alternative(autojump_clock: Any) -> None:
    worker = Agent("worker", capabilities=(SUM,))

    @worker.on_proposal
    def consider(proposal: Proposal) -> Reject:
        return Reject(RejectReason.BUSY, "try later", alternative="helper")

    worker.on_task(lambda work: None)
    async with pair(worker) as (a, _, boss):
        with pytest.raises(RemoteError) as info:
            await boss.propose("worker", Task("add", ("sum",)))
        assert info.value.code is ErrorCode.TASK_REJECTED
        assert info.value.details["rejections"] == [
            {"agent": "worker", "reason": "BUSY", "message": "try later", "alternative": "helper"}
        ]
        # A task needing what the agent does not offer is rejected as INCAPABLE by default.
        with pytest.raises(RemoteError, match="INCAPABLE"):
            await boss.propose("worker", Task("fly", ("wings",)))
        assert a.tasks.statistics()["proposalsRejected"] == 2


async def test_no_answer_by_the_deadline_is_a_proposal_timeout(autojump_clock: Any) -> None:
    # An agent with no task handlers gets the proposal as any other envelope, and its
    # handler does not answer it.
    inbox = Inbox()
    async with swarm(2, FAST_TASKS) as (_, (a, b)):
        boss = Agent("boss", tier=0)
        await a.add_agent(boss)
        await b.add_agent("quiet", inbox)
        await connect_all([a, b])
        start = trio.current_time()
        with pytest.raises(LocalError) as info:
            await boss.propose("quiet", Task("x"), deadline=1.5)
        assert info.value.code is ErrorCode.PROPOSAL_TIMEOUT
        assert 1.5 <= trio.current_time() - start < 1.6
        assert info.value.details["unanswered"] == ["quiet"]
        assert [e.type for e in inbox.received] == [MessageType.TASK_PROPOSAL]
        assert a.tasks.statistics()["proposalsTimedOut"] == 1


async def test_a_slow_decision_comes_too_late(autojump_clock: Any) -> None:
    worker = Agent("worker", capabilities=(SUM,))

    @worker.on_proposal
    async def consider(proposal: Proposal) -> Accept:
        await trio.sleep(5)
        return Accept()

    worker.on_task(lambda work: 1)
    async with pair(worker) as (_a, b, boss):
        with pytest.raises(LocalError) as info:
            await boss.propose("worker", Task("x", ("sum",)), deadline=1.0)
        assert info.value.code is ErrorCode.PROPOSAL_TIMEOUT
        await wait_until(lambda: b.tasks.statistics()["open"] == 0)


@pytest.mark.parametrize(
    ("selection", "winner"),
    [
        (Selection.FIRST_ACCEPT, "w-fast"),
        (Selection.BEST_ESTIMATE, "w-early"),
        (Selection.LOWEST_LOAD, "w-idle"),
    ],
)
async def test_a_call_for_proposals_selects_by_its_policy(
    autojump_clock: Any, selection: Selection, winner: str
) -> None:
    async with swarm(4, FAST_TASKS) as (_, nodes):
        boss = Agent("boss", tier=0)
        await nodes[0].add_agent(boss)
        # w-fast answers at once; w-early later with the earliest estimate; w-idle last,
        # idle (the others each run a task already, in a second agent slot).
        delays = {"w-fast": 0.0, "w-early": 0.3, "w-idle": 0.6}
        estimates = {"w-fast": 50.0, "w-early": 1.0, "w-idle": 20.0}
        busy = {"w-fast": 1, "w-early": 1, "w-idle": 0}
        ran: list[str] = []
        for node, name in zip(nodes[1:], delays, strict=True):
            agent = Agent(name, capabilities=(SUM,))

            def consider(proposal: Proposal, name: str = name) -> Any:
                async def later() -> Accept:
                    await trio.sleep(delays[name])
                    return Accept(estimates[name])

                return later()

            def run(work: Work, name: str = name) -> str:
                ran.append(name)
                return name

            agent.on_proposal(consider)
            agent.on_task(run, capacity=2)
            await node.add_agent(agent)
            node.tasks.executor._load[name] = busy[name]
        await connect_all(nodes)
        handle = await boss.propose(
            "sum", Task("x", ("sum",)), capability=True, selection=selection
        )
        assert handle.assignee == winner
        assert await handle.result() == winner
        await trio.sleep(1)
        assert ran == [winner]  # the others were released, not started
        assert all(n.tasks.statistics()["open"] == 0 for n in nodes)


async def test_input_required_then_input(autojump_clock: Any) -> None:
    worker = Agent("worker", capabilities=(SUM,))

    @worker.on_task
    async def ask(work: Work) -> str:
        answer = await work.ask("which branch?")
        return f"built {answer}"

    async with pair(worker) as (_, _b, boss):
        handle = await boss.propose("worker", Task("build", ("sum",)))
        await wait_until(lambda: handle.state is TaskState.INPUT_REQUIRED)
        assert handle.message == "which branch?"
        await trio.sleep(3.5)  # keepalives keep it alive while it waits
        assert handle.state is TaskState.INPUT_REQUIRED
        await handle.send_input("main")
        assert await handle.result() == "built main"
        with pytest.raises(LocalError) as info:
            await handle.send_input("again")
        assert info.value.code is ErrorCode.ILLEGAL_TRANSITION


async def test_cancel_stops_the_work(autojump_clock: Any) -> None:
    stopped = trio.Event()
    worker = Agent("worker", capabilities=(SUM,))

    @worker.on_task
    async def forever(work: Work) -> None:
        try:
            await trio.sleep_forever()
        finally:
            stopped.set()

    async with pair(worker) as (a, b, boss):
        handle = await boss.propose("worker", Task("spin", ("sum",)))
        await trio.sleep(0.5)
        await handle.cancel("enough")
        assert handle.state is TaskState.CANCELED
        with pytest.raises(LocalError) as info:
            await handle.result()
        assert info.value.code is ErrorCode.TASK_CANCELED
        await wait_until(stopped.is_set)
        await wait_until(lambda: b.tasks.statistics()["open"] == 0)
        assert a.tasks.statistics()["tasksCanceled"] == 1


async def test_a_failing_handler_fails_the_task_with_its_code(autojump_clock: Any) -> None:
    worker = Agent("worker", capabilities=(SUM,))

    @worker.on_task
    def broken(work: Work) -> None:
        raise ValueError("secret internals")

    async with pair(worker) as (a, _, boss):
        handle = await boss.propose("worker", Task("x", ("sum",)))
        with pytest.raises(RemoteError) as info:
            await handle.result()
        assert info.value.code is ErrorCode.HANDLER_FAILED
        assert "secret" not in info.value.message
        assert a.tasks.statistics()["tasksFailed"] == 1


async def test_a_dead_executor_fails_the_task_after_its_silence(autojump_clock: Any) -> None:
    async with swarm(2, FAST_TASKS) as (sim, (a, b)):
        boss = Agent("boss", tier=0)
        await a.add_agent(boss)
        await b.add_agent(summer("worker", delay=100))
        await connect_all([a, b])
        handle = await boss.propose("worker", Task("x", ("sum",), input=[1]))
        await trio.sleep(0.5)
        start = trio.current_time()
        sim.kill(b.listen_address[0])
        with pytest.raises(RemoteError) as info:
            await handle.result()
        assert info.value.code is ErrorCode.TIMEOUT
        assert trio.current_time() - start <= 3 * 1.0 + 1.0  # silence_limit keepalives


async def test_an_escalated_proposal_is_answered_across_tiers(autojump_clock: Any) -> None:
    # L3 may propose to L1 only with a justification; L1 may not address L3 at all, but
    # its answers and reports on the thread pass (they answer an allowed proposal).
    async with pair(summer("mercury", tier=1), boss_tier=3) as (_, _b, boss):
        with pytest.raises(LocalError) as info:
            await boss.propose("mercury", Task("x", ("sum",), input=[2]))
        assert info.value.code is ErrorCode.ESCALATION_REQUIRED
        handle = await boss.propose(
            "mercury", Task("x", ("sum",), input=[2]), justification="the build is on fire"
        )
        assert await handle.result() == 2


async def test_agents_on_one_node_negotiate_too(autojump_clock: Any) -> None:
    async with swarm(1, FAST_TASKS) as (_, (a,)):
        boss = Agent("boss", tier=0)
        await a.add_agent(boss)
        await a.add_agent(summer("worker"))
        handle = await boss.propose("worker", Task("x", ("sum",), input=[5, 5]))
        assert await handle.result() == 10


async def test_a_busy_agent_rejects_and_a_removed_one_stops(autojump_clock: Any) -> None:
    async with pair(summer("worker", delay=50)) as (_a, b, boss):
        first = await boss.propose("worker", Task("x", ("sum",), input=[1]))
        with pytest.raises(RemoteError, match="BUSY"):
            await boss.propose("worker", Task("x", ("sum",), input=[1]))
        await b.remove_agent("worker")  # its task is canceled; it cannot say so any more
        with pytest.raises(RemoteError) as info:
            await first.result()
        assert info.value.code is ErrorCode.TIMEOUT
        assert b.tasks.statistics()["open"] == 0


async def test_stray_answers_and_bad_reports_are_dropped(autojump_clock: Any) -> None:
    async with pair(summer("worker")) as (a, b, boss):
        inbox: list[Envelope] = []
        # An accept no thread waits for reaches the agent's own handler.
        boss.on_message(lambda m: inbox.append(m.envelope))
        stray = b.envelope("worker", "boss", MessageType.TASK_ACCEPT, {"taskId": "t"})
        await b.send(stray)
        await wait_until(lambda: inbox)
        bad = b.envelope("worker", "boss", MessageType.STREAM_DATA, {"task": "t", "state": 7},
                         correlation_id="t")  # fmt: skip
        await b.send(bad)
        await wait_until(lambda: a.tasks.statistics()["badMessages"] == 1)
        handle = await boss.propose("worker", Task("x", ("sum",), input=[3]))
        assert await handle.result() == 3


async def test_propose_refuses_bad_arguments(autojump_clock: Any) -> None:
    async with pair(summer("worker")) as (a, _, boss):
        with pytest.raises(LocalError, match="deadline"):
            await boss.propose("worker", Task("x"), deadline=0)
        with pytest.raises(LocalError) as info:
            await boss.propose("nobody.offers", Task("x"), capability=True)
        assert info.value.code is ErrorCode.CAPABILITY_NOT_FOUND
        with pytest.raises(LocalError) as info:
            await Agent("loose").propose("worker", Task("x"))
        assert info.value.code is ErrorCode.INVALID_ARGUMENT
        with pytest.raises(LocalError) as info:
            await a.tasks.propose("nobody", "worker", Task("x"))
        assert info.value.code is ErrorCode.AGENT_NOT_FOUND


async def test_agent_at_peer_reaches_that_peers_agent_past_a_squatter(
    autojump_clock: Any,
) -> None:
    # ``worker`` is claimed by b (the real one) and by c (a squatter that answers wrong).
    async with swarm(3, FAST_TASKS) as (_, (a, b, c)):
        boss = Agent("boss", tier=0)
        await a.add_agent(boss)
        await b.add_agent(summer("worker"))
        squatter = Agent("worker", capabilities=(SUM,))

        @squatter.on_task
        async def lie(work: Work) -> int:
            return -1

        await c.add_agent(squatter)
        for node in (b, c):  # connect_all waits for one owner per id: not here
            await node.connect(a.listen_address)
        await wait_until(
            lambda: all(a.registry.find_owned("worker", n.peer_id) for n in (b, c))
            and b.registry.find("boss") is not None
            and c.registry.find("boss") is not None
        )
        real, fake = f"worker@{b.peer_id}", f"worker@{c.peer_id}"
        handle = await boss.propose(real, Task("add", ("sum",), 1.0, [1, 2, 3]))
        assert handle.assignee == real
        assert await handle.result() == 6
        assert await (await boss.propose(fake, Task("add", ("sum",), 1.0, [1]))).result() == -1
        # A call for proposals names both; each answer is matched to its own owner, and
        # the best estimate wins whichever owner answered first.
        both = await boss.propose(
            [real, fake], Task("add", ("sum",), 1.0, [2]), selection=Selection.BEST_ESTIMATE
        )
        assert isinstance(both, TaskHandle)
        assert set(both.thread.accepts) == {real, fake}
        assert both.assignee in (real, fake)
        assert await both.result() == (2 if both.assignee == real else -1)
        # A peer id spelled in another case is the same owner.
        shout = f"worker@{str(b.peer_id).upper()}"
        upper = await boss.propose(shout, Task("x", ("sum",), 1.0, [4]))
        assert await upper.result() == 4
        assert a.tasks.statistics()["open"] == 0
        assert b.tasks.statistics()["proposalsRefused"] == 0
