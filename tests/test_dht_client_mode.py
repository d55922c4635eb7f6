"""DHT client mode (docs/protocol/dht.md §5.3): a node in client mode answers no request,
so no peer can prove its address and it never enters a routing table, while its own
lookups, stores and reads work; back in server mode it is admitted again; a server that
turns client leaves the tables as requests to it fail; the reachability verdict sets
the mode (reachability.md §5)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.dht import DhtMode
from p2pnode.dht.node import DhtNode
from p2pnode.dht.rpcwire import Response, decode_datagram_untrusted, encode_request
from p2pnode.services.reachability import NatMapping, Reachability, Verdict, dht_mode
from p2pnode.simnet import SimNetwork
from tests.sim import FAST_DHT, dht_node, dht_swarm, identity, make_card, wait_until


def held_by(nodes: list[DhtNode], node_id: bytes) -> int:
    """How many of ``nodes`` hold ``node_id`` in their routing table."""
    return sum(node_id in n.table for n in nodes)


@asynccontextmanager
async def with_newcomer(
    n: int, seed: int, mode: DhtMode
) -> AsyncIterator[tuple[list[DhtNode], DhtNode]]:
    """``n`` joined servers and one more node in ``mode``, joined after them."""
    rng = random.Random(seed + 10_000)  # not the swarm's seed: not node 0's identity
    async with dht_swarm(n, seed=seed) as (sim, nodes):
        newcomer = dht_node(sim, rng)
        async with newcomer:
            newcomer.set_mode(mode)
            assert await newcomer.bootstrap([nodes[0].address]) == 1
            yield nodes, newcomer


async def test_a_client_is_never_admitted_yet_looks_up_and_publishes(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with with_newcomer(20, 31, DhtMode.CLIENT) as (nodes, client):
        assert client.identity is not None and nodes[5].identity is not None
        mine = make_card(client.identity, ["client-cap"])
        theirs = make_card(nodes[5].identity, ["server-cap"])
        assert await client.provide(mine) > 0
        await nodes[5].provide(theirs)
        for target in random.Random(1).sample(nodes, 5):
            await client.find_node(target.node_id)
        # It reads, and what it published is read by others.
        assert await client.find_card(theirs.peer_id, theirs.id) is not None
        for reader in nodes[::4]:
            assert await reader.find_card(mine.peer_id, mine.id) is not None
        # Peers it asked checked it (a ping) and got silence: nobody holds it.
        await trio.sleep(FAST_DHT.rpc_hard_timeout)  # the last checks' pings time out
        assert client.statistics().requests_ignored > 0
        assert sum(n.statistics().checks_failed for n in nodes) > 0
        assert held_by(nodes, client.node_id) == 0
        assert client.statistics().requests_handled == 0
        # The node still holds servers itself (replies to its own requests prove them).
        assert len(client.table) > 0


async def test_back_in_server_mode_the_node_is_admitted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with with_newcomer(20, 32, DhtMode.CLIENT) as (nodes, node):
        await node.find_node(node.node_id)
        assert held_by(nodes, node.node_id) == 0
        node.set_mode(DhtMode.SERVER)
        # Past the 60 s rest after the checks it ignored, its requests are checked again.
        await trio.sleep(FAST_DHT.maintenance_interval)
        for _ in range(3):
            await node.find_node(node.node_id)
        await wait_until(lambda: held_by(nodes, node.node_id) > 0, timeout=30)
        assert node.statistics().requests_handled > 0


async def test_a_server_that_turns_client_leaves_the_tables_as_requests_to_it_fail(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with with_newcomer(30, 33, DhtMode.SERVER) as (nodes, node):
        await wait_until(lambda: held_by(nodes, node.node_id) > 0)
        node.set_mode(DhtMode.CLIENT)
        # Each holder looks up an id next to it: the node is asked, is silent, and two
        # failures in a row evict it (dht.md §5). Bounded: five rounds.
        near = node.node_id[:-1] + bytes([node.node_id[-1] ^ 1])
        for _ in range(5):
            holders = [n for n in nodes if node.node_id in n.table]
            if not holders:
                break
            async with trio.open_nursery() as nursery:
                for holder in holders:
                    nursery.start_soon(holder.find_node, near)
            await trio.sleep(FAST_DHT.rpc_hard_timeout)  # the failures count at the hard timeout
        assert held_by(nodes, node.node_id) == 0
        assert node.statistics().requests_ignored > 0


async def _pinged(sim: SimNetwork, peer: DhtNode) -> bool:
    """Whether ``peer`` answers a ping from a fresh address within the RPC timeout."""
    host = sim.add_host()
    endpoint = await host.bind_datagram((host.host, 9000))
    try:
        await endpoint.sendto(encode_request(b"m" * 20, "ping", [b"p" * 20]), peer.address)
        with trio.move_on_after(FAST_DHT.rpc_hard_timeout):
            for _ in range(4):  # the reply, and the peer's admission check of us
                data, _ = await endpoint.recvfrom()
                if isinstance(decode_datagram_untrusted(data), Response):
                    return True
        return False
    finally:
        endpoint.close()


@settings(max_examples=15, deadline=None)
@given(st.lists(st.sampled_from(list(DhtMode)), min_size=1, max_size=5))
def test_a_request_is_answered_exactly_while_the_node_is_a_server(modes: list[DhtMode]) -> None:
    async def main() -> None:
        sim = SimNetwork(random.Random(7))
        host = sim.add_host()
        async with DhtNode(
            host, identity=identity(random.Random(8)), address=(host.host, 4000)
        ) as peer:
            started: DhtMode = peer.mode
            assert started is DhtMode.SERVER  # every node starts a server
            ignored = 0
            for mode in modes:
                peer.set_mode(mode)
                assert peer.mode is mode
                assert await _pinged(sim, peer) is (mode is DhtMode.SERVER)
                ignored += mode is DhtMode.CLIENT
            assert peer.statistics().requests_ignored == ignored

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def _verdict(reachability: Reachability) -> Verdict:
    return Verdict(reachability, (), (), None, NatMapping.UNKNOWN, None, ())


@given(st.sampled_from(list(Reachability)))
def test_the_verdict_sets_the_mode_unknown_keeps_it(reachability: Reachability) -> None:
    expected: dict[Reachability, Any] = {
        Reachability.REACHABLE: DhtMode.SERVER,
        Reachability.UNREACHABLE: DhtMode.CLIENT,
        Reachability.UNKNOWN: None,
    }
    assert dht_mode(_verdict(reachability)) is expected[reachability]
