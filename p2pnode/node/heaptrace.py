"""A daemon's heap: large blocks handed back to the system, and opt-in growth reports.

:func:`return_large_blocks` fixes glibc's mmap threshold at 1 MiB. By default
glibc raises that threshold to the size of each large block freed (up to
32 MiB), after which blocks of that size come from the heap, whose free pages
are rarely given back: one flood of 4 MiB frames then left a daemon 140 MB
above its baseline for good (scripts/memory_attacks.py, notifications: RSS
after the flood 186 MB against 48 MB before; 80 MB with the threshold fixed).
Fixed, every block of 1 MiB or more is mapped on its own and unmapped when
freed. Elsewhere than glibc it does nothing.

Set ``P2PNODE_HEAP_TRACE`` to a file path before ``p2pnode run``: the daemon
then starts :mod:`tracemalloc` (``P2PNODE_HEAP_TRACE_FRAMES`` frames per
allocation, 6 by default) and a daemon thread that, every
``P2PNODE_HEAP_TRACE_EVERY`` seconds (60 by default), rewrites that file with
the heap's own figures (traced bytes now and at the peak; the RSS, and glibc's
bytes in use and free-but-kept beside it), the 25 allocation
sites that grew most since the first report (by bytes, with their tracebacks),
and the 25 object types whose live count grew most (``gc.get_objects``). The
first report is the baseline. Off by default: tracing costs the daemon about
a third of its speed and some memory, so it is for diagnosis runs only
(``scripts/soak.py --heap-trace DIR``).

The thread only reads: a snapshot and the object census run under the GIL,
between two bytecodes of the trio thread, and never touch the node's state.
"""

from __future__ import annotations

import ctypes
import gc
import linecache
import os
import threading
import tracemalloc
from collections import Counter
from pathlib import Path

__all__ = ["HEAP_TRACE_ENV", "LARGE_BLOCK", "HeapTrace", "return_large_blocks", "start_from_env"]

HEAP_TRACE_ENV = "P2PNODE_HEAP_TRACE"
_EVERY_ENV = "P2PNODE_HEAP_TRACE_EVERY"
_FRAMES_ENV = "P2PNODE_HEAP_TRACE_FRAMES"
TOP = 25
#: The reports' own allocations (snapshots, source lines read to print them).
_OWN = tuple(
    tracemalloc.Filter(False, path) for path in (tracemalloc.__file__, linecache.__file__, __file__)
)


#: Blocks of at least this many bytes are mapped on their own (see the module docstring).
LARGE_BLOCK = 1024 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def return_large_blocks(threshold: int = LARGE_BLOCK) -> bool:
    """Have glibc map blocks of ``threshold`` bytes or more on their own, so that freeing
    them returns their memory at once. Returns whether the allocator took the setting
    (False without glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own libc: no lookup
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, threshold))


def process_figures() -> str:
    """The process's resident memory and, with glibc, its allocator's own figures (bytes
    in use, and free but kept in the heap): RSS beside the heap, to tell a leak from
    pages the allocator keeps."""
    rss = "?"
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = f"{int(line.split()[1]) / 1024:.1f} MB"
    except OSError:
        pass
    info = _mallinfo()
    if info is None:
        return f"RSS {rss}"
    used, kept, mapped = info
    return (
        f"RSS {rss}; malloc in use {used / 2**20:.1f} MB, free but kept {kept / 2**20:.1f} MB,"
        f" mmapped {mapped / 2**20:.1f} MB"
    )


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                     "uordblks", "fordblks", "keepcost")
    ]  # fmt: skip


def _mallinfo() -> tuple[int, int, int] | None:
    """glibc's ``mallinfo2()``: (bytes in use, free bytes kept, mmapped bytes); None
    elsewhere."""
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2  # the process's own libc: no lookup
    except (OSError, AttributeError, TypeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return info.uordblks, info.fordblks, info.hblkhd


def type_census() -> Counter[str]:
    """Live objects tracked by the collector, counted by type name."""
    return Counter(type(o).__qualname__ for o in gc.get_objects())


class HeapTrace:
    """Writes a growth report to ``path`` every ``every`` seconds (see the module)."""

    def __init__(self, path: Path, every: float) -> None:
        self.path = path
        self.every = every
        self._stop = threading.Event()
        self._base: tracemalloc.Snapshot | None = None
        self._base_types: Counter[str] = Counter()
        self.reports = 0

    def report(self) -> str:
        """Take a snapshot and census; the report against the first one (the baseline)."""
        snapshot = tracemalloc.take_snapshot().filter_traces(_OWN)
        types = type_census()
        if self._base is None:
            self._base, self._base_types = snapshot, types
        current, peak = tracemalloc.get_traced_memory()
        lines = [
            f"report {self.reports}: traced {current / 2**20:.1f} MB, peak {peak / 2**20:.1f} MB,"
            f" tracing itself {tracemalloc.get_tracemalloc_memory() / 2**20:.1f} MB",
            process_figures(),
            f"top {TOP} growth since the first report, by bytes:",
        ]
        for stat in snapshot.compare_to(self._base, "traceback")[:TOP]:
            lines.append(f"{stat.size_diff / 1024:+10.1f} KiB {stat.count_diff:+8d} blocks")
            lines.extend(f"      {frame}" for frame in stat.traceback.format()[-12:])
        growth = Counter({k: v - self._base_types.get(k, 0) for k, v in types.items()})
        lines.append(f"top {TOP} object types by growth in count:")
        lines.extend(f"{count:+10d} {name}" for name, count in growth.most_common(TOP))
        self.reports += 1
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        """One report, written whole (a reader never sees half of one)."""
        text = self.report()
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(text)
        partial.replace(self.path)

    def _loop(self) -> None:
        while True:
            self.write()
            if self._stop.wait(self.every):
                return

    def start(self) -> None:
        """Start the reporting thread (a daemon thread: it never holds the process up)."""
        threading.Thread(target=self._loop, name="heap-trace", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()


def start_from_env(env: dict[str, str] | None = None) -> HeapTrace | None:
    """Start tracing and reporting when ``P2PNODE_HEAP_TRACE`` names a file; else None."""
    env = dict(os.environ) if env is None else env
    target = env.get(HEAP_TRACE_ENV)
    if not target:
        return None
    if not tracemalloc.is_tracing():
        tracemalloc.start(int(env.get(_FRAMES_ENV, "6")))
    trace = HeapTrace(Path(target), float(env.get(_EVERY_ENV, "60")))
    trace.start()
    return trace
