"""Open a complete node: network, DHT discovery and the node itself."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from p2pnode.identity import Identity
from p2pnode.net import Network
from p2pnode.node.config import NodeConfig
from p2pnode.node.node import Node


@asynccontextmanager
async def open_node(
    identity: Identity, network: Network, config: NodeConfig
) -> AsyncIterator[Node]:
    """A running node with its DHT; everything is closed on exit."""
    async with Node(identity, network, config) as node:
        yield node
