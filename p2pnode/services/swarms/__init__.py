"""Swarms: a plan shared out among agents, coordinated through a CRDT document; the plan,
the document and the coordinator are sans-IO cores, the member and the service drive them.

May import: core, agent, transport, dht, crdt, node.service, node.limits,
services' public modules.
"""

from p2pnode.services.swarms.coordinator import SwarmConfig
from p2pnode.services.swarms.document import doc_name
from p2pnode.services.swarms.protocols import Documents, Joiner, Tasks

__all__ = ["Documents", "Joiner", "SwarmConfig", "Tasks", "doc_name"]
