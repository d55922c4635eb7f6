"""p2pnode: a peer-to-peer node for AI agents.

The names most programs need are re-exported here; each layer's module has
the rest (``p2pnode.transport.channel``, ``p2pnode.dht``, ``p2pnode.crdt``, ...).

The node-level names (``open_node``, ``Node``, ``NodeConfig``, the networks)
are loaded on first use, so that importing a sans-IO core such as
``p2pnode.dht.routing`` or ``p2pnode.crdt.gossip`` does not load trio.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from p2pnode.agent.definition import Agent, Message
from p2pnode.core.card import AgentCard, Capability, Endpoint, Origin, Tier
from p2pnode.core.envelope import BROADCAST, Envelope, EnvelopeFactory, MessageType, Metadata
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.core.identity import Identity, PeerId
from p2pnode.core.registry import Registry

if TYPE_CHECKING:
    from p2pnode.hosting import aio as aio
    from p2pnode.node.router import RoutingResult
    from p2pnode.runtime import Node, NodeConfig, open_node
    from p2pnode.simnet import SimNetwork
    from p2pnode.transport.net import TrioNetwork

_LAZY = {
    "Node": "p2pnode.runtime",
    "NodeConfig": "p2pnode.runtime",
    "RoutingResult": "p2pnode.node.router",
    "SimNetwork": "p2pnode.simnet",
    "TrioNetwork": "p2pnode.transport.net",
    "open_node": "p2pnode.runtime",
}


#: Submodules loaded on first use (``p2pnode.hosting.aio`` loads asyncio).
_LAZY_MODULES = {"aio": "p2pnode.hosting.aio"}


def __getattr__(name: str) -> Any:
    if name in _LAZY_MODULES:
        return importlib.import_module(_LAZY_MODULES[name])
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'p2pnode' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


__all__ = [
    "BROADCAST",
    "Agent",
    "AgentCard",
    "Capability",
    "Endpoint",
    "Envelope",
    "EnvelopeFactory",
    "ErrorCode",
    "Identity",
    "LocalError",
    "Message",
    "MessageType",
    "Metadata",
    "Node",
    "NodeConfig",
    "Origin",
    "P2PError",
    "PeerId",
    "Registry",
    "RemoteError",
    "RoutingResult",
    "SimNetwork",
    "Tier",
    "TrioNetwork",
    "open_node",
]

__version__ = "0.1.0"
