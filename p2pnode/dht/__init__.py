"""Kademlia DHT: routing table, iterative lookups, the RPC core and signed records.

Wire-compatible with the PyPI ``kademlia`` package (see docs/protocol/dht.md).

This package namespace holds the sans-IO parts only, so importing it loads
no trio: the trio driver is :class:`p2pnode.dht.peer.DhtPeer` and the node
with the Agent Card API is :class:`p2pnode.dht.node.DhtNode`.

May import: core, transport.
"""

from p2pnode.dht.config import DhtConfig, DhtMode, DhtStatistics
from p2pnode.dht.lookup import Lookup, PeerState, RecordCollector, RttEstimator, merge_records
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
from p2pnode.dht.rpc import (
    CallState,
    CallTimedOut,
    DatagramDropped,
    DropReason,
    OutgoingCall,
    ReplyReceived,
    RequestReceived,
    RpcCore,
    RpcEvent,
)
from p2pnode.dht.rpcwire import RpcError

__all__ = [
    "CallState",
    "CallTimedOut",
    "Contact",
    "DatagramDropped",
    "DhtConfig",
    "DhtMode",
    "DhtStatistics",
    "DropReason",
    "Lookup",
    "OutgoingCall",
    "PeerState",
    "ProviderInfo",
    "RecordCollector",
    "RecordError",
    "RecordKind",
    "RecordStore",
    "ReplyReceived",
    "RequestReceived",
    "RoutingTable",
    "RpcCore",
    "RpcError",
    "RpcEvent",
    "RttEstimator",
    "SignedRecord",
    "capability_key",
    "card_key",
    "decode_value_untrusted",
    "encode_value",
    "merge_records",
]
