"""``p2pnode task`` and ``p2pnode swarm``: task proposals and swarms through a running
node, and the control operations that serve them.

The daemon's side (:func:`task_ops`) proposes and opens swarms as one of the
node's local agents (``from``; default: the node's first agent) and keeps the
tasks it proposed for the commands that follow them. The commands' side
(:func:`add_task_commands`) checks its arguments, then asks the node, follows
the task or swarm until it ends (progress on stderr), and prints the result:
a table, or with ``--json`` the node's answer as it is. An error is one line
naming its code, and the exit code is 1.

Control operations (JSON lines on ``control.sock``, see p2pnode.node.control;
docs/protocol/tasks.md for the protocol):

* ``task.propose`` ``{"from", "to", "task": {"description", "capabilities",
  "complexity", "input"}, "deadline", "capability", "selection",
  "justification"}``: returns once the task is awarded, ``{"taskId",
  "state", "assignee", "estimatedCompletion", "progress", "message"}``; the
  errors of negotiation otherwise (``PROPOSAL_TIMEOUT``, ``TASK_REJECTED``).
* ``task.wait`` ``{"taskId", "timeout"}``: the task after its next change or
  ``timeout`` seconds (at most 30), with ``result`` or ``error`` once it
  ended.
* ``task.cancel`` ``{"taskId"}``.
* ``swarm.open`` ``{"from", "plan"}``: ``{"swarm", "doc", "total"}``; the
  node starts its swarm service if it runs none.
* ``swarm.status`` ``{"swarm", "timeout"}``: the swarm as the node's replica
  says (``{"swarm", "status", "done", "total", "coordinator", "epoch",
  "members", "outcome", "subtasks": [{"id", "status", "assignee",
  "attempt", "resultRef"}]}``). A node that does not follow the swarm yet
  starts following it (its first agent subscribes to ``swarm.<id>``) and
  waits up to ``timeout`` seconds for the document.
* ``swarm.cancel`` ``{"swarm"}``: only on the node that opened it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from p2pnode.agent.task import TERMINAL_STATES, Selection, Task, TaskState, valid_id
from p2pnode.cli.options import add_acting_agent, add_json
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.jsonutil import loads_untrusted

if TYPE_CHECKING:
    # The composed node and the swarm service load in the daemon, where the ops run.
    from p2pnode.runtime import Node, TaskHandle

Op = Callable[[dict[str, Any]], Any]
Control = Callable[[argparse.Namespace, dict[str, Any]], Any]
#: Tasks a daemon keeps for ``task.wait`` after proposing them.
KEPT_TASKS = 1024
MAX_WAIT = 30.0


def _task_from(obj: object) -> Task:
    if not isinstance(obj, dict):
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "the task is a JSON object")
    unknown = set(obj) - {"description", "capabilities", "complexity", "input"}
    if unknown:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"task: unknown fields {sorted(unknown)}")
    capabilities = obj.get("capabilities", [])
    if not isinstance(capabilities, list):
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "task.capabilities is a list")
    return Task(
        str(obj.get("description", "")),
        tuple(capabilities),
        obj.get("complexity", 1.0),
        obj.get("input"),
    )


def _describe(handle: TaskHandle) -> dict[str, Any]:
    thread = handle.thread
    accepted = handle.acceptance(handle.assignee or "")
    out: dict[str, Any] = {
        "taskId": handle.task_id,
        "state": handle.state.value,
        "assignee": handle.assignee,
        "estimatedCompletion": accepted.estimated_completion_ms if accepted else None,
        "progress": handle.progress,
        "message": handle.message,
    }
    if handle.state is TaskState.COMPLETED:
        out["result"] = thread.result
    elif handle.state in TERMINAL_STATES:
        out["error"] = thread.error or {"code": str(ErrorCode.TASK_CANCELED), "message": ""}
    return out


def _sender(node: Node, request: dict[str, Any]) -> str:
    return str(request.get("from") or node.default_agent())


def task_ops(node: Node) -> dict[str, Op]:
    """The control operations of the module docstring, for ``node``."""
    return {**_proposal_ops(node), **_swarm_ops(node)}


def _proposal_ops(node: Node) -> dict[str, Op]:
    """``task.*``: propose, and wait on or cancel what this daemon proposed."""
    handles: OrderedDict[str, TaskHandle] = OrderedDict()

    async def propose(request: dict[str, Any]) -> Any:
        deadline = request.get("deadline")
        handle = await node.tasks.propose(
            _sender(node, request),
            str(request["to"]),
            _task_from(request.get("task")),
            deadline=float(deadline) if deadline is not None else None,
            capability=bool(request.get("capability")),
            selection=Selection(str(request.get("selection") or Selection.FIRST_ACCEPT)),
            justification=request.get("justification") or None,
        )
        handles[handle.task_id] = handle
        while len(handles) > KEPT_TASKS:
            handles.popitem(last=False)
        return _describe(handle)

    def handle_of(request: dict[str, Any]) -> TaskHandle:
        handle = handles.get(str(request["taskId"]))
        if handle is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"no task {request['taskId']!r} here")
        return handle

    async def wait(request: dict[str, Any]) -> Any:
        handle = handle_of(request)
        if handle.state not in TERMINAL_STATES:
            with trio.move_on_after(min(MAX_WAIT, float(request.get("timeout", 1.0)))):
                await handle.wait_changed()
        return _describe(handle)

    async def cancel(request: dict[str, Any]) -> Any:
        handle = handle_of(request)
        await handle.cancel()
        return _describe(handle)

    return {"task.propose": propose, "task.wait": wait, "task.cancel": cancel}


def _swarm_ops(node: Node) -> dict[str, Op]:
    """``swarm.*``: open a swarm, follow one by its document, cancel one."""
    from p2pnode.runtime import open_swarms
    from p2pnode.services.shared.docops import doc_capability
    from p2pnode.services.swarms import doc_name

    async def swarm_open(request: dict[str, Any]) -> Any:
        service = await open_swarms(node)
        handle = await service.open(_sender(node, request), request["plan"])
        return {"swarm": handle.swarm, "doc": handle.doc, "total": handle.progress[1]}

    async def swarm_status(request: dict[str, Any]) -> Any:
        swarm = str(request["swarm"])
        if not valid_id(swarm):
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"not a swarm id: {swarm!r}")
        service = await open_swarms(node)
        if service.members.get(swarm) is None:
            doc = doc_name(swarm)
            # A swarm nobody replicates is unknown: say so now rather than subscribing
            # and waiting for a document that will not come.
            if not node.shared.subscriptions().get(doc) and not await node.find(
                doc_capability(doc)
            ):
                raise LocalError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"no swarm {swarm!r} known: no reachable agent replicates its document {doc}",
                )
            if not node.shared.subscriptions().get(doc):
                await node.shared.subscribe(node.default_agent(), doc)
            service.members.node(swarm, doc)
        followed = service.members.get(swarm)
        assert followed is not None
        with trio.move_on_after(min(MAX_WAIT, float(request.get("timeout", 5.0)))):
            while followed.plan is None:
                await service.members.refresh(followed)
                if followed.plan is None:
                    await trio.sleep(0.2)
        return service.status(swarm)

    async def swarm_cancel(request: dict[str, Any]) -> Any:
        service = await open_swarms(node)
        await service.cancel(str(request["swarm"]))
        return {"swarm": request["swarm"], "canceled": True}

    return {"swarm.open": swarm_open, "swarm.status": swarm_status, "swarm.cancel": swarm_cancel}


# -- the commands ---------------------------------------------------------------------------------


def _json_arg(text: str, what: str) -> Any:
    try:
        return loads_untrusted(text, 1024 * 1024)
    except ValueError as exc:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"{what} is not JSON: {exc}") from None


def _progress_line(done: int, total: int, status: str, width: int = 30) -> str:
    filled = int(width * done / total) if total else width
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {status}"


def _cli(args: argparse.Namespace, *words: str) -> str:
    """A command line to suggest, with the ``--data-dir`` this one was given."""
    where = f" --data-dir {shlex.quote(args.data_dir)}" if args.data_dir else ""
    return " ".join([f"p2pnode{where}", *words])


def _interruptible(follow: Callable[[], int], note: Callable[[], str]) -> int:
    """Run ``follow``; on Ctrl-C print ``note()`` (what goes on in the node, and how to stop
    it) as one line and return 130, the shell's code for an interrupted command."""
    interrupted = False
    try:
        return follow()
    except* KeyboardInterrupt:
        interrupted = True
    assert interrupted
    print(f"p2pnode: interrupted: {note()}", file=sys.stderr)
    return 130


def cmd_task_propose(args: argparse.Namespace, control: Control) -> int:
    task = _task_from(_json_arg(args.task, "--task"))
    request = {
        "op": "task.propose", "from": args.sender, "to": args.target, "task": task.to_dict(),
        "deadline": args.deadline, "capability": args.capability, "selection": args.selection,
        "justification": args.justification,
    }  # fmt: skip
    proposed: list[str] = []

    def note() -> str:
        if not proposed:
            return "no task was awarded (a proposal under way may still be awarded in the node)"
        cancel = _cli(args, "task cancel", proposed[0])
        return f"task {proposed[0]} goes on in the node; `{cancel}` cancels it"

    def follow() -> int:
        answer = control(args, request)
        proposed.append(str(answer["taskId"]))
        return _follow_task(args, control, answer)

    return _interruptible(follow, note)


def _follow_task(args: argparse.Namespace, control: Control, answer: dict[str, Any]) -> int:
    if not args.json:
        print(f"{answer['taskId']}: accepted by {answer['assignee']}", file=sys.stderr)
    last: tuple[Any, ...] = ()
    while answer["state"] not in {s.value for s in TERMINAL_STATES} and not args.no_wait:
        seen = (answer["state"], answer["progress"], answer["message"])
        if seen != last and not args.json:
            progress = "" if answer["progress"] is None else f" {answer['progress']:.0%}"
            print(f"  {answer['state']}{progress} {answer['message']}".rstrip(), file=sys.stderr)
            last = seen
        answer = control(args, {"op": "task.wait", "taskId": answer["taskId"], "timeout": 5})
    if args.json or args.no_wait:
        print(json.dumps(answer, indent=2))
    elif answer["state"] == TaskState.COMPLETED:
        print(json.dumps(answer["result"], indent=2))
    else:
        error = answer.get("error") or {}
        print(f"{answer['state']}: {error.get('code')}: {error.get('message')}", file=sys.stderr)
    return 0 if answer["state"] in (TaskState.COMPLETED, TaskState.WORKING) else 1


def cmd_task_cancel(args: argparse.Namespace, control: Control) -> int:
    answer = control(args, {"op": "task.cancel", "taskId": args.task_id})
    print(f"task {args.task_id}: {answer['state']}", file=sys.stderr)
    return 0


def _table(status: dict[str, Any]) -> list[str]:
    """The final table: per participant, the sub-tasks it completed."""
    done: dict[str, int] = {}
    for sub in status["subtasks"]:
        if sub["status"] == "done" and sub["assignee"]:
            done[sub["assignee"]] = done.get(sub["assignee"], 0) + 1
    rows = [f"{'agent':<24} {'alive':<6} {'done':>6}"]
    members = {m["agent"]: m for m in status["members"]}
    for agent in sorted(set(members) | set(done)):
        alive = "yes" if members.get(agent, {}).get("alive", True) else "no"
        rows.append(f"{agent:<24} {alive:<6} {done.get(agent, 0):>6}")
    return rows


def _print_status(status: dict[str, Any], *, subtasks: bool) -> None:
    print(f"swarm        {status['swarm']}  ({status['doc']})")
    print(f"status       {status['status']}  {status['done']}/{status['total']} done")
    print(f"coordinator  {status['coordinator']}  (epoch {status['epoch']})")
    print(f"duplicates   {status['duplicates']}")
    for row in _table(status):
        print(f"  {row}")
    if subtasks:
        print(f"  {'sub-task':<24} {'status':<10} {'assignee':<24} {'try':>3} result")
        for sub in status["subtasks"]:
            print(f"  {sub['id']:<24} {sub['status']:<10} {sub['assignee'] or '-':<24} "
                  f"{sub['attempt']:>3} {sub['resultRef'] or '-'}")  # fmt: skip
    if status["status"] == "completed":
        print(f"outcome      {json.dumps(status['outcome'])}")


def cmd_swarm_run(args: argparse.Namespace, control: Control) -> int:
    try:
        text = Path(args.plan).read_text(encoding="utf-8")
    except OSError as exc:
        raise LocalError(ErrorCode.CONFIG_ERROR, f"cannot read {args.plan}: {exc}") from None
    plan = _json_arg(text, args.plan)
    opened: list[str] = []

    def note() -> str:
        if not opened:
            return "no swarm was opened (one being opened may still open in the node)"
        swarm = opened[0]
        return (
            f"swarm {swarm} goes on in the node; `{_cli(args, 'swarm status', swarm)}` "
            f"follows it, `{_cli(args, 'swarm cancel', swarm)}` cancels it"
        )

    def follow() -> int:
        answer = control(args, {"op": "swarm.open", "from": args.sender, "plan": plan})
        opened.append(str(answer["swarm"]))
        return _follow_swarm(args, control, answer)

    return _interruptible(follow, note)


def _follow_swarm(args: argparse.Namespace, control: Control, opened: dict[str, Any]) -> int:
    swarm = opened["swarm"]
    if not args.json:
        print(f"swarm {swarm}: {opened['total']} sub-tasks", file=sys.stderr)
    tty = sys.stderr.isatty()
    last = ""
    while True:
        status = control(args, {"op": "swarm.status", "swarm": swarm})
        line = _progress_line(status["done"], status["total"], status["status"])
        if line != last and not args.json:
            print(("\r" if tty else "") + line, end="" if tty else "\n", file=sys.stderr)
            last = line
        if status["status"] in ("completed", "canceled"):
            break
        time.sleep(args.interval)
    if tty and not args.json:
        print(file=sys.stderr)
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        _print_status(status, subtasks=False)
    return 0 if status["status"] == "completed" else 1


def cmd_swarm_status(args: argparse.Namespace, control: Control) -> int:
    status = control(args, {"op": "swarm.status", "swarm": args.swarm})
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        _print_status(status, subtasks=True)
    return 0


def cmd_swarm_cancel(args: argparse.Namespace, control: Control) -> int:
    control(args, {"op": "swarm.cancel", "swarm": args.swarm})
    print(f"swarm {args.swarm}: canceled", file=sys.stderr)
    return 0


def add_task_commands(sub: argparse._SubParsersAction[Any], control: Control) -> None:
    """Register ``task propose`` and ``swarm run | status | cancel``."""

    def bind(handler: Callable[[argparse.Namespace, Control], int]) -> Any:
        return lambda args: handler(args, control)

    task = sub.add_parser("task", help="propose tasks to other agents").add_subparsers(
        dest="task_command", required=True
    )
    propose = task.add_parser(
        "propose",
        help="propose a task and follow it to its result",
        description="Propose a task (Contract Net; docs/protocol/tasks.md) and print its "
        'result. --task is {"description", "capabilities", "complexity", "input"}.',
    )
    propose.add_argument("target", help="agent id, or with --capability a capability id")
    propose.add_argument("--task", required=True, help="the task as JSON")
    propose.add_argument("--deadline", type=float, help="seconds to answer (default 10)")
    propose.add_argument("--capability", action="store_true", help="TARGET is a capability")
    propose.add_argument(
        "--selection",
        choices=[s.value for s in Selection],
        default=Selection.FIRST_ACCEPT.value,
        help="how to pick among agents that accept (default: %(default)s)",
    )
    propose.add_argument("--justification", help="escalation justification (L2/L3 to L0/L1)")
    add_acting_agent(
        propose, "local agent proposing (default: the first)", dest="sender", old="--from"
    )
    propose.add_argument("--no-wait", action="store_true", help="return once it is awarded")
    add_json(propose, "the task's outcome")
    propose.set_defaults(handler=bind(cmd_task_propose))
    cancel_task = task.add_parser("cancel", help="cancel a task this node proposed")
    cancel_task.add_argument(
        "task_id", metavar="TASK_ID", help="the task's id (`task propose` prints it)"
    )
    cancel_task.set_defaults(handler=bind(cmd_task_cancel))
    _add_swarm_commands(sub, bind)


def _add_swarm_commands(
    sub: argparse._SubParsersAction[Any],
    bind: Callable[[Callable[[argparse.Namespace, Control], int]], Any],
) -> None:
    swarm = sub.add_parser("swarm", help="run swarms of agents").add_subparsers(
        dest="swarm_command", required=True
    )
    run = swarm.add_parser(
        "run",
        help="open a swarm for a plan and follow it to its outcome",
        description='PLAN.json: {"description", "aggregate": list|sum|concat|count|map, '
        '"lease": seconds, "subtasks": [{"id", "description", "capabilities", '
        '"complexity", "input"}, ...]}',
    )
    run.add_argument("plan", metavar="PLAN.json", help="the plan file (see above)")
    add_acting_agent(
        run, "local agent opening it (default: the first)", dest="sender", old="--from"
    )
    run.add_argument("--interval", type=float, default=0.5, help="seconds between updates")
    add_json(run, "the swarm's final status")
    run.set_defaults(handler=bind(cmd_swarm_run))
    status = swarm.add_parser("status", help="a swarm's sub-tasks, members and outcome")
    status.add_argument("swarm", metavar="ID", help="the swarm's id (`swarm run` prints it)")
    add_json(status, "the swarm's status")
    status.set_defaults(handler=bind(cmd_swarm_status))
    cancel = swarm.add_parser("cancel", help="cancel a swarm this node opened")
    cancel.add_argument("swarm", metavar="ID", help="the swarm's id")
    cancel.set_defaults(handler=bind(cmd_swarm_cancel))


__all__ = ["add_task_commands", "task_ops"]
