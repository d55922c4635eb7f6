"""p2pnode: a peer-to-peer node for AI agents."""

from p2pnode.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.identity import Identity, PeerId

__all__ = ["ErrorCode", "Identity", "LocalError", "P2PError", "PeerId", "RemoteError"]

__version__ = "0.1.0"
