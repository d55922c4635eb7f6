"""The kernel: links and secure channels to peers, routing and its decisions, the inbox,
replies, policy, limits, observability, the control socket, DHT discovery, the
configuration and the service interface (node.service) that services are built on. It
knows no service: the composition root (p2pnode.runtime) builds them on it.

May import: core, agent, transport, dht, crdt.
"""
