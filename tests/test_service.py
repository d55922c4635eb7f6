"""A protocol service on the ServiceHost interface (the example of docs/DESIGN.md)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from p2pnode.core.card import AgentCard
from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.node.service import ServiceHost
from tests.sim import Inbox, swarm, wait_until


class Pinger:
    """Answers every `notification` whose payload holds "ping" with a "pong"."""

    def __init__(self, host: ServiceHost) -> None:
        self.host = host
        self.seen: list[str] = []

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.host.intercept_types([MessageType.NOTIFICATION], self._on_note)
        try:
            async with trio.open_nursery():
                task_status.started()
                await trio.sleep_forever()
        finally:
            self.host.intercept_types([MessageType.NOTIFICATION], None)

    async def _on_note(self, source: AgentCard, agent: str, envelope: Envelope) -> None:
        self.seen.append(source.id)
        reply = self.host.envelope(agent, source.id, MessageType.NOTIFICATION, "pong")
        await self.host.send(reply)


async def test_a_service_intercepts_by_type_and_answers_through_the_host(
    autojump_clock: Any,
) -> None:
    async with swarm(2) as (_, (a, b)):
        a_inbox, b_inbox = Inbox(), Inbox()
        await a.add_agent("io", a_inbox, tier=3)
        await b.add_agent("triton", b_inbox, tier=3)
        await b.connect(a.listen_address)
        pinger = Pinger(a)
        await a.start_service(pinger)
        await b.send(b.envelope("triton", "io", MessageType.NOTIFICATION, "ping"))
        await wait_until(lambda: b_inbox.received, 5, interval=0.01)
        assert [e.payload for e in b_inbox.received] == ["pong"]
        assert pinger.seen == ["triton"]
        assert a_inbox.received == []  # intercepted: never reached the agent's handler
        # A request is not a notification: it still reaches the agent.
        assert (await b.request("triton", "io", "hello")).payload == {"echo": "hello"}


async def test_interceptors_are_claimed_once(autojump_clock: Any) -> None:
    async with swarm(1) as (_, (a,)):
        a.intercept_types([MessageType.STREAM_END], Pinger(a)._on_note)
        with pytest.raises(LocalError) as info:
            a.intercept_types([MessageType.NOTIFICATION, MessageType.STREAM_END], _noop)
        assert info.value.code is ErrorCode.INVALID_ARGUMENT
        a.intercept_types([MessageType.STREAM_END], None)
        a.intercept_types([MessageType.STREAM_END], _noop)  # free again


async def _noop(source: AgentCard, agent: str, envelope: Envelope) -> None:
    return None
