"""Bridges to other agent protocols, one package each, as extras: mcp (p2pnode[mcp]),
a2a (p2pnode[a2a]).
A bridge hosts agents like any program, through the public interfaces and hosting.

May import: public interfaces, hosting. Never another bridge, never the CLI.
"""
