"""The transport: the network interface (TCP and UDP on trio), the Noise handshake and
transport, framing, the AEAD backends and the secure channel.

May import: core.
"""
