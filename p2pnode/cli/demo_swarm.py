"""The swarm part of ``p2pnode demo``: worker processes and the check that a swarm
finishes with one of them killed.

Each worker is a ``p2pnode run --agent p2pnode.cli.demo_swarm:agent`` process whose
agent (id ``$DEMO_WORKER_ID``) squares numbers for the demo's swarm, one at a
time, taking each sub-task's complexity in seconds. The check has the first
node's agent open a swarm of :data:`SUBTASKS` sub-tasks with a short lease,
kills one worker (SIGKILL) once the swarm is under way, and passes when the
swarm completes with every sub-task's result counted once, the killed worker
dead in the swarm's document and its work reassigned.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import trio

from p2pnode.agent.definition import Agent
from p2pnode.agent.taskwork import Work
from p2pnode.core.card import Capability
from p2pnode.core.errors import P2PError

CAPABILITY = "demo.square"
WORKER_AGENT = "p2pnode.cli.demo_swarm:agent"
SUBTASKS = 12
LEASE = 3.0
SWARM_TIMEOUT = 60.0

agent = Agent(
    os.environ.get("DEMO_WORKER_ID", "worker"),
    description="Squares numbers for the demo's swarm",
    capabilities=(Capability(CAPABILITY, "Square", "the square of a number, slowly"),),
)


@agent.on_task
async def square(work: Work) -> int:
    """Square the input after working the sub-task's complexity in seconds."""
    await trio.sleep(min(5.0, float(work.task.complexity)))
    return int(work.input) ** 2


def plan() -> dict[str, Any]:
    return {
        "description": "the demo's squares",
        "aggregate": "sum",
        "lease": LEASE,
        "subtasks": [
            {"id": f"sq{i}", "description": f"square {i}", "capabilities": [CAPABILITY],
             "complexity": 1.0, "input": i}
            for i in range(SUBTASKS)
        ],
    }  # fmt: skip


class Node(Protocol):
    """What the check uses of a demo node process."""

    agent: str

    async def call(self, request: dict[str, Any]) -> Any: ...

    async def kill(self) -> None: ...


async def swarm_check(
    opener: Node,
    workers: Sequence[Node],
    check: Callable[[str, bool, str], None],
    find: Callable[[Any, str], Awaitable[list[Any]]],
) -> None:
    """Run the swarm with one worker killed (see the module docstring)."""
    found = await find(opener, CAPABILITY)
    if len(found) < len(workers):
        check("swarm with a participant killed", False, f"found only {len(found)} workers")
        return
    try:
        opened = await opener.call({"op": "swarm.open", "from": opener.agent, "plan": plan()})
        swarm = opened["swarm"]
        status = await _wait(opener, swarm, lambda s: s["done"] >= 2)
        victim = workers[0]
        await victim.kill()
        status = await _wait(opener, swarm, lambda s: s["status"] in ("completed", "canceled"))
        metrics = (await opener.call({"op": "status"}))["tasks"]
    except P2PError as exc:
        check("swarm with a participant killed", False, str(exc))
        return
    # Members are named agent@peer in the swarm document (docs/protocol/tasks.md §4.4).
    dead = [m["agent"].rpartition("@")[0] for m in status["members"] if not m["alive"]]
    expected = sum(i * i for i in range(SUBTASKS))
    check(
        "swarm with a participant killed",
        status["status"] == "completed"
        and status["outcome"] == expected
        and status["duplicates"] == 0
        and dead == [victim.agent]
        and metrics["reassignments"] >= 1,
        f"{status['done']}/{status['total']} sub-tasks done by {len(workers)} worker processes, "
        f"{victim.agent} killed mid-run (dead: {dead}, {metrics['reassignments']} reassigned); "
        f"outcome {status['outcome']} (expected {expected})",
    )


async def _wait(node: Node, swarm: str, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    status: dict[str, Any] = {}
    with trio.move_on_after(SWARM_TIMEOUT):
        while True:
            status = await node.call({"op": "swarm.status", "swarm": swarm})
            if done(status):
                break
            await trio.sleep(0.2)
    return status


__all__ = ["CAPABILITY", "SUBTASKS", "WORKER_AGENT", "agent", "plan", "swarm_check"]
