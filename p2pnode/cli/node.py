"""``p2pnode run | status | find | send | doc``: the daemon and its control clients
(``tools``, ``resources`` and ``prompts`` are in p2pnode.cli.tools)."""

from __future__ import annotations

import argparse
import enum
import importlib
import json
import logging
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from p2pnode.agent.definition import Agent
from p2pnode.cli.datalock import hold_data_dir
from p2pnode.cli.demo import add_demo_command
from p2pnode.cli.mcp import add_run_options, start_mcp_servers
from p2pnode.cli.options import add_acting_agent, add_json, add_log_level
from p2pnode.cli.tasks import add_task_commands, task_ops
from p2pnode.cli.tools import add_tool_commands, tool_ops
from p2pnode.core.boundary import describe
from p2pnode.core.cardfile import (
    CARD_FILE_NAME,
    card_from_template,
    default_agent_id,
    read_card_file,
    starter_template,
)
from p2pnode.core.envelope import Envelope, MessageType, wall_clock_ms
from p2pnode.core.errors import ErrorCode, LocalError, P2PError
from p2pnode.core.identity import default_data_dir, load_identity, load_or_create_identity
from p2pnode.core.jsonutil import b64decode
from p2pnode.node.control import (
    CONTROL_SOCKET_NAME,
    ControlServer,
    Op,
    check_payload,
    control_call,
    parse_message_type,
)
from p2pnode.transport.net import Address, DatagramEndpoint, StreamListener, TrioNetwork

if TYPE_CHECKING:
    # The composed node, its services and the relay load when `run` starts a node; the
    # commands that only ask a running node over its control socket start without them.
    from p2pnode.runtime import Node
    from p2pnode.transport.relay import RelayStatistics
    from p2pnode.transport.relayserve import RelayServer

CONTROL_TIMEOUT = 60.0
logger = logging.getLogger("p2pnode.node")


def _data_dir(args: argparse.Namespace) -> Path:
    return Path(args.data_dir) if args.data_dir else default_data_dir()


def read_bootstrap_file(path: Path) -> list[str]:
    """Bootstrap list: one ``host:port`` per line; ``#`` starts a comment."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise LocalError(ErrorCode.CONFIG_ERROR, f"cannot read {path}: {exc.strerror}") from exc
    return [s for line in lines if (s := line.split("#", 1)[0].strip())]


def bootstrap_addresses(args: argparse.Namespace) -> tuple[Address, ...]:
    """``--bootstrap`` and ``--bootstrap-file``, parsed (host names resolved later, when
    joining). Raises LocalError(CONFIG_ERROR) naming the first malformed address."""
    from p2pnode.node.config import parse_bootstrap

    texts = list(args.bootstrap or [])
    if args.bootstrap_file:
        texts += read_bootstrap_file(Path(args.bootstrap_file))
    return tuple(parse_bootstrap(text) for text in texts)


def ready_line(node: Node, control: Path, relay: str | None = None) -> str:
    """The JSON line ``run`` prints once it serves: who it is, where, and whether it
    joined (``join``: ``joined via 1 of 2 bootstrap peers, 3 peers`` or ``not joined:
    no bootstrap peer answered; retrying in 4 s, 0 peers``); with ``--relay``, the
    relay's address for other nodes' ``--use-relay`` (``relay``)."""
    join = node.joining.status(trio.current_time())
    line: dict[str, Any] = {
        "event": "ready",
        "peerId": str(node.peer_id),
        "addresses": node.advertised_addresses(),
        "control": str(control),
        "joined": join.joined,
        "peers": join.peers,
        "join": join.summary(),
    }
    if relay is not None:
        line["relay"] = relay
    return json.dumps(line)


def _authority_key(args: argparse.Namespace) -> bytes | None:
    if not args.authority_key:
        return None
    key = b64decode(args.authority_key)
    if key is None or len(key) != 32:
        raise LocalError(ErrorCode.CONFIG_ERROR, "--authority-key must be a base64 Ed25519 key")
    return key


async def echo_handler(envelope: Envelope) -> Any:
    """The daemon's built-in agent behaviour: answer a request with what it carried."""
    return {"agent": envelope.recipient, "echo": envelope.payload, "from": envelope.sender}


def _relay_status(node: Node, relay: tuple[RelayServer, str] | None) -> dict[str, Any]:
    """``status``'s ``relay`` (this node relaying, ``--relay``) and ``relays`` (the
    reservations it keeps: ``--use-relay``, ``chosen: configured``, or picked by
    itself, ``chosen: auto``)."""
    out: dict[str, Any] = {
        "relays": [
            {"relay": str(r.relay), "reserved": r.reservation is not None,
             "failure": None if r.failure is None else str(r.failure),
             "chosen": "auto" if node.links.started_at_run_time(r) else "configured"}
            for r in node.links.relay_listeners
        ]
    }  # fmt: skip
    if relay is not None:
        stats: RelayStatistics = relay[0].statistics()
        out["relay"] = {
            "address": relay[1], "reservations": stats.reservations, "circuits": stats.circuits,
            "circuitsOpened": stats.circuits_opened, "bytesRelayed": stats.bytes_relayed,
            "refusals": dict(stats.refusals), "circuitEnds": dict(stats.circuit_ends),
        }  # fmt: skip
    return out


async def _start_relay(node: Node, args: argparse.Namespace) -> tuple[RelayServer, str] | None:
    """``--relay HOST:PORT``: relay for nodes behind NAT (docs/protocol/relay.md), with
    this node's peer id, offered in its dial-back answers; the relayed-address prefix
    others reserve with."""
    from p2pnode.node.config import parse_address
    from p2pnode.transport.relay import format_relay_address
    from p2pnode.transport.relayserve import RelayServer

    if not args.relay:
        return None
    server = RelayServer(_DaemonNetwork(), node.peer_id)
    host, port = await node.nursery.start(server.serve, parse_address(args.relay))
    if args.advertise_host:
        host = args.advertise_host
    elif host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    address = format_relay_address((host, port), node.peer_id)
    node.reachability.offer_relay(address)  # to the nodes it checks (reachability.md §7)
    return server, address


def _node_ops(node: Node, relay: tuple[RelayServer, str] | None = None) -> dict[str, Any]:
    async def status(request: dict[str, Any]) -> Any:
        return {**node.status(), **_relay_status(node, relay)}

    async def find(request: dict[str, Any]) -> Any:
        viewer = request.get("agent")
        cards = await node.find(str(request["capability"]), str(viewer) if viewer else None)
        return [
            {"id": c.id, "peerId": str(c.peer_id), "tier": int(c.tier), "origin": str(c.origin),
             "addresses": list(c.addresses), "capabilities": sorted(c.capability_ids())}
            for c in cards
        ]  # fmt: skip

    async def send(request: dict[str, Any]) -> Any:
        sender = request.get("from") or node.default_agent()
        type_ = parse_message_type(str(request.get("type", "request")))
        payload = check_payload(request.get("payload"))
        target = str(request["to"])
        if type_.value == "request":
            capability = bool(request.get("capability"))
            reply = await node.request(sender, target, payload, capability=capability)
            return reply.to_dict()
        envelope = node.envelope(sender, target, type_, payload)
        result = await node.send(envelope)
        return {"id": result.envelope_id, "path": result.path, "targets": list(result.targets)}

    async def card(request: dict[str, Any]) -> Any:
        agent = request.get("agent")
        return node.local_agent(str(agent) if agent else node.default_agent()).to_dict()

    ops: dict[str, Op] = {"status": status, "find": find, "send": send, "card": card}
    ops.update(_doc_ops(node))
    ops.update(tool_ops(node))
    ops.update(task_ops(node))
    return ops


def _doc_ops(node: Node) -> dict[str, Any]:
    """``doc.subscribe``, ``doc.update``, ``doc.read`` (docs/protocol/node.md)."""
    from p2pnode.services.shared.docops import op_from_json, value_to_json

    def member(request: dict[str, Any]) -> str:
        return str(request.get("agent") or node.default_agent())

    def doc_state(doc: str) -> dict[str, Any]:
        shared = node.shared
        state = {
            "doc": doc,
            "value": value_to_json(shared.read(doc)),
            "clock": shared.clock(doc).to_wire(),
            "peers": list(shared.peers(doc)),
            "refused": shared.refused(doc),
        }
        warning = shared.convergence_warning(doc)
        if warning is not None:
            state["warning"] = warning
        return state

    async def subscribe(request: dict[str, Any]) -> Any:
        doc, agent = str(request["doc"]), member(request)
        await node.shared.subscribe(agent, doc)
        return {"doc": doc, "agent": agent, "subscriptions": node.shared.subscriptions()}

    async def update(request: dict[str, Any]) -> Any:
        doc = str(request["doc"])
        op = op_from_json(request.get("update"), now_ms=wall_clock_ms())
        delta = await node.shared.update(member(request), doc, op)
        return {"doc": doc, "origin": delta.origin, "seq": delta.seq, "durable": True}

    async def read(request: dict[str, Any]) -> Any:
        return doc_state(str(request["doc"]))

    return {"doc.subscribe": subscribe, "doc.update": update, "doc.read": read}


class _Phase(enum.Enum):
    """Where the daemon is, as far as SIGINT and SIGTERM care."""

    STARTING = "starting"  # a signal cancels the startup
    SERVING = "serving"  # a signal asks for an orderly stop
    STOPPING = "stopping"  # a second signal cancels what the stop still waits on


class _Stopper:
    """What SIGINT and SIGTERM do to ``p2pnode run`` (see :class:`_Phase`).

    The orderly stop leaves the node's ``async with`` normally, so the node
    closes its links and writes its state; cancelling is kept for a startup
    that may be stuck dialing and for an impatient second signal.
    """

    def __init__(self) -> None:
        self.phase = _Phase.STARTING
        self.requested = trio.Event()
        self.scope = trio.CancelScope()

    def serving(self) -> None:
        if self.phase is _Phase.STARTING:
            self.phase = _Phase.SERVING

    def on_signal(self, signum: int) -> None:
        logger.info("signal %s while %s: shutting down", signum, self.phase.value)
        if self.phase is _Phase.SERVING:
            self.phase = _Phase.STOPPING
            self.requested.set()
        else:
            self.scope.cancel()

    async def watch(self, signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            self.on_signal(signum)


class _DaemonNetwork(TrioNetwork):
    """The real network; a listener it cannot bind is the user's ``--listen`` (or
    another program on that port), so it says which protocol, address and OS reason
    in a LocalError(CONFIG_ERROR) instead of an OSError from deep in a traceback."""

    async def bind_datagram(self, address: Address) -> DatagramEndpoint:
        try:
            return await super().bind_datagram(address)
        except OSError as exc:
            raise _bind_error("UDP", address, exc) from exc

    async def listen_stream(self, address: Address) -> StreamListener:
        try:
            return await super().listen_stream(address)
        except OSError as exc:
            raise _bind_error("TCP", address, exc) from exc


def _bind_error(protocol: str, address: Address, exc: OSError) -> LocalError:
    from p2pnode.node.config import format_address

    reason = exc.strerror or str(exc)
    where = format_address(address)
    return LocalError(
        ErrorCode.CONFIG_ERROR, f"cannot listen on {protocol} {where}: {reason}", address=where
    )


def load_agent(spec: str) -> Agent:
    """The :class:`~p2pnode.agent.Agent` named by ``module:name`` (``module.sub:obj.attr``),
    imported with the current directory on the path, as uvicorn does.

    Raises LocalError(CONFIG_ERROR) naming what is wrong.
    """
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise LocalError(ErrorCode.CONFIG_ERROR, f"--agent {spec!r}: expected MODULE:NAME")
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        value: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise LocalError(ErrorCode.CONFIG_ERROR, f"--agent {spec!r}: {exc}") from None
    for part in attribute.split("."):
        try:
            value = getattr(value, part)
        except AttributeError:
            raise LocalError(
                ErrorCode.CONFIG_ERROR, f"--agent {spec!r}: {module_name} has no {attribute!r}"
            ) from None
    if not isinstance(value, Agent):
        raise LocalError(
            ErrorCode.CONFIG_ERROR,
            f"--agent {spec!r} is a {type(value).__name__}, not a p2pnode.Agent",
        )
    return value


async def run_daemon(args: argparse.Namespace) -> int:
    """``p2pnode run``: returns 0 after SIGINT or SIGTERM. Raises LocalError(BUSY) when
    another daemon holds the data directory, LocalError(CONFIG_ERROR) for bad options,
    an unreadable card file or a port that cannot be bound."""
    data_dir = _data_dir(args)
    control = data_dir / CONTROL_SOCKET_NAME
    # The lock comes first: a second daemon must not touch the first one's files
    # (identity, routing snapshot, CRDT store, control socket) at all.
    with hold_data_dir(data_dir, control):
        stopper = _Stopper()
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stopper.watch, signals)
                with stopper.scope:
                    await _serve(args, data_dir, stopper)
                nursery.cancel_scope.cancel()
    return 0


async def _serve(args: argparse.Namespace, data_dir: Path, stopper: _Stopper) -> None:
    from p2pnode.node.config import parse_address
    from p2pnode.node.policy import PolicyConfig
    from p2pnode.runtime import NodeConfig, open_node
    from p2pnode.services.attach.wire import AGENT_SOCKET_NAME

    identity = load_or_create_identity(data_dir)
    agents = [load_agent(spec) for spec in args.agent or []]
    # With --agent, the card file's echo agent is hosted only when asked for (--card).
    default_cards = [] if agents else [data_dir / CARD_FILE_NAME]
    card_paths = [Path(p) for p in args.card] if args.card else default_cards
    templates = [
        read_card_file(p)
        if p.exists() or args.card
        else starter_template(default_agent_id(identity.peer_id), "AGENT")
        for p in card_paths
    ]
    config = NodeConfig(
        data_dir=data_dir,
        listen=parse_address(args.listen),
        dht_listen=parse_address(args.listen),
        advertise_host=args.advertise_host,
        bootstrap=bootstrap_addresses(args),
        policy=PolicyConfig(authority_key=_authority_key(args)),
        relays=tuple(args.use_relay or ()),
    )
    endorser = load_identity(Path(args.endorse_with)) if args.endorse_with else None
    roles = tuple(args.role or ())
    async with open_node(identity, _DaemonNetwork(), config) as node:
        for template in templates:
            now = wall_clock_ms()
            card = card_from_template(
                template,
                identity,
                now,
                # A restarted node's cards must supersede the ones it published before.
                revision=now,
                noise_static_key=node.secure_identity.static_public,
                addresses=tuple(node.advertised_addresses()),
            )
            await node.add_agent_card(card, echo_handler, authority=endorser, roles=roles)
        for agent in agents:
            await node.add_agent(agent, authority=endorser, roles=roles)
        await node.open_shared()
        await node.open_swarms()  # its agents may join swarms, and it may open some
        # The control socket answers before joining, which can take a while (bootstrap
        # peers down or slow): `status` shows what the node is doing meanwhile.
        relay = await _start_relay(node, args)  # --relay
        server = ControlServer(data_dir / CONTROL_SOCKET_NAME, _node_ops(node, relay))
        await node.nursery.start(server.serve)
        if args.metrics:  # Prometheus, read from the node at each scrape
            await node.serve_metrics(parse_address(args.metrics))
        await node.join()
        # Attached processes use the swarm's tools and offer their own (audited here).
        await node.open_agent_socket(data_dir / AGENT_SOCKET_NAME, endorser=endorser)
        await start_mcp_servers(node, args, authority=endorser, roles=roles)  # --mcp-server
        relay_text = relay[1] if relay else None
        print(ready_line(node, data_dir / CONTROL_SOCKET_NAME, relay_text), flush=True)
        stopper.serving()
        await stopper.requested.wait()


def cmd_run(args: argparse.Namespace) -> int:
    """Run the daemon. Whatever ends it, the user sees at most one line: a P2PError
    is raised on to the command line's handler; anything else becomes
    P2PError(INTERNAL) naming the exception, its traceback logged at DEBUG."""
    from p2pnode.node.logs import configure_logging
    from p2pnode.services.metrics import check_metrics_extra

    if args.role and not args.endorse_with:
        raise LocalError(
            ErrorCode.INVALID_ARGUMENT,
            "--role needs --endorse-with: roles count only as the swarm authority endorses them",
        )
    if args.metrics:
        check_metrics_extra()  # one line naming the extra, before anything starts
    bootstrap_addresses(args)  # a malformed bootstrap address: one line, before anything
    configure_logging(args.log_level, json_lines=args.log_json, stream=sys.stderr)
    try:
        return trio.run(run_daemon, args)
    except (Exception, BaseExceptionGroup) as exc:
        leaves = _leaves(exc)
        if any(isinstance(e, KeyboardInterrupt) for e in leaves):
            raise KeyboardInterrupt from None  # a second Ctrl-C during startup or shutdown
        failure = _one_failure(leaves)
        if failure is not exc:
            logger.debug("the node stopped", exc_info=exc)
        raise failure from None


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _one_failure(leaves: list[BaseException]) -> P2PError:
    """The error to report for what ended the daemon: its first P2PError (those carry
    a message meant for the user), else the first exception, described."""
    first = next((e for e in leaves if isinstance(e, P2PError)), leaves[0])
    more = f" (and {len(leaves) - 1} more failures)" if len(leaves) > 1 else ""
    if isinstance(first, P2PError):
        if not more:
            return first
        return P2PError(first.code, first.message + more, **first.details)
    if isinstance(first, OSError):
        # The system refused something (a full disk, a path too long for a socket): its
        # reason is the message.
        return LocalError(ErrorCode.CONFIG_ERROR, f"{describe(first)}{more}")
    return P2PError(
        ErrorCode.INTERNAL,
        f"the node stopped on an unexpected {describe(first)}{more} "
        "(the traceback is logged at --log-level DEBUG)",
    )


def _control(args: argparse.Namespace, request: dict[str, Any]) -> Any:
    path = _data_dir(args) / CONTROL_SOCKET_NAME

    async def call() -> Any:
        with trio.fail_after(CONTROL_TIMEOUT):
            return await control_call(path, request)

    try:
        return trio.run(call)
    except trio.TooSlowError:
        raise LocalError(ErrorCode.TIMEOUT, f"the node at {path} did not answer") from None


def cmd_status(args: argparse.Namespace) -> int:
    status = _control(args, {"op": "status"})
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(f"peer id    {status['peerId']}")
    print(f"addresses  {', '.join(status['addresses'])}")
    print(f"swarm      {status['swarm']}")
    print(f"agents     {', '.join(status['agents'])}")
    print(f"peers      {len(status['peers'])}")
    if "join" in status:
        print(f"join       {status['join']['summary']}")
    for held in status.get("relays", []):
        state = "reserved" if held["reserved"] else f"not reserved ({held['failure']})"
        print(f"relay via  {held['relay']}  {state}  ({held.get('chosen', 'configured')})")
    if "relay" in status:
        r = status["relay"]
        print(f"relaying   {r['address']}  reservations {r['reservations']}  circuits "
              f"{r['circuits']} ({r['circuitsOpened']} opened)  bytes {r['bytesRelayed']}  "
              f"refusals {sum(r['refusals'].values())}")  # fmt: skip
    for channel in status["channels"]:
        print(f"  channel  {channel['peer']}  {channel['state']}")
    warnings = status.get("documentWarnings", {})
    for doc, agents in status.get("documents", {}).items():
        print(f"document   {doc}  ({', '.join(agents)})")
        if doc in warnings:
            print(f"  warning  {warnings[doc]}")
    discovery = status.get("discovery") or {}
    if "contacts" in discovery:
        print(f"dht        contacts {discovery['contacts']}  records {discovery['records']}  "
              f"dropped {discovery['datagrams_dropped']}  rejected {discovery['records_rejected']}"
              f"  failed {discovery['inputs_failed']}")  # fmt: skip
        if "buckets" in discovery:
            print(f"  buckets  {' '.join(map(str, discovery['buckets']))} (of "
                  f"{len(discovery['buckets'])}, farthest first)  admitted "
                  f"{discovery['contacts_admitted']}  checks {discovery['checks_sent']} "
                  f"({discovery['checks_failed']} unanswered, {discovery['checks_skipped']} "
                  f"skipped)  refused {discovery['admissions_refused']}")  # fmt: skip
    metrics = status["metrics"]
    print(f"messages   sent {metrics['totalMessagesSent']}  "
          f"received {metrics['totalMessagesReceived']}  errors {metrics['errorCount']}  "
          f"security events {metrics['securityEvents']}")  # fmt: skip
    print(f"tools      invocations {metrics['totalToolInvocations']}  "
          f"errors {metrics['toolErrorCount']}  "
          f"average {metrics['averageToolDurationMs']:.2f} ms")  # fmt: skip
    tasks = status["tasks"]
    print(f"tasks      proposals sent {tasks['proposalsSent']}  accepted "
          f"{tasks['proposalsAccepted']}  rejected {tasks['proposalsRejected']}  timed out "
          f"{tasks['proposalsTimedOut']}  swarms active {tasks.get('swarmsActive', 0)}  "
          f"reassignments {tasks.get('reassignments', 0)}")  # fmt: skip
    return 0


def cmd_find(args: argparse.Namespace) -> int:
    request = {"op": "find", "capability": args.capability}
    if args.agent:
        request["agent"] = args.agent
    found = _control(args, request)
    if args.json:
        print(json.dumps(found, indent=2))
    elif not found:
        print(f"no agent offers {args.capability!r}", file=sys.stderr)
        return 1
    else:
        for card in found:
            print(f"{card['id']:<20} tier L{card['tier']}  {card['peerId']}  "
                  f"{','.join(card['addresses'])}")  # fmt: skip
    return 0


def cmd_send(args: argparse.Namespace) -> int:
    try:
        payload = json.loads(args.payload)
    except json.JSONDecodeError as exc:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"--payload is not JSON: {exc}") from exc
    request = {
        "op": "send", "from": args.sender, "to": args.target, "type": args.type,
        "payload": payload, "capability": args.capability,
    }  # fmt: skip
    print(json.dumps(_control(args, request), indent=2))
    return 0


def cmd_doc(args: argparse.Namespace) -> int:
    request: dict[str, Any] = {"op": f"doc.{args.doc_command}", "doc": args.doc}
    if args.agent:
        request["agent"] = args.agent
    if args.doc_command == "update":
        try:
            request["update"] = json.loads(args.update)
        except json.JSONDecodeError as exc:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"UPDATE is not JSON: {exc}") from exc
    result = _control(args, request)
    print(json.dumps(result, indent=2))
    if isinstance(result, dict) and result.get("warning"):
        print(f"p2pnode: warning: {result['warning']}", file=sys.stderr)
    return 0


#: The operations of ``doc update`` (p2pnode/services/shared/docops.py), for its --help.
DOC_UPDATE_OPS = """\
operations (UPDATE is one JSON object; P is a key or a list of 1-8 keys):
  {"op": "counter.add", "path": P, "amount": N, "growOnly": B}
        add N (an integer, default 1) to a counter; growOnly: never decreases
  {"op": "register.set", "path": P, "value": V, "timestamp": MS}
        set a last-writer-wins register to V (null, boolean, number or string);
        timestamp defaults to now
  {"op": "set.add", "path": P, "element": E}
        add E (an integer or a string) to a set
  {"op": "set.remove", "path": P, "element": E}
        remove E from a set
  {"op": "map.remove", "path": P}
        remove the key P names from its map
example:
  p2pnode doc update plan '{"op": "counter.add", "path": ["tasks", "done"], "amount": 2}'
"""


def _add_doc_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doc = sub.add_parser("doc", help="shared CRDT documents of a running node")
    doc_sub = doc.add_subparsers(dest="doc_command", required=True)
    for name, text in (("subscribe", "replicate a document"), ("read", "print a document"),
                       ("update", "apply an operation; returns once it is durable")):  # fmt: skip
        update = name == "update"
        cmd = doc_sub.add_parser(
            name,
            help=text,
            epilog=DOC_UPDATE_OPS if update else None,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        cmd.add_argument("doc", help="document name")
        if update:
            cmd.add_argument("update", metavar="UPDATE", help="the operation as JSON (see below)")
        add_acting_agent(cmd, "the local agent that is the document's member (default: the first)")
        cmd.set_defaults(handler=cmd_doc)


def _add_run_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    run = sub.add_parser("run", help="run a node until SIGINT or SIGTERM (one per data directory)")
    run.add_argument(
        "--listen",
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="TCP and UDP address to listen on (default: 127.0.0.1:0, a free port on the "
        "loopback; the ready line names it)",
    )
    run.add_argument("--advertise-host", help="host to publish in cards (for 0.0.0.0 listeners)")
    run.add_argument(
        "--bootstrap", action="append", metavar="HOST:PORT", help="a node to join by (repeatable)"
    )
    run.add_argument("--bootstrap-file", help="file of host:port lines (# comments)")
    run.add_argument(
        "--agent",
        action="append",
        metavar="MODULE:NAME",
        help="host the p2pnode.Agent NAME of MODULE (repeatable; like uvicorn module:app)",
    )
    run.add_argument("--card", action="append", help="card file (repeatable; default card.json)")
    run.add_argument(
        "--relay",
        metavar="HOST:PORT",
        help="relay connections for nodes behind NAT at this TCP address (off by default; "
        "the ready line names the address they use with --use-relay)",
    )
    run.add_argument(
        "--use-relay",
        action="append",
        metavar="relay:HOST:PORT/PEERID",
        help="keep a reservation on this relay so peers reach this node through it "
        "(repeatable; for a node behind NAT)",
    )
    run.add_argument("--authority-key", help="base64 Ed25519 key of the swarm authority")
    run.add_argument("--endorse-with", help="authority key file to endorse this node's cards")
    run.add_argument(
        "--role",
        action="append",
        help="a role to endorse this node's agents with (repeatable; needs --endorse-with): "
        "what access rules of tools may ask for",
    )
    add_run_options(run)
    run.add_argument(
        "--metrics",
        metavar="HOST:PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (needs p2pnode[metrics])",
    )
    add_log_level(run, "INFO")
    run.add_argument("--log-json", action="store_true", help="JSON-lines logs on stderr")
    run.set_defaults(handler=cmd_run)


def add_node_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``run``, ``status``, ``find``, ``send``, ``doc``, ``tools``, ``resources``,
    ``prompts``, ``task``, ``swarm`` and ``demo``."""
    _add_run_command(sub)
    status = sub.add_parser("status", help="show a running node's state")
    add_json(status, "the node's whole status")
    status.set_defaults(handler=cmd_status)

    find = sub.add_parser("find", help="find agents offering a capability")
    find.add_argument(
        "capability",
        metavar="CAPABILITY",
        help="a capability id (echo), or tool:NAME for the agents offering tool NAME",
    )
    add_acting_agent(find, "local agent whose view to show (its sandbox rules; default: the first)")
    add_json(find, "the cards found")
    find.set_defaults(handler=cmd_find)

    send = sub.add_parser("send", help="send an envelope and print the response")
    send.add_argument("target", help="agent id, capability (with --capability) or *")
    send.add_argument(
        "--type",
        default="request",
        choices=[t.value for t in MessageType],
        metavar="TYPE",
        help="envelope type, one of: %(choices)s (default: request, which waits for and "
        "prints the response)",
    )
    send.add_argument("--payload", default="null", help="JSON payload (default: null)")
    add_acting_agent(send, "local agent sending (default: the first)", dest="sender", old="--from")
    send.add_argument("--capability", action="store_true", help="TARGET is a capability id")
    send.set_defaults(handler=cmd_send)

    _add_doc_command(sub)
    add_tool_commands(sub, _control)
    add_task_commands(sub, _control)
    add_demo_command(sub)
