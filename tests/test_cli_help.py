"""What the command line tells a user about itself: its help and the README agree
with what the node accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from p2pnode.cli import main

# The node's dispatch table of document operations: what `doc update` accepts.
from p2pnode.node.docops import _PARSERS as DOC_OPERATIONS

README = Path(__file__).resolve().parent.parent / "README.md"


def test_doc_update_operations_are_documented(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["doc", "update", "--help"])
    help_text = capsys.readouterr().out
    usage = README.read_text().split("## Usage", 1)[1].split("\n## ", 1)[0]
    for op in DOC_OPERATIONS:
        assert f'"op": "{op}"' in help_text, op
        assert f"`{op}`" in usage, op
