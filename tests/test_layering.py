"""Sans-IO cores stay sans-IO: no trio, sockets, sqlite3 or clock reads, not even by import."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import p2pnode

PACKAGE = Path(p2pnode.__file__).parent

#: Protocol cores: bytes, events and ``now`` in; no I/O and no clock of their own.
CORES = [
    "p2pnode.dht.admission",
    "p2pnode.dht.config",
    "p2pnode.dht.handlers",
    "p2pnode.dht.lookup",
    "p2pnode.dht.records",
    "p2pnode.dht.rejoin",
    "p2pnode.dht.routing",
    "p2pnode.dht.rpc",
    "p2pnode.dht.rpcwire",
    "p2pnode.dht.snapshot",
    "p2pnode.crdt.clock",
    "p2pnode.crdt.delta",
    "p2pnode.crdt.dots",
    "p2pnode.crdt.frames",
    "p2pnode.crdt.gossip",
    "p2pnode.crdt.ops",
    "p2pnode.crdt.plumtree",
    "p2pnode.crdt.replica",
    "p2pnode.crdt.signing",
    "p2pnode.crdt.simulate",
    "p2pnode.crdt.types",
    "p2pnode.agent.task",
    "p2pnode.agent.taskwork",
    "p2pnode.services.tasks.negotiation",
    "p2pnode.services.swarms.plan",
    "p2pnode.services.swarms.document",
    "p2pnode.services.swarms.coordinator",
]
#: Modules a core must not import: the I/O layers and the clock.
FORBIDDEN = {"trio", "socket", "sqlite3", "time"}
#: Modules that loading a core (or a core package's namespace) must not load.
NOT_LOADED = ("trio", "sqlite3")


def _path(module: str) -> Path:
    return PACKAGE.joinpath(*module.split(".")[1:]).with_suffix(".py")


def _imported(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", CORES)
def test_a_core_imports_no_io_and_no_clock(module: str) -> None:
    tree = ast.parse(_path(module).read_text())
    bad = {name for name in _imported(tree) if name.split(".")[0] in FORBIDDEN}
    assert not bad, f"{module} imports {sorted(bad)}"


def test_the_forbidden_import_check_sees_every_form() -> None:
    tree = ast.parse("import time\nimport trio.lowlevel as t\nfrom sqlite3 import connect\n")
    assert _imported(tree) == {"time", "trio.lowlevel", "sqlite3"}


def _loaded_after(modules: list[str]) -> dict[str, list[str]]:
    """For each module in turn, in one fresh interpreter: which of NOT_LOADED it loaded."""
    script = (
        "import importlib, json, sys\n"
        f"watch = {list(NOT_LOADED)!r}\n"
        "out = {}\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "    out[name] = [w for w in watch if w in sys.modules]\n"
        "print(json.dumps(out))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=PACKAGE.parent,
    )
    result: dict[str, list[str]] = json.loads(done.stdout)
    return result


@pytest.mark.slow
@pytest.mark.parametrize(
    "entry", ["p2pnode.dht.routing", "p2pnode.dht", "p2pnode.crdt.gossip", "p2pnode.crdt"]
)
def test_importing_a_core_package_loads_no_driver(entry: str) -> None:
    assert _loaded_after([entry]) == {entry: []}


@pytest.mark.slow
def test_no_core_loads_a_driver_transitively() -> None:
    loaded = _loaded_after(CORES)
    assert {name: found for name, found in loaded.items() if found} == {}


@pytest.mark.slow
def test_the_drivers_do_load_trio() -> None:
    # The check above would pass vacuously if nothing could load trio at all.
    assert _loaded_after(["p2pnode.dht.peer", "p2pnode.crdt.store"]) == {
        "p2pnode.dht.peer": ["trio"],
        "p2pnode.crdt.store": ["trio", "sqlite3"],
    }
