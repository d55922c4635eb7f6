"""``p2pnode mcp serve | publish`` and ``p2pnode run --mcp-server``: the MCP bridge's
commands (p2pnode.bridges.mcp; docs/protocol/mcp.md).

Registering the commands needs no MCP SDK; running one does, and without it
the command fails with one line naming the extra (``pip install
'p2pnode[mcp]'``). The SDK is written on anyio: ``mcp serve`` runs on trio
(on asyncio with ``--http``, for uvicorn), ``mcp publish`` on asyncio and
``run --mcp-server`` in the daemon's trio run.

* ``mcp serve`` is launched by an MCP client and speaks MCP on stdio (or
  streamable HTTP on the loopback with ``--http``), as agent ``--agent-id``
  of the node of ``--data-dir``.
* ``mcp publish --agent-id ID -- COMMAND ARGS...`` runs a stdio MCP server
  and publishes what it offers as agent ID, attached to the node over
  ``agent.sock``, until SIGINT or SIGTERM.
* ``run --mcp-server ID=COMMAND`` does the same inside the daemon;
  ``--mcp-allow KIND=VALUE`` restricts who may use them.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from p2pnode.agent.definition import Agent
from p2pnode.cli.options import (
    access_rule,
    add_allow_options,
    add_log_level,
    allow_rules,
    warn_open,
)
from p2pnode.core.cardfile import read_card_file
from p2pnode.core.errors import ErrorCode, LocalError, P2PError
from p2pnode.core.identity import Identity, default_data_dir

if TYPE_CHECKING:
    # The bridge and the composed node load when a command runs them, not with the parser.
    from p2pnode.runtime import Node

logger = logging.getLogger("p2pnode.mcp")

#: The agent ``mcp serve`` attaches as, unless told otherwise.
DEFAULT_SERVE_AGENT = "mcp-client"


def _data_dir(args: argparse.Namespace) -> Path:
    return Path(args.data_dir) if args.data_dir else default_data_dir()


def _check_agent_id(agent_id: str) -> str:
    """An agent id as given (the node checks it when the agent attaches or is added)."""
    if not agent_id:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "an agent id is required")
    return agent_id


def parse_server_option(value: str) -> tuple[str, tuple[str, ...]]:
    """``ID=COMMAND`` of ``run --mcp-server``: the agent id and the command's argv
    (split as a shell would). Raises LocalError(INVALID_ARGUMENT)."""
    agent_id, equals, command = value.partition("=")
    argv = tuple(shlex.split(command)) if equals else ()
    if not argv:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"--mcp-server {value!r}: expected ID=COMMAND")
    return _check_agent_id(agent_id), argv


def _run_async(main: Callable[[], Awaitable[int]], backend: str = "asyncio") -> int:
    """Run ``main`` on ``backend``; what ends it badly becomes one P2PError (the command
    line's handler prints it as one line)."""
    try:
        return anyio.run(main, backend=backend)
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        if any(isinstance(e, KeyboardInterrupt) for e in leaves):
            raise KeyboardInterrupt from None
        first = next((e for e in leaves if isinstance(e, P2PError)), None)
        if first is not None:
            raise first from None
        if any(isinstance(e, OSError) for e in leaves):
            error = next(e for e in leaves if isinstance(e, OSError))
            raise LocalError(ErrorCode.CONFIG_ERROR, str(error)) from None
        raise


def _leaves(exc: BaseException) -> Any:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, format="p2pnode mcp: %(levelname)s %(message)s"
    )


# -- mcp serve ----------------------------------------------------------------------------------


def _serve_agent(args: argparse.Namespace) -> Agent:
    if args.card:
        template = read_card_file(Path(args.card))
        agent_id = str(template.get("id", ""))
        return Agent(
            _check_agent_id(agent_id),
            name=str(template.get("name") or agent_id),
            description=str(template.get("description", "")),
            tier=int(template.get("tier", 3)),
            sandbox=template.get("sandboxId"),
        )
    return Agent(
        _check_agent_id(args.agent_id),
        description="An MCP client using the swarm through p2pnode mcp serve",
        tier=args.tier,
        sandbox=args.sandbox,
    )


def cmd_mcp_serve(args: argparse.Namespace) -> int:
    from p2pnode.bridges.mcp import require_sdk

    require_sdk()
    from p2pnode.bridges.mcp.serve import SwarmServer, serve_stdio
    from p2pnode.hosting.client import AgentClient

    _configure_logging(args.log_level)
    agent = _serve_agent(args)
    http = _loopback_address(args.http) if args.http else None

    async def main() -> int:
        async with AgentClient(agent, data_dir=_data_dir(args)) as client:
            server = SwarmServer(client.tools, poll_interval=args.poll)
            closed: list[bool] = []
            async with anyio.create_task_group() as tasks:

                async def node_closed() -> None:
                    await client.wait_closed()
                    closed.append(True)
                    tasks.cancel_scope.cancel()

                tasks.start_soon(node_closed)
                if http is not None:
                    from p2pnode.bridges.mcp.http import serve_http

                    await serve_http(server, *http, token_file=_data_dir(args) / TOKEN_FILE)
                else:
                    await serve_stdio(server)
                tasks.cancel_scope.cancel()
        if closed:
            raise LocalError(ErrorCode.CHANNEL_CLOSED, "the node closed the connection")
        return 0

    # stdio on trio (its pipes polled, not read by threads); HTTP on asyncio (uvicorn).
    return _run_async(main, "asyncio" if http is not None else "trio")


#: Where ``mcp serve --http`` writes the bearer token its clients must send.
TOKEN_FILE = "mcp-http.token"


def _loopback_address(value: str) -> tuple[str, int]:
    host, colon, port = value.rpartition(":")
    host = host.strip("[]")
    if not colon or not port.isdigit() or int(port) > 65535:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"--http {value!r}: expected HOST:PORT")
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise LocalError(
            ErrorCode.INVALID_ARGUMENT,
            f"--http {value!r}: serves on the loopback only (127.0.0.1, ::1 or localhost)",
        )
    return host, int(port)


# -- mcp publish --------------------------------------------------------------------------------


def cmd_mcp_publish(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise LocalError(
            ErrorCode.INVALID_ARGUMENT, "give the server's command after --: publish ... -- CMD"
        )
    access = access_rule(allow_rules(args))
    from p2pnode.bridges.mcp import require_sdk

    require_sdk()
    from p2pnode.bridges.mcp.supervise import ChildServer, ServerSpec, host_attached
    from p2pnode.hosting.client import cancel_on_signal

    _configure_logging(args.log_level)
    spec = ServerSpec(
        _check_agent_id(args.agent_id),
        tuple(command),
        tier=args.tier,
        sandbox=args.sandbox,
        access=access,
    )
    if access is None:
        warn_open(logger, spec.agent_id, "what the server offers")
    child = ChildServer(spec, host_attached(_data_dir(args)))

    async def main() -> int:
        async with anyio.create_task_group() as tasks:

            async def announce() -> None:
                agent = await child.wait_published()
                print(json.dumps({"event": "published", "agent": agent.id,
                                  "tools": sorted(agent.catalog.tools),
                                  "resources": sorted(agent.catalog.resources),
                                  "prompts": sorted(agent.catalog.prompts)}),
                      flush=True)  # fmt: skip

            tasks.start_soon(cancel_on_signal, tasks.cancel_scope)
            tasks.start_soon(announce)
            await child.run()
        return 0

    return _run_async(main)


# -- run --mcp-server ---------------------------------------------------------------------------


def add_run_options(run: argparse.ArgumentParser) -> None:
    """``run --mcp-server ID=COMMAND`` and ``--mcp-allow KIND=VALUE``."""
    run.add_argument(
        "--mcp-server",
        action="append",
        metavar="ID=COMMAND",
        help="run a stdio MCP server (COMMAND, split as a shell would) and publish what it "
        "offers as agent ID, restarted with backoff when it exits (repeatable; needs "
        "p2pnode[mcp])",
    )
    run.add_argument(
        "--mcp-allow",
        action="append",
        metavar="KIND=VALUE",
        help="who may use the --mcp-server agents (repeatable; KIND: tier, sandbox, agent, "
        "peer or role; every kind given must hold; default: whoever policy lets in)",
    )


async def start_mcp_servers(
    node: Node,
    args: argparse.Namespace,
    *,
    authority: Identity | None = None,
    roles: tuple[str, ...] = (),
) -> None:
    """Start the daemon's ``--mcp-server`` children as a service of ``node``; returns once
    each has published its agent. Raises LocalError(CONFIG_ERROR) when one cannot start,
    LocalError(INVALID_ARGUMENT) for a bad option."""
    specs = [parse_server_option(v) for v in args.mcp_server or ()]
    if not specs:
        return
    rules = []
    for rule in args.mcp_allow or ():
        kind, _, value = rule.partition("=")
        rules.append((kind, value))
    access = access_rule(rules)
    from p2pnode.bridges.mcp import require_sdk

    require_sdk()
    from p2pnode.bridges.mcp.supervise import ChildServer, ChildServers, ServerSpec, host_in_node

    host = host_in_node(node, authority=authority, roles=roles)
    children = [ChildServer(ServerSpec(i, argv, access=access), host) for i, argv in specs]
    await node.start_service(ChildServers(children))


# -- the parser ---------------------------------------------------------------------------------


def add_mcp_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``mcp serve`` and ``mcp publish``."""
    mcp = sub.add_parser("mcp", help="bridge MCP: the swarm's tools for MCP clients, and back")
    mcp_sub = mcp.add_subparsers(dest="mcp_command", required=True, metavar="ACTION")

    serve = mcp_sub.add_parser(
        "serve",
        help="an MCP server (stdio) offering the swarm's tools, resources and prompts",
        description="Launched by an MCP client: attaches to the local node as one agent and "
        "offers, over MCP, every tool, resource and prompt that agent may use in the swarm.",
    )
    serve.add_argument(
        "--agent-id",
        default=DEFAULT_SERVE_AGENT,
        help=f"id of the agent the server attaches as (default: {DEFAULT_SERVE_AGENT})",
    )
    serve.add_argument("--tier", type=int, choices=range(4), default=3, help="tier 0-3")
    serve.add_argument("--sandbox", help="sandbox id of the agent")
    serve.add_argument("--card", help="a card template (id, name, description, tier, sandboxId)")
    serve.add_argument(
        "--poll",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how often to look for tools appearing or vanishing (default 5)",
    )
    serve.add_argument(
        "--http",
        metavar="HOST:PORT",
        help="serve streamable HTTP on the loopback instead of stdio (clients send the "
        f"bearer token written to {TOKEN_FILE} in the data directory)",
    )
    add_log_level(serve, "WARNING")
    serve.set_defaults(handler=cmd_mcp_serve)

    publish = mcp_sub.add_parser(
        "publish",
        help="run a stdio MCP server and publish what it offers as an agent",
        usage="%(prog)s --agent-id ID [options] -- COMMAND [ARGS...]",
    )
    publish.add_argument("--agent-id", required=True, help="the agent the server becomes")
    publish.add_argument("--tier", type=int, choices=range(4), default=3, help="tier 0-3")
    publish.add_argument("--sandbox", help="sandbox id of the agent")
    add_allow_options(publish)
    add_log_level(publish, "INFO")
    publish.add_argument("command", nargs=argparse.REMAINDER, help="the server's command")
    publish.set_defaults(handler=cmd_mcp_publish)


__all__ = [
    "DEFAULT_SERVE_AGENT",
    "TOKEN_FILE",
    "access_rule",
    "add_mcp_commands",
    "add_run_options",
    "parse_server_option",
    "start_mcp_servers",
]
