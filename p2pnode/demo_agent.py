"""The agent of ``p2pnode demo``'s last node, written with the Agent API and hosted by
``p2pnode run --agent p2pnode.demo_agent:agent`` in its own process."""

from __future__ import annotations

from typing import Any

from p2pnode.agent import Agent, Message

agent = Agent("oracle", description="Answers questions about the swarm", tier=3)


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
