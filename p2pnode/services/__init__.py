"""Protocol services, each built on the kernel's service interface (node.service): shared
state, tasks, swarms, tools, the agent attach socket, metrics. The composition root
(p2pnode.runtime) builds them in order, shared, tasks, swarms, tools, attach, and hands
each the others it needs as protocols it declares.

May import: core, agent, transport, dht, crdt, node.service, node.limits,
services' public modules. Within a service, anything of its own.
A service's public modules are its package namespace (protocols, data types, constants)
and its protocol modules: attach.wire and shared.docops, sans-IO both.
"""
