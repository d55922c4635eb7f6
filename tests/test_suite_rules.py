"""Rules of the test suite itself: unique test file names, the helper package's
namespace, :func:`tests.sim.wait_until`, and the check that real sockets and
processes appear only in tests marked ``slow`` (tests/conftest.py)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import trio

import tests.sim
from tests.conftest import FIRST, GROUPS, RealIOInAFastTest
from tests.sim import wait_until

TESTS = Path(__file__).resolve().parent


def test_no_two_test_files_share_a_name() -> None:
    # Two test_x.py in different folders make `-k`, tracebacks and reports ambiguous.
    where: dict[str, list[str]] = defaultdict(list)
    for pattern in ("test_*.py", "*_test.py"):
        for path in TESTS.rglob(pattern):
            where[path.name].append(str(path.relative_to(TESTS)))
    assert where, "no test files found"
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}


def test_the_helper_package_exports_what_it_documents() -> None:
    public = {name for name in vars(tests.sim) if not name.startswith("_")}
    # Its modules (an attribute once anything imported them), whatever they are named.
    modules = {path.stem for path in (TESTS / "sim").glob("*.py")}
    assert public - modules == set(tests.sim.__all__)
    for name in tests.sim.__all__:
        # Constants are plain values; every function and class lives in a module of the package.
        assert name.isupper() or getattr(tests.sim, name).__module__.startswith("tests.sim.")


async def test_wait_until_returns_once_the_condition_holds(autojump_clock: Any) -> None:
    start = trio.current_time()
    await wait_until(lambda: True)
    assert trio.current_time() == start  # no sleep when it already holds
    ready = trio.Event()

    async def later() -> None:
        await trio.sleep(0.42)
        ready.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(later)
        await wait_until(ready.is_set, interval=0.1)
    assert 0.42 <= trio.current_time() - start <= 0.42 + 0.1 + 1e-9


async def test_wait_until_names_what_never_came(autojump_clock: Any) -> None:
    start = trio.current_time()
    polls: list[float] = []

    def never() -> bool:
        polls.append(trio.current_time())
        return False

    with pytest.raises(trio.TooSlowError, match="never"):
        await wait_until(never, 2.0, interval=0.5)
    assert trio.current_time() - start == pytest.approx(2.0)
    assert len(polls) == 2.0 / 0.5 + 1 + 1  # every interval, at the deadline, once more
    # A lambda is named by its source line: the condition as the test wrote it.
    with pytest.raises(trio.TooSlowError, match=r"lambda: polls == \[\]"):
        await wait_until(lambda: polls == [], 0.1)
    with pytest.raises(ValueError, match="interval"):
        await wait_until(never, 1.0, interval=0)


def test_a_fast_test_may_not_open_a_real_socket(real_io_tried: list[str]) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        with pytest.raises(RealIOInAFastTest):
            sock.bind(("127.0.0.1", 0))
        with pytest.raises(RealIOInAFastTest):
            sock.connect(("127.0.0.1", 9))
        with pytest.raises(RealIOInAFastTest):
            subprocess.run([sys.executable, "-c", "pass"], check=True)
    finally:
        sock.close()
    assert real_io_tried == [
        "binds a real socket",
        "connects a real socket",
        "starts an OS process",
    ]
    real_io_tried.clear()  # tried on purpose: not a failure of this test


@pytest.mark.slow
def test_a_slow_test_may(real_io_tried: list[str]) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        assert sock.getsockname()[1] > 0
    assert real_io_tried == []


def test_the_parallel_schedule_names_existing_tests() -> None:
    # tests/conftest.py's GROUPS keep tests that must not overlap on one xdist worker,
    # and FIRST starts the longest first: an entry naming a file that moved or went
    # would silently stop doing either.
    root = TESTS.parent
    for prefix in [*GROUPS, *FIRST]:
        path, _, test = prefix.partition("::")
        assert (root / path).is_file(), prefix
        if test:  # a parametrized test's id names its parameters in brackets
            name = test.partition("[")[0]
            assert f"def {name}(" in (root / path).read_text(encoding="utf-8"), prefix
    assert GROUPS["tests/test_netns.py"] == "netns"
