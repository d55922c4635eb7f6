"""Suite-wide rules.

Every test that opens a real socket or starts an OS process carries the ``slow``
marker (``pytest -m "not slow"`` is then the fast, deterministic suite). The
autouse fixture below holds unmarked tests to it: binding, connecting or sending
on a real socket, or starting a process, raises :class:`RealIOInAFastTest` and
fails the test even when the code under test swallows that error. Fixtures with a
wider scope than a function are set up before it and are not checked.

``pytest -q`` runs on every core (pytest-xdist, ``-n auto --dist loadgroup``):
:data:`GROUPS` keeps tests that must not overlap on one worker, one after another, and
:data:`FIRST` starts the longest tests first, so no worker is left running one of them
alone at the end.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
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


def _cache_bytecode_outside_the_tree() -> None:
    """With PYTHONDONTWRITEBYTECODE set (no ``__pycache__`` in the checkout), every
    interpreter the suite starts (each daemon, each ``p2pnode`` command) would compile the
    whole package from source again: about half a second of CPU per process. Instead the
    compiled modules go to one temporary directory for the run (PYTHONPYCACHEPREFIX),
    shared by this process, the xdist workers and every process they start, and removed
    at the end. What any test runs is the same code; only its compilation is shared."""
    if not os.environ.get("PYTHONDONTWRITEBYTECODE") or os.environ.get("PYTHONPYCACHEPREFIX"):
        return  # bytecode is cached already (in the tree), or a parent run set this up
    prefix = tempfile.mkdtemp(prefix="p2pnode-test-bytecode-")
    atexit.register(shutil.rmtree, prefix, ignore_errors=True)
    os.environ["PYTHONPYCACHEPREFIX"] = prefix
    del os.environ["PYTHONDONTWRITEBYTECODE"]
    sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False


_cache_bytecode_outside_the_tree()

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


#: Tests that must not run at the same time as each other (on two xdist workers): each
#: group runs on one worker, one test after another. Keyed by node id prefix.
GROUPS: dict[str, str] = {
    # Each lists the host's network namespaces before and after its swarm and wants the
    # same list back: a second test making namespaces meanwhile would break that.
    "tests/test_netns.py": "netns",
    # Floods against a real daemon that bound its RSS, its table or its admissions and
    # wait for it to settle: two floods at once on 2 cores starve both daemons, and the
    # time to settle then measures the other flood, not the code.
    "tests/test_memory_attacks.py": "floods",
    "tests/test_conn_limits.py::test_junk_connection_floods_do_not_grow_the_daemon": "floods",
    "tests/dht/test_flood_loopback.py": "floods",
    "tests/test_hostile_processes.py::test_more_connections_than_file_descriptors": "floods",
    # Both fuzz the CRDT decoders with the same large signed seeds (scripts/fuzz_seeds.py
    # bulk_crdt_seeds, cached per process), which take seconds of CPU to build: on one
    # worker they are built once.
    "tests/test_fuzz.py::test_entry_point_holds[crdt.delta]": "crdt-seeds",
    "tests/test_fuzz.py::test_entry_point_holds[crdt.sealed]": "crdt-seeds",
}

#: The longest tests (a parallel run's --durations on a loaded 2-core machine: 40-190 s
#: each), longest first, by node id prefix, started before everything else. A test not listed keeps
#: its place; a list entry that matches nothing costs nothing.
FIRST: tuple[str, ...] = (
    "tests/test_swarms_sim.py::test_50_agents_on_20_nodes_complete_500_subtasks",
    "tests/test_netns.py",
    "tests/test_memory_attacks.py",
    "tests/dht/test_flood.py::test_silent_flood_leaves_the_table_as_it_was",
    "tests/test_crdt_sim.py::test_hundred_nodes_loss_partition_heal_converge",
    "tests/dht/test_swarm_sim.py::test_lookups_survive_killing_a_fifth",
    "tests/test_node_frames.py::test_merged_frames_deliver_the_same_in_the_same_order",
    "tests/dht/test_swarm_sim.py::test_every_provider_found_without_churn",
    "tests/test_shared_sim.py::test_swarm_converges_through_partition_kills_and_restarts",
    "tests/test_tools.py::test_p18_a_catalog_lists_exactly_the_tools_registered",
    "tests/test_presence_swarm.py",
    "tests/test_fuzz.py::test_entry_point_holds[crdt.gossip]",
    "tests/test_mcp_passthrough_processes.py",
    "tests/test_nat_matrix.py",
    "tests/test_nat_sim_swarm.py",
    "tests/test_mcp_processes.py",
    "tests/dht/test_flood.py",
    "tests/test_demo_swarm.py",
    "tests/test_shared_kill.py",
    "tests/test_restart_processes.py",
    "tests/test_integration_processes.py",
    "tests/dht/test_swarm_sim.py",
    "tests/test_cli_tasks.py",
)


def _rank(nodeid: str) -> int:
    for rank, prefix in enumerate(FIRST):
        if nodeid.startswith(prefix):
            return rank
    return len(FIRST)


# tryfirst: the markers are in place before xdist's worker reads them (it appends each
# test's group to its node id).
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark :data:`GROUPS`' tests with their ``xdist_group``; put :data:`FIRST` first."""
    for item in items:
        for prefix, group in GROUPS.items():
            if item.nodeid.startswith(prefix):
                item.add_marker(pytest.mark.xdist_group(group))
    # Stable: each test not in FIRST keeps its order relative to the others.
    items.sort(key=lambda item: _rank(item.nodeid))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """In an xdist worker, give each grouped test the ``@GROUP`` suffix of its node id by
    which the scheduler keeps a group on one worker.

    pytest-xdist writes that suffix to ``item._nodeid``, which pytest 9.2 no longer reads
    (an item's id is ``item._id``): without this every group would be scattered over the
    workers like any other test. Runs before the worker reports its collection; a no-op
    where xdist's own suffix took effect."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for item in session.items:
        names = {
            str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
            for mark in item.iter_markers("xdist_group")
        }
        suffix = "@" + "_".join(sorted(names))
        node_id = getattr(item, "_id", None)
        if names and node_id is not None and not item.nodeid.endswith(suffix):
            item._id = type(node_id).parse(item.nodeid + suffix)
