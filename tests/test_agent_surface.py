"""One agent-facing surface: the trio node, the asyncio node and the attached client offer
the operations of p2pnode.agent.surface under the same names, with the same results and
the same errors.

All three run in one asyncio program: an AioNode (p2pnode.hosting.aio) whose trio node
(``node.node``, called through ``run_trio``) is the trio object, serving agent.sock to an
AgentClient on the same loop. Each acts as an agent of its own: "trio-agent",
"aio-agent", "proc" (attached), all L2 in an open swarm.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from p2pnode import Agent, Identity, Message, Node, NodeConfig, TrioNetwork, aio
from p2pnode.agent.surface import AGENT_SURFACE, SHARED, TASK_HANDLE, TASKS, TOOLS
from p2pnode.agent.task import Task, TaskState
from p2pnode.agent.taskwork import Work
from p2pnode.agent.tools import Access
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.crdt.ops import CounterAdd
from p2pnode.hosting.client import AgentClient
from p2pnode.services.attach.service import AgentSocket
from p2pnode.services.attach.wire import AGENT_SOCKET_NAME

LIMIT = 20.0
ACTORS = ("trio", "aio", "client")


def toolbox() -> Agent:
    owner = Agent("toolbox", tier=2)

    @owner.tool()
    def add(a: int, b: int = 2) -> int:
        """Add two numbers."""
        return a + b

    @owner.tool(access=Access(agents=["someone-else"]))
    def secret() -> str:
        return "no"

    return owner


def planner() -> Agent:
    agent = Agent("planner", tier=2)

    @agent.on_request("plan.strategy")
    def plan(message: Message) -> dict[str, Any]:
        return {"steps": [message.payload["goal"], "done"]}

    return agent


def worker() -> Agent:
    agent = Agent("worker", tier=2)

    @agent.on_task
    def total(work: Work) -> int:
        return sum(work.input)

    return agent


class Three:
    """The three objects, each bound to its own agent, behind one call per operation."""

    def __init__(self, node: aio.AioNode, client: AgentClient) -> None:
        self.aio = node
        self.client = client
        self.trio: Node = node.node

    async def call(self, actor: str, op: str, *args: Any, **kwargs: Any) -> Any:
        """``op`` (a dotted surface name) as ``actor``; a node gets its agent first."""
        if actor == "client":
            return await _maybe(_resolve(self.client, op)(*args, **kwargs))
        agent = f"{actor}-agent"
        if op.startswith("tools."):
            kwargs["caller"] = agent
        elif op == "find":
            kwargs["viewer"] = agent
        elif op != "shared.read":  # a document's value is the same for every member
            args = (agent, *args)
        if actor == "aio":
            return await _maybe(_resolve(self.aio, op)(*args, **kwargs))

        async def in_trio() -> Any:
            return await _maybe(_resolve(self.trio, op)(*args, **kwargs))

        return await self.aio.run_trio(in_trio)


def _resolve(obj: object, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


async def _maybe(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def _outcome(call: Awaitable[Any]) -> tuple[str, Any]:
    """("ok", result) or (error type, code): what the surface promises is the same."""
    try:
        return "ok", await call
    except P2PError as exc:
        return type(exc).__name__, exc.code


@asynccontextmanager
async def three(tmp_path: Path) -> AsyncIterator[Three]:
    async with aio.open_node(Identity.generate(), TrioNetwork(), NodeConfig()) as node:
        trio_node = node.node
        for agent in (toolbox(), planner(), worker(), Agent("trio-agent", tier=2)):
            await node.run_trio(trio_node.add_agent, agent)
        await node.add_agent(Agent("aio-agent", tier=2))
        await node.open_shared()
        service = AgentSocket(
            trio_node,
            tmp_path / AGENT_SOCKET_NAME,
            documents=trio_node.shared,
            tools=trio_node.tools,
            tasks=trio_node.tasks,
        )
        await node.run_trio(trio_node.start_service, service)
        async with AgentClient(Agent("proc", tier=2), data_dir=tmp_path) as client:
            yield Three(node, client)


def run(main: Callable[[], Awaitable[None]]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(LIMIT):
            await main()

    asyncio.run(bounded())


def _public(obj: object) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")}


# -- the declared surface -------------------------------------------------------------------


def test_the_surface_is_declared_once_in_groups() -> None:
    assert len(set(AGENT_SURFACE)) == len(AGENT_SURFACE)
    assert {"send", "request", "find", *TOOLS, *TASKS, *SHARED} == set(AGENT_SURFACE)
    groups = {name.split(".")[0] for name in AGENT_SURFACE if "." in name}
    assert groups == {"tools", "tasks", "shared"}


@pytest.mark.slow
def test_each_object_offers_the_declared_surface_and_its_groups_nothing_else(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with three(tmp_path) as t:
            objects: dict[str, Any] = {"trio": t.trio, "aio": t.aio, "client": t.client}
            for actor, root in objects.items():
                for name in AGENT_SURFACE:
                    assert callable(_resolve(root, name)), (actor, name)
                # The tools group is exactly the declared one on all three.
                tools = {n.split(".")[1] for n in TOOLS}
                assert _public(root.tools) == tools, actor
                # No second, flat spelling of a grouped operation.
                flat = {n.split(".")[1] for n in AGENT_SURFACE if "." in n}
                assert not (_public(root) & (flat - {"send", "request", "find"})), actor
                assert not {n for n in _public(root) if n.startswith("doc_")}, actor
            # What the client's groups offer is exactly the surface (it is that agent only).
            assert _public(t.client.tasks) == {n.split(".")[1] for n in TASKS}
            assert _public(t.client.shared) == {n.split(".")[1] for n in SHARED}
            # The asyncio node's groups offer at least what the trio node's offer.
            for group in ("tools", "shared"):
                trio_names = _public(getattr(t.trio, group))
                aio_names = _public(getattr(t.aio, group))
                assert {n for n in trio_names if not n.startswith(("run", "stat"))} & {
                    n.split(".")[1] for n in AGENT_SURFACE if n.startswith(group)
                } <= aio_names

    run(main)


# -- the same call, the same result or error ------------------------------------------------


@pytest.mark.slow
def test_tools_give_the_same_results_and_errors_on_all_three(tmp_path: Path) -> None:
    async def main() -> None:
        async with three(tmp_path) as t:
            for actor in ACTORS:
                listing = await t.call(actor, "tools.list_tools")
                assert [item["name"] for item in listing.items] == ["toolbox.add"], actor
                assert listing.unreachable == {} and listing.dropped == 0
                assert await t.call(actor, "tools.call_tool", "toolbox.add", {"a": 40}) == 42
                denied = await _outcome(t.call(actor, "tools.call_tool", "toolbox.secret"))
                assert denied == ("RemoteError", ErrorCode.PERMISSION_DENIED), actor
                wrong = await _outcome(t.call(actor, "tools.call_tool", "toolbox.add", {"a": "x"}))
                assert wrong == ("RemoteError", ErrorCode.INVALID_INPUT), actor
                missing = await _outcome(t.call(actor, "tools.call_tool", "toolbox.none"))
                assert missing == ("RemoteError", ErrorCode.TOOL_NOT_FOUND), actor
                nothing = await _outcome(t.call(actor, "tools.read_resource", "memo://none"))
                assert nothing == ("LocalError", ErrorCode.RESOURCE_NOT_FOUND), actor

    run(main)


@pytest.mark.slow
def test_find_and_request_give_the_same_results_and_errors_on_all_three(tmp_path: Path) -> None:
    async def main() -> None:
        async with three(tmp_path) as t:
            for actor in ACTORS:
                cards = await t.call(actor, "find", "plan.strategy")
                assert [card.id for card in cards] == ["planner"], actor
                assert await t.call(actor, "find", "nothing.offers.this") == []
                reply = await t.call(
                    actor, "request", "plan.strategy", {"goal": "ship"}, capability=True
                )
                assert reply.payload == {"steps": ["ship", "done"]}, actor
                bad = await _outcome(t.call(actor, "request", "planner", {"goal": 1}))
                assert bad[0] == "RemoteError", actor  # the responder's error, blamed on it
                gone = await _outcome(t.call(actor, "request", "nobody", None))
                assert gone == ("LocalError", ErrorCode.AGENT_NOT_FOUND), actor

    run(main)


@pytest.mark.slow
def test_a_shared_document_update_then_read_is_the_same_on_all_three(tmp_path: Path) -> None:
    async def main() -> None:
        async with three(tmp_path) as t:
            for actor in ACTORS:
                await t.call(actor, "shared.subscribe", "notes")
            for n, actor in enumerate(ACTORS, start=1):
                await t.call(actor, "shared.update", "notes", CounterAdd(("n",), n))
            for actor in ACTORS:
                assert await t.call(actor, "shared.read", "notes") == {"n": 6}, actor
            for actor in ACTORS:
                update = t.call(actor, "shared.update", "bad name!", CounterAdd(("n",)))
                bad = await _outcome(update)
                assert bad == ("LocalError", ErrorCode.INVALID_ARGUMENT), actor

    run(main)


@pytest.mark.slow
def test_a_proposed_task_gives_the_same_handle_result_and_errors_on_all_three(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        async with three(tmp_path) as t:
            for actor in ACTORS:
                handle = await t.call(actor, "tasks.propose", "worker", Task("sum", (), 1, [1, 2]))
                assert set(TASK_HANDLE) <= _public(handle), actor
                assert handle.assignee == "worker", actor
                if actor == "trio":  # the trio handle is followed in trio
                    followed = await t.aio.run_trio(follow, handle)
                else:
                    followed = await follow(handle)
                assert followed == (3, TaskState.COMPLETED, ErrorCode.ILLEGAL_TRANSITION), actor
                nobody = await _outcome(
                    t.call(actor, "tasks.propose", "no.such.skill", Task("x"), capability=True)
                )
                assert nobody == ("LocalError", ErrorCode.CAPABILITY_NOT_FOUND), actor

    run(main)


async def follow(handle: Any) -> tuple[Any, TaskState, ErrorCode | None]:
    """The result, the last state seen, and the code of cancelling it once it ended."""
    result = await handle.result()
    states = [state async for state in handle.updates()]
    try:
        await handle.cancel()
    except LocalError as exc:
        return result, states[-1], exc.code
    return result, states[-1], None


def test_a_client_error_keeps_its_blame() -> None:
    from p2pnode.hosting.client import _error

    remote = _error({"code": "PERMISSION_DENIED", "message": "no", "remote": True})
    local = _error({"code": "AGENT_NOT_FOUND", "message": "no", "details": {"x": 1}})
    unknown = _error({"code": "NOT_A_CODE", "message": "?"})
    assert isinstance(remote, RemoteError) and remote.code is ErrorCode.PERMISSION_DENIED
    assert isinstance(local, LocalError) and local.details == {"x": 1}
    assert unknown.code is ErrorCode.INTERNAL
