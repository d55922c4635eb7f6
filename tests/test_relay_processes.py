"""`p2pnode run --relay` and `--use-relay` as real processes on 127.0.0.1: the relay
daemon names its address, the other keeps a reservation on it, lists the relay in its
card's endpoints, and both show it in `status`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from p2pnode.cli.process import NodeProcess
from p2pnode.transport.relay import parse_relay_address

pytestmark = pytest.mark.slow


async def _until(process: NodeProcess, check: Any) -> dict[str, Any]:
    """``process``'s status once ``check(status)`` holds (polled, bounded)."""
    for _ in range(100):
        status: dict[str, Any] = await process.call({"op": "status"})
        if check(status):
            return status
        await trio.sleep(0.1)
    raise AssertionError(f"status never matched: {status}")


async def test_relay_and_use_relay_daemons(tmp_path: Path) -> None:
    relay, natted = NodeProcess(tmp_path / "relay"), NodeProcess(tmp_path / "natted")
    relay.prepare("relayer", 1)
    natted.prepare("natted", 2)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            try:
                await relay.start(nursery, None, run_args=["--relay", "127.0.0.1:0"])
                status = await relay.call({"op": "status"})
                text = status["relay"]["address"]
                parsed = parse_relay_address(text)
                assert parsed is not None and str(parsed.relay_id) == status["peerId"]
                await natted.start(nursery, relay.address, run_args=["--use-relay", text])
                held = await _until(natted, lambda s: s["relays"] and s["relays"][0]["reserved"])
                assert held["relays"][0]["relay"] == text
                assert "relay" not in held  # it does not relay for others itself
                shown = await _until(relay, lambda s: s["relay"]["reservations"] == 1)
                assert shown["relay"]["refusals"] == {}
                card = await natted.call({"op": "card"})
                assert {"transport": "tcp+noise", "address": text} in card["endpoints"]
                assert text not in card["addresses"]
            finally:
                with trio.CancelScope(shield=True):
                    for process in (natted, relay):
                        if process.process is not None:
                            await process.kill()
                nursery.cancel_scope.cancel()
