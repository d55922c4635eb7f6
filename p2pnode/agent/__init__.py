"""Agent definitions: an agent's handlers, its tools, resources and prompts with their
schemas and access rules, and task payloads. Data and handlers, no I/O: the kernel hosts
them, the services serve their calls.

May import: core.
"""

from p2pnode.agent.definition import Agent, Message

__all__ = ["Agent", "Message"]
