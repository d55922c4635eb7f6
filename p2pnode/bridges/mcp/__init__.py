"""The MCP bridge: the swarm's tools for any MCP client, and any MCP server's tools for the
swarm (docs/protocol/mcp.md). Needs the official MCP SDK: ``pip install 'p2pnode[mcp]'``.

* :mod:`p2pnode.bridges.mcp.serve` is an MCP server (``p2pnode mcp serve``) that
  attaches to the local node as one agent and offers every tool, resource and
  prompt that agent may use in the swarm.
* :mod:`p2pnode.bridges.mcp.mirror` builds a :class:`~p2pnode.agent.definition.Agent` whose
  catalog forwards to an MCP server it is connected to, and
  :mod:`p2pnode.bridges.mcp.supervise` runs such a server as a child process,
  publishes its agent while it lives and restarts it with backoff
  (``p2pnode mcp publish`` and ``p2pnode run --mcp-server``).
* :mod:`p2pnode.bridges.mcp.names` is the SDK-free part: names and errors across
  the bridge.

Only the ``mcp`` commands import the modules that import the SDK, so the core
package never needs it; :func:`require_sdk` turns its absence into one line.

May import: public interfaces, hosting.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from p2pnode.core.errors import ErrorCode, LocalError

#: What a command says when the SDK is missing.
MISSING_SDK = "the MCP bridge needs the mcp extra: pip install 'p2pnode[mcp]'"
#: The SDK's major version the bridge is written for (its 1.x API differs).
SDK_MAJOR = 2


def require_sdk() -> None:
    """Raise LocalError(CONFIG_ERROR) naming the extra when the MCP SDK is not installed,
    or is of another major version than the bridge's."""
    if importlib.util.find_spec("mcp") is None:
        raise LocalError(ErrorCode.CONFIG_ERROR, MISSING_SDK)
    try:
        version = importlib.metadata.version("mcp")
    except importlib.metadata.PackageNotFoundError:
        return  # an SDK on the path without metadata (a source checkout): trusted as is
    if version.split(".")[0] != str(SDK_MAJOR):
        raise LocalError(
            ErrorCode.CONFIG_ERROR,
            f"the MCP bridge needs mcp {SDK_MAJOR}.x, not {version}: pip install -U 'p2pnode[mcp]'",
        )


__all__ = ["MISSING_SDK", "require_sdk"]
