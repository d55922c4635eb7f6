"""The DHT node's tunables and counters (plain data, shared by the core and the driver)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DhtConfig:
    """Tunables; defaults follow Kademlia §2.3-§4 and the stock package (dht.md §7)."""

    k: int = 20
    alpha: int = 3
    rto_initial: float = 1.0
    rto_floor: float = 0.05
    rto_ceiling: float = 2.0
    rpc_hard_timeout: float = 5.0
    refresh_interval: float = 3600.0
    republish_interval: float = 1800.0
    maintenance_interval: float = 60.0
    record_ttl_ms: int = 2 * 3600 * 1000
    value_quorum: int = 3
    replacement_size: int = 8
    card_quorum: int = 1
    max_pending: int = 1024


@dataclass(slots=True)
class DhtStatistics:
    """Counters for benchmarks and tests."""

    rpcs_sent: int = 0
    rpcs_answered: int = 0
    rpcs_timed_out: int = 0
    requests_handled: int = 0
    datagrams_dropped: int = 0
    records_rejected: int = 0
    stores_rate_limited: int = 0
    #: Datagrams and looked-up values whose processing raised (contained, dropped).
    inputs_failed: int = 0


__all__ = ["DhtConfig", "DhtStatistics"]
