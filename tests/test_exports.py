"""The public namespace is what we mean it to be, and layers import only downwards."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import p2pnode

PACKAGE = Path(p2pnode.__file__).parent

# Layer of each top-level module or subpackage (DESIGN.md); a module may import
# only from its own layer or lower ones.
LAYERS = {
    "errors": 0, "jsonutil": 0, "boundary": 1, "wire": 1, "identity": 1, "datalock": 1,
    "card": 2, "card_rules": 2, "envelope": 2, "agent": 2, "registry": 2, "tools": 2, "a2a": 2,
    "cardfile": 2, "threadstore": 2,
    "toolschema": 2, "toolrecord": 2, "toolwire": 2, "toolaccess": 2, "task": 2, "taskwork": 2,
    "net": 3, "tcpstream": 3, "simnet": 3, "lifetime": 3,
    "noise": 4, "aead": 4, "framing": 4, "secure": 4, "channel": 4,
    "dht": 5, "crdt": 5,
    "node": 6, "aio": 6, "aioguest": 6, "aiohandoff": 6,
    "process": 7, "demo": 7, "demo_agent": 7, "cli_node": 7, "cli_tools": 7, "cli_tasks": 7,
    "demo_swarm": 7, "cli": 7,
    "client": 7, "clientlink": 7, "cli_mcp": 7, "mcpbridge": 7,
    "__main__": 8, "__init__": 8,
}  # fmt: skip


def test_public_names() -> None:
    assert set(p2pnode.__all__) == {
        "BROADCAST", "Agent", "AgentCard", "Capability", "Endpoint", "Envelope",
        "EnvelopeFactory", "ErrorCode", "Identity", "LocalError", "Message", "MessageType",
        "Metadata", "Node", "NodeConfig", "Origin", "P2PError", "PeerId", "Registry",
        "RemoteError", "RoutingResult", "SimNetwork", "Tier", "TrioNetwork", "open_node",
    }  # fmt: skip
    for name in p2pnode.__all__:
        value = getattr(p2pnode, name)
        assert value is not None
        if isinstance(value, type):
            assert value.__module__.startswith("p2pnode.")
    with pytest.raises(AttributeError):
        p2pnode.no_such_name  # noqa: B018


def _layer(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_every_module_has_a_layer_and_imports_downwards() -> None:
    for path in PACKAGE.rglob("*.py"):
        layer = _layer(path)
        assert layer in LAYERS, f"{path} has no layer"
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.startswith("p2pnode.")
            ):
                target = node.module.split(".")[1]
                assert LAYERS[target] <= LAYERS[layer], f"{path} imports {node.module}"
