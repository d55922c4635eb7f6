"""The p2pnode command and its demo. Public interfaces only.
"""
