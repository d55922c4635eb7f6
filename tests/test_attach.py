"""Agent processes attached to a node over agent.sock: Node.remove_agent, the service and the
client library in one trio process, then real OS processes (Python and Node.js agents,
kill -9, bad lines against a daemon)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar

import pytest
import trio

from p2pnode import Agent, Node
from p2pnode.cli.process import NodeProcess
from p2pnode.core.envelope import Envelope
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.crdt.ops import CounterAdd
from p2pnode.hosting.client import AgentClient
from p2pnode.services.attach.service import WITHDRAW_TIMEOUT, AgentSocket
from p2pnode.services.attach.session import AttachLimits
from p2pnode.services.attach.wire import AGENT_SOCKET_NAME, MAX_LINE
from tests.sim import FAST_NODE, FAST_SHARED, Inbox, connect_all, open_swarm, wait_until
from tests.test_agent import EXAMPLES, check_planner, planner

# -- Node.remove_agent --------------------------------------------------------------------------


async def test_remove_agent_answers_what_is_queued_and_withdraws_the_card(
    autojump_clock: Any,
) -> None:
    release = trio.Event()
    started: list[Any] = []

    async def slow(envelope: Envelope) -> Any:
        started.append(envelope.payload)
        await release.wait()
        return "done"

    # One waiting handler at a time, so two requests stay queued behind the first.
    one_call = dataclasses.replace(FAST_NODE, agent_concurrency=1)
    async with open_swarm(2, one_call, discovery=True) as sw:
        a, b = sw.nodes
        await a.add_agent("slow", slow, tier=3)
        await a.add_agent("stays", Inbox(), tier=3)
        await b.add_agent("caller", Inbox(), tier=3)
        await connect_all([a, b])
        outcomes: dict[int, Any] = {}

        async def ask(n: int) -> None:
            try:
                outcomes[n] = (await b.request("caller", "slow", n)).payload
            except RemoteError as exc:
                outcomes[n] = exc.code

        def received() -> int:
            return int(a.events.metrics().to_dict()["totalMessagesReceived"])

        before = received()
        async with trio.open_nursery() as nursery:
            for n in range(3):
                nursery.start_soon(ask, n)
            # One runs its handler, the other two wait in the inbox.
            await wait_until(lambda: len(started) == 1 and received() == before + 3)
            nursery.start_soon(a.remove_agent, "slow")
            await trio.sleep(0.1)
            assert "slow" in a.status()["agents"]  # the running handler is waited for
            release.set()
        [first] = started
        unavailable = {n: ErrorCode.AGENT_UNAVAILABLE for n in range(3)}
        assert outcomes == {**unavailable, first: "done"}
        assert a.status()["agents"] == ["stays"] and a.registry.find("slow") is None
        with pytest.raises(LocalError) as info:
            a.local_agent("slow")
        assert info.value.code is ErrorCode.AGENT_NOT_FOUND
        assert sw.directory is not None
        sw.directory.cards.clear()
        await a.join()  # re-provides the node's cards: the removed one is not among them
        assert sorted(sw.directory.cards) == ["stays"]
        with pytest.raises(LocalError) as info:
            await a.remove_agent("slow")
        assert info.value.code is ErrorCode.AGENT_NOT_FOUND


async def test_a_removed_member_of_a_shared_document_leaves_it_cleanly(
    autojump_clock: Any,
) -> None:
    async with open_swarm(shared=FAST_SHARED) as sw:
        first, second = await sw.add(agent="a1"), await sw.add(agent="b1")
        a, b = sw.nodes
        await a.add_agent("a2", Inbox(), tier=3)
        await connect_all([a, b])
        for member, agent in ((first, "a1"), (first, "a2"), (second, "b1")):
            await member.shared.subscribe(agent, "doc")
        await first.shared.update("a2", "doc", _counter())
        await a.remove_agent("a2")
        assert first.shared.subscriptions() == {"doc": ["a1"]}
        await trio.sleep(FAST_SHARED.refresh_interval * 3)  # refresh rounds see the change
        await first.shared.update("a1", "doc", _counter())
        await wait_until(lambda: b.shared.read("doc") == {"n": 2})
        with pytest.raises(LocalError):
            await first.shared.update("a2", "doc", _counter())


def _counter() -> Any:
    from p2pnode.services.shared.docops import op_from_json

    return op_from_json({"op": "counter.add", "path": ["n"]}, now_ms=1)


# -- the service and the client in one process (real sockets, real clock) -----------------------


@asynccontextmanager
async def served(tmp_path: Path, **options: Any) -> AsyncIterator[tuple[Node, Node, AgentSocket]]:
    """Two connected nodes; ``host`` serves agent.sock in ``tmp_path`` and hosts "resident"
    (L2), ``caller`` hosts "caller" (L3) and "mentor" (L2)."""
    async with open_swarm(2, shared=FAST_SHARED) as sw:
        host, caller = sw.nodes
        await host.add_agent("resident", Inbox(), tier=2)
        await caller.add_agent("caller", Inbox(), tier=3)
        await caller.add_agent("mentor", Inbox(), tier=2)  # an L2 agent may ask L0-L2 only
        await connect_all([host, caller])
        service = AgentSocket(host, tmp_path / AGENT_SOCKET_NAME, documents=host.shared, **options)
        await host.start_service(service)
        try:
            yield host, caller, service
        finally:
            for client in RawClient.opened:
                await client.stream.aclose()
            RawClient.opened.clear()


@pytest.mark.slow
async def test_the_client_attaches_an_agent_definition_and_serves_it(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with served(tmp_path) as (host, caller, service):
            assert (tmp_path / AGENT_SOCKET_NAME).stat().st_mode & 0o777 == 0o600
            async with AgentClient(planner().agent, data_dir=tmp_path) as client:
                assert client.card["id"] == "planner" and client.card["tier"] == 2
                assert service.attached() == ["planner"]
                await wait_until(lambda: caller.registry.find("planner") is not None)

                async def ask(capability: str, payload: Any) -> Any:
                    reply = await caller.request("caller", capability, payload, capability=True)
                    return reply.payload

                await check_planner(ask)  # the same answers as embedded and hosted agents
                reply = await client.request("mentor", {"q": 1})
                assert (reply.sender, reply.payload) == ("mentor", {"echo": {"q": 1}})
                with pytest.raises(LocalError) as info:
                    await client.request("caller", None)  # egress policy applies
                assert info.value.code is ErrorCode.TIER_VIOLATION
                sent = await client.send("resident", "hi")
                assert sent["path"] == "local" and sent["targets"] == ["resident"]
                with pytest.raises(LocalError) as info:
                    await client.send("nobody")
                assert info.value.code is ErrorCode.AGENT_NOT_FOUND
                await client.shared.subscribe("notes")
                update = CounterAdd(("n",), 2)
                assert (await client.shared.update("notes", update))["durable"] is True
                assert await client.shared.read("notes") == {"n": 2}
            # Leaving the block detached the agent: withdrawn at once.
            assert service.attached() == []
            assert "planner" not in host.status()["agents"]
            assert host.registry.find("planner") is None
            # The id is free again.
            async with AgentClient(planner().agent, path=tmp_path / AGENT_SOCKET_NAME):
                assert service.attached() == ["planner"]


@pytest.mark.slow
async def test_the_client_refuses_an_agent_the_node_refuses(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with served(tmp_path) as (_, _, service):
            with pytest.raises(LocalError) as info:
                async with AgentClient(Agent("resident"), data_dir=tmp_path):
                    pass
            assert info.value.code is ErrorCode.INVALID_CARD  # hosted in-process already
            with pytest.raises(LocalError) as info:
                async with AgentClient(Agent("x"), data_dir=tmp_path / "nowhere"):
                    pass
            assert info.value.code is ErrorCode.CONFIG_ERROR
            assert service.attached() == []


class RawClient:
    """One connection speaking the protocol by hand."""

    #: Connections to close when the test's node is done (``served``, ``two_daemons``).
    opened: ClassVar[list[RawClient]] = []

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""
        RawClient.opened.append(self)

    @classmethod
    async def open(cls, path: Path) -> RawClient:
        return cls(await trio.open_unix_socket(str(path)))

    async def send(self, obj: Any) -> None:
        await self.stream.send_all(json.dumps(obj).encode() + b"\n")

    async def receive(self) -> Any:
        """The next line's object, or None at the end of the stream."""
        while b"\n" not in self.buffer:
            chunk = await self.stream.receive_some(65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    async def attach(self, agent_id: str) -> None:
        await self.send({"v": 1, "op": "attach", "card": {"id": agent_id}})
        reply = await self.receive()
        assert reply["ok"] is True, reply


@pytest.mark.slow
async def test_bad_lines_close_only_their_connection(tmp_path: Path) -> None:
    with trio.fail_after(30):
        async with served(tmp_path, attach_timeout=1.0) as (_, caller, service):
            path = tmp_path / AGENT_SOCKET_NAME
            good = await RawClient.open(path)
            await good.attach("good")
            for data, code in (
                (b"{not json\n", "MALFORMED_MESSAGE"),
                (b"[1]\n", "MALFORMED_MESSAGE"),
                (b"x" * (MAX_LINE + 10), "MESSAGE_TOO_LARGE"),
            ):
                bad = await RawClient.open(path)
                await bad.stream.send_all(data)
                error = await bad.receive()
                assert error["ok"] is False and error["fatal"] is True
                assert error["error"]["code"] == code
                assert await bad.receive() is None  # closed by the node
            wrong = await RawClient.open(path)
            await wrong.send({"op": "fly", "id": 1})
            error = await wrong.receive()
            assert (error["id"], error["error"]["code"]) == (1, "INVALID_ARGUMENT")
            await wrong.attach("wrong")  # still open: it may go on
            idle = await RawClient.open(path)
            error = await idle.receive()  # no attach within attach_timeout
            assert error["error"]["code"] == "TIMEOUT" and await idle.receive() is None
            # The node and the good connection kept serving.
            await wait_until(lambda: caller.registry.find("good") is not None)
            async with trio.open_nursery() as nursery:
                replies: list[Envelope] = []

                async def ask() -> None:
                    replies.append(await caller.request("caller", "good", {"x": 1}))

                nursery.start_soon(ask)
                event = await good.receive()
                assert event["event"] == "envelope" and event["envelope"]["payload"] == {"x": 1}
                to = event["envelope"]["id"]
                await good.send({"op": "reply", "to": to, "payload": "fine"})
            assert replies[0].payload == "fine" and replies[0].sender == "good"
            assert service.attached() == ["good", "wrong"]


@pytest.mark.slow
async def test_a_process_that_answers_nothing_gets_busy_not_node_memory(tmp_path: Path) -> None:
    limits = AttachLimits(max_pending=2)
    with trio.fail_after(30):
        async with served(tmp_path, limits=limits) as (_, caller, _service):
            mute = await RawClient.open(tmp_path / AGENT_SOCKET_NAME)
            await mute.attach("mute")
            await wait_until(lambda: caller.registry.find("mute") is not None)
            codes: list[ErrorCode] = []

            async def ask(n: int) -> None:
                try:
                    await caller.request("caller", "mute", n)
                except P2PError as exc:
                    codes.append(exc.code)

            async with trio.open_nursery() as nursery:
                for n in range(5):
                    nursery.start_soon(ask, n)
                await wait_until(lambda: len(codes) == 3)
                assert codes == [ErrorCode.BUSY] * 3  # two wait for the process
                nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_a_closed_connection_withdraws_its_agent_and_answers_its_requests(
    tmp_path: Path,
) -> None:
    with trio.fail_after(30):
        async with served(tmp_path) as (host, caller, service):
            leaver = await RawClient.open(tmp_path / AGENT_SOCKET_NAME)
            await leaver.attach("leaver")
            await wait_until(lambda: caller.registry.find("leaver") is not None)
            outcome: list[Any] = []

            async def ask() -> None:
                try:
                    await caller.request("caller", "leaver", None)
                except P2PError as exc:
                    outcome.append((exc.code, trio.current_time()))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(ask)
                assert (await leaver.receive())["event"] == "envelope"
                closed_at = trio.current_time()
                await leaver.stream.aclose()  # what the kernel does when a process dies
            [(code, when)] = outcome
            assert code is ErrorCode.AGENT_UNAVAILABLE
            assert when - closed_at < WITHDRAW_TIMEOUT
            assert service.attached() == [] and host.registry.find("leaver") is None


# -- real processes ------------------------------------------------------------------------------

AGENT_SCRIPT = """
import sys
sys.path.insert(0, {examples!r})
from p2pnode import Agent
from p2pnode.hosting.client import run_agent
from planner import agent
if sys.argv[2] == "sleeper":
    import anyio
    agent = Agent("sleeper")

    @agent.on_request("hang")
    async def hang(message):
        print("got", message.payload, flush=True)
        await anyio.sleep_forever()

run_agent(agent, data_dir=sys.argv[1], backend=sys.argv[3])
"""


@asynccontextmanager
async def two_daemons(tmp_path: Path) -> AsyncIterator[tuple[NodeProcess, NodeProcess]]:
    """``host`` (agent processes attach to it) and ``caller`` (agent "triton"), connected."""
    host, caller = NodeProcess(tmp_path / "host"), NodeProcess(tmp_path / "caller")
    host.prepare("resident", 3)
    caller.prepare("triton", 3)
    async with trio.open_nursery() as nursery:
        try:
            await host.start(nursery, None)
            await caller.start(nursery, host.address)
            yield host, caller
        finally:
            with trio.CancelScope(shield=True):
                for client in RawClient.opened:
                    await client.stream.aclose()
                RawClient.opened.clear()
                await host.stop()
                await caller.stop()
            nursery.cancel_scope.cancel()


async def agent_process(argv: list[str], *, stdout: bool = False) -> trio.Process:
    return await trio.lowlevel.open_process(
        argv, stdout=subprocess.PIPE if stdout else subprocess.DEVNULL, stdin=subprocess.DEVNULL
    )


async def poll(what: str, check: Callable[[], Awaitable[bool]]) -> None:
    """Ask a daemon every 50 ms, for 20 s at most, until ``check`` holds."""
    for _ in range(400):
        if await check():
            return
        await trio.sleep(0.05)
    raise AssertionError(f"still not so after 20 s: {what}")


async def wait_for_agent(node: NodeProcess, agent_id: str, present: bool = True) -> None:
    async def check() -> bool:
        return (agent_id in (await node.call({"op": "status"}))["agents"]) is present

    await poll(f"{agent_id} hosted: {present}", check)


async def reaches(caller: NodeProcess, capability: str) -> None:
    """Wait until ``caller`` knows an agent offering ``capability``."""

    async def check() -> bool:
        return bool(await caller.call({"op": "find", "capability": capability}))

    await poll(f"an agent offers {capability}", check)


async def stop_process(process: trio.Process) -> None:
    with trio.CancelScope(shield=True):
        if process.returncode is None:
            process.kill()
        await process.wait()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
async def test_an_attached_python_process_answers_requests_from_another_node(
    tmp_path: Path, backend: str
) -> None:
    with trio.fail_after(90):
        async with two_daemons(tmp_path) as (host, caller):
            script = AGENT_SCRIPT.format(examples=str(EXAMPLES))
            argv = [sys.executable, "-c", script, str(host.data_dir), "planner", backend]
            process = await agent_process(argv)
            try:
                await reaches(caller, "plan.strategy")

                async def ask(capability: str, payload: Any) -> Any:
                    request = {"op": "send", "to": capability, "payload": payload}
                    return (await caller.call({**request, "capability": True}))["payload"]

                await check_planner(ask)
                process.send_signal(signal.SIGTERM)  # run_agent detaches
                assert await process.wait() == 0
                await wait_for_agent(host, "planner", present=False)
            finally:
                await stop_process(process)


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("node") is None, reason="the Node.js example needs the node runtime, absent here"
)
async def test_the_nodejs_example_answers_requests_from_another_node(tmp_path: Path) -> None:
    with trio.fail_after(90):
        async with two_daemons(tmp_path) as (host, caller):
            argv = ["node", str(EXAMPLES / "agent.js"), str(host.data_dir)]
            process = await agent_process(argv)
            try:
                await reaches(caller, "text.upper")
                request = {"op": "send", "to": "text.upper", "capability": True}
                reply = await caller.call({**request, "payload": {"text": "hello"}})
                assert reply["sender"] == "shouter"
                assert reply["payload"] == {"upper": "HELLO", "by": "node.js"}
                with pytest.raises(P2PError) as info:  # the node checks the inputSchema
                    await caller.call({**request, "payload": {"text": 5}})
                assert info.value.code is ErrorCode.INVALID_INPUT
                process.send_signal(signal.SIGTERM)  # the example detaches
                assert await process.wait() == 0
                await wait_for_agent(host, "shouter", present=False)
            finally:
                await stop_process(process)


@pytest.mark.slow
async def test_kill_9_of_an_attached_process_answers_agent_unavailable_within_5_s(
    tmp_path: Path,
) -> None:
    with trio.fail_after(90):
        async with two_daemons(tmp_path) as (host, caller):
            script = AGENT_SCRIPT.format(examples=str(EXAMPLES))
            argv = [sys.executable, "-c", script, str(host.data_dir), "sleeper", "asyncio"]
            process = await agent_process(argv, stdout=True)
            try:
                await reaches(caller, "hang")
                outcome: list[tuple[ErrorCode, float]] = []

                async def ask() -> None:
                    try:
                        await caller.call({"op": "send", "to": "hang", "capability": True})
                    except P2PError as exc:
                        outcome.append((exc.code, trio.current_time()))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(ask)
                    assert process.stdout is not None
                    printed = b""
                    while b"\n" not in printed:  # bounded by the test's fail_after
                        printed += await process.stdout.receive_some(100)
                    assert printed.startswith(b"got")
                    killed_at = trio.current_time()
                    process.kill()  # SIGKILL: no detach, the kernel closes its socket
                [(code, when)] = outcome
                assert code is ErrorCode.AGENT_UNAVAILABLE
                assert when - killed_at < 5.0
                await wait_for_agent(host, "sleeper", present=False)
                # The node keeps serving: its own agent answers, and the id attaches again.
                reply = await caller.call({"op": "send", "to": "resident", "payload": 1})
                assert reply["sender"] == "resident"
                again = await agent_process(argv, stdout=True)
                try:
                    await wait_for_agent(host, "sleeper")
                finally:
                    await stop_process(again)
            finally:
                await stop_process(process)


@pytest.mark.slow
async def test_a_daemon_survives_bad_lines_on_its_agent_socket(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with two_daemons(tmp_path) as (host, caller):
            path = host.data_dir / AGENT_SOCKET_NAME
            assert path.stat().st_mode & 0o777 == 0o600
            for data in (b"\x00\xff garbage\n", b"{" * (MAX_LINE + 1)):
                bad = await RawClient.open(path)
                await bad.stream.send_all(data)
                error = await bad.receive()
                assert error["fatal"] is True
                assert error["error"]["code"] in {"MALFORMED_MESSAGE", "MESSAGE_TOO_LARGE"}
                assert await bad.receive() is None
            good = await RawClient.open(path)
            await good.attach("good")
            await wait_for_agent(host, "good")
            reply = await caller.call({"op": "send", "to": "resident", "payload": 1})
            assert reply["sender"] == "resident"


# -- a process that writes without reading, then leaves ------------------------------------------


@pytest.mark.slow
async def test_a_process_that_writes_ops_without_reading_and_leaves_closes_cleanly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="p2pnode.agents")
    with trio.fail_after(30):
        async with served(tmp_path) as (host, caller, service):
            writer = await RawClient.open(tmp_path / AGENT_SOCKET_NAME)
            await writer.attach("writer")
            await wait_until(lambda: caller.registry.find("writer") is not None)
            # Ops each answered with an error line several times their size: the replies
            # fill the socket, then the node's reply backlog, and it stops reading; the
            # process leaves with the node's writer blocked and its reader paused.
            lines = json.dumps({"op": "fly", "id": 1}).encode() + b"\n"
            with trio.move_on_after(2):
                for _ in range(200):  # bounded: the node stops reading long before
                    await writer.stream.send_all(lines * 5_000)
            await writer.stream.aclose()
            await wait_until(lambda: service.attached() == [])
            await wait_until(lambda: host.registry.find("writer") is None)
            assert host.boundary.stats.unexpected == {}
            assert any("writer" in r.getMessage() and "closed" in r.getMessage()
                       for r in caplog.records)
            # The node serves another process as before.
            again = await RawClient.open(tmp_path / AGENT_SOCKET_NAME)
            await again.attach("again")
