"""A control client that leaves while its request runs (Ctrl-C on ``p2pnode tools call``)
cancels it, and so the swarm request it made: in memory, the control server's
connection handler on one end of a stream pair; and ``tools.call``'s ``timeout``
reaching the owner through the daemon's control op."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from p2pnode.agent.definition import Agent
from p2pnode.cli.tools import tool_ops
from p2pnode.core.errors import ErrorCode, LocalError, P2PError
from p2pnode.node.control import ControlServer
from p2pnode.node.service import current_progress
from tests.sim import FAST_NODE, open_swarm, wait_until
from tests.test_tools_sim import mesh


async def test_a_client_that_closes_its_end_cancels_its_running_request() -> None:
    cancelled = trio.Event()

    async def slow(request: dict[str, Any]) -> Any:
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()

    async def quick(request: dict[str, Any]) -> Any:
        return request.get("n")

    server = ControlServer(Path("unused.sock"), {"slow": slow, "quick": quick})
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            client, ours = trio.testing.memory_stream_pair()
            nursery.start_soon(server._handle, ours)
            # Requests sent while one runs are kept and answered after it, in order.
            await client.send_all(b'{"op": "quick", "n": 1}\n{"op": "quick", "n": 2}\n')
            answers = b""
            while answers.count(b"\n") < 2:
                answers += await client.receive_some()
            assert [json.loads(a)["result"] for a in answers.splitlines()] == [1, 2]
            await client.send_all(b'{"op": "slow"}\n')
            await trio.testing.wait_all_tasks_blocked()
            assert not cancelled.is_set()
            await client.aclose()  # Ctrl-C: the command's process is gone
            await cancelled.wait()


async def test_tools_call_takes_its_timeout_to_the_owner(autojump_clock: Any) -> None:
    asked: list[int | None] = []
    config = dataclasses.replace(FAST_NODE, tool_deadline=600.0)
    async with open_swarm(2, config) as sw:
        owner, user = sw.nodes
        slow = Agent("slow")

        @slow.tool()
        async def wait(seconds: int) -> int:
            reporter = current_progress()
            meta = reporter.request.metadata if reporter is not None else None
            asked.append(meta.deadline_ms if meta is not None else None)
            await trio.sleep(seconds)
            return seconds

        await owner.add_agent(slow)
        await user.add_agent(Agent("user"))
        await mesh(sw.nodes)
        call = tool_ops(user)["tools.call"]
        request = {"name": "slow.wait", "arguments": {"seconds": 1}, "timeout": 3}
        assert await call(request) == {"result": 1}
        assert asked == [3000]
        start = trio.current_time()
        with pytest.raises(P2PError) as caught:
            await call({**request, "arguments": {"seconds": 60}})
        assert caught.value.code is ErrorCode.TIMEOUT
        assert trio.current_time() - start < 5
        with pytest.raises(LocalError) as bad:
            await call({**request, "timeout": "soon"})
        assert bad.value.code is ErrorCode.INVALID_ARGUMENT
        await wait_until(lambda: len(asked) == 2)
