"""The ``p2pnode`` command.

Exit codes: 0 success (for ``run``: stopped by SIGINT or SIGTERM), 1 the
command failed (invalid card, unreadable key file, unreachable node, a data
directory another ``run`` holds, a port in use, ...), 2 bad usage, 130
interrupted. Errors are one line on stderr naming the error code, never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from p2pnode import __version__
from p2pnode.cli.a2a import add_a2a_commands
from p2pnode.cli.datalock import hold_data_dir
from p2pnode.cli.mcp import add_mcp_commands
from p2pnode.cli.node import add_node_commands
from p2pnode.cli.options import add_json
from p2pnode.core.a2a import to_a2a
from p2pnode.core.boundary import describe
from p2pnode.core.card import AgentCard
from p2pnode.core.cardfile import (
    CARD_FILE_NAME,
    card_from_template,
    default_agent_id,
    read_card_file,
    starter_template,
)
from p2pnode.core.envelope import wall_clock_ms
from p2pnode.core.errors import ErrorCode, LocalError, P2PError
from p2pnode.core.identity import (
    KEY_FILE_NAME,
    Identity,
    default_data_dir,
    load_identity,
    save_identity,
    write_private_file,
)
from p2pnode.core.jsonutil import b64encode

# trio, the kernel (p2pnode.node) and the composed node (p2pnode.runtime) are imported
# by the commands that use them, here and in the command modules: `p2pnode --help`,
# `init`, `id`, `card` and the commands that only ask a running node start without them.

Handler = Callable[[argparse.Namespace], int]

#: Seconds to wait for a running node's answer when a command only consults it.
NODE_QUERY_TIMEOUT = 5.0


def _data_dir(args: argparse.Namespace) -> Path:
    return Path(args.data_dir) if args.data_dir else default_data_dir()


def _identity(args: argparse.Namespace) -> Identity:
    path = _data_dir(args) / KEY_FILE_NAME
    if not path.exists():
        raise LocalError(
            ErrorCode.KEY_FILE_ERROR, f"no identity at {path}; run `p2pnode init` first"
        )
    return load_identity(path)


def _print_json(data: object) -> None:
    print(json.dumps(data, indent=2, sort_keys=False, ensure_ascii=False))


def _card_path(args: argparse.Namespace) -> Path:
    return Path(args.file) if getattr(args, "file", None) else _data_dir(args) / CARD_FILE_NAME


def _signed_card(
    args: argparse.Namespace, addresses: tuple[str, ...] | None = None
) -> tuple[AgentCard, Identity]:
    identity = _identity(args)
    now = wall_clock_ms()
    # The revision a node would publish this card at (a restart's cards supersede).
    card = card_from_template(
        read_card_file(_card_path(args)), identity, now, revision=now, addresses=addresses
    )
    return card, identity


def _node_addresses(args: argparse.Namespace) -> tuple[str, ...]:
    """The addresses to publish a card with: ``--address``, else those the node running
    on the data directory advertises, else none."""
    from p2pnode.node.config import format_address, parse_address

    if args.address:
        return tuple(format_address(parse_address(a)) for a in args.address)
    status = _ask_node(args, {"op": "status"})
    if status is None:
        return ()
    return tuple(str(a) for a in status.get("addresses", ()))


# -- commands ---------------------------------------------------------------------------------


def _identity_state(data_dir: Path) -> list[Path]:
    """What in ``data_dir`` belongs to its identity: the key, the card, and the state
    the node keeps under its peer id (DHT contacts, CRDT replica and subscriptions)."""
    from p2pnode.runtime import SNAPSHOT_FILE, STORE_FILE_NAME, SUBSCRIPTIONS_FILE_NAME

    names = [KEY_FILE_NAME, CARD_FILE_NAME, SNAPSHOT_FILE, SUBSCRIPTIONS_FILE_NAME]
    paths = [data_dir / name for name in names]
    paths += sorted(data_dir.glob(STORE_FILE_NAME + "*"))  # with SQLite's -wal and -shm
    return [p for p in paths if p.exists() or p.is_symlink()]


def _move_aside(data_dir: Path, paths: list[Path]) -> Path:
    """Move ``paths`` into a new ``replaced-<UTC time>`` folder of ``data_dir``; its path."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    folder = data_dir / f"replaced-{stamp}"
    n = 1
    while folder.exists():
        n += 1
        folder = data_dir / f"replaced-{stamp}-{n}"
    try:
        folder.mkdir(mode=0o700)
        for path in paths:
            path.rename(folder / path.name)
    except OSError as exc:
        raise LocalError(
            ErrorCode.CONFIG_ERROR, f"cannot move the old identity aside: {describe(exc)}"
        ) from exc
    return folder


def cmd_init(args: argparse.Namespace) -> int:
    from p2pnode.node.control import CONTROL_SOCKET_NAME

    data_dir = _data_dir(args)
    key_path = data_dir / KEY_FILE_NAME
    card_path = data_dir / CARD_FILE_NAME
    existing = _identity_state(data_dir)
    if existing and not args.force:
        raise LocalError(
            ErrorCode.CONFIG_ERROR,
            f"{', '.join(map(str, existing))} already exist; use --force to replace them",
        )
    identity = Identity.generate()
    agent_id = args.agent_id or default_agent_id(identity.peer_id)
    template = starter_template(agent_id, args.name or agent_id.upper(), args.tier)
    # Checked as `run` checks it, before anything is written or moved: a card that the
    # next `run` would refuse is refused here.
    card_from_template(template, identity, wall_clock_ms())
    # The lock keeps a running daemon's state from being moved under it.
    with hold_data_dir(data_dir, data_dir / CONTROL_SOCKET_NAME):
        if existing:
            # State bound to the old identity would stop the new one from running (the
            # CRDT store belongs to the old peer id): it is kept, out of the way.
            folder = _move_aside(data_dir, existing)
            print(f"moved the previous identity and its state to {folder}")
        save_identity(identity, key_path, overwrite=True)
        write_private_file(card_path, (json.dumps(template, indent=2) + "\n").encode())
    print(f"peer id   {identity.peer_id}")
    print(f"identity  {key_path}")
    print(f"card      {card_path}")
    return 0


def cmd_id(args: argparse.Namespace) -> int:
    identity = _identity(args)
    if args.json:
        _print_json({"peerId": str(identity.peer_id), "publicKey": b64encode(identity.public_key)})
    else:
        print(identity.peer_id)
    return 0


def _ask_node(args: argparse.Namespace, request: dict[str, Any]) -> Any:
    """The answer of the node running on the data directory, or None if none answers."""
    import trio

    from p2pnode.node.control import CONTROL_SOCKET_NAME, control_call

    control = _data_dir(args) / CONTROL_SOCKET_NAME
    if not control.exists():
        return None  # no node has run there (a stale socket is caught below)

    async def ask() -> Any:
        with trio.fail_after(NODE_QUERY_TIMEOUT):
            return await control_call(control, request)

    try:
        return trio.run(ask)
    except (P2PError, trio.TooSlowError):
        return None  # no node runs there, or it does not host the agent


def cmd_card_show(args: argparse.Namespace) -> int:
    if not args.file:
        # The card the running node publishes (its addresses, its revision), if one runs.
        agent_id = read_card_file(_card_path(args)).get("id")
        published = _ask_node(args, {"op": "card", "agent": agent_id})
        if published is not None:
            _print_json(published)
            return 0
        print(
            f"p2pnode: note: no node runs on {_data_dir(args)}: this is {CARD_FILE_NAME} "
            "signed now; a running node adds its addresses",
            file=sys.stderr,
        )
    card, _ = _signed_card(args)
    _print_json(card.to_dict())
    return 0


def cmd_card_sign(args: argparse.Namespace) -> int:
    card, _ = _signed_card(args)
    text = json.dumps(card.to_dict(), indent=2) + "\n"
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"signed card {card.id} revision {card.revision} written to {args.output}")
    else:
        sys.stdout.write(text)
    return 0


def cmd_card_validate(args: argparse.Namespace) -> int:
    data = read_card_file(Path(args.file))
    try:
        if "signature" in data:
            card = AgentCard.from_dict(data)
            card.verify()
        else:
            card = card_from_template(data, Identity.generate(), wall_clock_ms())
    except P2PError as exc:
        problems = exc.details.get("problems") or [exc.message]
        print(f"{args.file}: invalid card ({exc.code})", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    kind = "signed card" if card.signature and "signature" in data else "card template"
    print(f"{args.file}: valid {kind} for agent {card.id!r}")
    return 0


def cmd_card_export(args: argparse.Namespace) -> int:
    if not args.a2a:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "choose an export format: --a2a")
    card, identity = _signed_card(args)
    if not card.addresses:
        # A template names no address: the node fills its own in when it runs, and the
        # A2A URL is only usable with one.
        addresses = _node_addresses(args)
        if addresses:
            card, identity = _signed_card(args, addresses)
        else:
            print(
                "p2pnode: note: no address (no node runs on this data directory and no "
                "--address given): the A2A interface URL names no host:port",
                file=sys.stderr,
            )
    _print_json(to_a2a(card, identity))
    return 0


# -- parser -----------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line on stderr like every other error (exit code 2); the
    subcommands' parsers are of this class too (argparse makes them of the parent's)."""

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("p2pnode").strip()
        where = f"{command}: " if command else ""
        self.exit(2, f"p2pnode: error: {where}{message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = _Parser(
        prog="p2pnode",
        description="A peer-to-peer node for AI agents: signed Agent Cards on a Kademlia DHT, "
        "Noise-encrypted channels, CRDT gossip.",
    )
    parser.add_argument("--version", action="version", version=f"p2pnode {__version__}")
    _add_global_options(parser, default=None)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    init = sub.add_parser("init", help="create an identity and a starter card file")
    init.add_argument(
        "--agent-id", help="id of the starter agent card (default: agent-<first 6 of the peer id>)"
    )
    init.add_argument("--name", help="display name of the agent")
    init.add_argument("--tier", type=int, choices=range(4), default=3, help="tier 0-3")
    init.add_argument(
        "--force",
        action="store_true",
        help="replace an existing identity and card (the old ones and their state are moved "
        "to a replaced-<time> folder of the data directory)",
    )
    init.set_defaults(handler=cmd_init)

    ident = sub.add_parser("id", help="print this node's peer id")
    add_json(ident, "the peer id and public key")
    ident.set_defaults(handler=cmd_id)

    card = sub.add_parser("card", help="show, validate, sign or export agent cards")
    card_sub = card.add_subparsers(dest="card_command", required=True, metavar="ACTION")
    show = card_sub.add_parser(
        "show",
        help="print the signed card of this node: the running node's, if one runs (else "
        "the card file signed now, without addresses)",
    )
    show.add_argument("file", nargs="?", help="card file (default: the data dir's card.json)")
    show.set_defaults(handler=cmd_card_show)
    validate = card_sub.add_parser("validate", help="check a card file, listing every problem")
    validate.add_argument("file", metavar="FILE", help="the card file (a template or signed)")
    validate.set_defaults(handler=cmd_card_validate)
    sign = card_sub.add_parser("sign", help="sign a card file with this node's identity")
    sign.add_argument("file", nargs="?", help="card file (default: the data dir's card.json)")
    sign.add_argument("-o", "--output", help="write the signed card here instead of stdout")
    sign.set_defaults(handler=cmd_card_sign)
    export = card_sub.add_parser("export", help="export the card in another format")
    export.add_argument("file", nargs="?", help="card file (default: the data dir's card.json)")
    export.add_argument("--a2a", action="store_true", help="as an A2A 1.0 AgentCard document")
    export.add_argument(
        "--address",
        action="append",
        metavar="HOST:PORT",
        help="the node's advertised address for the interface URL (repeatable; default: "
        "those of the node running on the data directory)",
    )
    export.set_defaults(handler=cmd_card_export)
    add_node_commands(sub)
    add_mcp_commands(sub)
    add_a2a_commands(sub)
    _accept_global_options_anywhere(parser)
    return parser


def _add_global_options(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "--data-dir",
        default=default,
        help="where identity, card and state live (default: $P2PNODE_HOME, "
        "else $XDG_DATA_HOME/p2pnode, else ~/.local/share/p2pnode)",
    )


def _accept_global_options_anywhere(parser: argparse.ArgumentParser) -> None:
    """Let every subcommand take the global options too (``p2pnode status --data-dir D``).

    A subcommand's copy defaults to SUPPRESS, so it sets the option only when given
    there and never hides the value given before the subcommand.
    """
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in set(action.choices.values()):
                _add_global_options(command, default=argparse.SUPPRESS)
                _accept_global_options_anywhere(command)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    try:
        return handler(args)
    except P2PError as exc:
        print(f"p2pnode: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`p2pnode card show | head`): not an error of ours.
        sys.stderr.close()
        return 0
    except OSError as exc:
        # The system refused what the user asked for (a missing directory for -o, no
        # permission): the user's to fix, so one line, not a traceback.
        print(f"p2pnode: error: CONFIG_ERROR: {describe(exc)}", file=sys.stderr)
        return 1
