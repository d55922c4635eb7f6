"""Kademlia DHT: routing table, iterative lookups, UDP RPC and signed records.

Wire-compatible with the PyPI ``kademlia`` package (see docs/protocol/dht.md).
"""

from p2pnode.dht.lookup import Lookup, PeerState, RttEstimator
from p2pnode.dht.node import DhtConfig, DhtNode, DhtStatistics
from p2pnode.dht.peer import DhtPeer
from p2pnode.dht.records import (
    ProviderInfo,
    RecordError,
    RecordKind,
    RecordStore,
    SignedRecord,
    capability_key,
    card_key,
    decode_value_untrusted,
    encode_value,
)
from p2pnode.dht.routing import Contact, RoutingTable
from p2pnode.dht.rpcwire import RpcError

__all__ = [
    "Contact",
    "DhtConfig",
    "DhtNode",
    "DhtPeer",
    "DhtStatistics",
    "Lookup",
    "PeerState",
    "ProviderInfo",
    "RecordError",
    "RecordKind",
    "RecordStore",
    "RoutingTable",
    "RpcError",
    "RttEstimator",
    "SignedRecord",
    "capability_key",
    "card_key",
    "decode_value_untrusted",
    "encode_value",
]
