"""Tasks: Contract Net negotiation (both sides, a sans-IO core) and task execution.

May import: core, agent, transport, dht, crdt, node.service, node.limits,
services' public modules.
"""
