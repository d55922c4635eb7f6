"""The two largest memory attacks against a real ``p2pnode run`` daemon, measured as its
RSS (scripts/memory_attacks.py runs them at full size, and the junk-connection one).

An authenticated peer floods the victim with 3.8 MiB notifications, each with its
own correlation id, then with 3.8 MiB requests in a loop. An honest daemon's request
every half second must be answered throughout, and once the attacker has left the
victim's RSS must be back within 50 MB of what it was before the attacks.
"""

from __future__ import annotations

from pathlib import Path

import memory_attacks
import pytest
import trio

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not Path("/proc/self/status").exists(), reason="reads the daemon's RSS (Linux /proc)"
    ),
]

SLACK_MB = 50.0


async def test_large_envelope_floods_leave_the_daemon_near_its_baseline(tmp_path: Path) -> None:
    # The script's full sizes (617 notifications, 120 requests: 2.3 GB and 0.5 GB, many
    # times every budget they meet, 8 MiB of threads and 16 MiB of inbox per peer);
    # about 20 s on a free core.
    args = memory_attacks.parse_args(
        ["--attacks", "notifications,requests", "--linger", "1", "--slack", str(SLACK_MB)]
    )
    bench = memory_attacks.Bench(args, tmp_path)
    rows = []
    with trio.fail_after(150):
        async with trio.open_nursery() as nursery:
            await bench.start(nursery)
            for name in args.attacks:
                row = await bench.run(name, getattr(bench, name))
                memory_attacks.print_row(row, bench.baseline)
                rows.append(row)
            for node in (bench.honest, bench.victim):
                await node.stop()
            nursery.cancel_scope.cancel()
    for row in rows:
        assert row.sent == (617 if row.name == "notifications" else 120)
        assert row.honest_failed == 0, row.errors
        assert row.honest_ok >= 2  # served during the attack, and after it
        assert row.after <= bench.baseline + SLACK_MB, (row, bench.baseline)
