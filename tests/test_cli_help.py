"""What the command line tells a user about itself: its help and the README agree
with what the node accepts."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from p2pnode.cli.main import build_parser, main

# The node's dispatch table of document operations: what `doc update` accepts.
from p2pnode.services.shared.docops import _PARSERS as DOC_OPERATIONS

README = Path(__file__).resolve().parent.parent / "README.md"


def test_doc_update_operations_are_documented(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["doc", "update", "--help"])
    help_text = capsys.readouterr().out
    usage = README.read_text().split("## Usage", 1)[1].split("\n## ", 1)[0]
    for op in DOC_OPERATIONS:
        assert f'"op": "{op}"' in help_text, op
        assert f"`{op}`" in usage, op


def _commands(parser: argparse.ArgumentParser, prefix: str = "p2pnode") -> list[str]:
    """Every command line the parser takes, down to the last subcommand
    (``p2pnode tools call``)."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _commands(sub, f"{prefix} {name}") or [f"{prefix} {name}"]
    return found


def test_every_command_is_in_the_readme_usage() -> None:
    usage = README.read_text().split("## Usage", 1)[1].split("\n## ", 1)[0]
    commands = _commands(build_parser())
    assert "p2pnode tools call" in commands
    for command in commands:
        assert f"\n{command} " in usage or f"\n{command}\n" in usage, command
