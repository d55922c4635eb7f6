"""Hosting an agent outside a trio program: an asyncio program (trio's guest mode) or
another process attached through the node's socket. Public interfaces only.
"""
