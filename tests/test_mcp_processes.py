"""The MCP bridge's commands as processes, with the official SDK on the other side:
``p2pnode mcp serve`` launched by the SDK's ``stdio_client`` against a swarm of
``p2pnode run`` daemons, and a FastMCP server written here published with
``p2pnode mcp publish`` and ``p2pnode run --mcp-server``, its tool called from
another node with ``p2pnode tools call``."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shlex
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
import mcp_types as types
import pytest
import trio
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from p2pnode import Agent
from p2pnode.bridges.mcp import MISSING_SDK
from p2pnode.cli import main as cli
from p2pnode.cli.process import NodeProcess
from p2pnode.hosting.client import AgentClient
from tests.sim import wait_until

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
#: Seconds a command may take, and to wait for a node to see another's tools.
CLI_TIMEOUT = 30.0
SEEN_TIMEOUT = 20.0

#: A FastMCP server, as anyone writes one with the SDK.
NOTES_SERVER = '''
import os

from mcp.server.mcpserver import Context, MCPServer

server = MCPServer("notes", instructions="Notes kept by a FastMCP server")


@server.tool()
def shout(text: str) -> str:
    """Say it louder."""
    return text.upper()


@server.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()


@server.tool()
async def grow(ctx: Context) -> str:
    """Offer one more tool, and say so."""

    def extra() -> str:
        return "new"

    server.add_tool(extra)
    await ctx.request_context.session.send_tool_list_changed()
    return "grown"


@server.resource("notes://today", mime_type="text/markdown")
def today() -> str:
    return "# today"


if __name__ == "__main__":
    server.run()
'''


def env_for(tmp_path: Path) -> dict[str, str]:
    return dict(NodeProcess(tmp_path).env, PYTHONPATH=str(EXAMPLES))


async def p2pnode(env: dict[str, str], *argv: str) -> tuple[int, str, str]:
    with trio.fail_after(CLI_TIMEOUT):
        done = await trio.run_process(
            [sys.executable, "-m", "p2pnode", *argv],
            env=env,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


async def call_until(node: NodeProcess, name: str, arguments: dict[str, Any]) -> Any:
    """``tools.call`` on ``node`` until the tool answers (its owner is known and up)."""
    with trio.fail_after(SEEN_TIMEOUT):
        while True:
            try:
                return (await node.call({"op": "tools.call", "name": name,
                                         "arguments": arguments}))["result"]  # fmt: skip
            except Exception:
                await trio.sleep(0.1)


@asynccontextmanager
async def two_nodes(
    tmp_path: Path, owner_args: list[str]
) -> AsyncIterator[tuple[NodeProcess, NodeProcess]]:
    env = env_for(tmp_path)
    owner = NodeProcess(tmp_path / "owner", env)
    caller = NodeProcess(tmp_path / "caller", env)
    owner.prepare("owner-agent", 3)
    caller.prepare("caller-agent", 3)
    async with trio.open_nursery() as nursery:
        try:
            await owner.start(nursery, None, run_args=owner_args)
            await caller.start(nursery, owner.address)
            yield owner, caller
        finally:
            await caller.stop()
            await owner.stop()


def test_a_missing_sdk_is_one_line_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mcp" else real(name, *a)
    )
    for argv in (["mcp", "serve"], ["mcp", "publish", "--agent-id", "x", "--", "cmd"]):
        assert cli.main(argv) == 1
        assert capsys.readouterr().err == f"p2pnode: error: CONFIG_ERROR: {MISSING_SDK}\n"


@pytest.mark.slow
async def test_an_mcp_client_uses_the_swarm_through_mcp_serve(tmp_path: Path) -> None:
    async with two_nodes(tmp_path, ["--agent", "toolbox:agent"]) as (_owner, caller):
        serve = ["mcp", "serve", "--agent-id", "ide", "--poll", "0.5"]
        params = StdioServerParameters(
            command=sys.executable,
            args=["-m", "p2pnode", "--data-dir", str(caller.data_dir), *serve],
            env=env_for(tmp_path),
        )
        messages: list[Any] = []

        async def keep(message: Any) -> None:
            messages.append(message)

        with trio.fail_after(60):
            async with (
                stdio_client(params) as (read, write),
                ClientSession(read, write, message_handler=keep) as session,
            ):
                init = await session.initialize()
                assert init.server_info.name == "p2pnode"
                assert init.capabilities.tools is not None and init.capabilities.tools.list_changed
                names: list[str] = []
                while "toolbox.estimate" not in names:  # the caller node knows the owner
                    names = [t.name for t in (await session.list_tools()).tools]
                    await trio.sleep(0.1)
                assert "toolbox.set_rate" not in names  # its access rule refuses "ide"
                tool = next(t for t in (await session.list_tools()).tools
                            if t.name == "toolbox.estimate")  # fmt: skip
                assert tool.input_schema["required"] == ["tasks"]
                called = await session.call_tool("toolbox.estimate", {"tasks": 4, "parallel": 2})
                assert called.structured_content == {"hours": 3.0}  # computed on the other node
                refused = await session.call_tool("toolbox.set_rate", {"hours_per_task": 2})
                assert refused.is_error
                error = (refused.meta or {})["p2pnode/error"]
                assert (error["code"], error["agentId"]) == ("PERMISSION_DENIED", "toolbox")
                assert isinstance(refused.content[0], types.TextContent)
                assert refused.content[0].text.startswith("PERMISSION_DENIED: ide may not use")
                checklist = await session.read_resource("memo://checklist")
                [content] = checklist.contents
                assert isinstance(content, types.TextResourceContents)
                assert json.loads(content.text) == {"steps": ["scope", "estimate", "review"]}
                prompt = await session.get_prompt(
                    "toolbox.kickoff", {"project": "p2p", "date": "Friday"}
                )
                [message] = prompt.messages
                assert isinstance(message.content, types.TextContent)
                assert message.content.text == "Write the kickoff note of p2p, due Friday."
                # A tool appears in the swarm (an agent process attaches): the client hears.
                assert not changed(messages)
                async with AgentClient(pinger(), data_dir=caller.data_dir):
                    await wait_until(lambda: changed(messages), SEEN_TIMEOUT)
                    names = [t.name for t in (await session.list_tools()).tools]
                    assert "extra.ping" in names


def pinger() -> Agent:
    extra = Agent("extra")

    @extra.tool()
    def ping() -> int:
        return 1

    return extra


def changed(messages: list[Any]) -> bool:
    return any(isinstance(m, types.ToolListChangedNotification) for m in messages)


@pytest.mark.slow
async def test_mcp_serve_over_streamable_http_wants_its_token(tmp_path: Path) -> None:
    async with two_nodes(tmp_path, ["--agent", "toolbox:agent"]) as (_owner, caller):
        argv = [sys.executable, "-m", "p2pnode", "--data-dir", str(caller.data_dir), "mcp",
                "serve", "--agent-id", "web", "--http", "127.0.0.1:0"]  # fmt: skip
        serve = await trio.lowlevel.open_process(argv, stdout=-1, env=env_for(tmp_path))
        try:
            assert serve.stdout is not None
            with trio.fail_after(SEEN_TIMEOUT):
                line = await serve.stdout.receive_some(65536)
            ready = json.loads(line)
            assert ready["event"] == "ready" and ready["url"].startswith("http://127.0.0.1:")
            token_file = trio.Path(ready["tokenFile"])
            token = (await token_file.read_text()).strip()
            assert (await token_file.stat()).st_mode & 0o077 == 0
            # The SDK's HTTP client on asyncio (its event streams are asyncio-clean), in a
            # thread of this test.
            refused, estimate = await trio.to_thread.run_sync(
                asyncio.run, http_client(ready["url"], token)
            )
            assert refused == 401
            assert estimate == {"hours": 3.0}
        finally:
            serve.terminate()
            with trio.fail_after(10):
                await serve.wait()


async def http_client(url: str, token: str) -> tuple[int, Any]:
    """The status of a request without the token, and toolbox.estimate's result with it
    (after checking the server announces that its tool list changes)."""
    async with httpx2.AsyncClient() as anonymous:
        refused = (await anonymous.post(url, json={})).status_code
    headers = {"Authorization": f"Bearer {token}"}
    async with (
        httpx2.AsyncClient(headers=headers) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        init = await session.initialize()
        assert init.capabilities.tools is not None and init.capabilities.tools.list_changed
        for _ in range(200):  # until the caller node knows the owner
            names = [t.name for t in (await session.list_tools()).tools]
            if "toolbox.estimate" in names:
                break
            await asyncio.sleep(0.1)
        called = await session.call_tool("toolbox.estimate", {"tasks": 2})
        return refused, called.structured_content


@pytest.mark.slow
async def test_a_fastmcp_server_published_on_one_node_is_called_from_another(
    tmp_path: Path,
) -> None:
    server = tmp_path / "notes_server.py"
    server.write_text(NOTES_SERVER)
    env = env_for(tmp_path)
    async with two_nodes(tmp_path, []) as (owner, caller), trio.open_nursery() as nursery:
        argv = [sys.executable, "-m", "p2pnode", "--data-dir", str(owner.data_dir), "mcp",
                "publish", "--agent-id", "notes", "--allow-tier", "3", "--",
                sys.executable, str(server)]  # fmt: skip
        publish = await trio.lowlevel.open_process(argv, stdout=-1, stderr=-1, env=env)
        lines: list[str] = []

        async def read_stdout() -> None:
            assert publish.stdout is not None
            async for chunk in publish.stdout:
                lines.extend(chunk.decode().splitlines())

        nursery.start_soon(read_stdout)
        try:
            await wait_until(lambda: lines, SEEN_TIMEOUT)
            published = json.loads(lines[0])
            assert published["event"] == "published"
            assert published["tools"] == ["grow", "pid", "shout"]
            assert published["resources"] == ["notes://today"]
            await call_until(caller, "notes.shout", {"text": "x"})
            code, out, err = await p2pnode(
                env, "--data-dir", str(caller.data_dir), "tools", "call", "notes.shout",
                "--args", '{"text": "hello"}',
            )  # fmt: skip
            assert (code, err) == (0, "")
            assert json.loads(out) == {"result": "HELLO"}
            # The server dies: its agent is withdrawn, and it comes back (a new process).
            first = (await call_until(caller, "notes.pid", {}))["result"]
            os.kill(first, signal.SIGKILL)
            with trio.fail_after(SEEN_TIMEOUT):
                while True:
                    again = (await call_until(caller, "notes.pid", {}))["result"]
                    if again != first:
                        break
                    await trio.sleep(0.1)
            # The owner's node restarts (as a device does): the publisher attaches again.
            address = owner.address
            await owner.stop()
            await owner.start(nursery, None, listen=address)
            assert (await call_until(caller, "notes.shout", {"text": "back"})) == {
                "result": "BACK"
            }
            assert publish.returncode is None
        finally:
            publish.send_signal(signal.SIGTERM)
            with trio.fail_after(10):
                assert await publish.wait() == 0
            nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_the_daemon_hosts_an_mcp_server_with_mcp_server(tmp_path: Path) -> None:
    server = tmp_path / "notes_server.py"
    server.write_text(NOTES_SERVER)
    command = f"notes={sys.executable} {server}"
    owner_args = ["--mcp-server", command, "--mcp-allow", "agent=caller-agent"]
    async with two_nodes(tmp_path, owner_args) as (owner, caller):
        assert (await call_until(caller, "notes.shout", {"text": "hi"})) == {"result": "HI"}
        status = await owner.call({"op": "status"})
        assert "notes" in status["agents"]
        listed = await caller.call({"op": "resources.list"})
        assert [r["uri"] for r in listed["items"]] == ["notes://today"]
        history = await owner.call({"op": "tools.history"})
        assert history["invocations"][-1]["agentId"] == "caller-agent"
        # The server offers a new tool and says so: the agent is published again with it.
        assert (await call_until(caller, "notes.grow", {})) == {"result": "grown"}
        assert (await call_until(caller, "notes.extra", {})) == {"result": "new"}


@pytest.mark.slow
async def test_what_cannot_run_is_one_error_line(tmp_path: Path) -> None:
    env = env_for(tmp_path)
    missing = str(tmp_path / "no-such-server")
    node = NodeProcess(tmp_path / "node", env)
    node.prepare("node-agent", 3)
    data_dir = str(node.data_dir)
    failures = [
        ("--data-dir", data_dir, "mcp", "serve"),  # no node runs there
        ("--data-dir", data_dir, "mcp", "publish", "--agent-id", "x", "--", missing),
        ("--data-dir", data_dir, "run", "--mcp-server", f"x={missing}"),
        ("--data-dir", data_dir, "run", "--mcp-server", "x", "--mcp-allow", "colour=red"),
    ]
    said: list[str] = []
    for argv in failures:
        code, _, err = await p2pnode(env, *argv)
        lines = err.splitlines()
        assert code == 1 and "Traceback" not in err, (argv, err)
        assert lines[-1].startswith("p2pnode: error: "), (argv, err)
        said.append(err)
    assert "CONFIG_ERROR: no node answers on" in said[0]
    err = said[2]
    assert "CONFIG_ERROR: MCP server x" in err
    assert "ended before it listed what it offers: FileNotFoundError" in err


def readme_section() -> str:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return text.split("## Use it from an MCP client", 1)[1].split("\n## ", 1)[0]


def test_the_readmes_mcp_commands_parse() -> None:
    section = readme_section()
    config = json.loads(re.findall(r"```json\n(.*?)```", section, re.DOTALL)[0])
    server = config["mcpServers"]["p2pnode"]
    assert server["command"] == "p2pnode"
    commands = [server["args"]]
    [block] = re.findall(r"```sh\n(.*?)```", section, re.DOTALL)
    for line in block.splitlines():
        if line.strip() and not line.startswith("#"):
            argv = shlex.split(line)
            assert argv[0] == "p2pnode"
            commands.append(argv[1:])
    parser = cli.build_parser()
    for argv in commands:
        parser.parse_args(argv)
    assert "notes_server.py" in block and (EXAMPLES / "notes_server.py").exists()
