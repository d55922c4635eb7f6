"""Hosting an agent outside a trio program: an asyncio program (aio.AioNode, on trio's
guest mode) or another process attached through the node's agent socket
(client.AgentClient).

May import: public interfaces.

The public interfaces: the p2pnode namespace, the composition root p2pnode.runtime, the
library layers (core, agent, transport, dht, crdt) and simnet; of the kernel node.service,
node.config, node.policy, node.control and node.logs; services' public modules.
"""
