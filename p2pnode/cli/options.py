"""The options several commands share, so that one name keeps one meaning everywhere.

``--agent`` is always the local agent acting (sending, calling, proposing, opening a
swarm, viewing); ``--owner`` the remote agent that owns what is asked for; ``--json``
prints the node's answer as JSON; ``--log-level`` takes one of :data:`LOG_LEVELS`.
Older spellings stay accepted as hidden aliases (``--from`` for the acting agent of
``send``, ``task propose`` and ``swarm run``, and for the owner of ``resources read``),
so scripts written against them keep working.
"""

from __future__ import annotations

import argparse
from typing import Final

#: The levels ``--log-level`` takes (any case).
LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


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


__all__ = ["LOG_LEVELS", "add_acting_agent", "add_hidden_alias", "add_json", "add_log_level"]
