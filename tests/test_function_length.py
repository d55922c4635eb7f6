"""No function longer than :data:`MAX_LINES` in the packages that keep to it.

A function is counted from its ``def`` line to the last line of its body
(decorators not included; its docstring and comments are). A longer one is
split at a real sub-step with a name that says what it does.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import p2pnode

PACKAGE = Path(p2pnode.__file__).parent

#: Most lines a function may take, ``def`` to the end of its body.
MAX_LINES = 60
#: The packages held to it (more join as they are cleaned).
CHECKED_PACKAGES = (
    "core", "agent", "transport", "dht", "crdt", "simnet",
    "node", "services", "runtime", "hosting", "bridges", "cli",
)  # fmt: skip


def too_long(source: str, filename: str, limit: int = MAX_LINES) -> list[str]:
    """``name:line (n lines)`` for each function of ``source`` longer than ``limit``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            lines = node.end_lineno - node.lineno + 1
            if lines > limit:
                found.append(f"{filename}:{node.lineno} {node.name} ({lines} lines)")
    return found


@pytest.mark.parametrize("package", CHECKED_PACKAGES)
def test_no_function_is_longer_than_the_limit(package: str) -> None:
    base = PACKAGE / package  # a package, or a module (runtime)
    files = sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
    assert files and all(p.is_file() for p in files), f"no modules in p2pnode/{package}"
    found = [
        hit
        for path in files
        for hit in too_long(path.read_text(encoding="utf-8"), str(path.relative_to(PACKAGE)))
    ]
    assert found == []


def test_the_count_runs_from_def_to_the_end_of_the_body() -> None:
    body = "".join(f"    x = {i}\n" for i in range(59))
    fits = f"@decorator\ndef fits():\n{body}"  # 60 lines with its def
    assert too_long(fits, "m.py") == []
    method_body = "".join(f"        x = {i}\n" for i in range(60))
    over = f"class C:\n    async def over(self):\n{method_body}"  # 61 lines
    assert too_long(over, "m.py") == ["m.py:2 over (61 lines)"]
