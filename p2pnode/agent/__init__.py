"""Agent definitions: an agent's handlers, its tools, resources and prompts with their
schemas and access rules, and task payloads. Data and handlers, no I/O: the node hosts
them, the services serve their calls. Imports the core only.
"""

from p2pnode.agent.definition import Agent, Message

__all__ = ["Agent", "Message"]
