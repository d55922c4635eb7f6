"""Per-peer limits after the handshake: the envelope rate and the bytes queued per link.

The attack (the hardening issue): one peer sending envelopes as fast as it could had
46k envelopes/s accepted. Now a token bucket per link drops what is over the rate
before decoding it, counts it and reports it once a minute; other peers are served.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import trio
import trio.testing

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.identity import Identity
from p2pnode.core.wire import pack
from p2pnode.node.channels import HELLO_COST, LinkLimits, PeerLink, RetryPolicy, frame_cost
from p2pnode.node.frames import FrameKind, encode_hello
from p2pnode.node.observability import EventKind
from p2pnode.transport.channel import connect_secure
from p2pnode.transport.secure import SecureIdentity
from tests.sim import Inbox, swarm
from tests.sim.configs import FAST_NODE


def test_frame_cost_reads_the_member_count() -> None:
    member = {"id": "x"}
    assert frame_cost(pack([FrameKind.ENVELOPE, member])) == 1
    assert frame_cost(pack([FrameKind.ENVELOPES, [member] * 7])) == 7
    assert frame_cost(pack([FrameKind.ENVELOPES, [member] * 300])) == 300  # array 16
    assert frame_cost(pack([FrameKind.ENVELOPES, [member] * 70_000])) == 70_000  # array 32
    assert frame_cost(pack([FrameKind.ENVELOPES, []])) == 1
    assert frame_cost(encode_hello([], [])) == HELLO_COST
    for junk in (b"", b"\x92", b"\x93\x02\x91", b"\x92\x02\xdc", b"\xc0" * 10):
        assert frame_cost(junk) == 1


async def test_a_flooding_peer_is_held_to_its_rate(autojump_clock: Any) -> None:
    config = dataclasses.replace(FAST_NODE, envelope_rate=100.0, envelope_burst=200)
    async with swarm(2, config) as (sim, (victim, honest)):
        await victim.add_agent("io", Inbox(), tier=3)
        await honest.add_agent("triton", Inbox(), tier=3)
        await honest.connect(victim.listen_address)
        flooder = SecureIdentity(Identity.generate())
        stream = await sim.add_host("10.88.0.1").connect_stream(victim.listen_address)
        channel = await connect_secure(stream, flooder)
        frame = pack([FrameKind.ENVELOPES, [{"bogus": i} for i in range(10)]])
        start = trio.current_time()
        for _ in range(10):  # 10 bursts of 100 frames: 10,000 envelopes in one second
            await channel.send_many([frame] * 100)
            await trio.sleep(0.1)
        # Meanwhile an honest peer is answered as usual.
        assert (await honest.request("triton", "io", "hi")).payload == {"echo": "hi"}
        await trio.sleep(1.0)
        elapsed = trio.current_time() - start
        link = victim.links.get(flooder.peer_id)
        assert link is not None
        accepted = (link.frames_received - link.frames_dropped) * 10
        assert accepted <= 200 + 100 * elapsed + 10
        assert link.envelopes_dropped == victim.links.envelopes_dropped >= 10_000 - accepted - 10
        busy = [
            e
            for e in victim.events.recent(kind=EventKind.SECURITY)
            if e.code is ErrorCode.BUSY and e.peer == str(flooder.peer_id)
        ]
        assert len(busy) == 1  # reported once a minute, not per frame
        await channel.aclose()


def _link_to_a_silent_peer(
    nursery: trio.Nursery, dialing: trio.Event, retry: RetryPolicy, limits: LinkLimits
) -> PeerLink:
    """A link whose peer never answers its dial (``dialing`` is set then): what is sent
    stays queued."""
    me, them = Identity.generate(), Identity.generate()

    async def dial() -> Any:
        dialing.set()
        await trio.sleep_forever()

    async def on_frame(peer: object, data: bytes) -> None:
        raise AssertionError("nothing arrives")

    return PeerLink(
        SecureIdentity(me).peer_id, SecureIdentity(them).peer_id, nursery, dial, on_frame,
        lambda _link, _state: None, retry, None, limits,
    )  # fmt: skip


async def test_bytes_queued_for_a_peer_are_bounded(autojump_clock: Any) -> None:
    dialing = trio.Event()
    async with trio.open_nursery() as nursery:
        link = _link_to_a_silent_peer(
            nursery, dialing, RetryPolicy(dial_timeout=30.0), LinkLimits(max_queue_bytes=1000)
        )
        nursery.start_soon(link.send, b"a" * 600)
        await dialing.wait()
        assert link.queued_bytes == 600
        with pytest.raises(LocalError) as info:
            await link.send(b"b" * 600)
        assert info.value.code is ErrorCode.BUSY
        assert link.queued_bytes == 600  # the refused frame was never queued
        await link.aclose()
        nursery.cancel_scope.cancel()


async def test_a_sender_cancelled_while_the_queue_is_full_leaves_nothing_counted(
    autojump_clock: Any,
) -> None:
    async with trio.open_nursery() as nursery:
        link = _link_to_a_silent_peer(
            nursery,
            trio.Event(),
            RetryPolicy(dial_timeout=30.0, queue_size=1),
            LinkLimits(max_queue_bytes=10_000),
        )
        for frame in (b"a" * 100, b"b" * 100):  # the first goes to the writer, one waits
            nursery.start_soon(link.send, frame)
            await trio.testing.wait_all_tasks_blocked()
        assert link.queued_bytes == 200
        with trio.move_on_after(1.0) as scope:  # the queue is full: this send waits
            await link.send(b"c" * 100)
        assert scope.cancelled_caught
        assert link.queued_bytes == 200
        with trio.CancelScope() as scope:  # already cancelled: nothing is queued
            scope.cancel()
            await link.send(b"d" * 100)
        assert link.queued_bytes == 200
        await link.aclose()
        nursery.cancel_scope.cancel()
