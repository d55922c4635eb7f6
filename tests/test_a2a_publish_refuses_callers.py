"""``a2a publish``'s access rule end to end: an A2A server (the SDK's server classes, in
process over HTTP+JSON) published as agent ``desk`` attached over ``agent.sock`` to one
node, asked from agents of a second node over loopback TCP. The owner's node tells the
publisher who each caller is (its signed card's tier, the roles the swarm authority
endorsed); a caller of the wrong tier or without an endorsed role is refused with
``PERMISSION_DENIED`` and the server never sees its message; a matching caller is
served (docs/protocol/a2a.md §9.7)."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_rest_routes
from a2a.server.tasks import InMemoryTaskStore
from a2a.types import AgentCard as A2ACard
from google.protobuf.json_format import ParseDict
from starlette.applications import Starlette

from p2pnode import Identity, NodeConfig, TrioNetwork, aio
from p2pnode.agent.definition import Agent
from p2pnode.agent.tools import Access
from p2pnode.bridges.a2a.supervise import (
    PublishSpec,
    ServerPublisher,
    callers_in_aio_node,
    host_attached,
    host_in_aio_node,
)
from p2pnode.core.envelope import Metadata
from p2pnode.core.errors import ErrorCode, P2PError
from p2pnode.hosting.aio import AioNode
from p2pnode.node.policy import PolicyConfig
from tests.test_a2a_publish import Executor, Seen, server_card

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("a2a-publish")]

HOST = "127.0.0.1"
URL = "http://a2a.test"
LIMIT = 10.0
AGENT = "desk"
AUTHORITY = Identity(bytes([200]) * 32)
#: An agent of the asking node: its id, tier, roles and who endorsed them (None: nobody).
Asker = tuple[str, int, tuple[str, ...], Identity | None]


def server_app(seen: Seen) -> Starlette:
    """The test server (tests.test_a2a_publish's executor) over HTTP+JSON only."""
    document = server_card(URL)
    document["supportedInterfaces"] = [
        {"url": f"{URL}/rest", "protocolBinding": "HTTP+JSON", "protocolVersion": "1.0"}
    ]
    document["capabilities"] = {"streaming": False}
    card = ParseDict(document, A2ACard())
    handler = DefaultRequestHandler(
        agent_executor=Executor(seen), task_store=InMemoryTaskStore(), agent_card=card
    )
    routes = [*create_agent_card_routes(card), *create_rest_routes(handler, path_prefix="/rest")]
    return Starlette(routes=routes)


@dataclass
class World:
    owner: AioNode
    caller: AioNode
    seen: Seen

    def refusals(self) -> int:
        """The owner node's security events for refused access."""
        counts = self.owner.node.status()["metrics"]["securityByCode"]
        return int(counts.get("PERMISSION_DENIED", 0))

    async def ask(self, sender: str, text: str) -> Any:
        """``sender``'s request for skill ``shout`` of the published agent."""
        call = partial(
            self.caller.node.request,
            sender,
            AGENT,
            text,
            metadata=Metadata(capability="shout"),
            timeout=LIMIT,
        )
        return (await self.caller.run_trio(call)).payload

    async def refused(self, sender: str) -> P2PError:
        with pytest.raises(P2PError) as denied:
            await self.ask(sender, "let me in")
        return denied.value


async def wait_until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll ``check`` until it holds; fail naming ``what`` after LIMIT seconds."""
    for _ in range(int(LIMIT / 0.05)):
        if await check():
            return
        await asyncio.sleep(0.05)
    pytest.fail(f"not within {LIMIT:g} s: {what}")


@asynccontextmanager
async def published(
    access: Access,
    callers: Sequence[Asker],
    authority: Identity | None,
    tier: int = 3,
    *,
    attached: bool = True,
) -> AsyncIterator[World]:
    """The server published as ``desk`` (of ``tier``) with ``access`` on one node, and the
    ``callers`` (id, tier, roles, who endorsed them) on another; ``authority`` the
    swarm's. ``desk`` is attached over ``agent.sock``, or (``attached`` false) hosted
    in the owner's asyncio node, told who calls by :func:`callers_in_aio_node`."""
    key = authority.public_key if authority is not None else None
    config = NodeConfig(listen=(HOST, 0), policy=PolicyConfig(authority_key=key))
    network, seen = TrioNetwork(), Seen()
    with tempfile.TemporaryDirectory(dir="/tmp") as short:  # AF_UNIX paths are short
        path = Path(short) / "agent.sock"
        async with (
            aio.open_node(Identity.generate(), network, config) as owner,
            aio.open_node(Identity.generate(), network, config) as caller,
        ):
            await owner.run_trio(partial(owner.node.open_agent_socket, path, endorser=authority))
            for agent_id, its_tier, roles, endorser in callers:
                add = partial(
                    caller.node.add_agent, Agent(agent_id, tier=its_tier), authority=endorser,
                    roles=roles,
                )  # fmt: skip
                await caller.run_trio(add)
            await caller.connect((HOST, owner.listen_address[1]))
            transport = httpx.ASGITransport(app=server_app(seen))
            spec = PublishSpec(URL, AGENT, tier=tier, access=access, poll=LIMIT)
            if attached:
                publisher = ServerPublisher(spec, host_attached(path=path), transport=transport)
            else:
                host, callers_of = host_in_aio_node(owner), callers_in_aio_node(owner)
                publisher = ServerPublisher(spec, host, transport=transport, callers=callers_of)
            running = asyncio.create_task(publisher.run())
            try:
                async with asyncio.timeout(LIMIT):
                    await publisher.wait_published()

                async def listed() -> bool:
                    return any(card.id == AGENT for card in await caller.find("shout"))

                await wait_until(listed, "the published agent is found")
                yield World(owner, caller, seen)
            finally:
                running.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await running


def test_a_wrong_tier_or_a_role_not_endorsed_is_refused_and_a_match_is_served() -> None:
    callers = [
        ("boss", 1, ("admin",), AUTHORITY),
        ("clerk", 1, ("ops",), AUTHORITY),
        ("intern", 2, ("admin",), AUTHORITY),
    ]

    async def main() -> None:
        # desk is L1: the node's policy lets L1 and L2 agents send it requests.
        rule = Access(tiers=[1], roles=["admin"])
        async with published(rule, callers, AUTHORITY, tier=1) as world:
            clerk = await world.refused("clerk")
            assert clerk.code is ErrorCode.PERMISSION_DENIED
            assert clerk.message == (
                "clerk may not use skill 'shout' of the A2A server: no endorsed role among admin"
            )
            intern = await world.refused("intern")
            assert intern.code is ErrorCode.PERMISSION_DENIED
            assert intern.message.endswith("tier L2 is not one of L1")
            assert world.seen.skills == []  # the server saw neither
            assert await world.ask("boss", "quiet") == "QUIET"
            assert world.seen.skills == ["shout"]
            assert world.refusals() == 2  # each refusal is a security event on the owner

    asyncio.run(asyncio.wait_for(main(), LIMIT * 3))


def test_hosted_in_process_the_owners_node_names_the_caller() -> None:
    callers: list[Asker] = [
        ("boss", 1, (), None),
        ("intern", 2, (), None),
    ]

    async def main() -> None:
        # host_in_aio_node publishes unendorsed cards: an open swarm, tiers self-declared.
        rule = Access(tiers=[1])
        async with published(rule, callers, None, tier=1, attached=False) as world:
            intern = await world.refused("intern")
            assert intern.code is ErrorCode.PERMISSION_DENIED
            assert intern.message.endswith("tier L2 is not one of L1")
            assert world.seen.skills == []
            assert await world.ask("boss", "quiet") == "QUIET"
            assert world.seen.skills == ["shout"]

    asyncio.run(asyncio.wait_for(main(), LIMIT * 3))


def test_a_role_the_caller_endorsed_itself_counts_not() -> None:
    forger = Identity(bytes([201]) * 32)
    callers = [("mallory", 3, ("admin",), forger)]

    async def main() -> None:
        # An open swarm: no authority, so no role counts, whoever signed it.
        async with published(Access(roles=["admin"]), callers, None) as world:
            mallory = await world.refused("mallory")
            assert mallory.code is ErrorCode.PERMISSION_DENIED
            assert mallory.message.endswith("no endorsed role among admin")
            assert world.seen.skills == []

    asyncio.run(asyncio.wait_for(main(), LIMIT * 3))
