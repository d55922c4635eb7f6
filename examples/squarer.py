"""An example agent that takes tasks and joins swarms. From this folder:
``SQUARER_ID=sq-1 p2pnode run --agent squarer:agent``.

It offers the capability ``square``: a task's input is a number, the result its
square, after sleeping the task's complexity in seconds (at most 5) as if it
worked that long. Its id is ``$SQUARER_ID`` (default ``squarer``), so several
nodes can each host one. Try it with ``p2pnode swarm run squares.json`` from
another node.
"""

import os

import trio

from p2pnode import Agent, Capability
from p2pnode.agent.taskwork import Work

agent = Agent(
    os.environ.get("SQUARER_ID", "squarer"),
    description="Squares numbers, slowly",
    capabilities=(Capability("square", "Square", "the square of a number"),),
)


@agent.on_task(capacity=2)
async def square(work: Work) -> float:
    """Square the task's input."""
    await work.progress(0.0, f"squaring {work.input}")
    await trio.sleep(min(5.0, float(work.task.complexity)))
    return float(work.input) ** 2
