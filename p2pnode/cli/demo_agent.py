"""The agent of ``p2pnode demo``'s last node, written with the Agent API and hosted by
``p2pnode run --agent p2pnode.cli.demo_agent:agent`` in its own process."""

from __future__ import annotations

from typing import Any

from p2pnode.agent.definition import Agent, Message
from p2pnode.agent.tools import Access

agent = Agent("oracle", description="Answers questions about the swarm", tier=3)

#: Hours one task takes, as the oracle estimates plans.
HOURS_PER_TASK = 1.5


@agent.on_request(
    "demo.answer",
    input_schema={
        "type": "object",
        "properties": {"question": {"type": "string"}},
        "required": ["question"],
    },
)
def answer(message: Message) -> dict[str, Any]:
    """Answer a question."""
    question = message.payload["question"]
    return {"question": question, "answer": len(question), "asked by": message.sender}


# Estimates commit the swarm's time: only the orchestrator (L0) may ask for them.
@agent.tool(access=Access(tiers=[0]))
def estimate(tasks: int, agents: int = 1) -> dict[str, float]:
    """Estimate the hours a plan of tasks takes with agents working in parallel."""
    return {"hours": tasks * HOURS_PER_TASK / max(agents, 1)}
