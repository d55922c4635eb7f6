"""Protocol services, each on the node's service interface (p2pnode.node.service) and
the layers below the node: shared state, tasks, swarms, tools, the agent attach socket,
metrics. The composition root (p2pnode.node.runtime.open_node) builds them in order.
"""
