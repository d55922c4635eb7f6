"""The agent attach socket: agents in other processes, any language, over a local socket.
"""
