"""What a newcomer meets first on the command line: every option explained, one name
per meaning, refusals at the command that causes them, and Ctrl-C that says what
goes on."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from p2pnode.cli import demo as demo_module
from p2pnode.cli.main import build_parser, main
from p2pnode.cli.options import LOG_LEVELS
from p2pnode.cli.process import NodeProcess
from p2pnode.core.card import AgentCard
from tests import inprocess
from tests.inprocess import run_cli


def _parsers(
    parser: argparse.ArgumentParser, prog: str = "p2pnode"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every parser of the tree with its command line (``p2pnode tools call``)."""
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{prog} {name}")


def _undocumented(parser: argparse.ArgumentParser) -> list[str]:
    """The options and positionals of ``parser`` without help text. A hidden alias
    (help SUPPRESS) is fine when a documented option stores to the same place."""
    documented = {
        a.dest for a in parser._actions if a.help not in (None, "", argparse.SUPPRESS)
    }
    missing = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            missing += [f"command {c.dest}" for c in action._choices_actions if not c.help]
            continue
        hidden = action.help == argparse.SUPPRESS
        if not action.help or (hidden and action.dest not in documented):
            missing.append("/".join(action.option_strings) or action.dest)
    return missing


def test_every_option_and_positional_has_help() -> None:
    parsers = dict(_parsers(build_parser()))
    assert "p2pnode tools call" in parsers and len(parsers) > 30
    missing = {prog: gaps for prog, p in parsers.items() if (gaps := _undocumented(p))}
    assert missing == {}


def test_the_walk_finds_an_option_without_help() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--old", dest="quiet", help=argparse.SUPPRESS)
    parser.add_argument("--hidden", help=argparse.SUPPRESS)
    parser.add_argument("--verbose", action="store_true", help="say more")
    parser.add_argument("--loud", dest="verbose", help=argparse.SUPPRESS)
    # An alias of an option without help, or hiding an option of its own, is a gap.
    assert _undocumented(parser) == ["--quiet", "--old", "--hidden"]


def _options(prog: str) -> dict[str, argparse.Action]:
    parser = dict(_parsers(build_parser()))[prog]
    return {s: a for a in parser._actions for s in a.option_strings}


@pytest.mark.parametrize(
    "prog", ["p2pnode send", "p2pnode task propose", "p2pnode swarm run", "p2pnode tools call",
             "p2pnode find", "p2pnode doc update", "p2pnode resources read"],
)  # fmt: skip
def test_agent_is_the_local_acting_agent_everywhere(prog: str) -> None:
    agent = _options(prog)["--agent"]
    assert agent.metavar == "LOCAL_AGENT" and agent.help and "local agent" in agent.help


@pytest.mark.parametrize(
    ("argv", "dest"),
    [
        (["send", "x"], "sender"),
        (["task", "propose", "x", "--task", "{}"], "sender"),
        (["swarm", "run", "plan.json"], "sender"),
        (["resources", "read", "memo://x"], "owner"),
    ],
)
def test_the_old_from_spelling_still_works_but_is_not_shown(argv: list[str], dest: str) -> None:
    parser = build_parser()
    new = "--owner" if dest == "owner" else "--agent"
    with_new = parser.parse_args([*argv, new, "someone"])
    with_old = parser.parse_args([*argv, "--from", "someone"])
    assert getattr(with_new, dest) == getattr(with_old, dest) == "someone"
    assert getattr(parser.parse_args(argv), dest) is None
    words = argv[:2] if argv[0] in ("task", "swarm", "resources") else argv[:1]
    prog = "p2pnode " + " ".join(words)
    assert _options(prog)["--from"].help == argparse.SUPPRESS


def test_resources_read_names_the_remote_owner_with_owner() -> None:
    owner = _options("p2pnode resources read")["--owner"]
    assert owner.help is not None and "remote agent" in owner.help


def test_help_texts_say_the_choices_and_defaults() -> None:
    send_type = _options("p2pnode send")["--type"]
    assert send_type.choices is not None and "task-proposal" in send_type.choices
    for prog in ("p2pnode run", "p2pnode mcp serve", "p2pnode mcp publish"):
        level = _options(prog)["--log-level"]
        assert level.choices == LOG_LEVELS and level.type is str.upper
    listen = _options("p2pnode run")["--listen"]
    assert listen.help is not None and "127.0.0.1:0" in listen.help
    find = dict(_parsers(build_parser()))["p2pnode find"]
    [capability] = [a for a in find._actions if a.dest == "capability"]
    assert capability.help is not None and "tool:NAME" in capability.help


def test_a_bad_log_level_is_a_usage_error() -> None:
    done = run_cli("run", "--log-level", "loud")
    assert done.code == 2 and "invalid choice" in done.err and len(done.err.splitlines()) == 1


def test_init_refuses_an_agent_id_run_would_refuse(tmp_path: Path) -> None:
    done = run_cli("--data-dir", str(tmp_path / "d"), "init", "--agent-id", "bad id")
    assert done.code == 1
    assert done.err.startswith("p2pnode: error: INVALID_CARD: ")
    assert len(done.err.splitlines()) == 1
    assert not (tmp_path / "d").exists()  # nothing written
    assert run_cli("--data-dir", str(tmp_path / "d"), "init", "--agent-id", "good").code == 0


def test_card_show_without_a_node_says_it_signs_the_file(tmp_path: Path) -> None:
    assert run_cli("--data-dir", str(tmp_path), "init", "--agent-id", "sun").code == 0
    done = run_cli("--data-dir", str(tmp_path), "card", "show")
    assert done.code == 0
    assert json.loads(done.out)["addresses"] == []
    assert "no node runs" in done.err and "card.json signed now" in done.err
    with_file = run_cli("--data-dir", str(tmp_path), "card", "show", str(tmp_path / "card.json"))
    assert with_file.code == 0 and with_file.err == ""


@pytest.mark.slow
async def test_card_show_prints_the_running_nodes_card(tmp_path: Path) -> None:
    assert run_cli("--data-dir", str(tmp_path), "init", "--agent-id", "sun").code == 0
    node = NodeProcess(tmp_path)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            try:
                await node.start(nursery, None)
                done = await inprocess.p2pnode("--data-dir", str(tmp_path), "card", "show")
                published = await node.call({"op": "card", "agent": None})
            finally:
                await node.stop()
    assert done.code == 0 and done.err == ""
    card = AgentCard.from_json_untrusted(done.out)
    assert card.id == "sun" and list(card.addresses) == [node.address]
    assert json.loads(done.out) == published


# -- Ctrl-C -------------------------------------------------------------------------------------


def test_ctrl_c_on_demo_stops_with_one_line_and_claims_nothing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    async def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    async def interrupted_scenario(self: demo_module.Demo) -> None:
        self.check("discovery by capability", True, "found it")
        raise KeyboardInterrupt  # as trio delivers Ctrl-C to the main task

    monkeypatch.setattr(demo_module.Demo, "prepare", lambda self: None)
    monkeypatch.setattr(demo_module.Demo, "start", nothing)
    monkeypatch.setattr(demo_module.Demo, "stop", nothing)
    monkeypatch.setattr(demo_module.Demo, "run_scenario", interrupted_scenario)
    done = run_cli("demo", "--data-dir", str(tmp_path / "demo"))
    assert done.code == 130
    assert "summary" not in done.out and "Traceback" not in done.err
    assert done.err.splitlines() == [
        "p2pnode: interrupted: the demo stopped its nodes after 1 checks (1 passed); "
        "the rest did not run"
    ]


def test_demo_data_dir_must_be_new_or_empty(tmp_path: Path) -> None:
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "identity.key").write_text("x")
    done = run_cli("demo", "--data-dir", str(tmp_path / "busy"))
    assert done.code == 1 and "CONFIG_ERROR" in done.err and "not an empty directory" in done.err


def _interrupting_control(answers: dict[str, Any]) -> Any:
    """A control function answering ``answers`` by op, then Ctrl-C at the next ask."""

    def control(args: argparse.Namespace, request: dict[str, Any]) -> Any:
        answer = answers.pop(request["op"], None)
        if answer is None:
            raise KeyboardInterrupt
        return answer

    return control


def test_ctrl_c_on_swarm_run_says_the_swarm_goes_on_and_how_to_cancel_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from p2pnode.cli import node as node_module

    plan = tmp_path / "plan.json"
    plan.write_text('{"subtasks": []}')
    opened = {"swarm.open": {"swarm": "s-42", "doc": "swarm.s-42", "total": 3}}
    monkeypatch.setattr(node_module, "_control", _interrupting_control(opened))
    code = main(["--data-dir", "/tmp/boss", "swarm", "run", str(plan)])
    err = capsys.readouterr().err.splitlines()
    assert code == 130
    assert err[-1] == (
        "p2pnode: interrupted: swarm s-42 goes on in the node; "
        "`p2pnode --data-dir /tmp/boss swarm status s-42` follows it, "
        "`p2pnode --data-dir /tmp/boss swarm cancel s-42` cancels it"
    )


def test_ctrl_c_on_task_propose_says_the_task_goes_on_and_how_to_cancel_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from p2pnode.cli import node as node_module

    awarded = {"taskId": "t-7", "state": "working", "assignee": "sq", "progress": None,
               "message": "", "estimatedCompletion": 1}  # fmt: skip
    monkeypatch.setattr(node_module, "_control", _interrupting_control({"task.propose": awarded}))
    code = main(["task", "propose", "square", "--capability", "--task", '{"input": 7}'])
    err = capsys.readouterr().err.splitlines()
    assert code == 130
    assert err[-1] == (
        "p2pnode: interrupted: task t-7 goes on in the node; `p2pnode task cancel t-7` cancels it"
    )
    # Interrupted before the award: nothing to cancel, and it says so.
    monkeypatch.setattr(node_module, "_control", _interrupting_control({}))
    assert main(["task", "propose", "square", "--task", "{}"]) == 130
    assert "no task was awarded" in capsys.readouterr().err


def test_task_cancel_asks_the_node(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from p2pnode.cli import node as node_module

    asked: list[dict[str, Any]] = []

    def control(args: argparse.Namespace, request: dict[str, Any]) -> Any:
        asked.append(request)
        return {"taskId": "t-7", "state": "canceled"}

    monkeypatch.setattr(node_module, "_control", control)
    assert main(["task", "cancel", "t-7"]) == 0
    assert asked == [{"op": "task.cancel", "taskId": "t-7"}]
    assert "task t-7: canceled" in capsys.readouterr().err


def test_an_empty_listing_names_the_owners_it_could_not_reach(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from p2pnode.cli import node as node_module

    listing = {"items": [], "unreachable": {"geo": "TIMEOUT", "maps": "AGENT_UNAVAILABLE"},
               "dropped": 0}  # fmt: skip
    monkeypatch.setattr(node_module, "_control", lambda args, request: listing)
    assert main(["tools", "list"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == "no tools found among the owners that answered; not reached: geo, maps"
    monkeypatch.setattr(node_module, "_control", lambda args, request: {"items": []})
    assert main(["resources", "list"]) == 0
    assert capsys.readouterr().err.splitlines() == ["no resources found"]


async def test_swarm_status_of_a_swarm_nobody_replicates_answers_at_once(
    autojump_clock: Any,
) -> None:
    from p2pnode.cli.tasks import task_ops
    from p2pnode.core.errors import LocalError
    from tests.sim import Inbox, swarm

    async with swarm(1) as (_, (node,)):
        await node.add_agent("boss", Inbox(), tier=0)
        status = task_ops(node)["swarm.status"]
        started = trio.current_time()
        with pytest.raises(LocalError) as info:
            await status({"swarm": "nosuch"})
        assert trio.current_time() - started < 0.5  # it waited 5 s for a plan before
        assert info.value.message.startswith("no swarm 'nosuch' known")
        # Nothing is left behind: no subscription, no swarm counted as active.
        assert node.shared.subscriptions() == {}
        assert node.status()["tasks"]["swarmsActive"] == 0
