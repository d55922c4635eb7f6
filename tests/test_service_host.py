"""What the kernel offers services besides interceptors (p2pnode.node.service): request
methods a service serves in place of the agents' handlers, hooks on agents hosted and
removed, the clock; and the kernel alone builds and serves no service."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import trio

from p2pnode.agent.definition import Agent, Reply
from p2pnode.agent.tools import TOOLS_LIST
from p2pnode.core.card import AgentCard
from p2pnode.core.envelope import Envelope, MessageType, Metadata
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.identity import Identity
from p2pnode.node.kernel import Kernel
from p2pnode.node.service import ServiceHost
from tests.sim import FAST_NODE, Inbox, swarm


class Shouter:
    """Serves the request method ``shout`` for every local agent: the payload in capitals,
    stamped with the node's clock. Knows which agents the node hosts."""

    def __init__(self, host: ServiceHost, deadline: float = 5.0) -> None:
        self.host = host
        self.agents: set[str] = set()
        self.limit = deadline

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.host.serve_methods(["shout"], self)
        unwatch = self.host.watch_agents(
            added=lambda agent: self.agents.add(agent.id), removed=self.agents.discard
        )
        try:
            async with trio.open_nursery():
                task_status.started()
                await trio.sleep_forever()
        finally:
            unwatch()
            self.host.serve_methods(["shout"], None)

    async def serve(
        self, agent: Agent, envelope: Envelope, method: str, sender: AgentCard
    ) -> Reply | None:
        if envelope.payload == "hang":
            await trio.sleep_forever()
        text = f"{agent.id}: {envelope.payload}".upper()
        return Reply(MessageType.RESPONSE, {"text": text, "at": self.host.now_ms()})

    def deadline(self, agent: Agent, envelope: Envelope) -> float:
        return self.limit


SHOUT = Metadata(capability="shout")


async def test_a_served_method_answers_instead_of_the_handler(autojump_clock: Any) -> None:
    async with swarm(2) as (_, (a, b)):
        a_inbox = Inbox()
        await a.add_agent("io", a_inbox, tier=3)
        await b.add_agent("triton", Inbox(), tier=3)
        await b.connect(a.listen_address)
        shouter = Shouter(a, deadline=2.0)
        await a.start_service(shouter)
        before = a.now_ms()
        reply = await b.request("triton", "io", "hi", metadata=SHOUT)
        assert reply.payload["text"] == "IO: HI"
        assert before <= reply.payload["at"] <= a.now_ms()  # the node's clock (virtual here)
        assert a_inbox.received == []  # the agent's handler never saw it
        # Another method still reaches the agent's handler.
        assert (await b.request("triton", "io", "hello")).payload == {"echo": "hello"}
        # The server's deadline bounds the call: cut, and answered TIMEOUT.
        started = trio.current_time()
        with pytest.raises(RemoteError) as info:
            await b.request("triton", "io", "hang", metadata=SHOUT)
        assert info.value.code is ErrorCode.TIMEOUT
        assert 2.0 <= trio.current_time() - started < FAST_NODE.request_timeout


async def test_methods_are_served_once(autojump_clock: Any) -> None:
    async with swarm(1) as (_, (a,)):
        first = Shouter(a)
        await a.start_service(first)
        with pytest.raises(LocalError) as info:
            a.serve_methods(["other", "shout"], Shouter(a))
        assert info.value.code is ErrorCode.INVALID_ARGUMENT
        # The composed node's tool audit serves the MCP methods already.
        with pytest.raises(LocalError):
            a.serve_methods([TOOLS_LIST], Shouter(a))
        a.serve_methods(["other"], Shouter(a))  # nothing was taken by the refused call


async def test_hooks_follow_agents_hosted_and_removed(autojump_clock: Any) -> None:
    async with swarm(1) as (_, (a,)):
        shouter = Shouter(a)
        await a.start_service(shouter)
        await a.add_agent(Agent("one"))
        await a.add_agent("two", Inbox())
        card = a.local_agent("one")
        await a.add_agent_card(card, Agent("one"))  # re-hosted: told again, still one
        assert shouter.agents == {"one", "two"}
        await a.remove_agent("one")
        assert shouter.agents == {"two"}
        # The task service, watching the same way, unbound it: it may propose no more.
        assert a.tasks.handlers("one") is None and a.tasks.handlers("two") is not None


async def test_a_stopped_watch_hears_nothing(autojump_clock: Any) -> None:
    async with swarm(1) as (_, (a,)):
        heard: list[str] = []
        unwatch = a.watch_agents(added=lambda agent: heard.append(agent.id))
        await a.add_agent(Agent("one"))
        unwatch()
        unwatch()  # twice is harmless
        await a.add_agent(Agent("two"))
        assert heard == ["one"]


async def test_the_kernel_alone_serves_no_service(autojump_clock: Any) -> None:
    async with swarm(1) as (sim, _):
        host = sim.add_host()
        config = dataclasses.replace(FAST_NODE, listen=(host.host, 7000))
        await _kernel_alone(Kernel(Identity(b"\x42" * 32), host, config))


async def _kernel_alone(kernel: Kernel) -> None:
    async with kernel:
        inbox = Inbox()
        await kernel.add_agent("solo", inbox)
        await kernel.add_agent("asker", Inbox())
        for name in ("tasks", "tools", "tool_audit", "shared", "open_shared"):
            assert not hasattr(kernel, name)
        # No method is served: a tools/list request is the agent's handler's, as any is.
        meta = Metadata(capability=TOOLS_LIST)
        assert (await kernel.request("asker", "solo", "x", metadata=meta)).payload == {"echo": "x"}
        assert [e.payload for e in inbox.received] == ["x"]
        assert set(kernel.status()) >= {"agents", "channels", "discovery", "metrics"}
        assert "tasks" not in kernel.status() and "documents" not in kernel.status()
