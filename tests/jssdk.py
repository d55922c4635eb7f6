"""Where an npm-installed JavaScript SDK is for the tests that run official JS clients:
a node_modules directory named by an environment variable (.ci/run installs them)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest


def needs_js_sdk(variable: str, package: str) -> tuple[pytest.MarkDecorator, str, Path]:
    """The skip mark (with a NOT RUN reason) for a test needing ``node`` and ``package``
    in the node_modules directory ``$variable`` names, and, when present, both paths."""
    modules = os.environ.get(variable)
    path = Path(modules) if modules else None
    if path is not None and not (path / package / "package.json").exists():
        path = None
    node = shutil.which("node")
    mark = pytest.mark.skipif(
        node is None or path is None,
        reason=f"NOT RUN: needs node and {package}; set {variable} to a node_modules "
        f"directory holding it (npm install {package})",
    )
    return mark, node or "", path or Path()
