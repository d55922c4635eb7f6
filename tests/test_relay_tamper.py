"""A relay that flips, drops or reorders relayed bytes cannot slip anything past the
end-to-end secure channel: the handshake fails or the receiver's AEAD check does,
with a typed error, and no altered message is ever delivered (simulator)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from p2pnode.core.errors import ErrorCode, RemoteError
from p2pnode.core.identity import Identity
from p2pnode.simnet import LinkConditions, SimNetwork
from p2pnode.transport.channel import accept_secure, connect_secure
from p2pnode.transport.net import Address, StreamListener
from p2pnode.transport.relay import Connect, RelayAddress, encode_message
from p2pnode.transport.relayserve import RelayServer, connect_via_relay, reserve
from p2pnode.transport.secure import SecureChannelError, SecureIdentity
from tests.sim.waiting import wait_until

RELAY = Identity(b"\x30" * 32)
ALICE = SecureIdentity(Identity(b"\x31" * 32))
BOB = SecureIdentity(Identity(b"\x32" * 32))
#: Length of the CONNECT frame the dialer sends first (the tampering starts after it).
CONNECT_LEN = len(encode_message(Connect(ALICE.peer_id)))

class TamperingStream(trio.abc.Stream):
    """The relay's side of the dialer's connection, altering what the relay reads at
    stream offset ``at`` and beyond: ``mode`` flip, drop (16 bytes) or swap (two
    adjacent 32-byte blocks)."""

    def __init__(self, inner: trio.abc.Stream, mode: str, at: int) -> None:
        self._inner, self._mode, self._at = inner, mode, at
        self._seen = 0  # bytes read from the dialer so far
        self._held = bytearray()  # bytes from offset ``at`` on, while a swap needs more
        self._done = False
        self._dialer: bool | None = None

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        for _ in range(1000):  # bounded: each pass reads from the inner stream
            data = bytes(await self._inner.receive_some(max_bytes))
            if self._dialer is None:
                self._dialer = b"connect" in data
            if not data or not self._dialer or self._done:
                return data
            out = self._alter(data)
            if out:
                return out
        raise AssertionError("tampering stream read too long")

    def _alter(self, data: bytes) -> bytes:
        start, self._seen = self._seen, self._seen + len(data)
        if self._seen <= self._at:
            return data
        cut = self._at - start
        head, tail = data[: max(cut, 0)], bytearray(data[max(cut, 0) :])
        if self._mode == "flip":
            tail[0] ^= 0x40
        elif self._mode == "drop":
            self._held += tail
            if len(self._held) < 16:
                return head
            tail, self._held = self._held[16:], bytearray()
        else:  # swap
            self._held += tail
            if len(self._held) < 64:
                return head
            held, self._held = self._held, bytearray()
            tail = held[32:64] + held[:32] + held[64:]
        self._done = True
        return head + bytes(tail)

    async def aclose(self) -> None:
        await self._inner.aclose()


class TamperingListener(StreamListener):
    def __init__(self, inner: StreamListener, mode: str, at: int) -> None:
        self._inner, self._mode, self._at = inner, mode, at

    @property
    def local_address(self) -> Address:
        return self._inner.local_address

    async def accept(self) -> trio.abc.Stream:
        return TamperingStream(await self._inner.accept(), self._mode, self._at)

    async def aclose(self) -> None:
        await self._inner.aclose()


def wall() -> float:
    return 1.75e9 + trio.current_time()


@asynccontextmanager
async def tampering_world(mode: str, at: int) -> AsyncIterator[tuple[SimNetwork, RelayAddress]]:
    sim = SimNetwork(random.Random(3), default=LinkConditions(latency=0.01, jitter=0.0))
    host = sim.add_host()
    listener = TamperingListener(await host.listen_stream((host.host, 4100)), mode, at)
    server = RelayServer(host, RELAY.peer_id, wall_clock=wall)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(server.serve_listener, listener)
        yield sim, RelayAddress(address, RELAY.peer_id)
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def alice(
    sim: SimNetwork, relay: RelayAddress, received: list[bytes], errors: list[ErrorCode]
) -> AsyncIterator[None]:
    """Alice accepts relayed channels, records each message and each typed error."""
    async with reserve(sim.add_host(), relay, ALICE.identity, wall_clock=wall) as reservation:

        async def serve() -> None:
            stream = await reservation.accept()
            try:
                async with await accept_secure(stream, ALICE) as channel:
                    for _ in range(10):  # bounded: the test sends at most 3 messages
                        received.append(await channel.receive_message())
            except RemoteError as exc:
                errors.append(exc.code)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            yield
            nursery.cancel_scope.cancel()


MESSAGES = [random.Random(i).randbytes(6000) for i in range(3)]


@pytest.mark.parametrize("mode", ["flip", "drop", "swap"])
async def test_tampered_transport_bytes_are_detected(
    mode: str, autojump_clock: trio.testing.MockClock
) -> None:
    """Past the handshake (well inside the first message): the receiver's AEAD check
    fails, the channel closes with a typed error, and nothing altered is delivered."""
    received: list[bytes] = []
    errors: list[ErrorCode] = []
    async with (
        tampering_world(mode, CONNECT_LEN + 3000) as (sim, relay),
        alice(sim, relay, received, errors),
    ):
        stream = await connect_via_relay(sim.add_host(), relay, ALICE.peer_id)
        channel = await connect_secure(stream, BOB, expected_peer_id=ALICE.peer_id)
        try:
            for message in MESSAGES:
                await channel.send_message(message)
        except SecureChannelError:
            pass  # Alice hung up: fine, she detected it
        await wait_until(lambda: errors, timeout=60)
    assert errors[0] in {ErrorCode.DECRYPT_FAILED, ErrorCode.MESSAGE_TOO_LARGE}
    assert all(m in MESSAGES for m in received)  # intact messages only (none here)
    assert received == []


@pytest.mark.parametrize("mode", ["flip", "drop", "swap"])
async def test_tampered_handshake_fails(mode: str, autojump_clock: trio.testing.MockClock) -> None:
    """Inside the dialer's first handshake message: no channel is established."""
    received: list[bytes] = []
    errors: list[ErrorCode] = []
    async with (
        tampering_world(mode, CONNECT_LEN + 4) as (sim, relay),
        alice(sim, relay, received, errors),
    ):
        stream = await connect_via_relay(sim.add_host(), relay, ALICE.peer_id)
        with pytest.raises(SecureChannelError) as caught:
            await connect_secure(stream, BOB, expected_peer_id=ALICE.peer_id)
    assert caught.value.code in {
        ErrorCode.DECRYPT_FAILED,
        ErrorCode.HANDSHAKE_FAILED,
        ErrorCode.TIMEOUT,
    }
    assert received == []


async def test_untouched_relay_delivers(autojump_clock: trio.testing.MockClock) -> None:
    """The control case: the same wrapper with its offset beyond the traffic alters
    nothing, and every message arrives."""
    received: list[bytes] = []
    errors: list[ErrorCode] = []
    async with (
        tampering_world("flip", 10**9) as (sim, relay),
        alice(sim, relay, received, errors),
    ):
        stream = await connect_via_relay(sim.add_host(), relay, ALICE.peer_id)
        channel = await connect_secure(stream, BOB, expected_peer_id=ALICE.peer_id)
        for message in MESSAGES:
            await channel.send_message(message)
        await wait_until(lambda: len(received) == 3)
    assert received == MESSAGES and errors == []
