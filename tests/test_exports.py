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
    "core": 1, "agent": 2, "transport": 3, "simnet": 3, "dht": 5, "crdt": 5,
    # The kernel knows no service; the composition root (runtime) builds them.
    "node": 6, "services": 7, "runtime": 8, "hosting": 9, "bridges": 10, "cli": 11,
    "__main__": 12, "__init__": 12,
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
