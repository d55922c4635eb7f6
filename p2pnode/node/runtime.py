"""Open a complete node: secure-channel listener, DHT discovery and the node itself.

The DHT binds UDP on the same port number as the TCP listener (unless
``NodeConfig.dht_listen`` names a port), so one ``host:port`` in a bootstrap
list or a card reaches both. With a data directory, the DHT routing table is
restored from ``routing.snapshot`` at start and saved there on exit, so a
restarted node rejoins without its bootstrap peers.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from p2pnode.core.errors import LocalError
from p2pnode.core.identity import Identity, write_private_file
from p2pnode.dht.node import DhtNode
from p2pnode.node.config import NodeConfig
from p2pnode.node.discovery import DhtDiscovery
from p2pnode.node.node import Node
from p2pnode.transport.net import Network

SNAPSHOT_FILE = "routing.snapshot"
logger = logging.getLogger("p2pnode.node")


@asynccontextmanager
async def open_node(
    identity: Identity, network: Network, config: NodeConfig
) -> AsyncIterator[Node]:
    """A running node with its DHT; everything is closed on exit."""
    async with Node(identity, network, config) as node:
        host, port = config.dht_listen
        if port == 0:
            port = node.listen_address[1]
        async with DhtNode(network, identity=identity, address=(host, port)) as dht:
            node.discovery = DhtDiscovery(dht)
            # What the DHT drops (a forged or poisoned record, a datagram that failed)
            # is a security event of the node, counted in `status` like a bad frame.
            dht.boundary.also_report(node.report_input_failure)
            snapshot = config.data_dir / SNAPSHOT_FILE if config.data_dir else None
            if snapshot is not None and snapshot.exists():
                try:
                    restored = dht.restore(snapshot.read_bytes())
                    logger.info("restored %d DHT contacts from %s", restored, snapshot)
                except (LocalError, OSError) as exc:
                    logger.warning("ignoring DHT snapshot %s: %s", snapshot, exc)
            try:
                yield node
            finally:
                if snapshot is not None:
                    write_private_file(snapshot, dht.snapshot())
