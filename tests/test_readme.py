"""The README's Python code blocks run as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def test_the_readme_has_python_examples() -> None:
    assert python_blocks()


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_block_runs(index: int, tmp_path: Path) -> None:
    script = tmp_path / f"block{index}.py"
    script.write_text(python_blocks()[index], encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert done.stdout.strip(), "each example prints what it did"


def _block_after(heading: str) -> str:
    """The first Python block of the README section ``heading``."""
    section = README.read_text(encoding="utf-8").split(f"\n### {heading}\n", 1)[1]
    blocks: list[str] = re.findall(r"```python\n(.*?)```", section, re.S)
    return blocks[0]


@pytest.mark.slow
def test_the_simulated_swarm_block_runs_as_written(tmp_path: Path) -> None:
    script = tmp_path / "swarm.py"
    script.write_text(_block_after("A swarm in the simulator"), encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    found, answers = done.stdout.splitlines()
    assert found == "found " + str([f"worker-{i}" for i in range(1, 8)])
    # Seven one-second jobs in parallel: one virtual second and the network's latency.
    results, _, seconds = answers.partition(" in ")
    assert results == "[4, 9, 16, 25, 36, 49, 64]"
    assert seconds.endswith(" virtual s") and 1.0 < float(seconds.split()[0]) < 1.2
    # What the README says it prints (the hundredths vary with the random keys).
    assert f"`{results} in 1.0" in README.read_text(encoding="utf-8")
