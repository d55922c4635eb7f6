# toolbox.py
"""An agent offering tools, a resource and a prompt. From this folder:
``p2pnode run --agent toolbox:agent``; ``python toolbox.py`` uses them in one process."""

import trio

from p2pnode import Agent, Identity, NodeConfig, RemoteError, TrioNetwork, open_node
from p2pnode.agent.tools import Access, Caller

agent = Agent("toolbox", description="Estimates and checklists for plans", tier=2)
rates = {"hours_per_task": 1.5}


@agent.tool()
def estimate(tasks: int, parallel: int = 1) -> dict[str, float]:
    """Estimate the hours a plan of tasks takes."""
    return {"hours": tasks * rates["hours_per_task"] / parallel}


@agent.tool(access=Access(roles=["ops"]))
def set_rate(hours_per_task: float, caller: Caller) -> str:
    """Change the hours one task takes (operators only)."""
    rates["hours_per_task"] = hours_per_task
    return f"{caller.agent_id} set {hours_per_task} hours per task"


@agent.resource("memo://checklist", mime_type="application/json")
def checklist() -> dict[str, list[str]]:
    """The steps every plan goes through."""
    return {"steps": ["scope", "estimate", "review"]}


agent.add_prompt(
    "kickoff", "Write the kickoff note of {project}, due {date}.", description="A kickoff note"
)


async def main() -> None:  # the same agent, embedded in a trio program
    async with open_node(Identity.generate(), TrioNetwork(), NodeConfig()) as node:
        await node.add_agent(agent)
        await node.add_agent(Agent("lead"))
        listing = await node.tools.list_tools(caller="lead")
        print([tool["name"] for tool in listing.items])  # set_rate is not listed for lead
        print(await node.tools.call_tool("toolbox.estimate", {"tasks": 4}, caller="lead"))
        try:
            await node.tools.call_tool("toolbox.set_rate", {"hours_per_task": 2}, caller="lead")
        except RemoteError as exc:
            print(exc.code, exc.message)
        print(await node.tools.read_resource("memo://checklist", caller="lead"))
        print(await node.tools.get_prompt("toolbox.kickoff", {"project": "p2p", "date": "Friday"}))


if __name__ == "__main__":
    trio.run(main)
