"""Fuzz every entry point that takes bytes or values from outside.

Usage: python scripts/fuzz.py [--n 100000] [--only NAME ...] [--seed 1]
       [--budget SECONDS] [--list]

Each entry point gets its share of ``--n`` generated inputs (all of it but
the DHT lookup, whose every input runs two lookups: half); see
:mod:`fuzz_engine` for what fails a run, :mod:`fuzz_mutate` for how inputs
are made, :mod:`fuzz_targets` and :mod:`fuzz_live` for the table. Prints
one row per entry point (inputs, seconds, the slowest input in CPU ms, memory
growth after the warm-up in MiB of RSS and thousands of allocated blocks,
OK or FAIL, outcomes by exception type and code), then every problem with a
reproducing input, then a summary line. Exits 1 when any entry point failed.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable, Sequence

import trio
import trio.testing
from fuzz_engine import (
    DEFAULT_LIMITS,
    Entry,
    Limits,
    LiveEntry,
    Report,
    Target,
    count_for,
    format_row,
    header,
    iter_problems,
    run_entry,
    run_live,
)
from fuzz_live import LIVE_ENTRIES
from fuzz_targets import ENTRIES

#: The whole table: parsers first, then the live handlers.
TABLE: list[Target] = [*ENTRIES, *LIVE_ENTRIES]


def select(names: Sequence[str] | None) -> list[Target]:
    """The entry points named (all when ``names`` is empty); raises KeyError on an unknown
    name."""
    if not names:
        return list(TABLE)
    by_name = {t.name: t for t in TABLE}
    return [by_name[n] for n in names]


def run_table(
    targets: Sequence[Target],
    count: Callable[[Target], int],
    seed: int,
    limits: Limits = DEFAULT_LIMITS,
    on_report: Callable[[Report], None] | None = None,
) -> list[Report]:
    """Run ``targets`` with ``count(target)`` inputs each: the parsers one by one, the live
    handlers together in one ``trio.run`` on a virtual clock."""
    reports: list[Report] = []

    def done(report: Report) -> None:
        reports.append(report)
        if on_report is not None:
            on_report(report)

    for target in targets:
        if isinstance(target, Entry):
            done(run_entry(target, count(target), seed, limits))
    live = [t for t in targets if isinstance(t, LiveEntry)]
    if live:

        async def run_all() -> None:
            for target in live:
                done(await run_live(target, count(target), seed, limits))

        trio.run(run_all, clock=trio.testing.MockClock(autojump_threshold=0))
    return reports


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000, help="inputs per entry point")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only NAME")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--budget", type=float, default=1800.0, help="seconds after which an entry point stops"
    )
    parser.add_argument("--list", action="store_true", help="list the entry points and exit")
    args = parser.parse_args(argv)
    if args.list:
        for target in TABLE:
            kind = "live" if isinstance(target, LiveEntry) else "parser"
            print(f"{target.name:<26} {kind:<7} {count_for(target, args.n):>8} inputs")
        return 0
    try:
        targets = select(args.only)
    except KeyError as exc:
        print(f"unknown entry point {exc}; --list shows them", file=sys.stderr)
        return 2
    # The handlers log every bad input they drop; the report counts them instead (the
    # live driver still reads the tracebacks boundaries log, to locate contained defects).
    logging.getLogger("p2pnode").setLevel(logging.ERROR)
    print(f"fuzz: seed {args.seed}, --n {args.n}, {len(targets)} entry points")
    print(header())
    start = time.perf_counter()
    reports = run_table(
        targets,
        lambda target: count_for(target, args.n),
        args.seed,
        Limits(budget=args.budget),
        lambda r: print(format_row(r), flush=True),
    )
    problems = list(iter_problems(reports))
    if problems:
        print("\nproblems:")
        for line in problems:
            print(f"  {line}")
    failed = [r.name for r in reports if not r.ok]
    total = sum(r.inputs for r in reports)
    elapsed = time.perf_counter() - start
    verdict = f"FAIL ({', '.join(failed)})" if failed else "OK"
    print(
        f"\nsummary: {len(reports)} entry points, {total} inputs, {elapsed:.0f} s, "
        f"{len(failed)} failed: {verdict}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
