"""Hostile peers against the trio channel: every case ends in a RemoteError and a closed
stream within the configured timeout (trio's virtual clock), never a hang or a stray exception.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode, RemoteError
from p2pnode.core.identity import Identity
from p2pnode.transport.channel import (
    ChannelConfig,
    ChannelState,
    SecureChannel,
    accept_secure,
    connect_secure,
)
from p2pnode.transport.framing import TransportCodec
from p2pnode.transport.secure import HandshakeStage, SecureHandshake, SecureIdentity

VICTIM = SecureIdentity(Identity(b"\x44" * 32))
ATTACKER = SecureIdentity(Identity(b"\x55" * 32))
CONFIG = ChannelConfig(
    handshake_timeout=5.0, frame_timeout=3.0, idle_timeout=60.0, max_message_size=10_000
)
CASES = settings(max_examples=25, deadline=None)


def run_virtual(scenario: Callable[[], Awaitable[None]]) -> None:
    """Run ``scenario`` on trio's virtual clock, jumping over idle time."""
    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))


async def assert_closed(stream: trio.abc.Stream) -> None:
    """The victim closed the connection: the attacker reads to EOF (bounded)."""
    try:
        for _ in range(100):
            if not await stream.receive_some(65536):
                return
    except trio.ClosedResourceError:
        return  # the attacker hung up itself
    raise AssertionError("stream never closed")


Script = Callable[[trio.abc.Stream], Awaitable[None]]


async def _run_attacker(script: Script, stream: trio.abc.Stream) -> None:
    try:
        await script(stream)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # the victim hung up on us: expected


async def accept_expecting_failure(script: Script, *, check_closed: bool = True) -> RemoteError:
    """Run ``script`` as the initiating peer; the victim's accept must fail in time."""
    victim_stream, attacker_stream = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        nursery.start_soon(_run_attacker, script, attacker_stream)
        try:
            await accept_secure(victim_stream, VICTIM, config=CONFIG)
        except RemoteError as exc:
            failure = exc
        else:
            raise AssertionError("the handshake must fail")
        assert trio.current_time() - start <= CONFIG.handshake_timeout + 1e-6
        if check_closed:
            await assert_closed(attacker_stream)
        nursery.cancel_scope.cancel()
    return failure


async def attacker_handshake(stream: trio.abc.Stream) -> TransportCodec:
    """A well-behaved initiator handshake (sans-IO) so the attacker can craft frames."""
    hs = SecureHandshake(ATTACKER, initiator=True, now=trio.current_time(), timeout=100.0)
    await stream.send_all(hs.data_to_send())
    while hs.stage is not HandshakeStage.DONE:
        hs.receive_data_untrusted(await stream.receive_some(65536), trio.current_time())
        out = hs.data_to_send()
        if out:
            await stream.send_all(out)
    return TransportCodec(hs.result().transport, now=trio.current_time())


async def transport_expecting_failure(
    script: Callable[[trio.abc.Stream, TransportCodec], Awaitable[None]], within: float
) -> RemoteError:
    """Handshake honestly, then run ``script``; the victim must fail within ``within`` s."""
    victim_stream, attacker_stream = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as nursery:
        accepted: list[SecureChannel] = []

        async def accept() -> None:
            accepted.append(await accept_secure(victim_stream, VICTIM, config=CONFIG))

        nursery.start_soon(accept)
        codec = await attacker_handshake(attacker_stream)
        await trio.testing.wait_all_tasks_blocked()
        channel = accepted[0]
        assert channel.remote_peer_id == ATTACKER.peer_id

        async def attack(stream: trio.abc.Stream) -> None:
            await script(stream, codec)

        start = trio.current_time()
        nursery.start_soon(_run_attacker, attack, attacker_stream)
        try:
            for _ in range(1000):
                await channel.receive_message()
        except RemoteError as exc:
            failure = exc
        else:
            raise AssertionError("the channel must fail")
        assert trio.current_time() - start <= within + 1e-6
        assert channel.state is ChannelState.BROKEN
        await assert_closed(attacker_stream)
        nursery.cancel_scope.cancel()
    return failure


@CASES
@given(st.binary(min_size=1, max_size=300))
def test_garbage_before_handshake(junk: bytes) -> None:
    async def scenario() -> None:
        async def script(stream: trio.abc.Stream) -> None:
            await stream.send_all(junk)

        exc = await accept_expecting_failure(script)
        assert exc.code in {
            ErrorCode.PROTOCOL_VERSION_MISMATCH,
            ErrorCode.HANDSHAKE_FAILED,
            ErrorCode.MESSAGE_TOO_LARGE,
            ErrorCode.TIMEOUT,  # a valid-looking prefix, then silence
        }

    run_virtual(scenario)


@CASES
@given(st.binary(min_size=2, max_size=2).filter(lambda b: b not in (b"\x01X", b"\x01I")))
def test_wrong_pattern_or_version_gets_reject_record(preamble: bytes) -> None:
    async def scenario() -> None:
        async def script(stream: trio.abc.Stream) -> None:
            await stream.send_all(preamble)
            assert await stream.receive_some(10) == b"\x00\x00\x01"
            assert await stream.receive_some(10) == b""  # then the victim hangs up

        exc = await accept_expecting_failure(script, check_closed=False)
        assert exc.code in {ErrorCode.PROTOCOL_VERSION_MISMATCH, ErrorCode.HANDSHAKE_FAILED}

    run_virtual(scenario)


@CASES
@given(st.booleans(), st.integers(0, 200), st.booleans())
def test_peer_stalls_or_hangs_up_mid_handshake(ik: bool, cut: int, hang_up: bool) -> None:
    async def scenario() -> None:
        hs = SecureHandshake(
            ATTACKER,
            initiator=True,
            now=0.0,
            timeout=100.0,
            remote_static=VICTIM.static_public if ik else None,
        )
        first = hs.data_to_send()
        position = min(cut, len(first) - 1)

        async def script(stream: trio.abc.Stream) -> None:
            await stream.send_all(first[:position])
            if hang_up:
                await stream.aclose()
            else:
                await trio.sleep_forever()

        exc = await accept_expecting_failure(script)
        if hang_up:
            assert exc.code is ErrorCode.HANDSHAKE_FAILED
        else:
            assert exc.code is ErrorCode.TIMEOUT

    run_virtual(scenario)


def test_one_byte_a_second_during_handshake() -> None:
    async def scenario() -> None:
        hs = SecureHandshake(ATTACKER, initiator=True, now=0.0, timeout=100.0)
        first = hs.data_to_send()

        async def script(stream: trio.abc.Stream) -> None:
            for byte in first:
                await stream.send_all(bytes([byte]))
                await trio.sleep(1.0)

        exc = await accept_expecting_failure(script)
        assert exc.code is ErrorCode.TIMEOUT

    run_virtual(scenario)


def test_malicious_responder_garbage() -> None:
    async def scenario() -> None:
        client_stream, attacker = trio.testing.memory_stream_pair()
        start = trio.current_time()
        async with trio.open_nursery() as nursery:

            async def respond() -> None:
                await attacker.receive_some(1000)
                await attacker.send_all(b"\x00\x05hello")

            nursery.start_soon(respond)
            try:
                await connect_secure(client_stream, VICTIM, config=CONFIG)
            except RemoteError as exc:
                assert exc.code is ErrorCode.HANDSHAKE_FAILED
            else:
                raise AssertionError("handshake must fail")
            await assert_closed(attacker)
        assert trio.current_time() - start < 1.0

    run_virtual(scenario)


@CASES
@given(st.lists(st.binary(max_size=100), min_size=1, max_size=4), st.data())
def test_bad_mac(messages: list[bytes], data: st.DataObject) -> None:
    async def scenario() -> None:
        async def script(stream: trio.abc.Stream, codec: TransportCodec) -> None:
            wire = bytearray(codec.encode_many(messages))
            pos = data.draw(st.integers(2, len(wire) - 1))
            wire[pos] ^= 1 << data.draw(st.integers(0, 7))
            await stream.send_all(bytes(wire))

        exc = await transport_expecting_failure(script, within=0.0)
        assert exc.code is ErrorCode.DECRYPT_FAILED

    run_virtual(scenario)


@CASES
@given(st.binary(max_size=2000), st.data())
def test_truncated_frame_then_eof(message: bytes, data: st.DataObject) -> None:
    async def scenario() -> None:
        async def script(stream: trio.abc.Stream, codec: TransportCodec) -> None:
            wire = bytes(codec.encode(message))
            await stream.send_all(wire[: data.draw(st.integers(1, len(wire) - 1))])
            await stream.aclose()

        exc = await transport_expecting_failure(script, within=0.0)
        assert exc.code is ErrorCode.MALFORMED_MESSAGE

    run_virtual(scenario)


@CASES
@given(st.integers(CONFIG.max_message_size + 1, 2**32 - 1))
def test_frame_announcing_too_much(size: int) -> None:
    async def scenario() -> None:
        async def script(stream: trio.abc.Stream, codec: TransportCodec) -> None:
            # An authentic frame whose record header claims ``size`` bytes.
            header = size.to_bytes(4, "big") + b"tail"
            frame = bytearray(2 + len(header) + 16)
            frame[2 : 2 + len(header)] = header
            codec._seal(bytes(12), frame, 0, len(header))  # nonce 0: the first frame
            await stream.send_all(bytes(frame))

        exc = await transport_expecting_failure(script, within=0.0)
        assert exc.code is ErrorCode.MESSAGE_TOO_LARGE

    run_virtual(scenario)


@CASES
@given(st.binary(min_size=1, max_size=500), st.sampled_from([0.5, 1.0, 2.0]))
def test_one_byte_a_second_after_handshake(message: bytes, interval: float) -> None:
    async def scenario() -> None:
        async def script(stream: trio.abc.Stream, codec: TransportCodec) -> None:
            wire = bytes(codec.encode(message))
            for byte in wire:
                await stream.send_all(bytes([byte]))
                await trio.sleep(interval)

        exc = await transport_expecting_failure(script, within=CONFIG.frame_timeout)
        assert exc.code is ErrorCode.TIMEOUT

    run_virtual(scenario)


@CASES
@given(st.binary(min_size=1, max_size=200))
def test_random_bytes_after_handshake(junk: bytes) -> None:
    async def scenario() -> None:
        async def script(stream: trio.abc.Stream, codec: TransportCodec) -> None:
            await stream.send_all(junk)
            await stream.aclose()

        exc = await transport_expecting_failure(script, within=0.0)
        assert exc.code in {
            ErrorCode.DECRYPT_FAILED,
            ErrorCode.MALFORMED_MESSAGE,
        }

    run_virtual(scenario)


def test_silent_peer_after_handshake_hits_idle_timeout() -> None:
    async def scenario() -> None:
        async def script(stream: trio.abc.Stream, codec: TransportCodec) -> None:
            await trio.sleep_forever()

        assert CONFIG.idle_timeout is not None
        exc = await transport_expecting_failure(script, within=CONFIG.idle_timeout)
        assert exc.code is ErrorCode.TIMEOUT

    run_virtual(scenario)


def test_reject_record_to_a_peer_that_already_left() -> None:
    async def scenario() -> None:
        async def script(stream: trio.abc.Stream) -> None:
            await stream.send_all(b"\x07X")
            await stream.aclose()

        exc = await accept_expecting_failure(script)
        assert exc.code is ErrorCode.PROTOCOL_VERSION_MISMATCH

    run_virtual(scenario)
