"""``mcp serve`` with the official TypeScript SDK as its client (docs/protocol/mcp.md
§2.4-2.5): a tool's structured result, and a swarm error as an error result the SDK
accepts (it refuses structured content that does not match the tool's output schema,
-32602, which an error's fields never do).

It needs Node.js and the npm package ``@modelcontextprotocol/sdk``: set
``P2PNODE_MCP_TS_SDK`` to a ``node_modules`` directory holding it (``npm install
@modelcontextprotocol/sdk`` in any directory). Without them the test is skipped and
says so; it never passes without running."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import trio

from tests.jssdk import needs_js_sdk

#: ``mcp serve``'s server over a stand-in for the swarm: one tool with a result, one
#: refused, both declaring an output schema.
SERVER = """
import trio
from p2pnode.agent.surface import Listing
from p2pnode.bridges.mcp.serve import SwarmServer, serve_stdio
from p2pnode.core.errors import ErrorCode, RemoteError

SCHEMA = {"type": "object", "properties": {"count": {"type": "integer"}}, "required": ["count"]}

class Tools:
    async def list_tools(self):
        listing = Listing()
        for name in ("count", "refuse"):
            listing.items.append({"name": "box." + name, "agentId": "box", "description": "",
                                  "inputSchema": {"type": "object"}, "outputSchema": SCHEMA})
        return listing
    async def call_tool_result(self, name, arguments=None, *, timeout=None, on_progress=None):
        if name == "box.refuse":
            raise RemoteError(ErrorCode.PERMISSION_DENIED, "ide may not use tool box.refuse",
                              agentId="box")
        return {"structuredContent": {"count": 3}}
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

CLIENT = """
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StdioClientTransport } from "@modelcontextprotocol/sdk/client/stdio.js";

const [command, ...args] = process.argv.slice(2);
const client = new Client({ name: "ts-check", version: "0.0.0" });
await client.connect(new StdioClientTransport({ command, args }));
const out = { tools: (await client.listTools()).tools.map((t) => t.name) };
out.count = await client.callTool({ name: "box.count", arguments: {} });
try {
  out.refuse = await client.callTool({ name: "box.refuse", arguments: {} });
} catch (error) {
  out.thrown = { code: error.code, message: String(error.message) };
}
console.log(JSON.stringify(out));
await client.close();
"""


NEEDS_SDK, NODE, MODULES = needs_js_sdk("P2PNODE_MCP_TS_SDK", "@modelcontextprotocol/sdk")


@pytest.mark.slow
@NEEDS_SDK
async def test_the_typescript_sdk_reads_results_and_error_results(tmp_path: Path) -> None:
    node = NODE
    (tmp_path / "node_modules").symlink_to(MODULES)  # ESM resolves from the script's dir
    script = tmp_path / "check.mjs"
    script.write_text(CLIENT)
    server = tmp_path / "server.py"
    server.write_text(SERVER)
    with trio.fail_after(120):
        done = await trio.run_process(
            [node, str(script), sys.executable, str(server)],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert done.returncode == 0, done.stderr.decode()
    out = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert out["tools"] == ["box.count", "box.refuse"]
    assert out["count"]["structuredContent"] == {"count": 3}
    assert "thrown" not in out, out["thrown"]  # the SDK took the error result as one
    refuse = out["refuse"]
    assert refuse["isError"] is True and "structuredContent" not in refuse
    assert refuse["content"][0]["text"].startswith("PERMISSION_DENIED: ")
    assert refuse["_meta"]["p2pnode/error"]["agentId"] == "box"
