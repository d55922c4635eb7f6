"""The agent attach socket: agents in other processes, any language, over a local socket
(docs/protocol/agents.md). Its wire format (attach.wire) is public: the attach client speaks it.

May import: core, agent, transport, dht, crdt, node.service, node.limits,
services' public modules.
"""
