// An agent in Node.js, attached to a running p2pnode over its agent socket.
//
//   node examples/agent.js [DATA_DIR]     (default: $P2PNODE_HOME, else ~/.local/share/p2pnode)
//
// No npm packages: `net` and `readline` only. The protocol is JSON lines on the
// Unix socket DATA_DIR/agent.sock (docs/protocol/agents.md): attach a card, then
// answer each request the node forwards with a reply. It prints one JSON line
// to stdout once attached ({"attached": ID}) and one per envelope it receives.

"use strict";

const net = require("net");
const os = require("os");
const path = require("path");
const readline = require("readline");

const dataDir =
  process.argv[2] ||
  process.env.P2PNODE_HOME ||
  path.join(process.env.XDG_DATA_HOME || path.join(os.homedir(), ".local", "share"), "p2pnode");

const card = {
  id: process.env.AGENT_ID || "shouter",
  name: "Shouter",
  description: "Upper-cases text; a Node.js agent",
  tier: 3,
  capabilities: [
    {
      id: "text.upper",
      name: "Upper case",
      description: "Returns the text in upper case",
      inputSchema: {
        type: "object",
        properties: { text: { type: "string" } },
        required: ["text"],
      },
    },
  ],
};

// Handlers by capability: what they return is the response; what they throw, an error.
const handlers = {
  "text.upper": (payload) => ({ upper: payload.text.toUpperCase(), by: "node.js" }),
};

const socket = net.createConnection(path.join(dataDir, "agent.sock"));
const send = (obj) => socket.write(JSON.stringify(obj) + "\n");
let nextId = 1;

socket.on("connect", () => send({ v: 1, op: "attach", id: nextId++, card }));
socket.on("error", (err) => {
  console.error(`agent socket: ${err.message}`);
  process.exit(1);
});
socket.on("close", () => process.exit(0)); // the node closed: detached or stopping

readline.createInterface({ input: socket }).on("line", (line) => {
  const message = JSON.parse(line);
  if (message.event === "envelope") {
    onEnvelope(message.envelope);
  } else if (message.op === "attach") {
    if (!message.ok) {
      console.error(`attach refused: ${message.error.code}: ${message.error.message}`);
      process.exit(1);
    }
    console.log(JSON.stringify({ attached: message.result.agent }));
  } else if (message.ok === false) {
    console.error(`${message.op}: ${message.error.code}: ${message.error.message}`);
  }
});

function onEnvelope(envelope) {
  console.log(JSON.stringify({ received: envelope.type, from: envelope.sender }));
  if (envelope.type !== "request") return; // notifications need no answer
  // The node checked the capability and its inputSchema before forwarding.
  const capability = (envelope.metadata || {}).capability;
  const handler = handlers[capability];
  try {
    if (!handler) throw { code: "CAPABILITY_NOT_FOUND", message: `no ${capability}` };
    send({ op: "reply", to: envelope.id, type: "response", payload: handler(envelope.payload) });
  } catch (err) {
    const error = err.code
      ? { code: err.code, message: err.message, details: {} }
      : { code: "HANDLER_FAILED", message: "the handler failed", details: {} };
    send({ op: "reply", to: envelope.id, type: "error", payload: error });
  }
}

// SIGTERM or Ctrl-C: detach, so the node withdraws the card at once.
for (const signal of ["SIGINT", "SIGTERM"]) {
  process.on(signal, () => {
    send({ op: "detach", id: nextId++ });
    setTimeout(() => process.exit(0), 1000).unref();
  });
}
