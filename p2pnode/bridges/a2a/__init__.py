"""The A2A gateway: the swarm's agents for any A2A 1.0 client (docs/protocol/a2a.md).
Needs the official SDK: ``pip install 'p2pnode[a2a]'``.

* :mod:`p2pnode.bridges.a2a.gateway` serves one A2A agent per swarm agent that the
  gateway's acting agent may discover (JSON-RPC and HTTP+JSON bindings, an
  AgentCard at each agent's well-known path, an index), each message a request
  to the owning agent through the gateway's node.
* :mod:`p2pnode.bridges.a2a.push` is the gateway's push notifications: the
  configs of its tasks and the delivery of their events to the webhooks.
* :mod:`p2pnode.bridges.a2a.publish` and :mod:`p2pnode.bridges.a2a.supervise` are
  the other direction (``a2a publish``): an A2A server as one agent of the swarm,
  kept published while it answers.
* :mod:`p2pnode.bridges.a2a.mapping` is the SDK-free part: parts and payloads,
  errors and A2A outcomes, and their inverse for published servers.

Only the ``a2a`` command imports the modules that import the SDK, so the core
package never needs it; :func:`require_sdk` turns its absence into one line.

May import: public interfaces, hosting.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

from p2pnode.core.errors import ErrorCode, LocalError

#: What a command says when the SDK is missing.
MISSING_SDK = "the A2A gateway needs the a2a extra: pip install 'p2pnode[a2a]'"
#: The SDK version the gateway is written for.
SDK_VERSION = "1.3"


def require_sdk() -> None:
    """Raise LocalError(CONFIG_ERROR) naming the extra when the A2A SDK (or uvicorn) is
    not installed, or is of another minor version than the gateway's."""
    if importlib.util.find_spec("a2a") is None or importlib.util.find_spec("uvicorn") is None:
        raise LocalError(ErrorCode.CONFIG_ERROR, MISSING_SDK)
    try:
        version = importlib.metadata.version("a2a-sdk")
    except importlib.metadata.PackageNotFoundError:
        return  # an SDK on the path without metadata (a source checkout): trusted as is
    if ".".join(version.split(".")[:2]) != SDK_VERSION:
        raise LocalError(
            ErrorCode.CONFIG_ERROR,
            f"the A2A gateway needs a2a-sdk {SDK_VERSION}.x, not {version}: "
            "pip install 'p2pnode[a2a]'",
        )


__all__ = ["MISSING_SDK", "require_sdk"]
