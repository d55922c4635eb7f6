"""Tools, resources and prompts: the owner's side (access checks, the audit log) and the
caller's (list, call, read, get).

May import: core, agent, transport, dht, crdt, node.service, node.limits,
services' public modules.
"""
