"""Reachability: dial-back checks of a node's addresses by its peers
(docs/protocol/reachability.md). :mod:`.wire` is the request and answer, :mod:`.verdict`
the sans-IO conclusion, :mod:`.service` the checker and the requester, :mod:`.dhtside`
its use of the DHT.

May import: core, agent, transport, dht, crdt, node.service, node.limits,
services' public modules.
"""

from p2pnode.services.reachability.verdict import (
    NatMapping,
    Reachability,
    Report,
    Verdict,
    decide,
    dht_mode,
    pick_checkers,
)
from p2pnode.services.reachability.wire import (
    MAX_ADDRESSES,
    METHOD,
    Candidate,
    Outcome,
    ReachError,
    Transport,
)

__all__ = [
    "MAX_ADDRESSES",
    "METHOD",
    "Candidate",
    "NatMapping",
    "Outcome",
    "ReachError",
    "Reachability",
    "Report",
    "Transport",
    "Verdict",
    "decide",
    "dht_mode",
    "pick_checkers",
]
