"""Shared state: CRDT documents replicated by gossip, stored in SQLite.
"""
