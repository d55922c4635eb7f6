"""The soak's hostile peer: attacks cycled beside the honest traffic of scripts/soak.py.

One :class:`Hostile` runs for the whole soak, one attack after another, each
bounded in count and in time (``ATTACK_TIME`` seconds), all on 127.0.0.1:

* ``squat``: a peer announces a card claiming an honest agent's id (a signed
  card of its own key), stays ``SQUAT_STAY`` seconds and leaves;
* ``requests``: an authenticated peer sends ``FLOOD`` requests to the victim's
  agent as fast as its channel takes them, reading what comes back;
* ``proposals``: the hostile daemon proposes ``PROPOSALS`` tasks to the victim's
  agent, ``CONCURRENCY`` at a time (its control socket's ``task.propose``);
* ``tool_flood``: ``TOOL_CALLS`` calls of the toolbox's ``add`` from the hostile
  daemon, ``CONCURRENCY`` at a time;
* ``big_arguments``: tool calls whose arguments hold a 900 KB string (what the
  control socket's 1 MiB line carries), 40 levels of nesting, 70,000 items;
* ``hang``: ``HANGS`` calls at once of the toolbox's ``hang``, which never
  returns, each abandoned by the caller after ``HANG_WAIT`` seconds;
* ``attach_no_read``: a client of the victim's ``agent.sock`` writes an
  ``attach`` and ``ATTACH_OPS`` ``send`` ops (notifications) without reading a reply, and closes.

Forged swarm entries are not cycled here: they need a swarm the hostile peer
is a member of, and the swarm's own simulator tests forge each kind of entry
(uninvited results, early-sorting journal records, coordinator epochs).

Each attack's outcome is a count of what it sent and a short note; an
attack that fails (the victim refused the connection...) is counted, not
raised: the soak judges the honest traffic, not the attacker.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from memory_attacks import _drain

from p2pnode.agent.definition import Agent
from p2pnode.cli.process import NodeProcess
from p2pnode.core.card import AgentCard, Capability
from p2pnode.core.envelope import EnvelopeFactory, MessageType, Metadata, wall_clock_ms
from p2pnode.core.errors import P2PError
from p2pnode.core.identity import Identity
from p2pnode.hosting.client import card_template, socket_path
from p2pnode.node.config import parse_address
from p2pnode.node.frames import encode_envelope, encode_hello
from p2pnode.services.attach.wire import AGENT_SOCKET_NAME, PROTOCOL_VERSION
from p2pnode.transport.channel import SecureChannel, connect_secure
from p2pnode.transport.secure import SecureIdentity

ATTACK_TIME = 30.0
SQUAT_STAY = 5.0
FLOOD = 3000
PROPOSALS = 300
TOOL_CALLS = 300
HANGS = 5
HANG_WAIT = 3.0
ATTACH_OPS = 2000
CONCURRENCY = 8
PAUSE = 2.0
HOSTILE_AGENT = "mallory"

#: The errors an attack expects from a victim that defends itself.
EXPECTED = (P2PError, OSError, trio.BrokenResourceError, trio.ClosedResourceError, EOFError)


def signed_card(identity: Identity, agent: str) -> AgentCard:
    """A card for ``agent`` signed by ``identity`` (valid for an hour)."""
    now = wall_clock_ms()
    return AgentCard(
        id=agent,
        name=agent,
        version="1.0.0",
        public_key=identity.public_key,
        capabilities=(Capability(f"{agent}.echo", "echo"),),
        issued_at=now,
        expires_at=now + 3_600_000,
        revision=now,
    ).signed(identity)


async def open_peer(address: str, agent: str) -> SecureChannel:
    """An authenticated channel to ``address`` from a fresh peer announcing ``agent``."""
    identity = Identity.generate()
    host, port = parse_address(address)
    stream = await trio.open_tcp_stream(host, port)
    channel = await connect_secure(stream, SecureIdentity(identity))
    await channel.send_message(encode_hello([signed_card(identity, agent)], []))
    return channel


class Hostile:
    """The hostile peer: a daemon of its own (``process``, agent ``mallory``) and raw
    channels, against ``victim`` (a daemon whose agent is ``victim_agent``, with the
    ``toolbox`` agent attached) and the honest agent ids it squats (``names``)."""

    def __init__(
        self,
        process: NodeProcess,
        victim: Callable[[], NodeProcess],
        victim_agent: str,
        names: list[str],
    ) -> None:
        self.process = process
        self.victim = victim
        self.victim_agent = victim_agent
        self.names = names
        self.sent: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.rounds = 0

    def attacks(self) -> dict[str, Callable[[], Awaitable[None]]]:
        return {
            "squat": self.squat,
            "requests": self.requests,
            "proposals": self.proposals,
            "tool_flood": self.tool_flood,
            "big_arguments": self.big_arguments,
            "hang": self.hang,
            "attach_no_read": self.attach_no_read,
        }

    async def run(self, until: float) -> None:
        """Cycle the attacks until ``until`` (trio time); each one bounded in time."""
        while trio.current_time() < until:
            for name, attack in self.attacks().items():
                if trio.current_time() >= until:
                    return
                with trio.move_on_after(min(ATTACK_TIME, max(0.0, until - trio.current_time()))):
                    try:
                        await attack()
                    except* EXPECTED:  # the victim cut the attacker off (or refused it)
                        self.failed[name] += 1
                await trio.sleep(PAUSE)
            self.rounds += 1

    def summary(self) -> str:
        cells = ", ".join(
            f"{name} {self.sent[name]}"
            + (f" ({self.failed[name]} cut)" if self.failed[name] else "")
            for name in self.attacks()
        )
        return f"hostile peer: {self.rounds} full rounds; sent {cells}"

    # -- attacks ------------------------------------------------------------------------------

    async def squat(self) -> None:
        name = self.names[self.rounds % len(self.names)]
        channel = await open_peer(self.victim().address, name)
        async with channel, trio.open_nursery() as nursery:
            nursery.start_soon(_drain, channel)
            self.sent["squat"] += 1
            await trio.sleep(SQUAT_STAY)
            nursery.cancel_scope.cancel()

    async def requests(self) -> None:
        channel = await open_peer(self.victim().address, HOSTILE_AGENT + "-flood")
        factory = EnvelopeFactory(wall_clock_ms)
        async with channel, trio.open_nursery() as nursery:
            nursery.start_soon(_drain, channel)
            for n in range(FLOOD):
                envelope = factory.create(
                    HOSTILE_AGENT + "-flood",
                    self.victim_agent,
                    MessageType.REQUEST,
                    {"n": n},
                    metadata=Metadata(tier=3),
                )
                await channel.send_message(encode_envelope(envelope))
                self.sent["requests"] += 1
            await trio.sleep(1.0)
            nursery.cancel_scope.cancel()

    async def _many(self, name: str, count: int, request: Callable[[int], dict[str, Any]]) -> None:
        """``count`` control calls of the hostile daemon, CONCURRENCY at a time."""
        numbers = iter(range(count))

        async def worker() -> None:
            for n in numbers:
                self.sent[name] += 1
                try:
                    await self.process.call(request(n))
                except EXPECTED:
                    pass  # refusals are what a defending victim answers

        async with trio.open_nursery() as nursery:
            for _ in range(CONCURRENCY):
                nursery.start_soon(worker)

    async def proposals(self) -> None:
        def propose(n: int) -> dict[str, Any]:
            task = {"description": f"flood {n}", "capabilities": [], "input": {"n": n}}
            return {"op": "task.propose", "from": HOSTILE_AGENT, "to": self.victim_agent,
                    "task": task, "deadline": 5}  # fmt: skip

        await self._many("proposals", PROPOSALS, propose)

    async def tool_flood(self) -> None:
        def add(n: int) -> dict[str, Any]:
            return {"op": "tools.call", "agent": HOSTILE_AGENT, "name": "toolbox.add",
                    "arguments": {"a": n, "b": 1}}  # fmt: skip

        await self._many("tool_flood", TOOL_CALLS, add)

    async def big_arguments(self) -> None:
        deep: Any = 1
        for _ in range(40):
            deep = {"d": deep}
        for arguments in ({"a": "x" * 900_000}, {"a": deep}, {"a": list(range(70_000))}):
            self.sent["big_arguments"] += 1
            op = {"op": "tools.call", "agent": HOSTILE_AGENT, "name": "toolbox.add",
                  "arguments": arguments}  # fmt: skip
            with trio.move_on_after(12):
                try:
                    await self.process.call(op)
                except EXPECTED:
                    pass

    async def hang(self) -> None:
        async def one() -> None:
            op = {"op": "tools.call", "agent": HOSTILE_AGENT, "name": "toolbox.hang"}
            self.sent["hang"] += 1
            with trio.move_on_after(HANG_WAIT):
                try:
                    await self.process.call(op)
                except EXPECTED:
                    pass

        async with trio.open_nursery() as nursery:
            for _ in range(HANGS):
                nursery.start_soon(one)

    async def attach_no_read(self) -> None:
        path = self.victim().data_dir / AGENT_SOCKET_NAME
        assert path == socket_path(self.victim().data_dir)
        stream = await trio.open_unix_socket(str(path))
        card = card_template(Agent(f"noreader{self.rounds}"))
        lines = [json.dumps({"v": PROTOCOL_VERSION, "op": "attach", "card": card, "id": 0})]
        send = {"op": "send", "to": self.victim_agent, "type": "notification"}
        lines += [json.dumps({**send, "id": n, "payload": {"n": n}}) for n in range(1, ATTACH_OPS)]
        try:
            with trio.move_on_after(5):
                await stream.send_all(("\n".join(lines) + "\n").encode())
            self.sent["attach_no_read"] += 1
        finally:
            await trio.aclose_forcefully(stream)
