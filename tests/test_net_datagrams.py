"""Real UDP endpoints on 127.0.0.1: sends without a checkpoint, reads through the
shared receive buffer."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.transport.net import DatagramEndpoint, TrioNetwork

pytestmark = pytest.mark.slow  # real sockets on 127.0.0.1


async def _pair() -> tuple[DatagramEndpoint, DatagramEndpoint]:
    net = TrioNetwork()
    return await net.bind_datagram(("127.0.0.1", 0)), await net.bind_datagram(("127.0.0.1", 0))


async def test_sendto_nowait_sends_without_a_checkpoint() -> None:
    a, b = await _pair()
    with trio.fail_after(5):
        with trio.testing.assert_no_checkpoints():
            a.sendto_nowait(b"hello", b.local_address)
        data, src = await b.recvfrom()
    assert (data, src) == (b"hello", a.local_address)
    a.close()
    b.close()
    with pytest.raises(trio.ClosedResourceError):
        a.sendto_nowait(b"x", b.local_address)


async def test_sendto_nowait_resolves_no_names() -> None:
    a, b = await _pair()
    with trio.fail_after(5):
        a.sendto_nowait(b"by name", ("localhost", b.local_address[1]))  # dropped
        a.sendto_nowait(b"by address", b.local_address)
        assert await b.recvfrom() == (b"by address", a.local_address)
    a.close()
    b.close()


@settings(max_examples=20)
@given(sizes=st.lists(st.integers(min_value=0, max_value=9000), min_size=1, max_size=6))
def test_datagrams_keep_their_bytes_through_the_shared_buffer(sizes: list[int]) -> None:
    """Two endpoints read in turns through one buffer: each datagram comes out whole,
    a short one after a long one included."""

    async def main() -> None:
        a, b = await _pair()
        sent = [bytes([i % 251 + 1]) * n for i, n in enumerate(sizes)]
        got: dict[int, list[bytes]] = {0: [], 1: []}
        with trio.fail_after(5):
            for i, data in enumerate(sent):
                (a if i % 2 else b).sendto_nowait(data, (b if i % 2 else a).local_address)
            async with trio.open_nursery() as nursery:

                async def drain(k: int, ep: DatagramEndpoint, count: int) -> None:
                    for _ in range(count):
                        got[k].append((await ep.recvfrom())[0])

                nursery.start_soon(drain, 0, a, len(sent[::2]))
                nursery.start_soon(drain, 1, b, len(sent[1::2]))
        assert got == {0: sent[::2], 1: sent[1::2]}
        a.close()
        b.close()

    trio.run(main)


async def test_a_receive_waiting_on_a_closed_endpoint_ends() -> None:
    a, b = await _pair()
    b.close()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:

            async def receive() -> None:
                with pytest.raises(trio.ClosedResourceError):
                    await a.recvfrom()

            nursery.start_soon(receive)
            await trio.testing.wait_all_tasks_blocked()
            a.close()
    with pytest.raises(trio.ClosedResourceError):
        await a.recvfrom()
