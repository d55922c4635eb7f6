"""Local Unix stream sockets that only the owner of the process may connect to.

The control socket (:mod:`p2pnode.node.control`) and the agent attach socket
(:mod:`p2pnode.services.attach.service`) both listen on one in the data directory: the
file's mode (0600, set by the umask before ``bind``) is their access control.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import trio


def listen_owner_only(path: Path, backlog: int = 16) -> trio.SocketListener:
    """A Unix stream socket listening at ``path`` with mode 0600 (only the owner may
    connect), replacing what is there: the data directory's lock says no other
    daemon uses it. Raises OSError."""
    if path.exists() or path.is_symlink():
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)  # created 0600: no moment in which others may connect
    try:
        sock.bind(str(path))
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
    os.chmod(path, 0o600)
    sock.listen(backlog)
    return trio.SocketListener(trio.socket.from_stdlib_socket(sock))


__all__ = ["listen_owner_only"]
