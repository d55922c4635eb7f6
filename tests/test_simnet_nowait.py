"""The in-memory network's sendto_nowait: the same deliveries as sendto, no checkpoint."""

from __future__ import annotations

import random

import pytest
import trio
import trio.testing

from p2pnode.simnet import LinkConditions, SimNetwork


async def _run(nowait: bool) -> list[tuple[float, bytes]]:
    sim = SimNetwork(random.Random(3), default=LinkConditions(latency=0.02, jitter=0.01, loss=0.2))
    a, b = sim.add_host(), sim.add_host()
    ea, eb = await a.bind_datagram(("", 0)), await b.bind_datagram(("", 0))
    t0 = trio.current_time()
    for i in range(50):
        if nowait:
            with trio.testing.assert_no_checkpoints():
                ea.sendto_nowait(bytes([i]), eb.local_address)
        else:
            await ea.sendto(bytes([i]), eb.local_address)
    got = []
    with trio.move_on_after(1):
        while True:
            data, src = await eb.recvfrom()
            assert src == ea.local_address
            got.append((round(trio.current_time() - t0, 9), data))  # runs start at other times
    return got


async def test_sendto_nowait_delivers_as_sendto(autojump_clock: trio.testing.MockClock) -> None:
    awaited = await _run(nowait=False)
    assert 20 < len(awaited) < 50  # some lost, most delivered
    assert await _run(nowait=True) == awaited


async def test_sendto_nowait_on_a_closed_endpoint_raises() -> None:
    sim = SimNetwork(random.Random(1))
    ep = await sim.add_host().bind_datagram(("", 0))
    ep.close()
    with pytest.raises(trio.ClosedResourceError):
        ep.sendto_nowait(b"x", ("10.0.0.9", 1))
