"""docs/protocol/tasks.md stays true: its JSON examples are what the parsers take."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from p2pnode.agent.task import (
    Accepted,
    Instruction,
    Rejected,
    RejectReason,
    Update,
    parse_proposal_untrusted,
    parse_thread_untrusted,
)
from p2pnode.services.swarms.document import Plan

DOC = Path(__file__).resolve().parent.parent / "docs" / "protocol" / "tasks.md"


def examples() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for block in re.findall(r"```json\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S):
        try:
            out.append(json.loads(block))
        except ValueError:
            out.extend(json.loads(line) for line in block.splitlines() if line.strip())
    return out


def test_every_json_example_parses() -> None:
    kinds = []
    for example in examples():
        if "subtasks" in example:
            plan = Plan.from_json(example, swarm="s1")
            assert plan.aggregate == example["aggregate"]
            kinds.append("plan")
        elif "deadline" in example:
            proposal = parse_proposal_untrusted(example, "boss")
            assert proposal.swarm is not None
            kinds.append("proposal")
        elif "estimatedCompletion" in example:
            assert Accepted.from_payload_untrusted(example).to_payload() == example
            kinds.append("accept")
        elif "reason" in example:
            assert Rejected.from_payload_untrusted(example).to_payload() == example
            kinds.append("reject")
        else:
            message = parse_thread_untrusted(example)
            assert isinstance(message, Update | Instruction)
            assert message.to_payload() == example
            kinds.append("thread")
    assert sorted(set(kinds)) == ["accept", "plan", "proposal", "reject", "thread"]


def test_the_reason_codes_listed_are_the_ones_sent() -> None:
    text = DOC.read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([A-Z_]+)` \| ", text, re.M))
    assert {r.value for r in RejectReason} - {"INVALID"} <= listed
