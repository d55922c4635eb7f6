"""``p2pnode a2a serve`` and ``p2pnode a2a publish``: the swarm's agents for A2A clients,
and an A2A server as an agent of the swarm (p2pnode.bridges.a2a; docs/protocol/a2a.md).

The gateway is a node of its own (its identity in ``--data-dir``, a directory
no daemon runs in) that joins the swarm through ``--bootstrap`` and hosts one
agent, ``--agent-id``: the agent every owner sees asking. It runs on asyncio
(uvicorn, the SDK) with the node in trio's guest mode, serves HTTP on the
loopback only, and every request must carry the bearer token it writes to
``a2a-http.token`` in its data directory (mode 0600).

``a2a publish URL --agent-id ID`` reads the AgentCard of the A2A server at
URL and attaches agent ID, offering its skills, to the node of ``--data-dir``
over ``agent.sock`` (as ``mcp publish`` does); each request to ID becomes one
A2A message to the server. It runs until SIGINT or SIGTERM, withdrawing the
agent while the server is gone (p2pnode.bridges.a2a.supervise). Its
``--allow-*`` options are ``mcp publish``'s (p2pnode.cli.options.access_rule).

Registering the commands needs no SDK; running one does, and without it the
command fails with one line naming the extra (``pip install 'p2pnode[a2a]'``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio

from p2pnode.cli.datalock import hold_data_dir
from p2pnode.cli.options import (
    access_rule,
    add_allow_options,
    add_log_level,
    allow_rules,
    warn_open,
)
from p2pnode.core.envelope import Envelope
from p2pnode.core.errors import ErrorCode, LocalError, P2PError
from p2pnode.core.identity import default_data_dir, load_or_create_identity

logger = logging.getLogger("p2pnode.a2a")

#: The agent the gateway acts as, unless told otherwise.
DEFAULT_AGENT = "a2a-client"
#: Where the gateway writes the bearer token its clients send.
TOKEN_FILE = "a2a-http.token"
_LOOPBACK = ("127.0.0.1", "::1", "localhost")


def default_gateway_dir() -> Path:
    """The gateway's data directory unless told: ``a2a-gateway`` in the default one."""
    return default_data_dir() / "a2a-gateway"


def loopback_address(value: str) -> tuple[str, int]:
    """``--http HOST:PORT``, the host a loopback one. Raises LocalError(INVALID_ARGUMENT)."""
    host, colon, port = value.rpartition(":")
    host = host.strip("[]")
    if not colon or not port.isdigit() or int(port) > 65535:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"--http {value!r}: expected HOST:PORT")
    if host not in _LOOPBACK:
        raise LocalError(
            ErrorCode.INVALID_ARGUMENT,
            f"--http {value!r}: serves on the loopback only (127.0.0.1, ::1 or localhost)",
        )
    return host, int(port)


async def _acting(envelope: Envelope) -> None:
    """The gateway's agent only asks; what is sent to it is dropped."""


async def _serve(args: argparse.Namespace, data_dir: Path, http: tuple[str, int]) -> int:
    from p2pnode import NodeConfig, TrioNetwork, aio
    from p2pnode.bridges.a2a.gateway import Gateway, NodeSwarm
    from p2pnode.bridges.a2a.http import BearerGuard, base_url, listen, new_token, serve
    from p2pnode.node.config import parse_address, parse_bootstrap

    config = NodeConfig(
        data_dir=data_dir,
        listen=parse_address(args.listen),
        dht_listen=parse_address(args.listen),
        bootstrap=tuple(parse_bootstrap(text) for text in args.bootstrap or ()),
    )
    identity = load_or_create_identity(data_dir)
    try:
        sock = listen(*http)
    except OSError as exc:
        raise LocalError(ErrorCode.CONFIG_ERROR, f"cannot listen on --http: {exc}") from exc
    with sock:
        async with aio.open_node(identity, TrioNetwork(), config) as node:
            await node.add_agent(
                args.agent_id, _acting, tier=args.tier, sandbox_id=args.sandbox
            )
            if config.bootstrap:
                await node.join()
            url = base_url(http[0], sock.getsockname()[1])
            swarm = NodeSwarm(node, args.agent_id, refresh=args.refresh)
            gateway = Gateway(swarm, url, timeout=args.timeout)
            token_file = data_dir / TOKEN_FILE
            app = BearerGuard(gateway, new_token(token_file))
            ready = {"event": "ready", "url": f"{url}/agents", "tokenFile": str(token_file),
                     "peerId": str(node.peer_id), "agent": args.agent_id}  # fmt: skip
            try:
                await serve(app, sock, lambda: print(json.dumps(ready), flush=True))
            finally:
                await gateway.aclose()  # the pushes still waiting are lost (§6.1)
    return 0


def cmd_a2a_serve(args: argparse.Namespace) -> int:
    """``p2pnode a2a serve``: returns 0 after SIGINT or SIGTERM. Raises LocalError:
    CONFIG_ERROR without the SDK or for a port that cannot be bound, INVALID_ARGUMENT
    for an --http that is not a loopback HOST:PORT, BUSY when another process runs in
    the data directory."""
    http = loopback_address(args.http)
    if not 0 < args.timeout <= 86_400 or not args.refresh >= 0:
        raise LocalError(
            ErrorCode.INVALID_ARGUMENT,
            "--timeout is more than 0 and at most 86400 seconds; --refresh is 0 or more",
        )
    import asyncio

    from p2pnode.bridges.a2a import require_sdk

    require_sdk()
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="p2pnode a2a: %(levelname)s %(message)s"
    )
    data_dir = Path(args.data_dir) if args.data_dir else default_gateway_dir()
    with hold_data_dir(data_dir, data_dir / TOKEN_FILE):
        return asyncio.run(_serve(args, data_dir, http))


# -- a2a publish --------------------------------------------------------------------------------


def server_url(value: str) -> str:
    """``a2a publish URL``: an http or https URL. Raises LocalError(INVALID_ARGUMENT)."""
    scheme, sep, rest = value.partition("://")
    if not sep or scheme.lower() not in ("http", "https") or not rest.strip("/"):
        raise LocalError(
            ErrorCode.INVALID_ARGUMENT, f"{value!r}: expected the A2A server's http(s):// URL"
        )
    return value


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def _run_async(main: Callable[[], Awaitable[int]]) -> int:
    """Run ``main`` on asyncio; what ends it badly becomes one P2PError (printed as one
    line by the command line's handler)."""
    try:
        return anyio.run(main, backend="asyncio")
    except BaseExceptionGroup as group:
        leaves = list(_leaves(group))
        if any(isinstance(e, KeyboardInterrupt) for e in leaves):
            raise KeyboardInterrupt from None
        first = next((e for e in leaves if isinstance(e, P2PError)), None)
        if first is not None:
            raise first from None
        failed = next((e for e in leaves if isinstance(e, OSError)), None)
        if failed is not None:
            raise LocalError(ErrorCode.CONFIG_ERROR, str(failed)) from None
        raise


def cmd_a2a_publish(args: argparse.Namespace) -> int:
    """``p2pnode a2a publish``: returns 0 after SIGINT or SIGTERM. Raises LocalError:
    INVALID_ARGUMENT for a bad URL, agent id, interval or --allow-* rule, CONFIG_ERROR
    without the SDK, the first card read's code when it fails (INVALID_CARD,
    AGENT_UNAVAILABLE, TIMEOUT, MESSAGE_TOO_LARGE), and what attaching to the node
    raises."""
    url = server_url(args.url)
    if not args.agent_id:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "an agent id is required")
    if not 0 < args.timeout <= 86_400 or not 0 < args.poll <= 86_400:
        raise LocalError(
            ErrorCode.INVALID_ARGUMENT,
            "--timeout and --poll are more than 0 and at most 86400 seconds",
        )
    access = access_rule(allow_rules(args))
    from p2pnode.bridges.a2a import require_sdk

    require_sdk()
    from p2pnode.bridges.a2a.supervise import PublishSpec, ServerPublisher, host_attached
    from p2pnode.hosting.client import cancel_on_signal

    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="p2pnode a2a: %(levelname)s %(message)s"
    )
    # httpx logs each request at INFO: a card read every --poll seconds is no news.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    spec = PublishSpec(url, args.agent_id, tier=args.tier, sandbox=args.sandbox,
                       access=access, call_timeout=args.timeout, poll=args.poll)  # fmt: skip
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    publisher = ServerPublisher(spec, host_attached(data_dir))

    async def main() -> int:
        async with anyio.create_task_group() as tasks:

            async def announce() -> None:
                agent = await publisher.wait_published()
                print(json.dumps({"event": "published", "agent": agent.id, "url": url,
                                  "capabilities": [c.id for c in agent.capabilities]}),
                      flush=True)  # fmt: skip
                if access is None:
                    warn_open(logger, agent.id, "the A2A server")

            tasks.start_soon(cancel_on_signal, tasks.cancel_scope)
            tasks.start_soon(announce)
            await publisher.run()
        return 0

    return _run_async(main)


def _add_publish(a2a_sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    publish = a2a_sub.add_parser(
        "publish",
        help="publish an A2A server as an agent of the swarm",
        description="Read the AgentCard of the A2A server at URL (its "
        "/.well-known/agent-card.json, or URL itself when it ends in .json) and attach "
        "agent --agent-id to the node of --data-dir: each skill is a capability, each "
        "request one A2A message to the server. The agent is withdrawn while the server "
        "is gone and published again when it returns or its card changes. The --allow-* "
        "options restrict who may use it (every kind given must hold; the caller is who "
        "the node authenticated: its signed card, its peer, its endorsed roles); without "
        "one, any agent the node's policy lets send the agent a request may.",
    )
    publish.add_argument("url", metavar="URL", help="the A2A server's http(s) URL")
    publish.add_argument("--agent-id", required=True, help="the agent the server becomes")
    options: list[tuple[str, dict[str, Any]]] = [
        ("--tier", {"type": int, "choices": range(4), "default": 3, "help": "its tier 0-3"}),
        ("--sandbox", {"help": "its sandbox id"}),
        ("--timeout", {"type": float, "default": 30.0, "metavar": "SECONDS",
                       "help": "how long a message waits for the server when the request "
                       "has no deadline (default 30)"}),
        ("--poll", {"type": float, "default": 30.0, "metavar": "SECONDS",
                    "help": "how often the card is read again (default 30)"}),
    ]  # fmt: skip
    for flag, kwargs in options:
        publish.add_argument(flag, **kwargs)
    add_allow_options(publish)
    add_log_level(publish, "INFO")
    publish.set_defaults(handler=cmd_a2a_publish)


def add_a2a_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``a2a serve`` and ``a2a publish``."""
    a2a = sub.add_parser("a2a", help="bridge A2A: the swarm's agents for A2A clients, and back")
    a2a_sub = a2a.add_subparsers(dest="a2a_command", required=True, metavar="ACTION")
    serve = a2a_sub.add_parser(
        "serve",
        help="an A2A gateway: each agent of the swarm as an A2A agent over HTTP",
        description="A node of its own that joins the swarm and serves, on the loopback, "
        "one A2A agent per swarm agent its agent may discover (JSON-RPC and HTTP+JSON; "
        "the index at /agents). Clients send the bearer token written to "
        f"{TOKEN_FILE} in the data directory. --data-dir is the gateway node's own "
        "directory (default: a2a-gateway in the default one), never a daemon's.",
    )
    serve.add_argument("--http", required=True, metavar="HOST:PORT", help="loopback address")
    options: list[tuple[str, dict[str, Any]]] = [
        ("--listen", {"default": "127.0.0.1:0", "metavar": "HOST:PORT",
                      "help": "the gateway node's TCP and DHT address (default 127.0.0.1:0)"}),
        ("--bootstrap", {"action": "append", "metavar": "HOST:PORT",
                         "help": "a node of the swarm to join through (repeatable)"}),
        ("--agent-id", {"default": DEFAULT_AGENT,
                        "help": f"the agent the gateway acts as (default {DEFAULT_AGENT})"}),
        ("--tier", {"type": int, "choices": range(4), "default": 3, "help": "its tier 0-3"}),
        ("--sandbox", {"help": "its sandbox id"}),
        ("--timeout", {"type": float, "default": 30.0, "metavar": "SECONDS",
                       "help": "how long a message waits for its owner (default 30)"}),
        ("--refresh", {"type": float, "default": 5.0, "metavar": "SECONDS",
                       "help": "how long a discovery of the swarm's agents is reused "
                       "(default 5)"}),
    ]  # fmt: skip
    for flag, kwargs in options:
        serve.add_argument(flag, **kwargs)
    add_log_level(serve, "WARNING")
    serve.set_defaults(handler=cmd_a2a_serve)
    _add_publish(a2a_sub)


__all__ = [
    "DEFAULT_AGENT",
    "TOKEN_FILE",
    "add_a2a_commands",
    "cmd_a2a_publish",
    "cmd_a2a_serve",
    "loopback_address",
    "server_url",
]
