"""Circuit relays in the simulator (virtual clock): a target behind NAT keeps a
reservation, a dialer reaches it through the relay, and the secure channel runs end
to end over the relayed bytes; the relay's limits and refusals."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial

import pytest
import trio
import trio.testing

from p2pnode.core.errors import ErrorCode
from p2pnode.core.identity import Identity, PeerId
from p2pnode.simnet import LinkConditions, SimHost, SimNetwork
from p2pnode.transport.channel import SecureChannel, accept_secure, connect_secure
from p2pnode.transport.relay import (
    CircuitEnd,
    Ok,
    Refused,
    RelayAddress,
    RelayLimits,
    RelayRefusal,
    RelayRefusedError,
    encode_message,
    reserve_message,
)
from p2pnode.transport.relayserve import (
    RelayListener,
    RelayServer,
    connect_via_relay,
    reserve,
)
from p2pnode.transport.secure import SecureChannelError, SecureIdentity
from tests.sim.waiting import wait_until

RELAY = Identity(b"\x10" * 32)
ALICE = SecureIdentity(Identity(b"\x11" * 32))  # behind NAT: holds a reservation
BOB = SecureIdentity(Identity(b"\x12" * 32))  # dials Alice through the relay
MALLORY = SecureIdentity(Identity(b"\x13" * 32))
RELAY_PORT = 4100


def wall() -> float:
    """The wall clock the tests give relays and clients: trio's (virtual) clock."""
    return 1.75e9 + trio.current_time()


@dataclass
class World:
    sim: SimNetwork
    relay_host: SimHost
    server: RelayServer
    relay: RelayAddress

    def host(self) -> SimHost:
        return self.sim.add_host()


@asynccontextmanager
async def world(limits: RelayLimits | None = None) -> AsyncIterator[World]:
    """A simulated network with a relay serving on it."""
    sim = SimNetwork(random.Random(7), default=LinkConditions(latency=0.01, jitter=0.0))
    relay_host = sim.add_host()
    server = RelayServer(relay_host, RELAY.peer_id, limits, wall_clock=wall)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(server.serve, (relay_host.host, RELAY_PORT))
        yield World(sim, relay_host, server, RelayAddress(address, RELAY.peer_id))
        nursery.cancel_scope.cancel()


async def echo_one(channel: SecureChannel) -> None:
    """Answer each message with it reversed, until the channel ends."""
    try:
        while True:
            message = await channel.receive_message()
            await channel.send_message(message[::-1])
    except (SecureChannelError, trio.ClosedResourceError):
        pass


@asynccontextmanager
async def alice_serving(w: World, local: SecureIdentity = ALICE) -> AsyncIterator[list[str]]:
    """Alice on her own host keeps a reservation and echoes on every relayed channel;
    the list collects the peer ids she saw."""
    seen: list[str] = []
    host = w.host()
    async with reserve(host, w.relay, local.identity, wall_clock=wall) as reservation:

        async def accept_loop(nursery: trio.Nursery) -> None:
            for _ in range(100):  # bounded: a test opens few circuits
                stream = await reservation.accept()
                nursery.start_soon(answer, stream)

        async def answer(stream: trio.abc.Stream) -> None:
            try:
                channel = await accept_secure(stream, local)
            except SecureChannelError:
                return
            seen.append(str(channel.remote_peer_id))
            async with channel:
                await echo_one(channel)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(accept_loop, nursery)
            yield seen
            nursery.cancel_scope.cancel()


async def exchange_until_closed(
    channel: SecureChannel, message: bytes, times: int, pause: float
) -> None:
    """Send ``message`` and read the echo ``times`` times, ``pause`` s apart (raises
    when the channel breaks)."""
    for _ in range(times):
        await channel.send_message(message)
        await channel.receive_message()
        await trio.sleep(pause)


async def dial(w: World, target: PeerId, local: SecureIdentity = BOB) -> SecureChannel:
    stream = await connect_via_relay(w.host(), w.relay, target)
    return await connect_secure(stream, local, expected_peer_id=target)


# --- the happy path and identity ------------------------------------------------------


async def test_dial_through_relay_end_to_end(autojump_clock: trio.testing.MockClock) -> None:
    async with world() as w, alice_serving(w) as seen:
        channel = await dial(w, ALICE.peer_id)
        async with channel:
            assert channel.remote_peer_id == ALICE.peer_id
            for size in (1, 1000, 200_000):
                message = random.Random(size).randbytes(size)
                await channel.send_message(message)
                assert await channel.receive_message() == message[::-1]
        assert seen == [str(BOB.peer_id)]  # Alice authenticated Bob, not the relay
        stats = w.server.statistics()
        assert stats.circuits_opened == 1
        assert stats.bytes_relayed > 2 * 201_001  # both ways, plus Noise overhead
        await wait_until(lambda: w.server.statistics().circuits == 0)
        assert w.server.statistics().circuit_ends == {CircuitEnd.CLOSED: 1}


async def test_wrong_expected_peer_fails_handshake(autojump_clock: trio.testing.MockClock) -> None:
    async with world() as w, alice_serving(w):
        stream = await connect_via_relay(w.host(), w.relay, ALICE.peer_id)
        with pytest.raises(SecureChannelError) as caught:
            await connect_secure(stream, BOB, expected_peer_id=MALLORY.peer_id)
        assert caught.value.code is ErrorCode.PEER_ID_MISMATCH


async def test_reservation_is_renewed(autojump_clock: trio.testing.MockClock) -> None:
    limits = RelayLimits(reservation_ttl=20.0)
    async with world(limits) as w, alice_serving(w):
        await trio.sleep(100)  # five lifetimes: only renewals keep it
        assert w.server.core.reservation(ALICE.peer_id) is not None
        channel = await dial(w, ALICE.peer_id)
        await channel.aclose()


async def test_reservation_expires_without_renewal(autojump_clock: trio.testing.MockClock) -> None:
    limits = RelayLimits(reservation_ttl=20.0)
    async with world(limits) as w:
        stream = await w.host().connect_stream(w.relay.address)
        message = reserve_message(ALICE.identity, RELAY.peer_id, int(wall() * 1000))
        await stream.send_all(encode_message(message))
        await wait_until(lambda: w.server.core.reservation(ALICE.peer_id) is not None)
        await trio.sleep(21)
        assert w.server.core.reservation(ALICE.peer_id) is None
        assert await stream.receive_some(1024)  # the OK
        with trio.fail_after(1):
            assert await stream.receive_some(1024) == b""  # then the relay hung up


# --- limits ------------------------------------------------------------------------------


async def test_reservation_flood_refused_earlier_unaffected(
    autojump_clock: trio.testing.MockClock,
) -> None:
    limits = RelayLimits(max_reservations=3, max_reservations_per_ip=10)
    identities = [SecureIdentity(Identity(bytes([0x40 + i]) * 32)) for i in range(6)]
    async with world(limits) as w:
        holders = [w.host() for _ in identities]
        async with trio.open_nursery() as nursery:
            held: list[bool] = []
            refused: list[RelayRefusal] = []

            async def hold(host: SimHost, who: SecureIdentity) -> None:
                try:
                    async with reserve(host, w.relay, who.identity, wall_clock=wall):
                        held.append(True)
                        await trio.sleep_forever()
                except RelayRefusedError as exc:
                    refused.append(exc.reason)

            for host, who in zip(holders[:3], identities[:3], strict=True):
                before = len(held)
                nursery.start_soon(hold, host, who)
                await wait_until(lambda: len(held) > before)  # noqa: B023 (awaited here)
            for host, who in zip(holders[3:], identities[3:], strict=True):
                nursery.start_soon(hold, host, who)
            await wait_until(lambda: len(refused) == 3)
            assert refused == [RelayRefusal.RESERVATION_LIMIT] * 3
            assert w.server.statistics().refusals == {RelayRefusal.RESERVATION_LIMIT: 3}
            # The three earlier reservations still carry circuits.
            for who in identities[:3]:
                assert w.server.core.reservation(who.peer_id) is not None
            nursery.cancel_scope.cancel()


async def test_reservations_per_ip_limit(autojump_clock: trio.testing.MockClock) -> None:
    limits = RelayLimits(max_reservations_per_ip=2)
    identities = [Identity(bytes([0x50 + i]) * 32) for i in range(3)]
    async with world(limits) as w:
        host = w.host()  # one IP for all three
        async with reserve(host, w.relay, identities[0], wall_clock=wall):
            async with reserve(host, w.relay, identities[1], wall_clock=wall):
                with pytest.raises(RelayRefusedError) as caught:
                    async with reserve(host, w.relay, identities[2], wall_clock=wall):
                        pass
                assert caught.value.reason is RelayRefusal.RESERVATION_LIMIT
                assert caught.value.code is ErrorCode.RELAY_REFUSED
            # One released: room again on that IP.
            async with reserve(host, w.relay, identities[2], wall_clock=wall):
                assert w.server.statistics().reservations == 2


async def test_connect_without_reservation_refused(autojump_clock: trio.testing.MockClock) -> None:
    """A relay never dials a third party: CONNECT to a peer holding no reservation is
    refused NO_RESERVATION, and no stream leaves the relay's host."""
    async with world() as w:
        connects: list[object] = []
        original = w.relay_host.connect_stream

        async def spy(address: tuple[str, int]) -> trio.abc.Stream:
            connects.append(address)
            return await original(address)

        w.relay_host.connect_stream = spy  # type: ignore[method-assign]
        with pytest.raises(RelayRefusedError) as caught:
            await connect_via_relay(w.host(), w.relay, MALLORY.peer_id)
        assert caught.value.reason is RelayRefusal.NO_RESERVATION
        assert connects == []
        assert w.server.statistics().refusals == {RelayRefusal.NO_RESERVATION: 1}


async def test_connect_rate_limited_per_source(autojump_clock: trio.testing.MockClock) -> None:
    limits = RelayLimits(requests_per_ip=1.0, request_burst=3)
    async with world(limits) as w, alice_serving(w):
        noisy = w.host()
        reasons: list[RelayRefusal | None] = []
        for _ in range(5):
            try:
                stream = await connect_via_relay(noisy, w.relay, ALICE.peer_id)
                await stream.aclose()
                reasons.append(None)
            except RelayRefusedError as exc:
                reasons.append(exc.reason)
        assert reasons[:3] == [None, None, None]
        assert RelayRefusal.RATE_LIMITED in reasons[3:]
        # Another source is not affected, and the noisy one recovers with time.
        channel = await dial(w, ALICE.peer_id)
        await channel.aclose()
        await trio.sleep(3)
        stream = await connect_via_relay(noisy, w.relay, ALICE.peer_id)
        await stream.aclose()


async def test_circuits_per_reservation_limit(autojump_clock: trio.testing.MockClock) -> None:
    limits = RelayLimits(max_circuits_per_reservation=2)
    async with world(limits) as w, alice_serving(w):
        first, second = await dial(w, ALICE.peer_id), await dial(w, ALICE.peer_id)
        with pytest.raises(RelayRefusedError) as caught:
            await dial(w, ALICE.peer_id)
        assert caught.value.reason is RelayRefusal.CONNECTION_LIMIT
        await first.aclose()
        await wait_until(lambda: w.server.statistics().circuits == 1)
        third = await dial(w, ALICE.peer_id)
        await third.aclose()
        await second.aclose()


async def test_byte_budget_closes_circuit(autojump_clock: trio.testing.MockClock) -> None:
    limits = RelayLimits(circuit_data=100_000, circuit_rate=0)
    async with world(limits) as w, alice_serving(w):
        channel = await dial(w, ALICE.peer_id)
        await channel.send_message(b"x" * 10_000)
        assert await channel.receive_message() == b"x" * 10_000  # within the budget
        with pytest.raises(SecureChannelError) as caught:
            await exchange_until_closed(channel, b"y" * 10_000, 20, 0)  # 200 KB: twice the budget
        assert caught.value.code is ErrorCode.CHANNEL_CLOSED
        await wait_until(lambda: w.server.statistics().circuit_ends.get(CircuitEnd.DATA_LIMIT))


async def test_duration_closes_circuit(autojump_clock: trio.testing.MockClock) -> None:
    limits = RelayLimits(circuit_duration=30.0)
    async with world(limits) as w, alice_serving(w):
        channel = await dial(w, ALICE.peer_id)
        start = trio.current_time()
        with pytest.raises(SecureChannelError) as caught:
            await exchange_until_closed(channel, b"ping", 100, 1.0)  # a message a second
        assert caught.value.code is ErrorCode.CHANNEL_CLOSED
        assert 29 <= trio.current_time() - start <= 32
        assert w.server.statistics().circuit_ends.get(CircuitEnd.DURATION_LIMIT) == 1


async def test_rate_limit_paces_a_circuit(autojump_clock: trio.testing.MockClock) -> None:
    limits = RelayLimits(circuit_rate=100_000, circuit_burst=10_000)
    async with world(limits) as w, alice_serving(w):
        channel = await dial(w, ALICE.peer_id)
        start = trio.current_time()
        await channel.send_message(b"z" * 500_000)
        assert await channel.receive_message() == b"z" * 500_000
        # 500 KB each way at 100 KB/s per direction: about 5 s each way.
        assert trio.current_time() - start >= 9.0
        await channel.aclose()


async def test_pending_accept_timeout(autojump_clock: trio.testing.MockClock) -> None:
    """A target that holds a reservation but never answers INCOMING: the dialer is
    refused ACCEPT_TIMEOUT after pending_timeout, and the slot is freed."""
    limits = RelayLimits(pending_timeout=5.0)
    async with world(limits) as w:
        stream = await w.host().connect_stream(w.relay.address)
        message = reserve_message(ALICE.identity, RELAY.peer_id, int(wall() * 1000))
        await stream.send_all(encode_message(message))
        await wait_until(lambda: w.server.core.reservation(ALICE.peer_id) is not None)
        start = trio.current_time()
        with pytest.raises(RelayRefusedError) as caught:
            await connect_via_relay(w.host(), w.relay, ALICE.peer_id)
        assert caught.value.reason is RelayRefusal.ACCEPT_TIMEOUT
        assert 5.0 <= trio.current_time() - start <= 6.0
        assert w.server.statistics().circuits == 0
        await stream.aclose()


# --- hostile clients -----------------------------------------------------------------------


async def first_reply(w: World, data: bytes) -> bytes:
    """What the relay answers (until it hangs up) to a connection that sends ``data``."""
    stream = await w.host().connect_stream(w.relay.address)
    await stream.send_all(data)
    got = b""
    with trio.fail_after(30):
        for _ in range(10):  # bounded: the relay answers one frame, then hangs up
            chunk = await stream.receive_some(4096)
            if not chunk:
                break
            got += chunk
    await stream.aclose()
    return got


@pytest.mark.parametrize(
    "data",
    [
        b"\x00\x05hello",  # not msgpack
        b"\xff\xff" + b"x" * 100,  # a frame longer than allowed
        b"\x00\x00",  # an empty frame
        encode_message(Refused(RelayRefusal.OTHER)),  # a reply, not a request
        encode_message(Ok(1, 2, 3)),
        b"\x01X" + b"\x00" * 400,  # a Noise preamble and handshake sent by mistake
    ],
)
async def test_bad_first_frame_refused_malformed(
    data: bytes, autojump_clock: trio.testing.MockClock
) -> None:
    async with world() as w:
        reply = await first_reply(w, data)
        assert reply == encode_message(Refused(RelayRefusal.MALFORMED))
        assert w.server.statistics().refusals == {RelayRefusal.MALFORMED: 1}
        # The relay still serves.
        async with alice_serving(w):
            channel = await dial(w, ALICE.peer_id)
            await channel.aclose()


async def test_silent_client_dropped_after_control_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world(RelayLimits(control_timeout=5.0)) as w:
        start = trio.current_time()
        assert await first_reply(w, b"") == b""
        assert 5.0 <= trio.current_time() - start <= 6.0


async def test_target_not_reading_notices(autojump_clock: trio.testing.MockClock) -> None:
    """A target that never reads its control stream: dialers are refused (no pile-up
    of pending circuits), and the relay keeps serving others."""
    limits = RelayLimits(max_circuits_per_reservation=4, pending_timeout=5.0)
    async with world(limits) as w:
        stream = await w.host().connect_stream(w.relay.address)
        message = reserve_message(MALLORY.identity, RELAY.peer_id, int(wall() * 1000))
        await stream.send_all(encode_message(message))
        await wait_until(lambda: w.server.core.reservation(MALLORY.peer_id) is not None)
        reasons: list[RelayRefusal] = []

        async def try_dial() -> None:
            with pytest.raises(RelayRefusedError) as caught:
                await connect_via_relay(w.host(), w.relay, MALLORY.peer_id)
            reasons.append(caught.value.reason)

        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(try_dial)
        assert sorted(reasons) == sorted(
            [RelayRefusal.CONNECTION_LIMIT] * 2 + [RelayRefusal.ACCEPT_TIMEOUT] * 4
        )
        assert w.server.statistics().circuits == 0
        async with alice_serving(w):
            channel = await dial(w, ALICE.peer_id)
            await channel.aclose()
        await stream.aclose()


# --- the relay listener ---------------------------------------------------------------------


async def test_error_in_reservation_block_is_not_wrapped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with world() as w:
        with pytest.raises(KeyError):
            async with reserve(w.host(), w.relay, ALICE.identity, wall_clock=wall):
                raise KeyError("the caller's own")


async def test_relay_listener_reserves_again_after_relay_restart(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sim = SimNetwork(random.Random(5), default=LinkConditions(latency=0.01, jitter=0.0))
    relay_host = sim.add_host()
    relay = RelayAddress((relay_host.host, RELAY_PORT), RELAY.peer_id)
    listener = RelayListener(sim.add_host(), relay, ALICE.identity, wall_clock=wall, retry_max=4)
    assert listener.local_address == relay.address

    async def answer(count: int) -> None:
        for _ in range(count):
            stream = await listener.accept()
            async with await accept_secure(stream, ALICE) as channel:
                await channel.send_message(await channel.receive_message())

    async def dial_once() -> None:
        stream = await connect_via_relay(sim.add_host(), relay, ALICE.peer_id)
        async with await connect_secure(stream, BOB, expected_peer_id=ALICE.peer_id) as ch:
            await ch.send_message(b"ping")
            assert await ch.receive_message() == b"ping"

    async with trio.open_nursery() as nursery:
        await nursery.start(listener.keep)  # the relay is not up yet: it keeps trying
        nursery.start_soon(answer, 2)
        await trio.sleep(5)
        assert listener.reservation is None and listener.failure is not None
        for _ in range(2):  # the relay comes up, goes away, comes up again
            server = RelayServer(relay_host, RELAY.peer_id, wall_clock=wall)
            async with trio.open_nursery() as relay_nursery:
                await relay_nursery.start(server.serve, relay.address)
                await wait_until(partial(server.core.reservation, ALICE.peer_id))
                await dial_once()
                relay_nursery.cancel_scope.cancel()
            sim.kill(relay_host.host)  # break the streams the stopped relay left open
            await wait_until(lambda: listener.reservation is None)
            sim.revive(relay_host.host)
        await listener.aclose()
        with pytest.raises(trio.ClosedResourceError):
            await listener.accept()
        nursery.cancel_scope.cancel()
