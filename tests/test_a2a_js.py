"""``p2pnode a2a serve`` with a second, independent A2A client: the official JavaScript
SDK (``@a2a-js/sdk``) under Node.js discovers an agent's card, sends a message and
streams one, over both HTTP bindings (docs/protocol/a2a.md §2-4).

It needs Node.js and the npm package ``@a2a-js/sdk``: set ``P2PNODE_A2A_JS_SDK`` to a
``node_modules`` directory holding it (``npm install @a2a-js/sdk`` in any directory).
Without them the test is skipped and says so; it never passes without running."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from p2pnode.cli.process import NodeProcess
from tests.jssdk import needs_js_sdk

#: Every wait in this test gives up after this long.
LIMIT = 60.0

#: The client: argv is the gateway's index URL, the token and the agent. It waits for the
#: index to list the agent, reads the card through the SDK's resolver, then per binding
#: sends one message and streams one, and prints what it saw as one JSON line.
CLIENT = """
import { randomUUID } from "node:crypto";
import { Role, TaskState } from "@a2a-js/sdk";
import {
  ClientFactory, ClientFactoryOptions, DefaultAgentCardResolver,
  JsonRpcTransportFactory, RestTransportFactory,
} from "@a2a-js/sdk/client";

const [index, token, agent] = process.argv.slice(2);
const authed = (input, init = {}) => {
  const headers = new Headers(init.headers ?? (input instanceof Request ? input.headers : {}));
  headers.set("Authorization", `Bearer ${token}`);
  return fetch(input, { ...init, headers });
};

let listed = [];
for (let i = 0; i < 200 && !listed.some((a) => a.id === agent); i++) {
  listed = (await (await authed(index)).json()).agents;
  if (!listed.some((a) => a.id === agent)) await new Promise((r) => setTimeout(r, 100));
}
const entry = listed.find((a) => a.id === agent);
const resolver = new DefaultAgentCardResolver({ fetchImpl: authed });
const card = await resolver.resolve(entry.card, "");  // the card's URL, as the index gives it
const out = {
  card: {
    name: card.name,
    skills: card.skills.map((s) => s.id),
    streaming: card.capabilities.streaming,
    bindings: card.supportedInterfaces.map((i) => i.protocolBinding),
  },
};

const message = (text) => ({
  messageId: randomUUID(), contextId: "", taskId: "", role: Role.ROLE_USER,
  parts: [{ content: { $case: "text", value: text }, metadata: undefined, filename: "",
            mediaType: "" }],
  metadata: undefined, extensions: [], referenceTaskIds: [],
});
const request = (text) => ({ tenant: "", message: message(text), configuration: undefined,
                             metadata: undefined });
const partJson = (part) => part.content.$case === "data"
  ? { data: part.content.value } : { [part.content.$case]: part.content.value };

for (const binding of ["JSONRPC", "HTTP+JSON"]) {
  const options = ClientFactoryOptions.createFrom(ClientFactoryOptions.default, {
    transports: [new JsonRpcTransportFactory({ fetchImpl: authed }),
                 new RestTransportFactory({ fetchImpl: authed })],
    preferredTransports: [binding],
    cardResolver: resolver,
  });
  // The SDK resolves the card's path against the base URL: it needs the trailing "/".
  const client = await new ClientFactory(options).createFromUrl(`${entry.url}/`);
  const sent = await client.sendMessage(request(`sent over ${binding}`));
  const task = sent.payload?.value ?? sent;
  const events = [];
  for await (const event of client.sendMessageStream(request(`streamed over ${binding}`))) {
    const { $case, value } = event.payload;
    if ($case === "artifactUpdate") {
      events.push({ kind: $case, parts: value.artifact.parts.map(partJson) });
    } else {
      events.push({ kind: $case, state: TaskState[value.status.state] });
    }
  }
  out[binding] = {
    sent: { kind: sent.payload?.$case, state: TaskState[task.status.state],
            parts: task.artifacts.flatMap((a) => a.parts.map(partJson)) },
    streamed: events,
  };
}
console.log(JSON.stringify(out));
"""


NEEDS_SDK, NODE, MODULES = needs_js_sdk("P2PNODE_A2A_JS_SDK", "@a2a-js/sdk")


async def _run_client(node: str, script: Path, ready: dict[str, Any], token: str) -> Any:
    with trio.fail_after(LIMIT):
        done = await trio.run_process(
            [node, str(script), ready["url"], token, "owner-agent"],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


@pytest.mark.slow
@NEEDS_SDK
async def test_the_javascript_sdk_discovers_sends_and_streams(tmp_path: Path) -> None:
    node = NODE
    (tmp_path / "node_modules").symlink_to(MODULES)  # ESM resolves from the script's dir
    script = tmp_path / "client.mjs"
    script.write_text(CLIENT)
    owner = NodeProcess(tmp_path / "owner")
    owner.prepare("owner-agent", 3)
    async with trio.open_nursery() as nursery:
        await owner.start(nursery, None)
        argv = [sys.executable, "-m", "p2pnode", "--data-dir", str(tmp_path / "gateway"), "a2a",
                "serve", "--http", "127.0.0.1:0", "--bootstrap", owner.address]  # fmt: skip
        serve = await trio.lowlevel.open_process(argv, stdout=-1, env=owner.env)
        try:
            assert serve.stdout is not None
            with trio.fail_after(LIMIT):
                ready = json.loads(await serve.stdout.receive_some(65536))
            token = (await trio.Path(ready["tokenFile"]).read_text()).strip()
            out = await _run_client(node, script, ready, token)
            serve.send_signal(signal.SIGTERM)
            with trio.fail_after(LIMIT):
                assert await serve.wait() == 0
        finally:
            if serve.returncode is None:
                serve.kill()
                await serve.wait()
            await owner.stop()
    assert out["card"]["name"] and out["card"]["skills"]
    assert out["card"]["streaming"] is True
    assert out["card"]["bindings"][:2] == ["JSONRPC", "HTTP+JSON"]
    for binding in ("JSONRPC", "HTTP+JSON"):
        sent = out[binding]["sent"]
        assert sent["state"] == "TASK_STATE_COMPLETED", sent
        (part,) = sent["parts"]
        assert part["data"]["echo"] == f"sent over {binding}"
        assert part["data"]["from"] == "a2a-client"
        streamed = out[binding]["streamed"]
        kinds = [e["kind"] for e in streamed]
        assert kinds[0] == "task" and kinds[-1] == "statusUpdate", streamed
        states = [e["state"] for e in streamed if e["kind"] == "statusUpdate"]
        assert states == ["TASK_STATE_WORKING", "TASK_STATE_COMPLETED"], streamed
        (artifact,) = [e for e in streamed if e["kind"] == "artifactUpdate"]
        assert artifact["parts"][0]["data"]["echo"] == f"streamed over {binding}"
