"""The hardening issue's flood over real UDP sockets on loopback (where it was found).

Smaller than the simulator's (tests/dht/test_flood.py): 20,000 datagrams
from 64 source ports, against the node every other one bootstrapped from.
"""

from __future__ import annotations

import random
from contextlib import AsyncExitStack
from functools import partial

import pytest
import trio

from p2pnode.core.identity import Identity
from p2pnode.dht.config import DhtConfig
from p2pnode.dht.node import DhtNode
from p2pnode.transport.net import TrioNetwork
from tests.dht.flood import Flood, ask_find_node, junk_in
from tests.sim import wait_until

pytestmark = pytest.mark.slow

FLOOD = 20_000
PORTS = 64
CONFIG = DhtConfig(rpc_hard_timeout=2.0)


async def _start(
    stack: AsyncExitStack, rng: random.Random, host: str, config: DhtConfig
) -> DhtNode:
    node = DhtNode(
        TrioNetwork(),
        identity=Identity(rng.randbytes(32)),
        address=(host, 0),
        config=config,
        rng=random.Random(rng.random()),
    )
    return await stack.enter_async_context(node)


async def _flood(*, responsive: bool, hosts: list[str], attacker: str, config: DhtConfig) -> None:
    rng = random.Random(41 + responsive)
    with trio.fail_after(120):
        async with AsyncExitStack() as stack:
            victim = await _start(stack, rng, hosts[0], config)
            honest = [await _start(stack, rng, h, config) for h in hosts[1:]]
            for node in honest[:-1]:
                assert await node.bootstrap([victim.address]) == 1
            await wait_until(lambda: len(victim.table) == len(honest) - 1)
            before = {c.node_id for c in victim.table.contacts()}
            net = TrioNetwork()
            ports = [await net.bind_datagram((attacker, 0)) for _ in range(PORTS)]
            for ep in ports:
                stack.callback(ep.close)
            flood = Flood(ports, victim.address, random.Random(43))
            async with trio.open_nursery() as nursery:
                if responsive:
                    for ep in ports:
                        nursery.start_soon(flood.answer, ep)
                async with trio.open_nursery() as attack:
                    attack.start_soon(partial(flood.send, FLOOD, gap=0.002))
                    await trio.sleep(1)
                    # The last honest node joins while the victim is flooded.
                    assert await honest[-1].bootstrap([victim.address]) == 1
                await wait_until(lambda: victim.gate.admission.checking == 0, timeout=30)
                ids = {c.node_id for c in victim.table.contacts()}
                asker = await net.bind_datagram((hosts[0], 0))
                served: set[bytes] = set()
                for _ in range(20):
                    key = rng.randbytes(20)
                    served |= set(await ask_find_node(asker, victim.address, key, b"\x5a" * 20))
                asker.close()
                nursery.cancel_scope.cancel()
            stats = victim.stats
            print(
                f"\nloopback flood ({'responsive' if responsive else 'silent'}): sent {flood.sent} "
                f"from {PORTS} ports; victim handled {stats.requests_handled} requests, "
                f"dropped {stats.datagrams_dropped}, checks sent {stats.checks_sent} "
                f"(retried {stats.checks_retried}); "
                f"contacts {len(ids)} (junk {junk_in(ids, flood)}), junk served "
                f"{junk_in(served, flood)}"
            )
            assert honest[-1].node_id in ids
            assert before <= ids
            assert junk_in(served, flood) <= config.max_ids_per_host
            if responsive:
                assert junk_in(ids, flood) <= config.max_ids_per_host
            else:
                assert ids == before | {honest[-1].node_id}


async def test_silent_flood_on_loopback_leaves_the_table_as_it_was() -> None:
    # Every node on 127.0.0.1, as `p2pnode demo` runs them: loopback ids are not
    # limited per host by default, and none of the flood's ids answers.
    await _flood(responsive=False, hosts=["127.0.0.1"] * 4, attacker="127.0.0.1", config=CONFIG)


async def test_answering_flood_on_loopback_is_held_to_the_host_limit() -> None:
    # Distinct loopback addresses stand for distinct hosts, and loopback counts.
    config = DhtConfig(rpc_hard_timeout=2.0, limit_loopback=True)
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"]
    await _flood(responsive=True, hosts=hosts, attacker="127.0.0.9", config=config)
