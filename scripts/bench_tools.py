"""Benchmark: a cross-node tool call beside a plain request and beside the MCP SDK's own calls.

Usage: python scripts/bench_tools.py [--runs 3] [--calls 2000]

Every row calls one tool shape, ``add(a: int, b: int) -> int`` with ``{"a": 1, "b": 2}``,
one call at a time, and is measured in the same run:

(a) a plain request between two node processes: the owner agent's request handler
    adds the payload's two numbers (no schema, no audit);
(b) ``node.tools.call_tool("owner.add", ...)`` between the same two processes, over the
    same channel, to the same agent: the caller's checks, the owner's argument
    validation (pydantic, from the type hints), access check, the function, result
    validation, the audit event and the invocation record;
(c) the MCP SDK's ``ClientSession`` calling the same tool on the SDK's server in the
    same process: "direct" is the SDK's default in-process client (mcp 2: a dispatcher
    pair, no streams and no JSON-RPC framing: no transport at all); "memory streams"
    is the same through in-memory streams (mcp 1's
    ``create_connected_server_and_client_session``, mcp 2's ``Client(mode="legacy")``);
(d) the SDK's ``ClientSession`` over ``stdio_client`` to the SDK's server in a
    subprocess;
(e) the same client over ``stdio_client`` to ``p2pnode mcp serve`` (the MCP bridge),
    calling ``owner.add``: the bridge attaches to a ``p2pnode run`` daemon joined to
    the owner's node, so the call crosses stdio, agent.sock and the node-to-node
    channel (4 processes), where (d) crosses stdio only.

(a) and (b) alternate call by call, so machine noise falls on both alike; the SDK rows
run on asyncio, where the SDK is commonly used. The SDK is not a dependency of
p2pnode: install it in the benchmark's environment (``pip install mcp``).

Targets, each computed within one run, then the median of the runs:
(b) - (a) p50 <= 40 us (what validation and audit add); (b) p50 <= the SDK's fastest
in-process p50; (b) p50 <= 0.3x the SDK's stdio p50; the swarm hop adds at most 1.5x
the local stdio call: (e) - (d) p50 <= 1.5x (d) p50 (so (e) <= 2.5x (d)).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any

import trio
from bench_agents import HOST, echo, quantiles, timed_round_trips
from bench_channel import fmt
from bench_node import SERVE_SECONDS

from p2pnode.agent.definition import Agent, Message
from p2pnode.core.identity import Identity
from p2pnode.runtime import Node
from p2pnode.transport.net import TrioNetwork

ARGUMENTS = {"a": 1, "b": 2}
ANSWER = 3
WARMUP = 200
TARGET_ADDED_US = 40.0
TARGET_IN_PROCESS_RATIO = 1.0
TARGET_STDIO_RATIO = 0.3
#: What the MCP bridge's swarm hop may add to the local stdio call, as a multiple of it.
TARGET_BRIDGE_ADDED = 1.5
#: The tool as the bridge names it (the owner's agent id, a dot, the tool).
BRIDGED_TOOL = "owner.add"
#: The SDK's server logs each request at INFO in mcp 1; a benchmark measures the calls.
SDK_LOG_LEVEL = "WARNING"


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


# -- the owner's node (a child process) -------------------------------------------------------


def owner_agent() -> Agent:
    """The tool, and a plain request handler doing the same work with no schema or audit."""
    agent = Agent("owner", tier=3)
    agent.tool()(add)

    @agent.on_request()
    def plain(message: Message) -> int:
        return add(message.payload["a"], message.payload["b"])

    return agent


async def serve_owner(*, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    async with Node(Identity.generate(), TrioNetwork()) as node:
        await node.add_agent(owner_agent())
        task_status.started(node.listen_address[1])
        await trio.sleep_forever()


async def serve_until_killed() -> None:
    with trio.move_on_after(SERVE_SECONDS):
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_owner)
            print(port, flush=True)


# -- the caller's node ------------------------------------------------------------------------


async def node_round_trips(port: int, calls: int) -> tuple[list[float], list[float]]:
    """Round trips (us) of a plain request and of a tool call, alternating call by call."""
    async with Node(Identity.generate(), TrioNetwork()) as node:
        await node.add_agent("user", echo, tier=3)
        await node.connect((HOST, port))

        async def request() -> Any:
            return (await node.request("user", "owner", ARGUMENTS)).payload

        async def tool() -> Any:
            return await node.tools.call_tool("owner.add", ARGUMENTS, caller="user")

        for call in (request, tool):
            answer = await call()
            if answer != ANSWER:
                raise SystemExit(f"{call.__name__} answered {answer!r}, not {ANSWER}")
        requests: list[float] = []
        tools: list[float] = []
        for i in range(WARMUP + calls):
            pairs = ((request, requests), (tool, tools))
            for call, samples in pairs if i % 2 else pairs[::-1]:  # neither always first
                start = time.perf_counter()
                await call()
                if i >= WARMUP:
                    samples.append((time.perf_counter() - start) * 1e6)
        return requests, tools


def in_two_processes(calls: int) -> tuple[list[float], list[float]]:
    owner = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        port = int(owner.stdout.readline())
        return trio.run(node_round_trips, port, calls)
    finally:
        owner.kill()
        owner.wait()


# -- the MCP SDK (imported lazily: not a dependency of p2pnode) --------------------------------


def sdk_available() -> bool:
    try:
        importlib.import_module("mcp")
    except ImportError:
        return False
    return True


def sdk_server() -> Any:
    """The SDK's server (mcp 2: MCPServer; mcp 1: FastMCP) offering ``add``."""
    try:
        server_class = importlib.import_module("mcp.server.mcpserver").MCPServer
    except ImportError:
        server_class = importlib.import_module("mcp.server.fastmcp").FastMCP
    server = server_class("bench", log_level=SDK_LOG_LEVEL)
    server.tool()(add)
    return server


def sdk_has_direct() -> bool:
    """Whether the SDK has an in-process client with no streams (mcp 2's ``Client``)."""
    return hasattr(importlib.import_module("mcp"), "Client")


@asynccontextmanager
async def sdk_session(transport: str, data_dir: str = "") -> AsyncIterator[Any]:
    """An initialized SDK ``ClientSession`` to a server offering ``add``, over ``transport``:
    "direct", "memory" (both in this process), "stdio" (the server in a subprocess) or
    "bridge" (``p2pnode mcp serve`` attached to the daemon of ``data_dir``)."""
    sdk = importlib.import_module("mcp")
    if transport in ("stdio", "bridge"):
        stdio = importlib.import_module("mcp.client.stdio")
        # The SDK passes the server a short list of variables; PYTHONPATH is kept so that
        # the server imports the same SDK as this process.
        keep = {k: v for k, v in os.environ.items() if k == "PYTHONPATH"}
        argv = [__file__, "--serve-mcp"]
        if transport == "bridge":
            argv = ["-m", "p2pnode", "--data-dir", data_dir, "mcp", "serve", "--agent-id", "bench"]
        params = sdk.StdioServerParameters(command=sys.executable, args=argv, env=keep)
        async with (
            stdio.stdio_client(params) as (read, write),
            sdk.ClientSession(read, write) as session,
        ):
            await session.initialize()
            yield session
    elif sdk_has_direct():  # mcp 2: Client(server) connects in-process
        mode = "auto" if transport == "direct" else "legacy"
        async with sdk.Client(sdk_server(), mode=mode) as client:
            yield client.session
    else:  # mcp 1: in-memory streams only
        memory = importlib.import_module("mcp.shared.memory")
        lowlevel = sdk_server()._mcp_server
        async with memory.create_connected_server_and_client_session(lowlevel) as session:
            yield session


async def sdk_round_trips(transport: str, calls: int, data_dir: str = "") -> list[float]:
    async with sdk_session(transport, data_dir) as session:
        name = BRIDGED_TOOL if transport == "bridge" else "add"

        async def call() -> Any:
            return await session.call_tool(name, ARGUMENTS)

        result = await call()
        for _ in range(100):  # the bridge's node may still be meeting the owner's
            if not getattr(result, "is_error", False):
                break
            await asyncio.sleep(0.05)
            result = await call()
        if getattr(result, "is_error", getattr(result, "isError", True)) or (
            result.content[0].text != str(ANSWER)
        ):
            raise SystemExit(f"the SDK over {transport} answered {result!r}")
        return await timed_round_trips(calls, call)  # bench_node's loop: 200 calls of warm-up


def serve_mcp() -> None:
    sdk_server().run()  # stdio


def bridge_round_trips(calls: int) -> list[float]:
    """(e): the owner's node as for (a) and (b), a ``p2pnode run`` daemon joined to it,
    and the SDK's client calling ``owner.add`` through ``p2pnode mcp serve``."""
    owner = subprocess.Popen(
        [sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True
    )
    with tempfile.TemporaryDirectory() as data_dir:
        daemon = None
        try:
            assert owner.stdout is not None
            port = int(owner.stdout.readline())
            daemon = subprocess.Popen(
                [sys.executable, "-m", "p2pnode", "--data-dir", data_dir, "run",
                 "--bootstrap", f"{HOST}:{port}", "--log-level", "WARNING"],
                stdout=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            assert daemon.stdout is not None
            if '"ready"' not in daemon.stdout.readline():
                raise SystemExit("the bridge's daemon did not start")
            return asyncio.run(sdk_round_trips("bridge", calls, data_dir))
        finally:
            for process in (daemon, owner):
                if process is not None:
                    process.kill()
                    process.wait()


# -- one run, and the report ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Row:
    key: str
    label: str


REQUEST = Row("request", "(a) plain request, node to node, 2 processes")
TOOL = Row("tool", "(b) tool call, node to node, 2 processes")
DIRECT = Row("direct", "(c) MCP SDK in-process, direct")
MEMORY = Row("memory", "(c') MCP SDK in-process, memory streams")
STDIO = Row("stdio", "(d) MCP SDK over stdio, 2 processes")
BRIDGE = Row("bridge", "(e) MCP SDK over stdio, mcp serve, node to node")


def rows() -> list[Row]:
    in_process = [DIRECT, MEMORY] if sdk_has_direct() else [MEMORY]
    return [REQUEST, TOOL, *in_process, STDIO, BRIDGE]


#: One run: each row's (p50, p99) in us.
Run = dict[str, tuple[float, float]]


def one_run(calls: int) -> Run:
    requests, tools = in_two_processes(calls)
    run = {REQUEST.key: quantiles(requests), TOOL.key: quantiles(tools)}
    for row in rows()[2:-1]:
        run[row.key] = quantiles(asyncio.run(sdk_round_trips(row.key, calls)))
    run[BRIDGE.key] = quantiles(bridge_round_trips(calls))
    return run


def in_process_reference(run: Run) -> tuple[str, float]:
    """The SDK's fastest in-process p50 in ``run``, and which it is."""
    key = min((r.key for r in rows() if r.key in (DIRECT.key, MEMORY.key)), key=lambda k: run[k][0])
    return key, run[key][0]


def print_run(number: int, runs: int, run: Run) -> None:
    header = f"run {number} of {runs}"
    print(f"{header:<48}{'p50 (us)':>10}{'p99 (us)':>10}")
    for row in rows():
        p50, p99 = run[row.key]
        print(f"  {row.label:<46}{fmt(p50):>10}{fmt(p99):>10}")


def verdict(met: bool) -> str:
    return "MET" if met else "NOT MET"


def print_summary(results: list[Run]) -> None:
    count = len(results)
    print(f"{'medians of ' + str(count) + ' runs':<48}{'p50 (us)':>10}{'p99 (us)':>10}")
    for row in rows():
        p50 = statistics.median(run[row.key][0] for run in results)
        p99 = statistics.median(run[row.key][1] for run in results)
        print(f"  {row.label:<46}{fmt(p50):>10}{fmt(p99):>10}")
    added = statistics.median(run[TOOL.key][0] - run[REQUEST.key][0] for run in results)
    over_request = statistics.median(run[TOOL.key][0] / run[REQUEST.key][0] for run in results)
    references = [in_process_reference(run) for run in results]
    in_process = statistics.median(
        run[TOOL.key][0] / p50 for run, (_, p50) in zip(results, references, strict=True)
    )
    which = statistics.mode(key for key, _ in references)
    stdio = statistics.median(run[TOOL.key][0] / run[STDIO.key][0] for run in results)
    print(f"targets (each computed within a run; the median of {count})")
    print(
        f"  validation and audit add (b) - (a) p50: {added:.1f} us ({over_request:.2f}x) "
        f"<= {TARGET_ADDED_US:.0f} us: {verdict(added <= TARGET_ADDED_US)}"
    )
    print(
        f"  tool call vs the SDK in-process (fastest: {which}) p50: {in_process:.2f}x <= "
        f"{TARGET_IN_PROCESS_RATIO:.2f}x: {verdict(in_process <= TARGET_IN_PROCESS_RATIO)}"
    )
    print(
        f"  tool call vs the SDK over stdio p50: {stdio:.2f}x <= {TARGET_STDIO_RATIO:.2f}x: "
        f"{verdict(stdio <= TARGET_STDIO_RATIO)}"
    )
    bridged = statistics.median(run[BRIDGE.key][0] / run[STDIO.key][0] for run in results)
    hop = statistics.median(
        (run[BRIDGE.key][0] - run[STDIO.key][0]) / run[STDIO.key][0] for run in results
    )
    print(
        f"  MCP client to a swarm tool through mcp serve vs the SDK over stdio p50: "
        f"{bridged:.2f}x; the swarm hop adds {hop:.2f}x the local stdio call <= "
        f"{TARGET_BRIDGE_ADDED:.2f}x: {verdict(hop <= TARGET_BRIDGE_ADDED)}"
    )


def main(runs: int, calls: int) -> None:
    print(
        f"add(a: int, b: int) -> int, {calls} calls per row after {WARMUP} of warm-up, "
        f"one at a time; mcp {version('mcp')}"
    )
    results = []
    for number in range(1, runs + 1):
        results.append(one_run(calls))
        print_run(number, runs, results[-1])
    print_summary(results)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of the whole set (median)")
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per row and run")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-mcp", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        trio.run(serve_until_killed)
    elif args.serve_mcp:
        serve_mcp()
    elif not sdk_available():
        print(
            "bench_tools.py compares with the MCP SDK, which is not installed here: "
            "pip install mcp (in the benchmark's environment; p2pnode does not depend on it)",
            file=sys.stderr,
        )
        sys.exit(2)
    else:
        main(max(1, args.runs), max(100, args.calls))
