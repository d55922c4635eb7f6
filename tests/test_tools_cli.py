"""``p2pnode tools | resources | prompts`` as a user runs them: real ``p2pnode run``
daemons on 127.0.0.1, one hosting examples/toolbox.py, the other using it through
the command line (its ``main(argv)``, in the test's process: the commands only ask a
daemon and print); the README's commands for them, run as written; and what the
commands print of an owner's answer that is not what it should be."""

from __future__ import annotations

import argparse
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from p2pnode.agent.definition import Agent
from p2pnode.cli.process import NodeProcess
from p2pnode.cli.tools import add_tool_commands
from p2pnode.core.errors import ErrorCode
from p2pnode.core.identity import Identity, save_identity
from p2pnode.core.jsonutil import b64encode
from p2pnode.hosting.client import AgentClient
from tests import inprocess

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
README = ROOT / "README.md"
#: Seconds one command may take; and to wait for the caller to see the owner's tools.
CLI_TIMEOUT = 30.0
SEEN_TIMEOUT = 20.0


@dataclass(frozen=True, slots=True)
class Run:
    """One finished ``p2pnode`` command."""

    code: int
    out: str
    err: str

    def error_line(self) -> str:
        """The one error line of a failed command (asserting it is one line, no traceback)."""
        lines = self.err.splitlines()
        assert self.code == 1 and len(lines) == 1 and "Traceback" not in self.err, self
        assert lines[0].startswith("p2pnode: error: "), self
        return lines[0].removeprefix("p2pnode: error: ")


async def p2pnode(cwd: Path, *argv: str) -> Run:
    """``p2pnode ARGV`` run in ``cwd``, in this process (tests/inprocess.py): these
    commands only ask a daemon and print; the daemons are real processes."""
    done = await inprocess.p2pnode(*argv, cwd=cwd, seconds=CLI_TIMEOUT)
    return Run(done.code, done.out, done.err)


async def wait_for_tool(cwd: Path, data_dir: str, name: str) -> None:
    """Until ``tools list`` on ``data_dir`` lists ``name`` (the node has the owner's card)."""
    with trio.fail_after(SEEN_TIMEOUT):
        while True:
            run = await p2pnode(cwd, "--data-dir", data_dir, "tools", "list", "--json")
            if run.code == 0 and name in [t["name"] for t in json.loads(run.out)["items"]]:
                return
            await trio.sleep(0.1)


def readme_section() -> str:
    text = README.read_text(encoding="utf-8")
    return text.split("## Tools, resources and prompts", 1)[1].split("\n## ", 1)[0]


def readme_commands() -> list[tuple[list[str], str]]:
    """The README section's shell block: each command's argv and its comment."""
    [block] = re.findall(r"```sh\n(.*?)```", readme_section(), re.DOTALL)
    commands = []
    for line in block.splitlines():
        command, _, comment = line.partition("  # ")
        if command.strip() and not command.startswith("#"):
            commands.append((shlex.split(command), comment))
    return commands


def run_options(argv: list[str]) -> list[str]:
    """A README ``run`` command's options, less the fixed port and the bootstrap address
    (the test's daemons listen on port 0)."""
    options = argv[argv.index("run") + 1 :]
    for fixed in ("--listen", "--bootstrap"):
        if fixed in options:
            at = options.index(fixed)
            del options[at : at + 2]
    return options


def test_the_readme_toolbox_is_the_example() -> None:
    [block] = re.findall(r"```python\n(.*?)```", readme_section(), re.DOTALL)
    assert block == (EXAMPLES / "toolbox.py").read_text(encoding="utf-8")


@pytest.mark.slow
async def test_a_second_node_uses_the_toolbox_through_the_command_line(tmp_path: Path) -> None:
    env = dict(NodeProcess(tmp_path).env, PYTHONPATH=str(EXAMPLES))
    commands = readme_commands()
    [owner_run, caller_run] = [argv for argv, _ in commands if "run" in argv]
    owner_dir, caller_dir = owner_run[2], caller_run[2]  # ./planner-node, ./caller-node
    for data_dir in (owner_dir, caller_dir):  # as the README's "Write an agent" makes them
        assert (await p2pnode(tmp_path, "--data-dir", data_dir, "init")).code == 0
    owner = NodeProcess(tmp_path / owner_dir, env)
    caller = NodeProcess(tmp_path / caller_dir, env)

    async def cli(data_dir: str, *argv: str) -> Run:
        return await p2pnode(tmp_path, "--data-dir", data_dir, *argv)

    async with trio.open_nursery() as nursery:
        try:
            await owner.start(nursery, None, run_args=run_options(owner_run))
            await caller.start(nursery, owner.address, run_args=run_options(caller_run))
            await wait_for_tool(tmp_path, caller_dir, "toolbox.estimate")
            me = (await caller.call({"op": "status"}))["agents"][0]  # agent-<6 of its peer id>

            listed = await cli(caller_dir, "tools", "list")
            assert listed.code == 0 and listed.err == ""
            assert listed.out.splitlines()[0].split() == ["TOOL", "OWNER", "DESCRIPTION"]
            assert re.search(r"^toolbox\.estimate +toolbox +Estimate the hours", listed.out, re.M)
            assert "set_rate" not in listed.out  # its access rule refuses this caller

            called = await cli(caller_dir, "tools", "call", "toolbox.estimate",
                               "--args", '{"tasks": 4, "parallel": 2}')  # fmt: skip
            assert called.code == 0 and json.loads(called.out) == {"hours": 3.0}
            full = await cli(caller_dir, "tools", "call", "toolbox.estimate", "--json")
            assert full.code == 1  # tasks is required
            assert full.error_line().startswith("INVALID_INPUT: arguments.tasks")

            wrong = await cli(caller_dir, "tools", "call", "toolbox.estimate",
                              "--args", '{"tasks": "many"}')  # fmt: skip
            assert wrong.error_line().startswith("INVALID_INPUT: arguments.tasks: ")
            refused = await cli(caller_dir, "tools", "call", "toolbox.set_rate",
                                "--args", '{"hours_per_task": 9}')  # fmt: skip
            assert refused.error_line() == (
                f"PERMISSION_DENIED: {me} may not use tool toolbox.set_rate: "
                "no endorsed role among ops"
            )
            for argv, code in [
                (["toolbox.nope"], ErrorCode.TOOL_NOT_FOUND),
                (["estimate"], ErrorCode.INVALID_ARGUMENT),
                (["toolbox.estimate", "--args", "{not json"], ErrorCode.INVALID_ARGUMENT),
                (["toolbox.estimate", "--args", "[4]"], ErrorCode.INVALID_ARGUMENT),
                (["toolbox.estimate", "--agent", "nobody"], ErrorCode.AGENT_NOT_FOUND),
            ]:
                run = await cli(caller_dir, "tools", "call", *argv)
                assert run.error_line().startswith(f"{code}: "), argv

            resources = await cli(caller_dir, "resources", "list")
            assert re.search(r"^memo://checklist +toolbox +application/json ", resources.out, re.M)
            read = await cli(caller_dir, "resources", "read", "memo://checklist")
            assert read.code == 0 and json.loads(read.out) == {
                "steps": ["scope", "estimate", "review"]
            }
            read = await cli(caller_dir, "resources", "read", "memo://checklist", "--json",
                             "--from", "toolbox")  # fmt: skip
            assert json.loads(read.out)["contents"][0]["mimeType"] == "application/json"
            missing = await cli(caller_dir, "resources", "read", "memo://nothing")
            assert missing.error_line().startswith(f"{ErrorCode.RESOURCE_NOT_FOUND}: ")

            prompts = await cli(caller_dir, "prompts", "list")
            assert re.search(r"^toolbox\.kickoff +toolbox +project, date +A kickoff note$",
                             prompts.out, re.M)  # fmt: skip
            note = await cli(caller_dir, "prompts", "get", "toolbox.kickoff",
                             "--args", '{"project": "p2p", "date": "Friday"}')  # fmt: skip
            assert note.code == 0 and note.out == "Write the kickoff note of p2p, due Friday.\n"
            half = await cli(caller_dir, "prompts", "get", "toolbox.kickoff",
                             "--args", '{"project": "p2p"}')  # fmt: skip
            assert half.error_line().startswith("INVALID_INPUT: arguments.date")

            # The owner's records: who used what, with which outcome.
            history = await cli(owner_dir, "tools", "history", "--json")
            records = json.loads(history.out)["invocations"]
            used = [(r["tool"], r["agentId"], r["error"]) for r in records]
            for expected in [
                ("toolbox.estimate", me, None),
                ("toolbox.estimate", me, "INVALID_INPUT"),
                ("toolbox.set_rate", me, "PERMISSION_DENIED"),
                ("toolbox.nope", me, "TOOL_NOT_FOUND"),
                ("resource:memo://checklist", me, None),
                ("prompt:toolbox.kickoff", me, None),
            ]:
                assert expected in used
            first = records[used.index(("toolbox.estimate", me, None))]
            assert first["arguments"] == {"tasks": 4, "parallel": 2}
            table = await cli(owner_dir, "tools", "history")
            assert table.out.splitlines()[0].split() == [
                "STARTED", "USED", "CALLER", "OUTCOME", "MS"
            ]  # fmt: skip
            assert re.search(rf" toolbox\.set_rate +{me} +PERMISSION_DENIED +\d", table.out)
            planner = await cli(owner_dir, "tools", "history", "--agent", "planner", "--json")
            assert json.loads(planner.out) == {"invocations": []}  # the planner offers none
            status = await cli(owner_dir, "status")
            errors = sum(1 for r in records if r["error"])
            assert f"tools      invocations {len(records)}  errors {errors}  average " in status.out

            # The README's commands, as written: each works, or fails with the code its
            # comment names.
            for argv, comment in commands:
                if "run" in argv:
                    continue
                assert argv[0] == "p2pnode"
                run = await p2pnode(tmp_path, *argv[1:])
                named = [code for code in ErrorCode if code in comment.split()]
                if named:
                    assert run.error_line().startswith(f"{named[0]}: "), argv
                else:
                    assert run.code == 0 and run.err == "", (argv, run)

            # An agent process attached to the caller's daemon offers a tool too: the
            # owner's node calls it, and the daemon that hosts it audits the use.
            helper = Agent("helper", tier=2)  # the owner's agents are L2: L2 reaches L0-L2

            @helper.tool()
            def shout(text: str) -> str:
                """Say it louder."""
                return text.upper()

            async with AgentClient(helper, data_dir=tmp_path / caller_dir):
                await wait_for_tool(tmp_path, owner_dir, "helper.shout")
                loud = await cli(owner_dir, "tools", "call", "helper.shout",
                                 "--args", '{"text": "hi"}', "--agent", "toolbox")  # fmt: skip
                assert loud.code == 0 and json.loads(loud.out) == "HI"
                audit = await cli(caller_dir, "tools", "history", "--agent", "helper", "--json")
                [use] = json.loads(audit.out)["invocations"]
                assert (use["tool"], use["agentId"], use["error"]) == (
                    "helper.shout",
                    "toolbox",
                    None,
                )
        finally:
            await caller.stop()
            await owner.stop()
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_roles_endorsed_by_the_authority_open_a_tool(tmp_path: Path) -> None:
    env = dict(NodeProcess(tmp_path).env, PYTHONPATH=str(EXAMPLES))
    authority = Identity.generate()
    key_file = tmp_path / "authority.key"
    save_identity(authority, key_file)
    closed = ["--authority-key", b64encode(authority.public_key), "--endorse-with", str(key_file)]
    owner, operator = NodeProcess(tmp_path / "owner", env), NodeProcess(tmp_path / "ops", env)
    owner.prepare("unused", 3)
    operator.prepare("operator", 3)
    arguments = '{"hours_per_task": 2}'

    async def cli(node: NodeProcess, *argv: str) -> Run:
        return await p2pnode(tmp_path, "--data-dir", str(node.data_dir), *argv)

    async with trio.open_nursery() as nursery:
        try:
            await owner.start(nursery, None, run_args=["--agent", "toolbox:agent", *closed])
            await operator.start(nursery, owner.address, run_args=[*closed, "--role", "ops"])
            await wait_for_tool(tmp_path, str(operator.data_dir), "toolbox.set_rate")
            done = await cli(operator, "tools", "call", "toolbox.set_rate", "--args", arguments)
            assert done.code == 0 and json.loads(done.out) == "operator set 2.0 hours per task"
            hours = await cli(operator, "tools", "call", "toolbox.estimate", "--args",
                              '{"tasks": 4}')  # fmt: skip
            assert json.loads(hours.out) == {"hours": 8.0}
            # Endorsed, but without the role: the toolbox itself, on its own node.
            own = await cli(owner, "tools", "call", "toolbox.set_rate", "--args", arguments,
                            "--agent", "toolbox")  # fmt: skip
            assert own.error_line().endswith("no endorsed role among ops")
            listed: dict[str, Any] = json.loads((await cli(owner, "tools", "list", "--json")).out)
            assert [t["name"] for t in listed["items"]] == ["toolbox.estimate"]
        finally:
            await operator.stop()
            await owner.stop()
        nursery.cancel_scope.cancel()


def command(answer: Any, *argv: str) -> tuple[int, list[dict[str, Any]]]:
    """Run one command against a node that answers ``answer``: the exit code, and the
    requests the node got."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--data-dir")
    asked: list[dict[str, Any]] = []

    def control(args: argparse.Namespace, request: dict[str, Any]) -> Any:
        asked.append(request)
        return answer

    add_tool_commands(parser.add_subparsers(), control)
    args = parser.parse_args(argv)
    code: int = args.handler(args)
    return code, asked


def test_the_requests_name_the_caller_and_the_arguments() -> None:
    _, asked = command({"result": 1}, "tools", "call", "a.b", "--args",
                       '{"x": [1]}', "--agent", "me")  # fmt: skip
    assert asked == [{"op": "tools.call", "name": "a.b", "arguments": {"x": [1]}, "agent": "me"}]
    _, asked = command({"contents": []}, "resources", "read", "memo://x", "--from", "owner")
    assert asked == [{"op": "resources.read", "uri": "memo://x", "from": "owner"}]
    _, asked = command({"messages": []}, "prompts", "get", "a.b")
    assert asked == [{"op": "prompts.get", "name": "a.b", "arguments": {}}]


@pytest.mark.parametrize(
    "argv",
    [("resources", "read", "memo://x"), ("prompts", "get", "a.b")],
)
@pytest.mark.parametrize(
    "answer",
    [
        None,
        "text",
        {"contents": "x", "messages": 3},
        {"contents": [1, None, {"text": 5}, {"blob": None}], "messages": [1, {"content": 2}]},
        {"messages": [{"role": {"x": 1}, "content": {"type": "image", "data": "AA=="}}] * 2},
    ],
)
def test_a_malformed_owner_answer_prints_what_it_can(
    answer: Any, argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    # The node passes the owner's answer on as it came: the command must not trip on it.
    code, _ = command(answer, *argv)
    assert code == 0
    assert "Traceback" not in capsys.readouterr().err


def test_a_peer_text_in_a_table_cannot_drive_the_terminal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    listing = {"items": [{"name": "evil.x", "agentId": "evil",
                          "description": "line\nbreak \x1b[2Jclear"}],
               "unreachable": {"gone\x1b]0;title\x07": "TIMEOUT"}, "dropped": 2}  # fmt: skip
    assert command(listing, "tools", "list")[0] == 0
    out, err = capsys.readouterr()
    assert "\x1b" not in out + err and "\x07" not in err
    assert out.splitlines()[1].split(maxsplit=2)[2] == "line break \ufffd[2Jclear"
    assert err.splitlines() == [
        "p2pnode: warning: agent gone\ufffd]0;title\ufffd did not list its tools: TIMEOUT",
        "p2pnode: warning: 2 malformed or excess tools entries left out",
    ]


def test_prompt_messages_and_resource_contents_print_as_text(
    capsys: pytest.CaptureFixture[str],
) -> None:
    contents = {"contents": [{"uri": "u:x", "text": "one"}, {"uri": "u:y", "blob": "AAE="}]}
    command(contents, "resources", "read", "u:x")
    assert capsys.readouterr().out == "one\nAAE=\n"
    messages = [
        {"role": "user", "content": {"type": "text", "text": "Plan it."}},
        {"role": "model", "content": {"type": "image", "data": "AA==", "mimeType": "image/png"}},
    ]
    command({"messages": messages}, "prompts", "get", "a.b")
    assert capsys.readouterr().out == "user: Plan it.\nmodel: [image content, image/png]\n"
