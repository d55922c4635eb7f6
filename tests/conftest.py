"""Suite-wide rules.

Every test that opens a real socket or starts an OS process carries the ``slow``
marker (``pytest -m "not slow"`` is then the fast, deterministic suite). The
autouse fixture below holds unmarked tests to it: binding, connecting or sending
on a real socket, or starting a process, raises :class:`RealIOInAFastTest` and
fails the test even when the code under test swallows that error. Fixtures with a
wider scope than a function are set up before it and are not checked.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

SLOW = "slow"

# The suite runs on small shared machines (2 cores, often with other work): how fast
# hypothesis draws inputs there says nothing about the code, so neither a draw's
# speed nor an example's duration fails a test. What the properties assert is unchanged.
settings.register_profile(
    "shared-machine",
    suppress_health_check=[HealthCheck.too_slow],
    deadline=None,
)
settings.load_profile("shared-machine")

#: What a fast test may not call: (owner, attribute, description).
GUARDED: tuple[tuple[Any, str, str], ...] = (
    (socket.socket, "bind", "binds a real socket"),
    (socket.socket, "connect", "connects a real socket"),
    (socket.socket, "connect_ex", "connects a real socket"),
    (socket.socket, "sendto", "sends on a real socket"),
    (subprocess.Popen, "__init__", "starts an OS process"),
    (os, "fork", "forks an OS process"),
)


class RealIOInAFastTest(Exception):
    """A test without the ``slow`` marker opened a real socket or started a process."""


@pytest.fixture(autouse=True)
def real_io_tried(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[str]]:
    """In a test not marked ``slow``, real sockets and OS processes raise
    :class:`RealIOInAFastTest`; the test fails at teardown if it tried any."""
    tried: list[str] = []
    if request.node.get_closest_marker(SLOW) is not None:
        yield tried
        return
    for owner, name, what in GUARDED:
        monkeypatch.setattr(owner, name, _refusal(tried, what))
    yield tried
    if tried:
        pytest.fail(
            f"this test {', '.join(sorted(set(tried)))} but is not marked "
            f"@pytest.mark.{SLOW} (real sockets or OS processes)",
            pytrace=False,
        )


def _refusal(tried: list[str], what: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        tried.append(what)
        if args and isinstance(args[0], socket.socket):
            # Closed here: code that does not close a socket whose bind failed would
            # otherwise leak it into a later test's ResourceWarning.
            args[0].close()
        raise RealIOInAFastTest(f"a test not marked {SLOW} {what}")

    return refuse
