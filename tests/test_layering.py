"""The layers, per package: who may import whom, each package saying so in its docstring,
and sans-IO cores free of trio, sockets, sqlite3 and clock reads.

RULES below is the layer picture of docs/DESIGN.md ("The layers"); every package's
``__init__`` docstring ends its rule with the same tokens (``May import: ...``), and
test_every_package_docstring_states_its_rule holds the three to one another.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import p2pnode

PACKAGE = Path(p2pnode.__file__).parent
ROOT = PACKAGE.parent

# ---------------------------------------------------------------------------
# The import graph: every import statement of every module, wherever it sits
# (module level, functions, ``if TYPE_CHECKING:``), with its line.
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Import:
    """One imported module, named in one statement of one file."""

    path: str  #: the importing file, relative to the repository
    line: int
    importer: str  #: dotted module name of the importing file
    imported: str  #: dotted module name imported (a from-imported submodule counts as itself)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(name: str) -> bool:
    """Whether ``name`` is a module or package of p2pnode (not a name defined in one)."""
    if name != "p2pnode" and not name.startswith("p2pnode."):
        return False
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _from_base(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module a from-import names, relative imports resolved against the importer."""
    if node.level == 0:
        return node.module or ""
    parts = importer.split(".") if is_package else importer.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def imports_in_source(source: str, importer: str, path: str, is_package: bool) -> list[Import]:
    """Every module the source imports; ``from m import x`` names m.x when that is a module."""
    found: list[Import] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(path, node.lineno, importer, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(importer, is_package, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                target = sub if alias.name != "*" and is_module(sub) else base
                found.append(Import(path, node.lineno, importer, target))
    return found


@functools.cache
def package_imports() -> tuple[Import, ...]:
    found: list[Import] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += imports_in_source(
            path.read_text(),
            module_name(path),
            str(path.relative_to(ROOT)),
            is_package=path.name == "__init__.py",
        )
    return tuple(dict.fromkeys(found))  # one entry for ``from m import a, b``


# ---------------------------------------------------------------------------
# The rules. A unit is a top-level package or module of p2pnode, or one service
# (p2pnode.services.<name>) or one bridge (p2pnode.bridges.<name>). A module may
# import its own unit, and whatever its unit's tokens allow.
# ---------------------------------------------------------------------------

#: The token for "a service's public modules" (service_public()).
SERVICES_PUBLIC = "services' public modules"
#: The token for PUBLIC, the public interfaces.
PUBLIC_INTERFACES = "public interfaces"

#: Modules of one service that other services and the outer layers may import, besides
#: each service's package namespace (p2pnode.services.<name>, which re-exports only
#: protocols, data types and constants). Each is a protocol module, sans-IO (held to the
#: cores' rule below): what crosses a process boundary, not a service's driver. A service
#: uses another's behaviour only through a Protocol it declares itself, with the object
#: passed in by the composition root (p2pnode.runtime), never by importing its class.
SERVICE_PROTOCOLS = {
    # The attach socket's wire format, which the attach client (hosting.client) speaks.
    "p2pnode.services.attach.wire",
    # Documents' names, ops and values as JSON: what the attach and control sockets carry.
    "p2pnode.services.shared.docops",
}

#: What a service may take from the kernel. p2pnode.node.service is the service
#: interface (ServiceHost: identity, registry, sending, clock, events, hooks). Besides it,
#: only p2pnode.node.limits: sans-IO per-peer quotas and report gates that hold no kernel
#: state (a service holding work for peers needs the same bounds; a copy per service
#: would drift). Nothing else: routing, links, channels, observability and control stay
#: the kernel's, reached through ServiceHost.
SERVICE_KERNEL = ("node.service", "node.limits")

#: The library layers below the kernel: each a protocol library with its own public API.
LIBRARIES = ("core", "agent", "transport", "dht", "crdt")

#: The public interfaces, for hosting, bridges and the CLI: the p2pnode namespace, the
#: composition root, the library layers and the simulator, and of the kernel only the
#: modules a program outside it needs: the service interface (a bridge hosts agents on it),
#: the configuration and its policy part (NodeConfig), the control socket (a daemon's
#: server and its clients) and logging setup.
PUBLIC = (
    "p2pnode", "runtime", *LIBRARIES, "simnet",
    "node.service", "node.config", "node.policy", "node.control", "node.logs",
    SERVICES_PUBLIC,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Rule:
    what: str  #: the rule in words, for failure messages
    may: tuple[str, ...]  #: tokens: a package or module under p2pnode, "p2pnode", SERVICES_PUBLIC


RULES = {
    "core": Rule("the core imports no other layer", ()),
    "agent": Rule("agent definitions import the core only", ("core",)),
    "transport": Rule("the transport imports the core only", ("core",)),
    "simnet": Rule("the simulator imports the core and the transport", ("core", "transport")),
    "dht": Rule("the DHT imports the core and the transport", ("core", "transport")),
    "crdt": Rule("the CRDT layer imports the core only", ("core",)),
    "node": Rule(
        "the kernel imports the library layers only: no service, hosting, bridge or CLI",
        LIBRARIES,
    ),
    "services": Rule(
        "a service imports the library layers, of the kernel only its service interface"
        " (node.service, node.limits), and of another service only its public modules",
        (*LIBRARIES, *SERVICE_KERNEL, SERVICES_PUBLIC),
    ),
    "runtime": Rule(
        "the composition root imports the kernel, the services and the library layers",
        (*LIBRARIES, "node", "services"),
    ),
    "hosting": Rule("hosting uses public interfaces only", (PUBLIC_INTERFACES,)),
    "bridges": Rule(
        "a bridge uses public interfaces and hosting only, never another bridge",
        (PUBLIC_INTERFACES, "hosting"),
    ),
    "cli": Rule(
        "the CLI uses public interfaces, hosting and the bridges",
        (PUBLIC_INTERFACES, "hosting", "bridges"),
    ),
    "p2pnode": Rule(
        "the p2pnode namespace re-exports the layers up to hosting",
        (*LIBRARIES, "simnet", "node", "services", "runtime", "hosting"),
    ),
    "__main__": Rule("python -m p2pnode runs the CLI", ("p2pnode", "cli")),
}  # fmt: skip


def unit(module: str) -> str:
    """p2pnode.node.kernel -> node; p2pnode.services.tasks.service -> services.tasks."""
    parts = module.split(".")
    if len(parts) == 1:
        return "p2pnode"
    if parts[1] in ("services", "bridges") and len(parts) > 2:
        return ".".join(parts[1:3])
    return parts[1]


def rule_of(module: str) -> Rule:
    return RULES[unit(module).split(".")[0]]


def service_public() -> set[str]:
    services = PACKAGE / "services"
    namespaces = {
        module_name(p if p.suffix == ".py" else p / "__init__.py")
        for p in services.iterdir()
        if (p.suffix == ".py" and p.name != "__init__.py") or (p / "__init__.py").is_file()
    }
    return namespaces | SERVICE_PROTOCOLS


def allows(token: str, module: str) -> bool:
    if token == PUBLIC_INTERFACES:
        return any(allows(public, module) for public in PUBLIC)
    if token == SERVICES_PUBLIC:
        return module in service_public()
    if token == "p2pnode":
        return module == "p2pnode"
    target = f"p2pnode.{token}"
    return module == target or module.startswith(target + ".")


def broken_rule(imp: Import) -> Rule | None:
    """The rule this import breaks, or None: imports outside p2pnode are not layering."""
    outside = imp.imported != "p2pnode" and not imp.imported.startswith("p2pnode.")
    if outside or unit(imp.imported) == unit(imp.importer):
        return None
    rule = rule_of(imp.importer)
    if any(allows(token, imp.imported) for token in rule.may):
        return None
    return rule


def violations(imports: tuple[Import, ...]) -> list[tuple[Import, Rule]]:
    found = [(imp, broken_rule(imp)) for imp in imports]
    return [(imp, rule) for imp, rule in found if rule is not None]


#: Imports that break a rule while a move is under way (none now: the kernel builds no
#: service, and services, hosting, the bridges and the CLI use public interfaces). The
#: list can only shrink: a pair that no longer breaks a rule fails
#: test_pending_imports_still_occur until it is removed here.
PENDING: set[tuple[str, str]] = set()


def _describe(imp: Import, rule: Rule) -> str:
    return f"{imp.path}:{imp.line}: {imp.importer} imports {imp.imported}: {rule.what}"


def test_every_module_has_a_rule() -> None:
    missing = sorted(
        str(path.relative_to(ROOT))
        for path in PACKAGE.rglob("*.py")
        if unit(module_name(path)).split(".")[0] not in RULES
    )
    assert missing == [], "modules outside every layer rule (add them to RULES)"


def unexpected(imports: tuple[Import, ...], pending: set[tuple[str, str]]) -> list[str]:
    """Each import breaking its rule that ``pending`` does not list, described."""
    return [
        _describe(imp, rule)
        for imp, rule in violations(imports)
        if (imp.importer, imp.imported) not in pending
    ]


def stale(imports: tuple[Import, ...], pending: set[tuple[str, str]]) -> list[tuple[str, str]]:
    """The pairs of ``pending`` that no import breaking its rule makes any more."""
    occurring = {(imp.importer, imp.imported) for imp, _ in violations(imports)}
    return sorted(pending - occurring)


def test_every_import_keeps_its_layer_rule() -> None:
    new = unexpected(package_imports(), PENDING)
    assert new == [], "\n" + "\n".join(new)


def test_pending_imports_still_occur() -> None:
    gone = stale(package_imports(), PENDING)
    assert gone == [], f"no longer broken, remove from PENDING: {gone}"


def test_pending_excuses_only_its_pairs_and_only_while_they_occur() -> None:
    source = "from p2pnode.services.tasks.service import TaskService\nimport p2pnode.cli\n"
    imports = tuple(imports_in_source(source, "p2pnode.node.kernel", "k.py", False))
    pending = {
        ("p2pnode.node.kernel", "p2pnode.services.tasks.service"),
        ("p2pnode.node.kernel", "p2pnode.services.shared.service"),
    }
    assert unexpected(imports, pending) == [
        f"k.py:2: p2pnode.node.kernel imports p2pnode.cli: {RULES['node'].what}"
    ]
    assert stale(imports, pending) == [("p2pnode.node.kernel", "p2pnode.services.shared.service")]


def _broken(source: str, importer: str, is_package: bool = False) -> list[str]:
    imports = imports_in_source(source, importer, "x.py", is_package)
    return [_describe(imp, rule) for imp, rule in violations(tuple(imports))]


def test_the_rules_see_every_import_form_with_its_line() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import p2pnode.services.tasks.service as s\n"
        "from p2pnode.hosting import aio\n"
        "from ..cli.main import main\n"
        "if TYPE_CHECKING:\n"
        "    from p2pnode.bridges.mcp.names import tool_name\n"
        "def f() -> None:\n"
        "    from p2pnode.node import kernel, routing\n"
        "    from . import frames\n"
    )
    broken = _broken(source, "p2pnode.node.links")
    rule = RULES["node"].what
    assert broken == [
        f"x.py:2: p2pnode.node.links imports p2pnode.services.tasks.service: {rule}",
        f"x.py:3: p2pnode.node.links imports p2pnode.hosting.aio: {rule}",
        f"x.py:4: p2pnode.node.links imports p2pnode.cli.main: {rule}",
        f"x.py:6: p2pnode.node.links imports p2pnode.bridges.mcp.names: {rule}",
    ]


def test_a_service_may_use_the_service_interface_and_public_modules_only() -> None:
    allowed = (
        "from p2pnode.node.service import ServiceHost\n"
        "from p2pnode.node.limits import PeerQuota\n"
        "from p2pnode.services.shared.docops import op_from_json\n"
        "from p2pnode.services import shared\n"
        "import p2pnode.services.tasks\n"
        "from p2pnode.crdt.ops import Op\n"
    )
    assert _broken(allowed, "p2pnode.services.swarms.member") == []
    for line in (
        "from p2pnode.node.kernel import Kernel\n",
        "from p2pnode.services.shared.service import SharedState\n",
        "from p2pnode.services.tasks import negotiation\n",
        "from p2pnode.runtime import open_node\n",
        "from p2pnode.hosting.client import AgentClient\n",
    ):
        assert len(_broken(line, "p2pnode.services.swarms.member")) == 1, line
    # Inside one service, anything goes.
    own = "from p2pnode.services.swarms.plan import Plan\n"
    assert _broken(own, "p2pnode.services.swarms") == []


def test_outer_layers_use_public_interfaces_only() -> None:
    public = (
        "from p2pnode import Node\n"
        "from p2pnode.runtime import open_node\n"
        "from p2pnode.node.config import NodeConfig\n"
        "from p2pnode.services.attach.wire import Ref\n"
    )
    assert _broken(public, "p2pnode.hosting.aio") == []
    client = "from p2pnode.hosting.client import AgentClient\n"
    assert _broken(client, "p2pnode.bridges.mcp.serve") == []
    assert len(_broken("from p2pnode.node.routing import Handler\n", "p2pnode.hosting.aio")) == 1
    other_bridge = "from p2pnode.bridges.mcp import names\n"
    assert len(_broken(other_bridge, "p2pnode.bridges.a2a.gateway")) == 1
    assert len(_broken("from p2pnode.cli.main import main\n", "p2pnode.bridges.mcp.serve")) == 1
    assert len(_broken("from p2pnode.bridges.mcp import serve\n", "p2pnode.hosting.aio")) == 1


def test_the_rules_name_modules_that_exist() -> None:
    tokens = {t for rule in RULES.values() for t in rule.may} | set(PUBLIC)
    tokens -= {SERVICES_PUBLIC, PUBLIC_INTERFACES, "p2pnode"}
    assert sorted(t for t in tokens if not is_module(f"p2pnode.{t}")) == []
    assert sorted(m for m in SERVICE_PROTOCOLS if not is_module(m)) == []
    assert sorted(m for m, _ in PENDING if not is_module(m)) == []


# ---------------------------------------------------------------------------
# The tree: each package's docstring says what it is, then states its rule as
# "May import: <tokens>." with the tokens of RULES (or "nothing").
# ---------------------------------------------------------------------------

_MAY = re.compile(r"May import: (.*?)\.(?:\s|$)", re.DOTALL)


def stated_rule(docstring: str) -> tuple[str, ...] | None:
    found = _MAY.search(docstring)
    if found is None:
        return None
    text = " ".join(found.group(1).split())
    return () if text == "nothing" else tuple(t.strip() for t in text.split(","))


def packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)


@pytest.mark.parametrize("package", packages(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_package_docstring_states_its_rule(package: Path) -> None:
    init = package / "__init__.py"
    docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
    assert docstring.split("\n")[0].strip(), f"{init}: no first line saying what it is"
    stated = stated_rule(docstring)
    assert stated is not None, f"{init}: no 'May import: ...' sentence"
    expected = rule_of(module_name(init)).may
    assert sorted(stated) == sorted(expected), f"{init} says {stated}, RULES say {expected}"


def test_a_stated_rule_is_read_across_lines() -> None:
    doc = "The kernel.\n\nMay import: core, agent,\nnode.service, services' public modules. More.\n"
    assert stated_rule(doc) == ("core", "agent", "node.service", SERVICES_PUBLIC)
    assert stated_rule("The core.\n\nMay import: nothing. Third-party: msgpack.") == ()
    assert stated_rule("No rule here.") is None


# ---------------------------------------------------------------------------
# Sans-IO cores: no trio, sockets, sqlite3 or clock reads, not even by import.
# ---------------------------------------------------------------------------

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


@pytest.mark.parametrize("module", CORES + sorted(SERVICE_PROTOCOLS))
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
