"""The data model every layer shares: errors, identities, cards, envelopes, the wire
encoding with its limits, the registry, correlation threads and the failure boundary.
Imports nothing above it (pynacl, msgpack, trio for TaskOwner alone).
"""
