"""Helpers for tests that run nodes in the in-memory simulator on trio's virtual clock.

* :mod:`tests.sim.waiting`: :func:`wait_until` a condition instead of a fixed sleep.
* :mod:`tests.sim.configs`: the one set of fast configs (node, DHT, shared state).
* :mod:`tests.sim.nodes`: the node-swarm builder, :class:`Inbox`, the three-node
  victim/honest/evil setup and the predicates tests wait for.
* :mod:`tests.sim.dht`: signed cards, a virtual wall clock and DHT swarms.
* :mod:`tests.sim.nat`: a network whose next host may be put behind a NAT.
"""

from tests.sim.configs import FAST_DHT, FAST_NODE, FAST_SHARED
from tests.sim.dht import (
    DEFAULT_LINK,
    EPOCH_MS,
    dht_node,
    dht_swarm,
    identity,
    make_card,
    virtual_ms,
)
from tests.sim.nodes import (
    Inbox,
    Member,
    Swarm,
    connect_all,
    converged,
    knows,
    linked,
    met,
    open_swarm,
    swarm,
    victim_honest_evil,
)
from tests.sim.waiting import wait_until

__all__ = [
    "DEFAULT_LINK",
    "EPOCH_MS",
    "FAST_DHT",
    "FAST_NODE",
    "FAST_SHARED",
    "Inbox",
    "Member",
    "Swarm",
    "connect_all",
    "converged",
    "dht_node",
    "dht_swarm",
    "identity",
    "knows",
    "linked",
    "make_card",
    "met",
    "open_swarm",
    "swarm",
    "victim_honest_evil",
    "virtual_ms",
    "wait_until",
]
