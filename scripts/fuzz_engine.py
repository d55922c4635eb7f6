"""The fuzzer's engine: the entry-point table types, the drivers and the reports.

Theory of operation. An entry point is a small object: a name, a generator
(seeded ``random.Random`` in, one input out) and a runner. Plain parsers are
:class:`Entry` objects whose runner is synchronous and may raise only the
entry's expected error type (the project's ``RemoteError`` for ``_untrusted``
functions). Live handlers are :class:`LiveEntry` objects: their runner is an
async harness opened once over the in-memory simulator; nothing may escape
it, and the failure boundaries it names must count no unexpected exception.

Every entry point draws its inputs from its own ``random.Random`` seeded by
``(seed, name)``, so ``--only NAME`` replays exactly the inputs of a full run.

The drivers fail an entry point on any exception that is not the expected
type, on any single input slower than :attr:`Limits.slow_seconds`, and on
memory growth between the end of a warm-up and the end of the run (resident
set size and the interpreter's count of allocated blocks, both after a full
garbage collection). For each unexpected exception type the shortest failing
input is kept and, for byte inputs, shrunk.
"""

from __future__ import annotations

import gc
import logging
import random
import signal
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import trio
from fuzz_mutate import Generator

from p2pnode.core.boundary import FailureBoundary
from p2pnode.core.errors import P2PError, RemoteError


@dataclass(frozen=True, slots=True)
class Limits:
    """What fails an entry point besides an exception of the wrong type."""

    #: Any single input slower than this, in CPU seconds of this process (for a live
    #: handler, every task's work while the input is fed): a busy machine does not fail a
    #: run, and a stuck input is the watchdog's (real time, :attr:`hang_seconds`).
    slow_seconds: float = 1.0
    #: Growth from the end of the warm-up to the end (after ``gc.collect()``): resident
    #: set size, and blocks the interpreter holds (``sys.getallocatedblocks()``). A live
    #: node's bounded caches fill during a run and count here: its 10,000 conversation
    #: threads alone reach about 280,000 blocks, full after some 70,000 inputs, and stay
    #: there (measured to 130,000). A leak of one envelope per input exceeds the limit
    #: within the default run.
    max_rss_growth: int = 64 * 1024 * 1024
    max_block_growth: int = 400_000
    #: Seconds after which an entry point stops early (a note, not a failure).
    budget: float = 1800.0
    #: Seconds after which one input is interrupted (InputHung): a hang fails, not stalls.
    hang_seconds: float = 60.0


DEFAULT_LIMITS = Limits()
#: Inputs processed before the memory baseline is taken.
WARMUP_FRACTION = 0.1
#: Failing inputs kept per exception type (the shortest wins), and shrinking effort.
MAX_SHRINK_ATTEMPTS = 400
MAX_SHRINK_SECONDS = 5.0


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True, slots=True)
class Entry:
    """A synchronous parser: ``run(input)`` may raise only ``expected``."""

    name: str
    generate: Generator
    run: Callable[[Any], object]
    expected: type[BaseException] = RemoteError
    #: Share of ``--n`` this entry point runs (expensive ones run fewer inputs).
    share: float = 1.0


class Harness(Protocol):
    """An opened live handler: feeds one input; names the boundaries to watch."""

    async def feed(self, data: Any) -> None: ...

    def boundaries(self) -> dict[str, FailureBoundary]: ...

    def outcomes(self) -> dict[str, int]:
        """What the handler did with the inputs (its own counters), for the report."""
        ...


@dataclass(frozen=True, slots=True)
class LiveEntry:
    """An async handler on the simulator: nothing may escape ``feed`` and every
    boundary's ``stats.unexpected`` must stay empty."""

    name: str
    generate: Generator
    open: Callable[[], AbstractAsyncContextManager[Harness]]
    share: float = 1.0


Target = Entry | LiveEntry


# --------------------------------------------------------------------------- reports


@dataclass(slots=True)
class Failure:
    """The shortest input seen for one unexpected exception type, and where it was raised."""

    kind: str
    data: Any
    where: str
    message: str


@dataclass(slots=True)
class Report:
    name: str
    limits: Limits = field(default_factory=Limits)
    inputs: int = 0
    seconds: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    failures: dict[str, Failure] = field(default_factory=dict)
    slowest: float = 0.0
    slowest_input: Any = None
    rss_growth: int = 0
    block_growth: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def slow(self) -> bool:
        return self.slowest > self.limits.slow_seconds

    @property
    def leaked(self) -> bool:
        limits = self.limits
        return (
            self.rss_growth > limits.max_rss_growth or self.block_growth > limits.max_block_growth
        )

    @property
    def ok(self) -> bool:
        return not self.failures and not self.slow and not self.leaked

    def problems(self) -> list[str]:
        out = [
            f"{f.kind} at {f.where}: {f.message} | input {describe_input(f.data)}"
            for f in self.failures.values()
        ]
        if self.slow:
            slow = f"slow input ({self.slowest:.2f} CPU s)"
            out.append(f"{slow}: {describe_input(self.slowest_input)}")
        if self.leaked:
            out.append(
                f"memory grew {self.rss_growth / 2**20:.1f} MiB RSS, "
                f"{self.block_growth} blocks after warm-up"
            )
        return out + self.notes


def describe_input(data: Any, limit: int = 600) -> str:
    text = f"hex {bytes(data).hex()}" if isinstance(data, bytes | bytearray) else repr(data)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def outcome_key(exc: BaseException) -> str:
    if isinstance(exc, P2PError):
        return f"{type(exc).__name__}:{exc.code}"
    return type(exc).__name__


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "?"
    last = frames[-1]
    return f"{Path(last.filename).name}:{last.lineno} ({last.name})"


def record_failure(report: Report, exc: BaseException, data: Any) -> None:
    kind = type(exc).__name__
    held = report.failures.get(kind)
    if held is None or _size(data) < _size(held.data):
        report.failures[kind] = Failure(kind, data, _where(exc), str(exc)[:200])


def _size(data: Any) -> int:
    return len(data) if isinstance(data, bytes | bytearray | str) else len(repr(data))


# --------------------------------------------------------------------------- memory


def rss_bytes() -> int:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * 4096


@dataclass(slots=True)
class MemoryProbe:
    rss: int = 0
    blocks: int = 0

    def take(self) -> None:
        gc.collect()
        self.rss = rss_bytes()
        self.blocks = sys.getallocatedblocks()

    def growth_since(self, earlier: MemoryProbe) -> tuple[int, int]:
        return self.rss - earlier.rss, self.blocks - earlier.blocks


def count_for(target: Target, n: int) -> int:
    return max(1, round(n * target.share))


# --------------------------------------------------------------------------- hangs


class InputHung(Exception):
    """Raised into an input that ran past :attr:`Limits.hang_seconds` of real time."""


class Watchdog:
    """Interrupts one input with :class:`InputHung` after ``seconds`` (SIGALRM), so a hang
    fails its entry point instead of stalling the run. A no-op off the main thread,
    where signal handlers cannot be set."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._active = False

    def _fire(self, signum: int, frame: object) -> None:
        raise InputHung(f"the input ran past {self.seconds:.0f} s")

    @contextmanager
    def installed(self) -> Iterator[Watchdog]:
        try:
            previous = signal.signal(signal.SIGALRM, self._fire)
        except ValueError:
            yield self
            return
        self._active = True
        try:
            yield self
        finally:
            self._active = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    def arm(self) -> None:
        if self._active:
            signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def disarm(self) -> None:
        if self._active:
            signal.setitimer(signal.ITIMER_REAL, 0)


# --------------------------------------------------------------------------- the sync driver


def run_entry(entry: Entry, count: int, seed: int, limits: Limits = DEFAULT_LIMITS) -> Report:
    """Feed ``entry`` ``count`` generated inputs (fewer if it runs past ``limits.budget``)."""
    rng = random.Random(f"{seed}:{entry.name}")
    report = Report(entry.name, limits)
    warmup = max(1, int(count * WARMUP_FRACTION))
    base, end = MemoryProbe(), MemoryProbe()
    start = time.perf_counter()
    with Watchdog(limits.hang_seconds).installed() as watchdog:
        for i in range(count):
            if i == warmup:
                base.take()
            data = entry.generate(rng)
            t0 = time.process_time()
            try:
                watchdog.arm()
                try:
                    entry.run(data)
                finally:
                    watchdog.disarm()
            except entry.expected as exc:
                report.outcomes[outcome_key(exc)] += 1
            except Exception as exc:
                report.outcomes[outcome_key(exc)] += 1
                record_failure(report, exc, data)
            else:
                report.outcomes["accepted"] += 1
            took = time.process_time() - t0
            if took > report.slowest:
                report.slowest, report.slowest_input = took, data
            report.inputs += 1
            if time.perf_counter() - start > limits.budget:
                report.notes.append(f"stopped at the {limits.budget:.0f} s budget")
                break
    report.seconds = time.perf_counter() - start
    if report.inputs > warmup:
        end.take()
        report.rss_growth, report.block_growth = end.growth_since(base)
    for failure in report.failures.values():
        if isinstance(failure.data, bytes) and failure.kind != InputHung.__name__:
            failure.data = shrink(entry, failure.data, failure.kind)
    return report


def _fails_with(entry: Entry, data: bytes, kind: str) -> bool:
    try:
        entry.run(data)
    except entry.expected:
        return False
    except Exception as exc:
        return type(exc).__name__ == kind
    return False


def shrink(entry: Entry, data: bytes, kind: str) -> bytes:
    """A shorter input failing with the same exception type (greedy chunk removal, bounded
    in attempts and time)."""
    deadline = time.perf_counter() + MAX_SHRINK_SECONDS
    attempts = 0
    chunk = max(1, len(data) // 2)
    while chunk >= 1 and attempts < MAX_SHRINK_ATTEMPTS and time.perf_counter() < deadline:
        i = 0
        while i < len(data) and attempts < MAX_SHRINK_ATTEMPTS:
            candidate = data[:i] + data[i + chunk :]
            attempts += 1
            if candidate != data and _fails_with(entry, candidate, kind):
                data = candidate
            else:
                i += chunk
        chunk //= 2
    return data


# --------------------------------------------------------------------------- the async driver


class TracebackCatcher(logging.Handler):
    """Keeps where each exception type a boundary logged was raised (boundaries log an
    unexpected exception with its traceback), so a contained defect can be located."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: dict[str, tuple[str, str]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            self.seen.setdefault(type(exc).__name__, (_where(exc), str(exc)[:200]))


@contextmanager
def catching_tracebacks(logger_name: str = "p2pnode") -> Iterator[TracebackCatcher]:
    """Route the package's log to a :class:`TracebackCatcher` only (errors and worse)."""
    logger = logging.getLogger(logger_name)
    catcher = TracebackCatcher()
    saved = (logger.level, logger.propagate, logger.disabled)
    logger.setLevel(logging.ERROR)
    logger.propagate = False
    logger.disabled = False
    logger.addHandler(catcher)
    try:
        yield catcher
    finally:
        logger.removeHandler(catcher)
        logger.level, logger.propagate, logger.disabled = saved


async def run_live(
    entry: LiveEntry, count: int, seed: int, limits: Limits = DEFAULT_LIMITS
) -> Report:
    """Open the harness, feed it ``count`` inputs, then check its boundaries."""
    with catching_tracebacks() as catcher:
        return await _run_live(entry, count, seed, limits, catcher)


async def _run_live(
    entry: LiveEntry, count: int, seed: int, limits: Limits, catcher: TracebackCatcher
) -> Report:
    rng = random.Random(f"{seed}:{entry.name}")
    report = Report(entry.name, limits)
    start = time.perf_counter()
    try:
        with Watchdog(limits.hang_seconds).installed() as watchdog:
            async with entry.open() as harness:
                await _feed_live(entry, harness, count, rng, report, watchdog, catcher)
    except Exception as exc:  # opening or closing the harness failed
        report.outcomes[f"harness {outcome_key(exc)}"] += 1
        record_failure(report, exc, "(harness)")
    report.seconds = time.perf_counter() - start
    return report


async def _feed_live(
    entry: LiveEntry,
    harness: Harness,
    count: int,
    rng: random.Random,
    report: Report,
    watchdog: Watchdog,
    catcher: TracebackCatcher,
) -> None:
    limits = report.limits
    boundaries = harness.boundaries()
    seen_unexpected: dict[str, int] = {}
    warmup = max(1, int(count * WARMUP_FRACTION))
    base, end = MemoryProbe(), MemoryProbe()
    start = time.perf_counter()
    for i in range(count):
        if i == warmup:
            base.take()
        data = entry.generate(rng)
        t0 = time.process_time()
        try:
            watchdog.arm()
            try:
                # Virtual seconds: an input that waits for ever fails (autojump clock).
                with trio.fail_after(120):
                    await harness.feed(data)
            finally:
                watchdog.disarm()
        except Exception as exc:  # nothing may escape a live handler
            report.outcomes[f"escaped {outcome_key(exc)}"] += 1
            record_failure(report, exc, data)
        took = time.process_time() - t0
        if took > report.slowest:
            report.slowest, report.slowest_input = took, data
        report.inputs += 1
        _note_boundaries(report, boundaries, seen_unexpected, data, catcher)
        if time.perf_counter() - start > limits.budget:
            report.notes.append(f"stopped at the {limits.budget:.0f} s budget")
            break
    if report.inputs > warmup:
        end.take()
        report.rss_growth, report.block_growth = end.growth_since(base)
    report.outcomes.update(harness.outcomes())
    for label, boundary in boundaries.items():
        report.outcomes[f"{label}.typed"] = boundary.stats.typed
        for name, k in boundary.stats.unexpected.items():
            report.outcomes[f"{label}.unexpected {name}"] = k


def _note_boundaries(
    report: Report,
    boundaries: dict[str, FailureBoundary],
    seen: dict[str, int],
    data: Any,
    catcher: TracebackCatcher,
) -> None:
    # The first input that made a boundary count a new unexpected exception is its repro.
    for label, boundary in boundaries.items():
        for name, k in boundary.stats.unexpected.items():
            key = f"{label}:{name}"
            if k > seen.get(key, 0):
                seen[key] = k
                kind = f"{label} contained {name}"
                where, message = catcher.seen.get(name, (label, "counted as unexpected"))
                held = report.failures.get(kind)
                if held is None or _size(data) < _size(held.data):
                    report.failures[kind] = Failure(kind, data, where, message)


def require_boundary(owner: object, attribute: str = "boundary") -> FailureBoundary:
    """The failure boundary ``owner`` keeps under ``attribute``; raises if there is none, so
    a live entry point cannot pass for want of the thing it checks."""
    boundary = getattr(owner, attribute, None)
    if not isinstance(boundary, FailureBoundary):
        raise RuntimeError(
            f"{type(owner).__name__} has no FailureBoundary attribute {attribute!r}: "
            "the live handler is not behind a boundary"
        )
    return boundary


# --------------------------------------------------------------------------- printing


def format_row(report: Report, width: int = 22) -> str:
    """One line: name, inputs, seconds, slowest input (CPU ms), memory growth after warm-up
    (MiB of RSS, thousands of blocks), OK or FAIL, then the outcomes by count."""
    status = "OK" if report.ok else "FAIL"
    seen = ", ".join(f"{k} {v}" for k, v in report.outcomes.most_common())
    memory = f"{report.rss_growth / 2**20:+.1f}/{report.block_growth / 1000:+.0f}k"
    return (
        f"{report.name:<{width}} {report.inputs:>7} {report.seconds:>7.1f} "
        f"{report.slowest * 1000:>7.1f} {memory:>12}  {status:<4}  {seen}"
    )


def header(width: int = 22) -> str:
    columns = (
        f"{'entry point':<{width}} {'inputs':>7} {'seconds':>7} {'max ms':>7} {'mem MiB/blk':>12}"
    )
    return f"{columns}  {'':<4}  outcomes (type:code count)"


def iter_problems(reports: Sequence[Report]) -> Iterator[str]:
    for report in reports:
        for problem in report.problems():
            yield f"{report.name}: {problem}"
