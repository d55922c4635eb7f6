"""The one set of fast configurations for simulator tests.

Short retry delays, dial and request timeouts, gossip and refresh periods keep a
test's virtual time small, so the events a test waits for come after a few
seconds of trio's clock rather than the minutes the defaults allow.
"""

from __future__ import annotations

from p2pnode.crdt.gossip import GossipConfig
from p2pnode.dht.config import DhtConfig
from p2pnode.node.channels import RetryPolicy
from p2pnode.runtime import NodeConfig
from p2pnode.services.shared.service import SharedConfig

#: A node that redials quickly and gives up on a silent request after 5 s.
FAST_NODE = NodeConfig(
    retry=RetryPolicy(first_delay=0.05, max_redials=3, dial_timeout=2.0), request_timeout=5.0
)

#: A DHT node with maintenance every minute; refresh and republish still come long after
#: a test's lookups, so tests that exercise them sleep past these intervals on purpose.
FAST_DHT = DhtConfig(maintenance_interval=60.0, refresh_interval=600.0, republish_interval=1200.0)

#: Shared state gossiping and rescanning for peers every second.
FAST_SHARED = SharedConfig(
    gossip=GossipConfig(interval=1.0), refresh_interval=1.0, discovery_interval=5.0, suspend=3.0
)
