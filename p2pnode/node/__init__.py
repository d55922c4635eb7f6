"""The node: channels, routing, policy, observability, the composition of every layer."""
