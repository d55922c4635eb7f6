"""Real OS processes on 127.0.0.1: four `p2pnode run` daemons driven through their
control sockets (discovery, request/response, broadcast, kill and restart)."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import trio

from p2pnode.cli.demo import Demo
from p2pnode.cli.main import main
from p2pnode.core.errors import ErrorCode, P2PError

pytestmark = pytest.mark.slow


async def test_four_daemons(tmp_path: Path) -> None:
    demo = Demo(4, tmp_path)
    demo.prepare()
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            try:
                await demo.start(nursery, demo.nodes[0], None)
                for node in demo.nodes[1:]:
                    await demo.start(nursery, node, demo.nodes[0].address)
                sun, mercury, venus, mars = demo.nodes

                found: list[dict[str, object]] = []
                while not found:
                    found = await mercury.call({"op": "find", "capability": mars.capability})
                    await trio.sleep(0.1)
                assert found[0]["id"] == "mars"

                ask = {"op": "send", "from": "venus", "to": "plan.strategy", "capability": True}
                reply = await venus.call({**ask, "type": "request", "payload": {"q": 1}})
                assert reply["sender"] == "mercury"
                assert reply["payload"]["echo"] == {"q": 1}

                result = await sun.call(
                    {"op": "send", "from": "sun", "to": "*", "type": "notification"}
                )
                assert sorted(result["targets"]) == ["mars", "mercury", "venus"]

                with pytest.raises(P2PError) as info:
                    await mercury.call(
                        {"op": "send", "from": "mercury", "to": "venus", "type": "request"}
                    )
                assert info.value.code is ErrorCode.TIER_VIOLATION

                # Kill venus hard, restart it on the same data dir: channels reconnect.
                await venus.kill()
                await demo.start(nursery, venus, sun.address)
                again = {"op": "send", "from": "sun", "to": "venus", "payload": "again"}
                reply = await sun.call({**again, "type": "request"})
                assert reply["sender"] == "venus"
                status = await sun.call({"op": "status"})
                assert {c["state"] for c in status["channels"]} == {"open"}
                assert status["metrics"]["totalMessagesSent"] == 2  # the broadcast and the request
                assert status["metrics"]["totalMessagesReceived"] >= 1  # venus's response
            finally:
                with trio.CancelScope(shield=True):
                    await demo.stop()
                nursery.cancel_scope.cancel()


async def _cli(data_dir: Path, *argv: str) -> tuple[int, str, str]:
    """``p2pnode --data-dir D ARGV``: exit code, stdout and stderr. The command talks to
    the daemon over its control socket, so it runs here (in a thread: it runs its own
    trio loop), not in an interpreter of its own; the daemons are real processes."""

    def run() -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            code = main(["--data-dir", str(data_dir), *argv])
        return code, out.getvalue(), err.getvalue()

    return await trio.to_thread.run_sync(run)


async def test_cli_commands_against_a_running_daemon(tmp_path: Path) -> None:
    demo = Demo(2, tmp_path)
    demo.prepare()
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            try:
                await demo.start(nursery, demo.nodes[0], None)
                await demo.start(nursery, demo.nodes[1], demo.nodes[0].address)
                sun, mercury = demo.nodes
                code, out, _ = await _cli(sun.data_dir, "status", "--json")
                assert code == 0
                status = json.loads(out)
                assert status["agents"] == ["sun"]
                assert status["swarm"].startswith("open")
                code, out, _ = await _cli(mercury.data_dir, "find", "orchestrate.swarm")
                assert code == 0
                assert out.startswith("sun")
                code, out, _ = await _cli(
                    mercury.data_dir, "send", "sun", "--payload", '{"ping": 1}'
                )
                assert code == 0
                assert json.loads(out)["payload"]["echo"] == {"ping": 1}
                code, _, err = await _cli(mercury.data_dir, "send", "nobody", "--payload", "{")
                assert code == 1
                assert "not JSON" in err
                code, _, err = await _cli(mercury.data_dir, "send", "nobody")
                assert code == 1
                assert "AGENT_NOT_FOUND" in err
                code, _, err = await _cli(tmp_path / "no-node", "status")
                assert code == 1
                assert "p2pnode run" in err
            finally:
                with trio.CancelScope(shield=True):
                    await demo.stop()
                nursery.cancel_scope.cancel()
