"""The agent-facing surface: the operations every way of running an agent offers.

An agent reaches the swarm through one of three objects: the trio node
(``p2pnode.Node``), the asyncio node (:class:`p2pnode.hosting.aio.AioNode`) and
the client of an agent process attached to a daemon
(:class:`p2pnode.hosting.client.AgentClient`). Each offers the operations
below under the same dotted names, with the same results and the same error
codes (a LocalError where the caller or the local node is at fault, a
RemoteError where a responder or an owner refused), so code moves between
them by changing how the object is made, not how it is used.

What differs, by nature of the object: a node hosts several agents, so its
operations name the agent acting (``sender``, ``caller``, the member
``agent_id``); an attached client *is* one agent and leaves that argument
out. On a node ``shared`` is there once :meth:`open_shared` ran, and
``shared.read`` is a plain call; on a client it is a round trip, so it is
awaited.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

#: Send one envelope (a node: an Envelope from a local agent; a client: ``to``, ``payload``).
SEND: Final = "send"
#: Send a request and wait for its response envelope.
REQUEST: Final = "request"
#: The cards of agents offering a capability that the agent may discover.
FIND: Final = "find"

#: The swarm's tools, resources and prompts (docs/protocol/tools.md).
TOOLS: Final = (
    "tools.list_tools",
    "tools.call_tool",
    "tools.call_tool_result",
    "tools.list_resources",
    "tools.read_resource",
    "tools.list_prompts",
    "tools.get_prompt",
)
#: Task negotiation (docs/protocol/tasks.md): ``propose`` returns a handle once awarded.
TASKS: Final = ("tasks.propose",)
#: Shared CRDT documents (docs/protocol/gossip.md).
SHARED: Final = ("shared.subscribe", "shared.update", "shared.read")

#: The whole surface, as dotted attribute names from the agent-facing object.
AGENT_SURFACE: Final = (SEND, REQUEST, FIND, *TOOLS, *TASKS, *SHARED)

#: The members of a proposed task's handle that every object's ``tasks.propose`` returns.
TASK_HANDLE: Final = (
    "task_id",
    "state",
    "assignee",
    "progress",
    "message",
    "wait_changed",
    "result",
    "outcome",
    "updates",
    "cancel",
)



@dataclass(slots=True)
class Listing:
    """What ``tools.list_tools``, ``list_resources`` and ``list_prompts`` return on every
    object: ``items`` (each with its owner's ``agentId``; tool and prompt names qualified
    ``agent.name``), owners that did not answer (agent id → error code), and how many
    entries were dropped as malformed or past the limits."""

    items: list[dict[str, Any]] = field(default_factory=list)
    unreachable: dict[str, str] = field(default_factory=dict)
    dropped: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"items": self.items, "unreachable": self.unreachable, "dropped": self.dropped}


__all__ = [
    "AGENT_SURFACE",
    "FIND",
    "REQUEST",
    "SEND",
    "SHARED",
    "TASKS",
    "TASK_HANDLE",
    "TOOLS",
    "Listing",
]
