"""An example agent. From this folder: ``p2pnode run --agent planner:agent``.

It offers two capabilities: ``plan.strategy`` (its input must be an object
with a string ``goal``) and ``plan.review``, and keeps the notifications it
receives.
"""

from p2pnode import Agent, Message

agent = Agent("planner", description="Turns goals into plans", tier=2)
notes: list[object] = []


@agent.on_request(
    "plan.strategy",
    input_schema={
        "type": "object",
        "properties": {"goal": {"type": "string"}},
        "required": ["goal"],
    },
)
async def plan(message: Message) -> dict[str, object]:
    """Plan the steps towards a goal."""
    goal = message.payload["goal"]
    return {"goal": goal, "steps": [f"understand {goal}", f"do {goal}"], "for": message.sender}


@agent.on_request("plan.review")
def review(message: Message) -> dict[str, object]:
    """Review a plan (a sync handler: it does no I/O)."""
    if not message.payload:
        raise ValueError("nothing to review")  # answered as HANDLER_FAILED, logged here
    return {"approved": True, "notes": len(notes)}


@agent.on_notification
def remember(message: Message) -> None:
    notes.append(message.payload)
