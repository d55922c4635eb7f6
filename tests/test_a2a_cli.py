"""``p2pnode a2a serve`` as a process: a gateway node joins a daemon's swarm and the A2A
SDK's client reaches the daemon's agent through it; and the command's one-line refusals."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from a2a.client import ClientConfig, create_client
from a2a.types import Message, Part, Role, SendMessageRequest
from google.protobuf.json_format import MessageToDict

from p2pnode.bridges.a2a import MISSING_SDK
from p2pnode.cli import main as cli
from p2pnode.cli.process import NodeProcess

#: Every wait in these tests gives up after this long.
LIMIT = 20.0


def test_a_missing_sdk_is_one_line_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "a2a" else real(name, *a)
    )
    assert cli.main(["a2a", "serve", "--http", "127.0.0.1:0"]) == 1
    assert capsys.readouterr().err == f"p2pnode: error: CONFIG_ERROR: {MISSING_SDK}\n"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--http", "0.0.0.0:8080"], "serves on the loopback only"),
        (["--http", "127.0.0.1"], "expected HOST:PORT"),
        (["--http", "127.0.0.1:0", "--timeout", "0"], "--timeout is more than 0"),
    ],
)
def test_bad_options_are_one_error_line(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["a2a", "serve", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("p2pnode: error: INVALID_ARGUMENT: ") and says in err
    assert err.count("\n") == 1


async def first_answer(url: str, token: str, agent: str) -> dict[str, Any]:
    """The task the gateway answers for a text message to ``agent``, once the gateway
    knows it (the index lists it), as JSON."""
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(headers=headers, timeout=LIMIT) as http:
        for _ in range(int(LIMIT / 0.1)):
            listed = (await http.get(url)).json()["agents"]
            if any(a["id"] == agent for a in listed):
                break
            await asyncio.sleep(0.1)
        config = ClientConfig(httpx_client=http, streaming=False)
        client = await create_client(f"{url}/{agent}", client_config=config)
        msg = Message(message_id="m1", role=Role.ROLE_USER, parts=[Part(text="hello")])
        events = [e async for e in client.send_message(SendMessageRequest(message=msg))]
        return MessageToDict(events[-1].task)


@pytest.mark.slow
async def test_a2a_serve_joins_the_swarm_and_answers_an_a2a_client(tmp_path: Path) -> None:
    owner = NodeProcess(tmp_path / "owner")
    owner.prepare("owner-agent", 3)
    gateway_dir = tmp_path / "gateway"
    async with trio.open_nursery() as nursery:
        await owner.start(nursery, None)
        argv = [sys.executable, "-m", "p2pnode", "--data-dir", str(gateway_dir), "a2a", "serve",
                "--http", "127.0.0.1:0", "--bootstrap", owner.address]  # fmt: skip
        serve = await trio.lowlevel.open_process(argv, stdout=-1, env=owner.env)
        try:
            assert serve.stdout is not None
            with trio.fail_after(LIMIT):
                ready = json.loads(await serve.stdout.receive_some(65536))
            assert ready["event"] == "ready" and ready["agent"] == "a2a-client"
            token_file = trio.Path(ready["tokenFile"])
            assert (await token_file.stat()).st_mode & 0o077 == 0
            token = (await token_file.read_text()).strip()
            task = await trio.to_thread.run_sync(
                asyncio.run, first_answer(ready["url"], token, "owner-agent")
            )
            assert task["status"]["state"] == "TASK_STATE_COMPLETED"
            (part,) = task["artifacts"][0]["parts"]
            assert part["data"]["echo"] == "hello" and part["data"]["from"] == "a2a-client"
            serve.send_signal(signal.SIGTERM)
            with trio.fail_after(LIMIT):
                assert await serve.wait() == 0
        finally:
            if serve.returncode is None:
                serve.kill()
                await serve.wait()
            await owner.stop()
