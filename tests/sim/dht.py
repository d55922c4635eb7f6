"""DHT helpers: signed cards, a wall clock on trio's virtual time, simulated DHT swarms."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import trio

from p2pnode.core.card import AgentCard, Capability
from p2pnode.core.identity import Identity
from p2pnode.dht.config import DhtConfig
from p2pnode.dht.node import DhtNode
from p2pnode.simnet import LinkConditions, SimNetwork
from tests.sim.configs import FAST_DHT

EPOCH_MS = 1_800_000_000_000


def virtual_ms() -> int:
    """Wall clock for simulations: a fixed epoch plus trio's (virtual) time."""
    return EPOCH_MS + int(trio.current_time() * 1000)


def identity(rng: random.Random) -> Identity:
    return Identity(rng.randbytes(32))


def make_card(
    owner: Identity,
    caps: list[str],
    *,
    revision: int = 1,
    ttl_ms: int = 3 * 3600 * 1000,
    now_ms: int | None = None,
) -> AgentCard:
    issued = virtual_ms() if now_ms is None else now_ms
    card = AgentCard(
        id=f"agent-{str(owner.peer_id)[:8]}",
        name="test agent",
        version="1.0.0",
        public_key=owner.public_key,
        capabilities=tuple(Capability(id=c, name=c) for c in caps),
        revision=revision,
        addresses=("10.0.0.1:7000",),
        issued_at=issued,
        expires_at=issued + ttl_ms,
    )
    return card.signed(owner)


DEFAULT_LINK = LinkConditions(latency=0.02, jitter=0.01)


def dht_node(sim: SimNetwork, rng: random.Random, config: DhtConfig = FAST_DHT) -> DhtNode:
    """A DHT node on a new host of ``sim`` (port 4000), its identity and randomness from
    ``rng``, on the virtual wall clock; not started."""
    host = sim.add_host()
    return DhtNode(
        host,
        identity=identity(rng),
        address=(host.host, 4000),
        config=config,
        rng=random.Random(rng.random()),
        wall_clock_ms=virtual_ms,
    )


@asynccontextmanager
async def dht_swarm(
    n: int,
    *,
    seed: int = 1,
    config: DhtConfig = FAST_DHT,
    conditions: LinkConditions = DEFAULT_LINK,
) -> AsyncIterator[tuple[SimNetwork, list[DhtNode]]]:
    """``n`` nodes with identities on a simulated network, each bootstrapped off node 0."""
    rng = random.Random(seed)
    sim = SimNetwork(rng, default=conditions)
    async with AsyncExitStack() as stack:
        nodes: list[DhtNode] = []
        for _ in range(n):
            node = dht_node(sim, rng, config)
            await stack.enter_async_context(node)
            nodes.append(node)
        for node in nodes[1:]:
            await node.bootstrap([nodes[0].address])
        yield sim, nodes
