"""The README's library example of joining runs as written and prints what the README
says it prints: two nodes that joined through a third find each other's agents."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def joining_block() -> str:
    text = README.read_text(encoding="utf-8")
    blocks: list[str] = re.findall(r"```python\n(.*?)```", text, re.S)
    found = [b for b in blocks if "hub.listen_address" in b and ".connect(" in b]
    assert len(found) == 1, "the README has one library example of joining through a hub"
    return found[0]


@pytest.mark.slow
def test_the_library_joining_example_finds_the_agent_through_the_hub(tmp_path: Path) -> None:
    script = tmp_path / "joining.py"
    script.write_text(joining_block(), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines == ["found ['io'] | joined, 2 peers", "io {'echo': {'run': 'all'}}"]
    text = README.read_text(encoding="utf-8")
    assert f"It prints `{lines[0]}` and `{lines[1]}`" in text
