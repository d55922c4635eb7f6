"""SecureChannel over trio streams: memory pairs, lockstep, real TCP; concurrency; limits."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
import trio.testing

from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.identity import Identity
from p2pnode.transport.channel import (
    DEFAULT_CONFIG,
    ChannelConfig,
    ChannelState,
    SecureChannel,
    accept_secure,
    connect_secure,
)
from p2pnode.transport.secure import SecureChannelError, SecureIdentity

ALICE = SecureIdentity(Identity(b"\x11" * 32))
BOB = SecureIdentity(Identity(b"\x22" * 32))
MALLORY = SecureIdentity(Identity(b"\x33" * 32))

StreamPair = Callable[[], tuple[trio.abc.Stream, trio.abc.Stream]]


async def open_pair(
    make: StreamPair = trio.testing.memory_stream_pair,
    *,
    ik: bool = False,
    client_config: ChannelConfig = DEFAULT_CONFIG,
    server_config: ChannelConfig = DEFAULT_CONFIG,
) -> tuple[SecureChannel, SecureChannel]:
    left, right = make()
    return await handshake_over(
        left, right, ik=ik, client_config=client_config, server_config=server_config
    )


async def handshake_over(
    left: trio.abc.Stream,
    right: trio.abc.Stream,
    *,
    ik: bool = False,
    server: SecureIdentity = BOB,
    client_config: ChannelConfig = DEFAULT_CONFIG,
    server_config: ChannelConfig = DEFAULT_CONFIG,
) -> tuple[SecureChannel, SecureChannel]:
    """Both handshakes; raises the client's error if it fails, else the server's."""
    accepted: list[SecureChannel] = []
    errors: list[RemoteError] = []

    async def accept() -> None:
        try:
            accepted.append(await accept_secure(right, server, config=server_config))
        except RemoteError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept)
        try:
            client = await connect_secure(
                left,
                ALICE,
                expected_peer_id=BOB.peer_id,
                remote_static=server.static_public if ik else None,
                config=client_config,
            )
        except RemoteError as exc:
            errors.insert(0, exc)
    if errors:
        raise errors[0]
    return client, accepted[0]


@pytest.mark.parametrize("ik", [False, True])
@pytest.mark.parametrize(
    "make", [trio.testing.memory_stream_pair, trio.testing.lockstep_stream_pair]
)
async def test_channel_both_patterns(ik: bool, make: StreamPair) -> None:
    client, server = await open_pair(make, ik=ik)
    assert client.remote_peer_id == BOB.peer_id
    assert server.remote_peer_id == ALICE.peer_id
    assert client.remote_public_key == BOB.identity.public_key
    assert server.remote_static == ALICE.static_public
    assert client.handshake_hash == server.handshake_hash
    assert client.pattern == server.pattern == ("IK" if ik else "XX")
    big = bytes(range(256)) * 1000

    async def chat() -> None:
        await client.send_message(b"hello")
        await client.send_message(big)
        await client.send_message(b"")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(chat)
        assert await server.receive_message() == b"hello"
        assert await server.receive_message() == big
        assert await server.receive_message() == b""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.send_message, b"back")
        assert await client.receive_message() == b"back"
    await client.aclose()
    with pytest.raises(SecureChannelError) as info:
        await server.receive_message()
    assert info.value.code is ErrorCode.CHANNEL_CLOSED
    assert server.state is ChannelState.BROKEN


@pytest.mark.slow
async def test_real_tcp() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        results: list[SecureChannel] = []

        async def serve() -> None:
            stream = await listeners[0].accept()
            channel = await accept_secure(stream, BOB)
            results.append(channel)
            for _ in range(3):
                await channel.send_message(await channel.receive_message())

        nursery.start_soon(serve)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with await connect_secure(stream, ALICE, expected_peer_id=BOB.peer_id) as client:
            for message in (b"a", b"b" * 200000, b"c"):
                await client.send_message(message)
                assert await client.receive_message() == message
        await results[0].aclose()
    await listeners[0].aclose()


async def test_man_in_the_middle_is_peer_id_mismatch() -> None:
    # Alice dials Bob's address; Mallory answers with her own valid identity.
    left, right = trio.testing.memory_stream_pair()
    with pytest.raises(SecureChannelError) as info:
        await handshake_over(left, right, server=MALLORY)
    assert info.value.code is ErrorCode.PEER_ID_MISMATCH
    assert isinstance(info.value, RemoteError)
    with pytest.raises(trio.ClosedResourceError):
        await left.send_all(b"x")  # Alice closed her side


async def test_man_in_the_middle_with_known_static_key() -> None:
    # IK to Bob's published key while Mallory answers: she cannot complete the handshake.
    left, right = trio.testing.memory_stream_pair()
    accepted: list[BaseException] = []

    async def accept() -> None:
        try:
            await accept_secure(right, MALLORY)
        except RemoteError as exc:
            accepted.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept)
        with pytest.raises(SecureChannelError) as info:
            await connect_secure(
                left, ALICE, expected_peer_id=BOB.peer_id, remote_static=BOB.static_public
            )
    assert info.value.code is ErrorCode.HANDSHAKE_FAILED  # Mallory closed on her side
    assert isinstance(accepted[0], SecureChannelError)
    assert accepted[0].code is ErrorCode.HANDSHAKE_FAILED  # she could not decrypt msg 1


async def test_concurrent_senders_never_interleave() -> None:
    client, server = await open_pair(trio.testing.lockstep_stream_pair)
    senders, per = 5, 20

    def message(sender: int, i: int) -> bytes:
        size = 70000 if i % 7 == 0 else 50 + i
        return bytes([sender, i]) + bytes([sender]) * size

    async def send(sender: int) -> None:
        for i in range(per):
            await client.send_message(message(sender, i))

    async with trio.open_nursery() as nursery:
        for s in range(senders):
            nursery.start_soon(send, s)
        seen = {s: 0 for s in range(senders)}
        for _ in range(senders * per):
            got = await server.receive_message()
            sender, i = got[0], got[1]
            assert got == message(sender, i)  # intact
            assert i == seen[sender]  # in order per sender
            seen[sender] += 1
    stats = client.statistics()
    assert stats.messages_sent == senders * per
    assert stats.writes < senders * per  # queued messages rode along with others


async def test_send_many_and_nowait_coalesce() -> None:
    client, server = await open_pair()
    await client.send_many([b"1", b"2", b"3"])
    assert client.statistics().writes == 1
    client.send_message_nowait(b"4")
    client.send_message_nowait(b"5")
    assert client.statistics().pending_send_bytes == 2
    await client.flush()
    assert client.statistics().writes == 2
    for expected in (b"1", b"2", b"3", b"4", b"5"):
        assert await server.receive_message() == expected
    small = await open_pair(client_config=ChannelConfig(max_pending_bytes=10))
    small[0].send_message_nowait(b"x" * 10)
    with pytest.raises(trio.WouldBlock):
        small[0].send_message_nowait(b"y")


async def test_concurrent_receivers_are_busy() -> None:
    client, server = await open_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.receive_message)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await server.receive_message()
        await client.send_message(b"unblock")


async def test_too_large_send_is_local_and_harmless() -> None:
    config = ChannelConfig(max_message_size=1000)
    client, server = await open_pair(client_config=config)
    with pytest.raises(LocalError) as info:
        await client.send_message(b"x" * 1001)
    assert info.value.code is ErrorCode.MESSAGE_TOO_LARGE
    with pytest.raises(LocalError):
        client.send_message_nowait(b"x" * 1001)
    with pytest.raises(LocalError):
        await client.send_many([b"ok", b"x" * 1001])
    assert client.state is ChannelState.OPEN
    await client.send_message(b"x" * 1000)
    assert await server.receive_message() == b"x" * 1000


async def test_peer_announcing_too_much_gets_closed() -> None:
    client, server = await open_pair(server_config=ChannelConfig(max_message_size=1000))
    await client.send_message(b"x" * 5000)
    with pytest.raises(SecureChannelError) as info:
        await server.receive_message()
    assert info.value.code is ErrorCode.MESSAGE_TOO_LARGE
    assert server.state is ChannelState.BROKEN
    with pytest.raises(SecureChannelError) as info:
        await server.receive_message()
    assert info.value.code is ErrorCode.CHANNEL_CLOSED
    with pytest.raises(SecureChannelError):
        await client.receive_message()  # the peer sees the connection go away


async def test_closed_channel_raises_closed_resource() -> None:
    client, _ = await open_pair()
    await client.aclose()
    await client.aclose()  # idempotent
    with pytest.raises(trio.ClosedResourceError):
        await client.send_message(b"x")
    with pytest.raises(trio.ClosedResourceError):
        await client.receive_message()


async def test_send_to_vanished_peer_is_channel_closed() -> None:
    client, server = await open_pair()
    await server.aclose()
    with pytest.raises(SecureChannelError) as info:
        await client.send_message(b"x")
    assert info.value.code is ErrorCode.CHANNEL_CLOSED
    assert client.state is ChannelState.BROKEN


async def test_idle_timeout(autojump_clock: trio.testing.MockClock) -> None:
    config = ChannelConfig(idle_timeout=30.0)
    _client, server = await open_pair(server_config=config)
    start = trio.current_time()
    with pytest.raises(SecureChannelError) as info:
        await server.receive_message()
    assert info.value.code is ErrorCode.TIMEOUT
    assert trio.current_time() - start == pytest.approx(30.0)
    assert server.state is ChannelState.BROKEN


async def test_cancelled_receive_loses_nothing(autojump_clock: trio.testing.MockClock) -> None:
    client, server = await open_pair()
    with trio.move_on_after(1.0):
        await server.receive_message()
    await client.send_message(b"after")
    assert await server.receive_message() == b"after"


async def test_config_validation() -> None:
    with pytest.raises(LocalError):
        ChannelConfig(handshake_timeout=0)
    with pytest.raises(LocalError):
        ChannelConfig(idle_timeout=0)
    with pytest.raises(LocalError):
        ChannelConfig(max_pending_bytes=-1)


def test_repr_names_the_peer() -> None:
    async def main() -> str:
        client, _ = await open_pair()
        return repr(client)

    assert str(BOB.peer_id) in trio.run(main)


async def _relay(src: trio.abc.Stream, dst: trio.abc.Stream, flip_at: int | None) -> None:
    """Forward bytes, optionally flipping one bit at absolute offset ``flip_at``."""
    seen = 0
    try:
        while data := await src.receive_some(65536):
            if flip_at is not None and seen <= flip_at < seen + len(data):
                tampered = bytearray(data)
                tampered[flip_at - seen] ^= 0x01
                data = bytes(tampered)
            seen += len(data)
            await dst.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await dst.aclose()


@pytest.mark.parametrize("flip_at", [None, 1, 3, 40, 100])
async def test_on_path_relay_sees_nothing_and_cannot_tamper(
    flip_at: int | None, autojump_clock: trio.testing.MockClock
) -> None:
    # Alice <-> relay <-> Bob. A transparent relay changes nothing (and sees
    # only ciphertext); a relay flipping any bit of Alice's side breaks the handshake.
    alice, relay_a = trio.testing.memory_stream_pair()
    relay_b, bob = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_relay, relay_a, relay_b, flip_at)
        nursery.start_soon(_relay, relay_b, relay_a, None)
        try:
            client, server = await handshake_over(alice, bob)
        except RemoteError as exc:
            assert flip_at is not None
            assert exc.code in {
                ErrorCode.HANDSHAKE_FAILED,
                ErrorCode.PROTOCOL_VERSION_MISMATCH,
                ErrorCode.MESSAGE_TOO_LARGE,
                ErrorCode.TIMEOUT,  # a longer length byte: waiting for bytes never sent
            }
        else:
            assert flip_at is None
            assert client.remote_peer_id == BOB.peer_id
            assert server.remote_peer_id == ALICE.peer_id
            await client.aclose()
            await server.aclose()
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_terminating_man_in_the_middle_over_tcp() -> None:
    # Mallory terminates Alice's connection with her own identity and dials Bob herself.
    bob_listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    mallory_listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    bob_port = bob_listener.socket.getsockname()[1]
    mallory_port = mallory_listener.socket.getsockname()[1]

    async def bob_serves() -> None:
        with trio.move_on_after(5):
            channel = await accept_secure(await bob_listener.accept(), BOB)
            await channel.aclose()

    async def mallory_intercepts() -> None:
        stream = await mallory_listener.accept()
        upstream = await connect_secure(await trio.open_tcp_stream("127.0.0.1", bob_port), MALLORY)
        assert upstream.remote_peer_id == BOB.peer_id
        try:
            await accept_secure(stream, MALLORY)
        except RemoteError:
            pass  # Alice hangs up on her
        await upstream.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(bob_serves)
        nursery.start_soon(mallory_intercepts)
        stream = await trio.open_tcp_stream("127.0.0.1", mallory_port)  # Alice was misrouted
        with pytest.raises(SecureChannelError) as info:
            await connect_secure(stream, ALICE, expected_peer_id=BOB.peer_id)
        assert info.value.code is ErrorCode.PEER_ID_MISMATCH
        assert info.value.details["actual"] == str(MALLORY.peer_id)
    await bob_listener.aclose()
    await mallory_listener.aclose()


async def test_queued_senders_all_fail_when_the_write_fails(
    autojump_clock: trio.testing.MockClock,
) -> None:
    client, server = await open_pair(trio.testing.lockstep_stream_pair)
    outcomes: list[str] = []

    async def send(i: int) -> None:
        try:
            await client.send_message(bytes([i]) * 1000)
            outcomes.append("sent")
        except SecureChannelError as exc:
            assert exc.code is ErrorCode.CHANNEL_CLOSED
            outcomes.append("failed")

    with trio.fail_after(5):  # nobody may hang
        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(send, i)
            await trio.testing.wait_all_tasks_blocked()  # one writes, five are queued
            await server.aclose()
    assert outcomes == ["failed"] * 6
    assert client.state is ChannelState.BROKEN


async def test_flush_waits_for_the_batch_in_flight() -> None:
    client, server = await open_pair(trio.testing.lockstep_stream_pair)
    received: list[bytes] = []

    async def reader() -> None:
        for _ in range(3):
            received.append(await server.receive_message())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.send_message, b"first")
        await trio.testing.wait_all_tasks_blocked()  # "first" is being written
        client.send_message_nowait(b"second")
        client.send_message_nowait(b"third")
        nursery.start_soon(reader)
        await client.flush()
        assert client.statistics().pending_send_bytes == 0
    assert received == [b"first", b"second", b"third"]


async def test_local_close_wakes_queued_senders_with_closed_resource(
    autojump_clock: trio.testing.MockClock,
) -> None:
    client, _server = await open_pair(trio.testing.lockstep_stream_pair)
    outcomes: list[type[BaseException]] = []

    async def send() -> None:
        try:
            await client.send_message(b"x" * 1000)
        except (trio.ClosedResourceError, SecureChannelError) as exc:
            outcomes.append(type(exc))

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(send)
            await trio.testing.wait_all_tasks_blocked()
            await client.aclose()
    assert outcomes == [trio.ClosedResourceError] * 3
