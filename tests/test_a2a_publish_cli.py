"""``p2pnode a2a publish`` as a process: an A2A server (tests.test_a2a_publish's) attached
to a daemon and asked through it; and the command's refusals: a server whose card cannot
be read is one error line and a non-zero exit, before any node is asked (those servers are
plain HTTP servers of the standard library on loopback, each answering the card path with
a body of the test's)."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import trio

from p2pnode.cli import main as cli
from p2pnode.cli.process import NodeProcess
from p2pnode.core.errors import P2PError
from tests.test_a2a_publish import Seen, Server

#: Every wait gives up after this long.
LIMIT = 20.0

pytestmark = pytest.mark.slow  # real sockets


def _server(status: int, body: bytes) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            """Quiet."""

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@pytest.fixture
def serving(request: pytest.FixtureRequest) -> Iterator[str]:
    """The URL of a server answering ``request.param`` (status, body)."""
    status, body = request.param
    server = _server(status, body)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


NO_SKILLS = json.dumps({"name": "x", "skills": []}).encode()
NOT_A_CARD = json.dumps({"name": "x", "skills": [{"id": "a", "tags": "not a list"}]}).encode()
NO_BINDING = json.dumps(
    {
        "name": "x",
        "skills": [{"id": "a", "name": "a"}],
        "supportedInterfaces": [{"url": "grpc://h:1", "protocolBinding": "GRPC"}],
    }
).encode()


@pytest.mark.parametrize(
    ("serving", "code", "says"),
    [
        ((200, b"{not json"), "INVALID_CARD", "is not an A2A agent card"),
        ((200, b"[1, 2]"), "INVALID_CARD", "not a JSON object"),
        ((200, NO_SKILLS), "INVALID_CARD", "no skill the swarm can carry"),
        ((200, NOT_A_CARD), "INVALID_CARD", "is not an A2A agent card"),
        ((200, NO_BINDING), "INVALID_CARD", "lists no JSONRPC or HTTP+JSON interface"),
        ((404, b"{}"), "INVALID_CARD", "answered HTTP 404"),
        ((200, b" " * (1024 * 1024 + 1)), "MESSAGE_TOO_LARGE", "over 1048576 bytes"),
    ],
    indirect=["serving"],
)
def test_a_card_that_cannot_be_read_is_one_error_line(
    serving: str, code: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["a2a", "publish", serving, "--agent-id", "x", "--data-dir", str(tmp_path)]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    (line,) = err.splitlines()
    assert line.startswith(f"p2pnode: error: {code}: the A2A server at {serving}: "), err
    assert says in line
    assert "Traceback" not in err


def test_a_server_nobody_answers_at_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = _server(200, b"{}")
    url = f"http://127.0.0.1:{server.server_address[1]}"
    server.server_close()  # the port is free: connections are refused
    assert cli.main(["a2a", "publish", url, "--agent-id", "x", "--data-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("p2pnode: error: AGENT_UNAVAILABLE: ")
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["ftp://h/x", "--agent-id", "x"], "expected the A2A server's http(s):// URL"),
        (["http://", "--agent-id", "x"], "expected the A2A server's http(s):// URL"),
        (["http://h", "--agent-id", "x", "--poll", "0"], "--timeout and --poll"),
    ],
)
def test_bad_options_are_one_error_line(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["a2a", "publish", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("p2pnode: error: INVALID_ARGUMENT: ") and says in err
    assert err.count("\n") == 1


@pytest.fixture
def a2a_server() -> Iterator[Server]:
    """The A2A server of tests.test_a2a_publish, served by a loop in a thread of its own."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = Server(Seen())
    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(LIMIT)
        yield server
    finally:

        async def stop() -> None:
            await server.stop()
            # What the server left behind (sse-starlette's shutdown watchers) ends here.
            pending = asyncio.all_tasks() - {asyncio.current_task()}
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(stop(), loop).result(LIMIT)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(LIMIT)
        loop.close()


async def test_a_published_server_answers_the_daemons_agents(
    a2a_server: Server, tmp_path: Path
) -> None:
    node = NodeProcess(tmp_path / "node")
    node.prepare("owner-agent", 3)
    async with trio.open_nursery() as nursery:
        await node.start(nursery, None)
        argv = [sys.executable, "-m", "p2pnode", "--data-dir", str(node.data_dir), "a2a",
                "publish", a2a_server.url, "--agent-id", "weather", "--poll", "0.5"]  # fmt: skip
        publish = await trio.lowlevel.open_process(argv, stdout=-1, env=node.env)
        try:
            assert publish.stdout is not None
            with trio.fail_after(LIMIT):
                line = json.loads(await publish.stdout.receive_some(65536))
            assert line == {
                "event": "published",
                "agent": "weather",
                "url": a2a_server.url,
                "capabilities": ["echo", "shout", "fail", "reject", "slow"],
            }
            ask = {"op": "send", "from": "owner-agent", "type": "request", "payload": "quiet"}
            answer = await node.call({**ask, "to": "shout", "capability": True})
            assert answer["payload"] == "QUIET"
            direct = await node.call({**ask, "to": "weather", "capability": False})
            assert direct["payload"] == "quiet"  # no skill named: the server's default
            # The node restarts (as a device does): the publisher attaches to it again.
            address = node.address
            await node.stop()
            await node.start(nursery, None, listen=address)
            with trio.fail_after(LIMIT * 2):
                while True:  # until the publisher is attached again (bounded above)
                    try:
                        again = await node.call({**ask, "to": "shout", "capability": True})
                        break
                    except P2PError:
                        await trio.sleep(0.2)
            assert again["payload"] == "QUIET"
            assert publish.returncode is None
            publish.send_signal(signal.SIGTERM)
            with trio.fail_after(LIMIT):
                assert await publish.wait() == 0
        finally:
            if publish.returncode is None:
                publish.kill()
                await publish.wait()
            await node.stop()
