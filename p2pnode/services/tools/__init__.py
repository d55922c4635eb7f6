"""Tools, resources and prompts: the owner's side (checks, audit) and the caller's.
"""
