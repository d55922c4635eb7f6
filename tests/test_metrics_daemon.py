"""``p2pnode run --metrics HOST:PORT``: a daemon serves its metrics over HTTP, scraped and
parsed with prometheus-client's parser after real traffic; the port closes with the
daemon; without the library the flag is one error line naming the extra."""

from __future__ import annotations

import importlib.util
import os
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import cast

import pytest
import trio

from p2pnode.cli import main as cli
from p2pnode.cli.process import NodeProcess
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.services.metrics import MISSING_EXTRA, check_metrics_extra
from tests.test_metrics import histogram_is_sound, parse, value

DOC = "ledger"


def test_a_missing_library_is_one_line_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "prometheus_client" else real(name, *a),
    )
    with pytest.raises(LocalError) as info:
        check_metrics_extra()
    assert info.value.code is ErrorCode.CONFIG_ERROR and "p2pnode[metrics]" in MISSING_EXTRA
    argv = ["--data-dir", str(tmp_path / "node"), "run", "--metrics", "127.0.0.1:9464"]
    assert cli.main(argv) == 1
    assert capsys.readouterr().err == f"p2pnode: error: CONFIG_ERROR: {MISSING_EXTRA}\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return cast(bytes, response.read()).decode()


@pytest.mark.slow
async def test_a_daemon_serves_its_metrics(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(Path(__file__).parents[1]))
    hub, other = NodeProcess(tmp_path / "hub", env), NodeProcess(tmp_path / "other", env)
    hub.prepare("hub", 3)
    other.prepare("other", 3)
    port = _free_port()
    try:
        async with trio.open_nursery() as nursery:
            await hub.start(nursery, None, run_args=["--metrics", f"127.0.0.1:{port}"])
            await other.start(nursery, hub.address)
            reply = await other.call({"op": "send", "to": "hub", "payload": {"n": 1}})
            assert reply["payload"]["echo"] == {"n": 1}
            for d in (hub, other):
                await d.call({"op": "doc.subscribe", "doc": DOC})
            update = {"op": "counter.add", "path": ["n"], "amount": 1}
            for _ in range(3):
                await other.call({"op": "doc.update", "doc": DOC, "update": update})
            url = f"http://127.0.0.1:{port}/metrics"
            with trio.fail_after(40):
                while True:
                    samples = parse(await trio.to_thread.run_sync(_get, url))
                    if value(samples, "p2pnode_gossip_deltas_total", doc=DOC, outcome="new") >= 3:
                        break
                    await trio.sleep(0.2)
            assert (
                value(samples, "p2pnode_messages_total", direction="received", type="request") >= 1
            )
            assert value(samples, "p2pnode_messages_total", direction="sent", type="response") >= 1
            assert histogram_is_sound(samples, "p2pnode_routing_latency_seconds") >= 1
            assert value(samples, "p2pnode_channels", state="open") >= 1
            assert value(samples, "p2pnode_dht_contacts") >= 1
            assert value(samples, "p2pnode_dht_rpcs_sent_total") >= 1
            assert value(samples, "p2pnode_gossip_lag_operations", doc=DOC) == 0
            nursery.cancel_scope.cancel()
    finally:
        await other.stop()
        await hub.stop()
    # The daemon stopped: its metrics port is closed with it.
    with pytest.raises(urllib.error.URLError):
        await trio.to_thread.run_sync(_get, f"http://127.0.0.1:{port}/metrics")
