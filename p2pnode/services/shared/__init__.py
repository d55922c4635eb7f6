"""Shared state: CRDT documents replicated by gossip among their members, stored in SQLite.
Documents' names, ops and values as JSON (shared.docops) are public.

May import: core, agent, transport, dht, crdt, node.service, node.limits,
services' public modules.
"""
