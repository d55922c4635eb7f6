"""Kademlia DHT: routing table, iterative lookups, UDP RPC and signed records."""
