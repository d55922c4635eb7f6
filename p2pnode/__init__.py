"""p2pnode: a peer-to-peer node for AI agents.

The names most programs need are re-exported here; each layer's module has
the rest (``p2pnode.channel``, ``p2pnode.dht``, ``p2pnode.crdt``, ...).
"""

from p2pnode.card import AgentCard, Capability, Endpoint, Origin, Tier
from p2pnode.envelope import BROADCAST, Envelope, EnvelopeFactory, MessageType, Metadata
from p2pnode.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.identity import Identity, PeerId
from p2pnode.registry import Registry

__all__ = [
    "BROADCAST",
    "AgentCard",
    "Capability",
    "Endpoint",
    "Envelope",
    "EnvelopeFactory",
    "ErrorCode",
    "Identity",
    "LocalError",
    "MessageType",
    "Metadata",
    "Origin",
    "P2PError",
    "PeerId",
    "Registry",
    "RemoteError",
    "Tier",
]

__version__ = "0.1.0"
