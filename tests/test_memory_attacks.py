"""The two largest memory attacks against a real ``p2pnode run`` daemon, measured as its
RSS (scripts/memory_attacks.py runs them at full size, and the junk-connection one).

An authenticated peer floods the victim with 3.8 MiB notifications, each with its
own correlation id, then with 3.8 MiB requests in a loop. An honest daemon's request
every half second must be answered throughout, and once the attacker has left the
victim's RSS must be back within 50 MB of what it was before the attacks.

Here the floods are a quarter and a third of the script's (which keeps the full 2.3 GB
and 0.5 GB): still many times every budget they meet, so a structure that kept what
it read would leave the victim well above the slack, for a fraction of the encryption
and decryption.
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
NOTIFICATIONS = 160
REQUESTS = 40


async def test_large_envelope_floods_leave_the_daemon_near_its_baseline(tmp_path: Path) -> None:
    # 160 notifications and 40 requests: 608 MB and 152 MB (the script's full 617 and
    # 120 are 2.3 GB and 0.5 GB), still 38 and 9 times the 16 MiB of inbox per peer and
    # 76 and 19 times the 8 MiB of threads; a kept copy of what was read would be 12
    # and 3 times the slack.
    args = memory_attacks.parse_args(
        [
            *("--attacks", "notifications,requests"),
            *("--notifications", str(NOTIFICATIONS), "--requests", str(REQUESTS)),
            *("--linger", "1", "--slack", str(SLACK_MB)),
        ]
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
        assert row.sent == (NOTIFICATIONS if row.name == "notifications" else REQUESTS)
        assert row.honest_failed == 0, row.errors
        assert row.honest_ok >= 2  # served during the attack, and after it
        assert row.after <= bench.baseline + SLACK_MB, (row, bench.baseline)
