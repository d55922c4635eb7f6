"""DhtPeer.serve: the node run in the caller's task, stopped by close() (virtual time)."""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

from p2pnode.core.errors import LocalError
from p2pnode.dht.peer import DhtPeer
from p2pnode.simnet import SimNetwork


def _peer(sim: SimNetwork, n: int) -> DhtPeer:
    host = sim.add_host()
    return DhtPeer(host, node_id=bytes([n]) * 20, address=(host.host, 4000), rng=random.Random(n))


async def test_serve_runs_the_node_until_close(autojump_clock: trio.testing.MockClock) -> None:
    sim = SimNetwork(random.Random(1))
    served, asker = _peer(sim, 1), _peer(sim, 2)
    returned = trio.Event()
    async with trio.open_nursery() as nursery, asker:

        async def run() -> None:
            await served.serve()
            returned.set()

        nursery.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()
        address = served.address
        assert await asker.ping(address) == served.node_id
        assert served.stats.requests_handled == 1
        served.close()
        await returned.wait()
        # Stopped: nobody answers there any more.
        assert await asker.ping(address) is None


async def test_serve_starts_with_the_node_and_refuses_a_second_run(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sim = SimNetwork(random.Random(2))
    peer = _peer(sim, 3)
    async with trio.open_nursery() as nursery:
        assert await nursery.start(peer.serve) is peer
        assert peer.address[1] == 4000  # bound by the time it started
        with pytest.raises(LocalError):
            await peer.serve()
        with pytest.raises(LocalError):
            async with peer:
                pass
        peer.close()
    # Stopped, it may run again.
    async with trio.open_nursery() as nursery:
        await nursery.start(peer.serve)
        peer.close()


async def test_close_ends_an_async_with_node_and_its_body_goes_on(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sim = SimNetwork(random.Random(3))
    peer, asker = _peer(sim, 4), _peer(sim, 5)
    async with asker, peer:
        address = peer.address
        peer.close()
        await trio.testing.wait_all_tasks_blocked()
        assert await asker.ping(address) is None
    peer.close()  # not running: nothing
