"""The data model every layer shares: errors with their stable codes, identities, Agent
Cards and their rules, envelopes, the wire encoding with its limits, the registry,
correlation threads, the failure boundary and task ownership.

May import: nothing. Third-party: pynacl and msgpack; trio for TaskOwner (core.lifetime) alone.
"""
