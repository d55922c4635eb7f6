"""``p2pnode tools | resources | prompts``: the swarm's tools, resources and prompts,
used through a running node, and the control operations that serve them.

The daemon's side (:func:`tool_ops`) runs each operation with the node's
:class:`~p2pnode.services.tools.client.ToolClient` as one of its local agents
(``agent`` in the request; default: the node's first agent), so the owner
checks its access rules against that agent's authenticated card. The
commands' side (:func:`add_tool_commands`) checks what it can before asking
the node (``--args`` is a JSON object, a tool or prompt name is
``AGENT.NAME``), then prints the answer: a table, the content itself, or with
``--json`` the node's answer as it is. An error is one line naming its code
(the command line's handler prints it), and the exit code is 1.

Control operations (JSON lines on ``control.sock``, see p2pnode.node.control):

The names, arguments and results are those of the same ops on ``agent.sock``
(docs/protocol/agents.md), where the caller is the attached agent; here it is
``agent``, and a resource's owner is ``from``.

* ``tools.list``, ``resources.list``, ``prompts.list`` ``{"agent"}``: a
  listing, ``{"items", "unreachable", "dropped"}``.
* ``tools.call`` ``{"name", "arguments", "agent", "timeout"}``: ``{"result"}``;
  ``timeout`` is the caller's deadline in seconds (tools.md §3.3).
* ``resources.read`` ``{"uri", "from", "agent"}``: the MCP result,
  ``{"contents": [...]}``; ``from`` is the owner (default: the first agent
  the caller may discover whose card lists the URI).
* ``prompts.get`` ``{"name", "arguments", "agent"}``: the MCP result,
  ``{"description", "messages"}``.
* ``tools.history`` ``{"agent"}``: ``{"invocations": [...]}``, the records of
  this node's tools, resources and prompts being used (of ``agent``'s only,
  when given), oldest first.
"""

from __future__ import annotations

import argparse
import json
import sys
import unicodedata
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from p2pnode.agent.toolwire import split_qualified
from p2pnode.cli.options import add_acting_agent, add_hidden_alias, add_json
from p2pnode.core.card import AgentCard
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.node.control import Op

if TYPE_CHECKING:
    from p2pnode.runtime import Node  # loaded by the daemon, where the ops run

#: How a command asks the running node: ``control(args, request)`` is the op's result.
Control = Callable[[argparse.Namespace, dict[str, Any]], Any]


# -- the daemon's side ------------------------------------------------------------------------


def tool_ops(node: Node) -> dict[str, Op]:
    """The control operations of these commands (see the module docstring)."""
    client = node.tools

    def caller(request: dict[str, Any]) -> str | None:
        agent = request.get("agent")
        return str(agent) if agent else None

    def arguments(request: dict[str, Any]) -> dict[str, Any]:
        value = request.get("arguments")
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "arguments must be a JSON object")
        return value

    async def list_tools(request: dict[str, Any]) -> Any:
        return (await client.list_tools(caller(request))).to_dict()

    async def list_resources(request: dict[str, Any]) -> Any:
        return (await client.list_resources(caller(request))).to_dict()

    async def list_prompts(request: dict[str, Any]) -> Any:
        return (await client.list_prompts(caller(request))).to_dict()

    async def call(request: dict[str, Any]) -> Any:
        name, timeout = str(request["name"]), request.get("timeout")
        result = await client.call_tool(
            name, arguments(request), caller=caller(request), timeout=timeout
        )
        return {"result": result}

    async def read(request: dict[str, Any]) -> Any:
        owner = request.get("from")
        return await client.read_resource(
            str(request["uri"]), caller=caller(request), agent=str(owner) if owner else None
        )

    async def get(request: dict[str, Any]) -> Any:
        name = str(request["name"])
        return await client.get_prompt(name, arguments(request), caller=caller(request))

    async def history(request: dict[str, Any]) -> Any:
        records = node.tool_audit.invocations()
        agent = caller(request)
        if agent is not None:
            mine = _used_names(node.local_agent(agent))
            records = [r for r in records if r.tool in mine]
        return {"invocations": [r.to_dict() for r in records]}

    return {
        "tools.list": list_tools,
        "tools.call": call,
        "tools.history": history,
        "resources.list": list_resources,
        "resources.read": read,
        "prompts.list": list_prompts,
        "prompts.get": get,
    }


def _used_names(card: AgentCard) -> frozenset[str]:
    """What the audit names the uses of ``card``'s agent's offers by
    (p2pnode.services.tools.audit.used_name)."""
    return frozenset(
        [f"{card.id}.{tool}" for tool in card.tools]
        + [f"resource:{uri}" for uri in card.resources]
        + [f"prompt:{card.id}.{prompt}" for prompt in card.prompts]
    )


# -- the commands' side -----------------------------------------------------------------------


def _json_arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"--args is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise LocalError(
            ErrorCode.INVALID_ARGUMENT, "--args must be a JSON object of the arguments by name"
        )
    return value


def _print_json(data: object) -> None:
    print(json.dumps(data, indent=2, ensure_ascii=False))


def _cell(text: object) -> str:
    """A table cell from a peer's text: one line, no control characters (which could
    drive the user's terminal)."""
    flat = " ".join(str(text).split())
    return "".join("\ufffd" if unicodedata.category(c) == "Cc" else c for c in flat)


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[_cell(c) for c in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header) - 1)]
    for row in cells:
        padded = [c.ljust(w) for c, w in zip(row, widths, strict=False)]
        print("  ".join([*padded, row[-1]]).rstrip())


def _warn(text: str) -> None:
    print(f"p2pnode: warning: {text}", file=sys.stderr)


def _listing_notes(kind: str, listing: dict[str, Any]) -> None:
    """What a listing left out, on stderr: the owners that did not answer, and the
    entries dropped as malformed or past the limits."""
    for agent, code in listing.get("unreachable", {}).items():
        _warn(f"agent {_cell(agent)} did not list its {kind}: {_cell(code)}")
    if listing.get("dropped"):
        _warn(f"{listing['dropped']} malformed or excess {kind} entries left out")
    if not listing.get("items"):
        unreachable = sorted(listing.get("unreachable", {}))
        if unreachable:
            owners = ", ".join(_cell(agent) for agent in unreachable)
            print(f"no {kind} found among the owners that answered; not reached: {owners}",
                  file=sys.stderr)  # fmt: skip
        else:
            print(f"no {kind} found", file=sys.stderr)


def _utc(ms: object) -> str:
    if not isinstance(ms, int):
        return "?"
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _message_text(message: dict[str, Any]) -> str:
    """The text of one MCP prompt message (a placeholder for other content)."""
    content = message.get("content")
    if not isinstance(content, dict):
        return json.dumps(content)
    if isinstance(content.get("text"), str):
        return str(content["text"])
    resource = content.get("resource")
    if isinstance(resource, dict) and isinstance(resource.get("text"), str):
        return str(resource["text"])
    return _cell(f"[{content.get('type', '?')} content, {content.get('mimeType', 'no type')}]")


class _Commands:
    """The handlers, each asking the node through ``control``."""

    def __init__(self, control: Control) -> None:
        self._control = control

    def _ask(self, args: argparse.Namespace, op: str, **fields: Any) -> Any:
        request: dict[str, Any] = {"op": op, **fields}
        if args.agent:
            request["agent"] = args.agent
        return self._control(args, request)

    def tools_list(self, args: argparse.Namespace) -> int:
        listing = self._ask(args, "tools.list")
        if args.json:
            _print_json(listing)
            return 0
        rows = [(t["name"], t["agentId"], t["description"]) for t in listing["items"]]
        if rows:
            _table(("TOOL", "OWNER", "DESCRIPTION"), rows)
        _listing_notes("tools", listing)
        return 0

    def tools_call(self, args: argparse.Namespace) -> int:
        split_qualified(args.name)
        fields: dict[str, Any] = {"name": args.name, "arguments": _json_arguments(args.args)}
        if args.timeout is not None:
            fields["timeout"] = args.timeout
        answer = self._ask(args, "tools.call", **fields)
        _print_json(answer if args.json else answer["result"])
        return 0

    def tools_history(self, args: argparse.Namespace) -> int:
        answer = self._ask(args, "tools.history")
        if args.json:
            _print_json(answer)
            return 0
        records = answer["invocations"]
        if not records:
            whose = f"{args.agent}'s" if args.agent else "this node's"
            print(f"no use of {whose} tools, resources or prompts recorded", file=sys.stderr)
            return 0
        _table(
            ("STARTED", "USED", "CALLER", "OUTCOME", "MS"),
            [(_utc(r["startedAt"]), r["tool"], r["agentId"], r["error"] or "ok",
              f"{r['durationMs']:.2f}") for r in records],
        )  # fmt: skip
        return 0

    def resources_list(self, args: argparse.Namespace) -> int:
        listing = self._ask(args, "resources.list")
        if args.json:
            _print_json(listing)
            return 0
        rows = [(r["uri"], r["agentId"], r["mimeType"], r["description"] or r["name"])
                for r in listing["items"]]  # fmt: skip
        if rows:
            _table(("URI", "OWNER", "TYPE", "DESCRIPTION"), rows)
        _listing_notes("resources", listing)
        return 0

    def resources_read(self, args: argparse.Namespace) -> int:
        fields = {"uri": args.uri} | ({"from": args.owner} if args.owner else {})
        result = self._ask(args, "resources.read", **fields)
        if args.json:
            _print_json(result)
            return 0
        for item in _dicts(result, "contents"):
            # A blob is printed in base64, as it came.
            text = next((v for v in (item.get("text"), item.get("blob")) if isinstance(v, str)), "")
            sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return 0

    def prompts_list(self, args: argparse.Namespace) -> int:
        listing = self._ask(args, "prompts.list")
        if args.json:
            _print_json(listing)
            return 0
        rows = [(p["name"], p["agentId"], _prompt_arguments(p["arguments"]), p["description"])
                for p in listing["items"]]  # fmt: skip
        if rows:
            _table(("PROMPT", "OWNER", "ARGUMENTS", "DESCRIPTION"), rows)
        _listing_notes("prompts", listing)
        return 0

    def prompts_get(self, args: argparse.Namespace) -> int:
        split_qualified(args.name)
        arguments = _json_arguments(args.args)
        result = self._ask(args, "prompts.get", name=args.name, arguments=arguments)
        if args.json:
            _print_json(result)
            return 0
        messages = _dicts(result, "messages")
        for message in messages:
            text = _message_text(message)
            if len(messages) > 1:
                text = f"{_cell(message.get('role', '?'))}: {text}"
            print(text)
        return 0


def _dicts(answer: Any, key: str) -> list[dict[str, Any]]:
    """The objects listed under ``key`` of an owner's answer (which the node passes on as
    the owner sent it: anything else there is skipped)."""
    items = answer.get(key) if isinstance(answer, dict) else None
    return [item for item in items if isinstance(item, dict)] if isinstance(items, list) else []


def _prompt_arguments(arguments: Any) -> str:
    """``name, date?``: the arguments of a listed prompt, ``?`` marking optional ones."""
    if not isinstance(arguments, list):
        return ""
    names = [f"{a.get('name')}{'' if a.get('required', True) else '?'}"
             for a in arguments if isinstance(a, dict)]  # fmt: skip
    return ", ".join(names) or "-"


CALLER_HELP = (
    "the local agent to act as (the owner checks its access rules against this agent's "
    "card; default: the node's first agent)"
)


def _add_action(
    actions: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    text: str,
    handler: Callable[[argparse.Namespace], int],
    agent_help: str = CALLER_HELP,
) -> argparse.ArgumentParser:
    action = actions.add_parser(name, help=text, description=text)
    add_acting_agent(action, agent_help)
    add_json(action)
    action.set_defaults(handler=handler)
    return action


def add_tool_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], control: Control
) -> None:
    """Register ``tools``, ``resources`` and ``prompts``, asking the node with ``control``."""
    commands = _Commands(control)
    tools = sub.add_parser("tools", help="list and call the swarm's tools through a running node")
    actions = tools.add_subparsers(dest="tools_command", required=True, metavar="ACTION")
    _add_action(actions, "list", "the tools the agent may call, with their owners",
                commands.tools_list)  # fmt: skip
    call = _add_action(actions, "call", "call a tool; prints its result as JSON",
                       commands.tools_call)  # fmt: skip
    call.add_argument("name", metavar="AGENT.TOOL", help="the tool, qualified by its owner")
    call.add_argument("--args", default="{}", metavar="JSON", help="the arguments (an object)")
    call.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help="how long to wait for the result or the tool's next progress report (more "
        "than 0, at most 86400; default: the node's request timeout, 10 s); the owner "
        "ends the call then too",
    )
    _add_action(
        actions,
        "history",
        "the uses of this node's tools, resources and prompts, oldest first",
        commands.tools_history,
        agent_help="only the uses of this local agent's tools, resources and prompts "
        "(default: all)",
    )

    resources = sub.add_parser("resources", help="list and read the swarm's resources")
    actions = resources.add_subparsers(dest="resources_command", required=True, metavar="ACTION")
    _add_action(actions, "list", "the resources the agent may read, with their owners",
                commands.resources_list)  # fmt: skip
    read = _add_action(
        actions, "read", "print a resource's content (a blob in base64)", commands.resources_read
    )
    read.add_argument("uri", metavar="URI", help="the resource's URI (as `resources list` shows)")
    read.add_argument(
        "--owner",
        metavar="AGENT",
        help="the remote agent to read it from (default: the first known whose card lists URI)",
    )
    add_hidden_alias(read, "--from", "owner")

    prompts = sub.add_parser("prompts", help="list and get the swarm's prompts")
    actions = prompts.add_subparsers(dest="prompts_command", required=True, metavar="ACTION")
    _add_action(actions, "list", "the prompts the agent may get, with their arguments",
                commands.prompts_list)  # fmt: skip
    get = _add_action(actions, "get", "print a prompt's messages rendered with the arguments",
                      commands.prompts_get)  # fmt: skip
    get.add_argument("name", metavar="AGENT.PROMPT", help="the prompt, qualified by its owner")
    get.add_argument("--args", default="{}", metavar="JSON", help="the arguments (strings)")


__all__ = ["Control", "add_tool_commands", "tool_ops"]
