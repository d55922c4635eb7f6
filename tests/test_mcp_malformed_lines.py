"""``mcp serve`` on pipes answers every line that is no JSON-RPC message as JSON-RPC 2.0
§5.1 asks (-32700 for what is not JSON, -32600 for JSON that is no message), then serves
the next valid request (docs/protocol/mcp.md §2.1): raw lines to a real process's stdin,
and a property test of the answer to any bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.bridges.mcp.stdio import MAX_ECHOED_ID, malformed_reply, message_untrusted

#: ``mcp serve``'s server and stdio transport over a stand-in for the swarm: one tool.
SERVER = """
import trio
from p2pnode.agent.surface import Listing
from p2pnode.bridges.mcp.serve import SwarmServer, serve_stdio

class Tools:
    async def list_tools(self):
        listing = Listing()
        listing.items.append({"name": "box.echo", "agentId": "box", "description": "",
                              "inputSchema": {"type": "object"}})
        return listing
    async def call_tool_result(self, name, arguments=None, *, timeout=None, on_progress=None):
        return {"structuredContent": {"echo": arguments}}
    async def list_resources(self):
        return Listing()
    async def read_resource(self, uri, *, agent=None):
        return {"contents": []}
    async def list_prompts(self):
        return Listing()
    async def get_prompt(self, name, arguments=None):
        return {"messages": []}

trio.run(serve_stdio, SwarmServer(Tools(), poll_interval=60))
"""

INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": "2025-06-18",
        "capabilities": {},
        "clientInfo": {"name": "raw", "version": "0"},
    },
}


class Lines:
    """Lines read from a process's stdout."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self.stream = stream
        self.buffer = b""

    async def next(self) -> dict[str, Any]:
        while b"\n" not in self.buffer:
            chunk = await self.stream.receive_some()
            assert chunk, "the server closed its stdout"
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        answer: dict[str, Any] = json.loads(line)
        return answer


@pytest.mark.slow
async def test_each_malformed_line_gets_its_error_and_the_next_call_still_works() -> None:
    malformed: list[tuple[bytes, int, Any]] = [
        (b"garbage", -32700, None),
        (b"\xff\xfe not utf-8", -32700, None),
        (b'{"jsonrpc": "2.0", "id": 3, "method": ', -32700, None),  # cut short
        (b'{"jsonrpc": "1.0", "id": 7, "method": "ping"}', -32600, 7),
        (b'{"jsonrpc": "2.0", "id": "a"}', -32600, "a"),  # no method, no result
        (b"[1, 2]", -32600, None),  # a batch: not in MCP
        (b'"just a string"', -32600, None),
        (b'{"jsonrpc": "2.0", "id": {"x": 1}, "method": "ping"}', -32600, None),
    ]
    # Generous: the child imports the SDK, which takes seconds on a loaded machine.
    with trio.fail_after(120):
        process = await trio.lowlevel.open_process(
            [sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        try:
            assert process.stdin is not None and process.stdout is not None
            lines = Lines(process.stdout)
            for line, code, request_id in malformed:
                await process.stdin.send_all(line + b"\n")
                answer = await lines.next()
                assert answer["jsonrpc"] == "2.0"
                assert answer["error"]["code"] == code, line
                assert answer["id"] == request_id, line
            # The session goes on: a handshake and a call.
            await process.stdin.send_all(json.dumps(INITIALIZE).encode() + b"\n")
            assert (await lines.next())["result"]["serverInfo"]["name"] == "p2pnode"
            initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
            call = {
                "jsonrpc": "2.0",
                "id": 2,
                "method": "tools/call",
                "params": {"name": "box.echo", "arguments": {"n": 1}},
            }
            for message in (initialized, call):
                await process.stdin.send_all(json.dumps(message).encode() + b"\n")
            answer = await lines.next()
            assert answer["id"] == 2
            assert answer["result"]["structuredContent"] == {"echo": {"n": 1}}
            await process.stdin.aclose()
            assert await process.wait() == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()


@given(st.binary(max_size=256) | st.text(max_size=64).map(str.encode))
def test_any_line_gets_a_parse_error_or_an_invalid_request(line: bytes) -> None:
    answer = malformed_reply(line)
    try:
        json.loads(line)
    except ValueError:
        assert answer.error.code == -32700 and answer.id is None
    else:
        assert answer.error.code == -32600


@given(
    st.one_of(
        st.integers(),
        st.text(max_size=2 * MAX_ECHOED_ID),
        st.none(),
        st.booleans(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.lists(st.integers(), max_size=3),
    )
)
def test_an_invalid_request_echoes_only_a_string_or_integer_id(request_id: Any) -> None:
    line = json.dumps({"jsonrpc": "1.0", "id": request_id, "method": "x"}).encode()
    answer = malformed_reply(line)
    assert answer.error.code == -32600
    echoable = type(request_id) in (str, int) and len(str(request_id)) <= MAX_ECHOED_ID
    assert answer.id == (request_id if echoable else None)


def test_a_line_nested_past_the_stack_is_a_parse_error() -> None:
    assert malformed_reply(b"[" * 100_000).error.code == -32700


@given(st.binary(max_size=256) | st.text(max_size=64).map(str.encode))
def test_reading_any_line_never_raises(line: bytes) -> None:
    message = message_untrusted(line)
    if message is None:
        assert malformed_reply(line).error.code in (-32700, -32600)


def test_a_notification_carrying_an_id_is_an_invalid_request() -> None:
    line = b'{"jsonrpc": "2.0", "id": {"x": 1}, "method": "ping"}'
    assert message_untrusted(line) is None
    assert message_untrusted(b'{"jsonrpc": "2.0", "method": "ping"}') is not None
