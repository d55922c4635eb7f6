"""The Agent definition API: dispatch, validation and typed replies, embedded in a trio
node and hosted by a daemon with ``p2pnode run --agent`` (the asyncio way is in
tests/test_aio.py). The same behaviour check runs against each host."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from p2pnode import Agent, Message
from p2pnode.cli.process import NodeProcess
from p2pnode.core.envelope import EnvelopeFactory, MessageType, Metadata
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from tests.sim import Inbox, swarm

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
factory = EnvelopeFactory(lambda: 1_700_000_000_000)


def planner() -> Any:
    """A fresh import of examples/planner.py (its notes start empty)."""
    sys.path.insert(0, str(EXAMPLES))
    try:
        sys.modules.pop("planner", None)
        return importlib.import_module("planner")
    finally:
        sys.path.remove(str(EXAMPLES))


def request(capability: str | None, payload: Any) -> Any:
    meta = Metadata(capability=capability) if capability else None
    return factory.create("caller", "planner", MessageType.REQUEST, payload, metadata=meta)


# -- the definition alone ---------------------------------------------------------------------


async def test_requests_dispatch_on_the_capability_and_validate_input() -> None:
    agent = planner().agent
    reply = await agent.handle(request("plan.strategy", {"goal": "ship"}))
    assert reply is not None and reply.type is MessageType.RESPONSE
    assert reply.payload["steps"] == ["understand ship", "do ship"]
    bad = await agent.handle(request("plan.strategy", {"goal": 7}))
    assert bad is not None and bad.type is MessageType.ERROR
    assert bad.payload["code"] == ErrorCode.INVALID_INPUT
    assert bad.payload["message"].startswith("payload.goal:")
    missing = await agent.handle(request("plan.strategy", {}))
    assert missing is not None and "goal" in missing.payload["message"]
    unknown = await agent.handle(request("plan.other", 1))
    assert unknown is not None and unknown.payload["code"] == ErrorCode.CAPABILITY_NOT_FOUND


async def test_what_a_handler_raises_decides_the_error(caplog: pytest.LogCaptureFixture) -> None:
    agent = Agent("a")

    @agent.on_request("typed")
    def typed(message: Message) -> None:
        raise LocalError(ErrorCode.TIMEOUT, "too slow", after=3)

    @agent.on_request("buggy")
    async def buggy(message: Message) -> None:
        raise KeyError("secret internals")

    typed_reply = await agent.handle(request("typed", None))
    assert typed_reply is not None
    assert typed_reply.payload == {
        "code": "TIMEOUT",
        "message": "too slow",
        "details": {"after": 3},
    }
    buggy_reply = await agent.handle(request("buggy", None))
    assert buggy_reply is not None and buggy_reply.payload["code"] == ErrorCode.HANDLER_FAILED
    assert "secret" not in str(buggy_reply.payload)  # nothing of the failure leaves the owner
    assert any("secret internals" in r.exc_text for r in caplog.records if r.exc_text)


async def test_other_types_reach_their_handler_and_get_no_reply() -> None:
    module = planner()
    note = factory.create("caller", "planner", MessageType.NOTIFICATION, {"n": 1})
    assert await module.agent.handle(note) is None
    assert module.notes == [{"n": 1}]
    fallback = Agent("b")
    seen: list[MessageType] = []
    fallback.on_message(lambda m: seen.append(m.type))
    proposal = factory.create("caller", "b", MessageType.TASK_PROPOSAL, None)
    assert await fallback.handle(proposal) is None
    assert seen == [MessageType.TASK_PROPOSAL]
    # A request with no handler for it and a fallback goes to the fallback.
    reply = await fallback.handle(request(None, "x"))
    assert reply is not None and reply.type is MessageType.RESPONSE


def test_declarations_are_checked() -> None:
    agent = Agent("c")

    @agent.on_request("x", input_schema={"type": "object"})
    def x(message: Message) -> None:
        """Does x.

        More text that is not the description."""

    assert [(c.id, c.description) for c in agent.capabilities] == [("x", "Does x.")]
    with pytest.raises(LocalError):
        agent.on_request("x")(x)
    with pytest.raises(LocalError):
        agent.on_request("y", input_schema={"type": "no-such-type"})(x)
    with pytest.raises(LocalError):
        agent.on_type(MessageType.REQUEST)(x)
    agent.on_message(x)
    with pytest.raises(LocalError):
        agent.on_message(x)


# -- the same behaviour, hosted two ways ------------------------------------------------------

Ask = Callable[[str, Any], Awaitable[Any]]


async def check_planner(ask: Ask) -> None:
    """What a caller sees of examples/planner.py, wherever it runs."""
    answer = await ask("plan.strategy", {"goal": "ship"})
    assert answer["steps"] == ["understand ship", "do ship"]
    for payload, code in (({"goal": 1}, ErrorCode.INVALID_INPUT), (None, None)):
        capability = "plan.strategy" if code else "plan.review"
        with pytest.raises((RemoteError, LocalError)) as info:
            await ask(capability, payload)
        assert info.value.code is (code or ErrorCode.HANDLER_FAILED)
    assert (await ask("plan.review", {"plan": 1}))["approved"] is True


async def test_embedded_in_a_trio_node(autojump_clock: Any) -> None:
    async with swarm(2) as (_, (host, caller)):
        card = await host.add_agent(planner().agent)
        assert card.has_capability("plan.strategy") and card.tier == 2
        await caller.add_agent("triton", Inbox(), tier=3)
        await caller.connect(host.listen_address)

        async def ask(capability: str, payload: Any) -> Any:
            reply = await caller.request("triton", capability, payload, capability=True)
            return reply.payload

        await check_planner(ask)


@pytest.mark.slow
async def test_hosted_by_the_daemon(tmp_path: Path) -> None:
    env = dict(NodeProcess(tmp_path).env, PYTHONPATH=str(EXAMPLES))
    host, caller = NodeProcess(tmp_path / "host", env), NodeProcess(tmp_path / "caller", env)
    host.prepare("unused", 3)
    caller.prepare("triton", 3)
    async with trio.open_nursery() as nursery:
        await host.start(nursery, None, run_args=["--agent", "planner:agent"])
        await caller.start(nursery, host.address)

        async def ask(capability: str, payload: Any) -> Any:
            request = {"op": "send", "to": capability, "payload": payload, "capability": True}
            return (await caller.call(request))["payload"]

        try:
            await check_planner(ask)
            status = await host.call({"op": "status"})
            assert status["agents"] == ["planner"]  # --agent replaces the card file's agent
        finally:
            await host.stop()
            await caller.stop()
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("planner", "expected MODULE:NAME"),
        ("no_such_module:agent", "No module named"),
        ("planner:nobody", "has no 'nobody'"),
        ("planner:notes", "not a p2pnode.Agent"),
    ],
)
def test_run_agent_names_a_bad_reference_in_one_line(spec: str, problem: str) -> None:
    from p2pnode.cli.node import load_agent

    sys.path.insert(0, str(EXAMPLES))
    try:
        with pytest.raises(LocalError) as info:
            load_agent(spec)
    finally:
        sys.path.remove(str(EXAMPLES))
    assert info.value.code is ErrorCode.CONFIG_ERROR and problem in info.value.message


def test_an_agent_id_needs_a_handler() -> None:
    from p2pnode.agent.definition import as_agent

    with pytest.raises(LocalError) as info:
        as_agent("lonely")
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    defined = Agent("d")
    assert as_agent(defined) is defined
    made = as_agent("made", lambda envelope: None, tier=1)
    assert (made.id, made.name, made.tier) == ("made", "MADE", 1)
