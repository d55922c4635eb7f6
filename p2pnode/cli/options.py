"""The options several commands share, so that one name keeps one meaning everywhere.

``--agent`` is always the local agent acting (sending, calling, proposing, opening a
swarm, viewing); ``--owner`` the remote agent that owns what is asked for; ``--json``
prints the node's answer as JSON; ``--log-level`` takes one of :data:`LOG_LEVELS`;
``--allow-KIND VALUE`` (``mcp publish``, ``a2a publish``) and ``--mcp-allow KIND=VALUE``
are one access rule (:func:`access_rule`) of who may use what a command publishes.
Older spellings stay accepted as hidden aliases (``--from`` for the acting agent of
``send``, ``task propose`` and ``swarm run``, and for the owner of ``resources read``),
so scripts written against them keep working.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Final

from p2pnode.agent.tools import Access
from p2pnode.core.errors import ErrorCode, LocalError

#: The levels ``--log-level`` takes (any case).
LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
#: The kinds of an access rule, in the order the options are listed.
ALLOW_KINDS: Final = ("tier", "sandbox", "agent", "peer", "role")
_ALLOW_HELP: Final = {
    "tier": "a caller tier (0-3)",
    "sandbox": "a caller sandbox",
    "agent": "a caller agent id",
    "peer": "a caller's peer id",
    "role": "a role the swarm authority endorsed",
}


def add_acting_agent(
    parser: argparse.ArgumentParser, help_text: str, *, dest: str = "agent", old: str = ""
) -> None:
    """``--agent LOCAL_AGENT`` (into ``dest``), and ``old`` as a hidden alias if given."""
    parser.add_argument("--agent", dest=dest, metavar="LOCAL_AGENT", help=help_text)
    if old:
        add_hidden_alias(parser, old, dest)


def add_hidden_alias(parser: argparse.ArgumentParser, flag: str, dest: str) -> None:
    """Accept ``flag`` for ``dest`` without listing it in ``--help``."""
    # SUPPRESS as default: an absent alias leaves the documented option's value alone.
    parser.add_argument(flag, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def add_json(parser: argparse.ArgumentParser, what: str = "the node's answer") -> None:
    """``--json``: print ``what`` as JSON instead of a table or text."""
    parser.add_argument("--json", action="store_true", help=f"print {what} as JSON")


def add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    """``--log-level`` with its choices and ``default``."""
    parser.add_argument(
        "--log-level",
        default=default,
        type=str.upper,
        choices=LOG_LEVELS,
        help=f"least severe log level written to stderr (default: {default})",
    )


def add_allow_options(parser: argparse.ArgumentParser) -> None:
    """``--allow-tier``, ``--allow-sandbox``, ``--allow-agent``, ``--allow-peer`` and
    ``--allow-role``, each repeatable (read back with :func:`allow_rules`)."""
    for kind in ALLOW_KINDS:
        parser.add_argument(
            f"--allow-{kind}",
            action="append",
            metavar=kind.upper(),
            help=f"allow {_ALLOW_HELP[kind]} (repeatable; every kind given must hold)",
        )


def allow_rules(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The ``(kind, value)`` rules of the options :func:`add_allow_options` added."""
    rules: list[tuple[str, str]] = []
    for kind in ALLOW_KINDS:
        rules += [(kind, str(v)) for v in getattr(args, f"allow_{kind}", None) or ()]
    return rules


def access_rule(rules: Sequence[tuple[str, str]]) -> Access | None:
    """The Access of ``(kind, value)`` rules (kinds: :data:`ALLOW_KINDS`); None when there
    are none. Raises LocalError(INVALID_ARGUMENT) for a bad one."""
    if not rules:
        return None
    given: dict[str, list[str]] = {}
    for kind, value in rules:
        if kind not in ALLOW_KINDS or not value:
            raise LocalError(
                ErrorCode.INVALID_ARGUMENT,
                f"bad access rule {kind}={value!r}: KIND=VALUE, KIND one of "
                f"{', '.join(ALLOW_KINDS)}",
            )
        given.setdefault(kind, []).append(value)
    tiers = given.get("tier")
    if tiers is not None and not all(t in ("0", "1", "2", "3") for t in tiers):
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "an allowed tier is 0, 1, 2 or 3")
    return Access(
        tiers=[int(t) for t in tiers] if tiers is not None else None,
        sandboxes=given.get("sandbox"),
        agents=given.get("agent"),
        peers=given.get("peer"),
        roles=given.get("role"),
    )


def warn_open(logger: logging.Logger, agent_id: str, what: str) -> None:
    """The WARNING of a command publishing ``what`` as ``agent_id`` with no access rule."""
    logger.warning(
        "%s: no --allow-* rule: any agent the node's policy lets send %s a request may "
        "use %s",
        agent_id,
        agent_id,
        what,
    )


__all__ = [
    "ALLOW_KINDS",
    "LOG_LEVELS",
    "access_rule",
    "add_acting_agent",
    "add_allow_options",
    "add_hidden_alias",
    "add_json",
    "add_log_level",
    "allow_rules",
    "warn_open",
]
