"""Bridges to other agent protocols, as extras: MCP (p2pnode[mcp]). Public interfaces only.
"""
