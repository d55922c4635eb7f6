"""Tasks: Contract Net negotiation (both sides) and task execution.
"""
