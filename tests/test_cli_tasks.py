"""``p2pnode task`` and ``p2pnode swarm``: the commands against a fake node (what they
send, print and exit with), and against real daemons (examples/squarer.py on two
nodes, examples/squares.json as the plan)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import trio

from p2pnode.cli.process import NodeProcess
from p2pnode.cli.tasks import add_task_commands
from p2pnode.core.errors import ErrorCode, LocalError
from tests import inprocess

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


class FakeNode:
    """Answers control requests from a script: op -> list of results, in turn."""

    def __init__(self, answers: dict[str, list[Any]]) -> None:
        self.answers = answers
        self.requests: list[dict[str, Any]] = []

    def __call__(self, args: argparse.Namespace, request: dict[str, Any]) -> Any:
        self.requests.append(request)
        queue = self.answers[request["op"]]
        answer = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(answer, Exception):
            raise answer
        return answer


def parse(control: FakeNode, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_task_commands(parser.add_subparsers(dest="command"), control)
    return parser.parse_args(argv)


def task_state(state: str, **extra: Any) -> dict[str, Any]:
    base = {"taskId": "task-1", "state": state, "assignee": "sq-a", "estimatedCompletion": 1,
            "progress": None, "message": ""}  # fmt: skip
    return base | extra


def test_task_propose_follows_the_task_and_prints_its_result(
    capsys: pytest.CaptureFixture[str],
) -> None:
    node = FakeNode({
        "task.propose": [task_state("working")],
        "task.wait": [task_state("working", progress=0.5, message="half"),
                      task_state("completed", progress=1.0, result={"n": 49})],
    })  # fmt: skip
    task = '{"description": "sq", "capabilities": ["square"], "input": 7}'
    args = parse(node, "task", "propose", "square", "--capability", "--deadline", "3",
                 "--task", task)  # fmt: skip
    assert args.handler(args) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"n": 49}
    assert "task-1: accepted by sq-a" in err and "working 50% half" in err
    first = node.requests[0]
    assert (first["to"], first["capability"], first["deadline"]) == ("square", True, 3.0)
    assert first["task"] == {"description": "sq", "capabilities": ["square"], "complexity": 1.0,
                             "input": 7}  # fmt: skip


def test_a_failed_task_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    failed = task_state("failed", error={"code": "HANDLER_FAILED", "message": "boom"})
    node = FakeNode({"task.propose": [task_state("working")], "task.wait": [failed]})
    args = parse(node, "task", "propose", "sq-a", "--task", '{"description": "x"}')
    assert args.handler(args) == 1
    assert "failed: HANDLER_FAILED: boom" in capsys.readouterr().err


def test_task_arguments_are_checked_before_asking_the_node() -> None:
    node = FakeNode({})
    for bad, message in [("{", "not JSON"), ("[]", "JSON object"), ('{"x": 1}', "unknown"),
                         ('{"description": "x", "complexity": -1}', "complexity")]:  # fmt: skip
        args = parse(node, "task", "propose", "sq-a", "--task", bad)
        with pytest.raises(LocalError, match=message) as info:
            args.handler(args)
        assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert node.requests == []


def swarm_status(status: str, done: int) -> dict[str, Any]:
    return {
        "swarm": "s1", "doc": "swarm.s1", "status": status, "done": done, "total": 2,
        "coordinator": "boss", "epoch": 1, "duplicates": 0, "outcome": 1 if done == 2 else None,
        "members": [{"agent": "sq-a", "alive": True}, {"agent": "sq-b", "alive": False}],
        "subtasks": [{"id": "a", "status": "done", "assignee": "sq-a", "attempt": 1,
                      "resultRef": "k/1"},
                     {"id": "b", "status": "done" if done == 2 else "assigned",
                      "assignee": "sq-a", "attempt": 2, "resultRef": None}],
    }  # fmt: skip


def test_swarm_run_shows_progress_then_a_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text((EXAMPLES / "squares.json").read_text(encoding="utf-8"), encoding="utf-8")
    node = FakeNode({
        "swarm.open": [{"swarm": "s1", "doc": "swarm.s1", "total": 2}],
        "swarm.status": [swarm_status("working", 1), swarm_status("completed", 2)],
    })  # fmt: skip
    args = parse(node, "swarm", "run", str(plan), "--interval", "0")
    assert args.handler(args) == 0
    out, err = capsys.readouterr()
    assert "[###############...............] 1/2 working" in err
    assert "2/2 completed" in err
    assert "sq-a" in out and "outcome      1" in out
    assert node.requests[0]["plan"]["aggregate"] == "sum"
    args = parse(node, "swarm", "status", "s1")
    assert args.handler(args) == 0
    out, _ = capsys.readouterr()
    assert "k/1" in out and "sub-task" in out
    missing = parse(node, "swarm", "run", str(tmp_path / "nope.json"))
    with pytest.raises(LocalError) as info:
        missing.handler(missing)
    assert info.value.code is ErrorCode.CONFIG_ERROR


# -- real daemons ---------------------------------------------------------------------------------


async def p2pnode(data_dir: Path, *argv: str) -> tuple[int, str, str]:
    """``p2pnode --data-dir DATA_DIR ARGV``: its ``main(argv)`` in this process (the
    command only asks the daemon and prints; tests/inprocess.py); the daemons are real."""
    done = await inprocess.p2pnode("--data-dir", str(data_dir), *argv, seconds=60)
    return done.code, done.out, done.err


@pytest.mark.slow
async def test_tasks_and_a_swarm_through_the_command_line(tmp_path: Path) -> None:
    base = dict(NodeProcess(tmp_path).env, PYTHONPATH=str(EXAMPLES))
    boss = NodeProcess(tmp_path / "boss", base)
    workers = [
        NodeProcess(tmp_path / name, base | {"SQUARER_ID": name}) for name in ("sq-a", "sq-b")
    ]
    for node in (boss, *workers):
        assert (await p2pnode(node.data_dir, "init"))[0] == 0
    async with trio.open_nursery() as nursery:
        try:
            await boss.start(nursery, None)
            for worker in workers:
                await worker.start(nursery, boss.address, run_args=["--agent", "squarer:agent"])
            with trio.fail_after(30):
                while True:
                    code, out, _ = await p2pnode(boss.data_dir, "find", "square")
                    if code == 0 and "sq-a" in out and "sq-b" in out:
                        break
                    await trio.sleep(0.2)
            task = json.dumps({"description": "square 7", "capabilities": ["square"],
                               "complexity": 0.1, "input": 7})  # fmt: skip
            code, out, err = await p2pnode(boss.data_dir, "task", "propose", "square",
                                           "--capability", "--task", task)  # fmt: skip
            assert code == 0, err
            assert json.loads(out) == 49.0
            code, out, err = await p2pnode(boss.data_dir, "swarm", "run",
                                           str(EXAMPLES / "squares.json"))  # fmt: skip
            assert code == 0, err
            assert f"outcome      {float(sum(i * i for i in range(20)))}" in out
            assert "20/20 completed" in err
            swarm = err.split(":", 1)[0].removeprefix("swarm ")
            with trio.fail_after(20):  # the worker's replica catches up by gossip
                while True:
                    code, out, err = await p2pnode(workers[0].data_dir, "swarm", "status",
                                                   swarm)  # fmt: skip
                    assert code == 0, err
                    if "completed  20/20 done" in out:
                        break
                    await trio.sleep(0.2)
            status = json.loads((await p2pnode(boss.data_dir, "status", "--json"))[1])
            tasks = status["tasks"]
            assert tasks["proposalsSent"] >= 3 and tasks["swarmsOpened"] == 1
            assert tasks["swarmsActive"] == 0 and tasks["reassignments"] == 0
            code, _, err = await p2pnode(boss.data_dir, "task", "propose", "nobody",
                                         "--task", '{"description": "x"}')  # fmt: skip
            assert code == 1 and "AGENT_NOT_FOUND" in err and "Traceback" not in err
        finally:
            with trio.CancelScope(shield=True):
                for node in (*workers, boss):
                    await node.stop()
            nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_task_propose_to_agent_at_peer_through_the_command_line(tmp_path: Path) -> None:
    # The real squarer is "squarer" on one node, and a second node claims "squarer" too:
    # only squarer@<peer> names the real one, and the task reaches it (it timed out
    # with PROPOSAL_TIMEOUT when the answer, from bare "squarer", was not matched).
    base = dict(NodeProcess(tmp_path).env, PYTHONPATH=str(EXAMPLES))
    boss = NodeProcess(tmp_path / "boss", base)
    real, squatter = NodeProcess(tmp_path / "real", base), NodeProcess(tmp_path / "sq", base)
    for node in (boss, real, squatter):
        assert (await p2pnode(node.data_dir, "init"))[0] == 0
    async with trio.open_nursery() as nursery:
        try:
            await boss.start(nursery, None)
            for worker in (real, squatter):
                await worker.start(nursery, boss.address, run_args=["--agent", "squarer:agent"])
            peer = (await real.call({"op": "status"}))["peerId"]
            task = json.dumps({"description": "square 9", "capabilities": ["square"],
                               "complexity": 0.1, "input": 9})  # fmt: skip
            with trio.fail_after(30):  # the boss learns both owners' cards
                while True:
                    code, out, err = await p2pnode(boss.data_dir, "task", "propose",
                                                   f"squarer@{peer}", "--task", task,
                                                   "--json")  # fmt: skip
                    if code == 0 or "AGENT_NOT_FOUND" not in err:
                        break
                    await trio.sleep(0.2)
            assert code == 0, err
            answer = json.loads(out)
            assert answer["result"] == 81.0 and answer["assignee"] == f"squarer@{peer}"
        finally:
            with trio.CancelScope(shield=True):
                for node in (squatter, real, boss):
                    await node.stop()
            nursery.cancel_scope.cancel()
