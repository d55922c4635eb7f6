"""Swarms: a plan shared out among agents, coordinated through a CRDT document.
"""
