"""Failure boundaries of a node in the simulator: what one frame, one looked-up DHT value,
one control request or one failed accept raises ends only that input."""

from __future__ import annotations

import errno
import json
import logging
import random
from pathlib import Path
from typing import Any

import msgpack
import pytest
import trio
import trio.testing

from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.identity import Identity
from p2pnode.core.wire import pack
from p2pnode.dht.records import (
    ProviderInfo,
    RecordKind,
    SignedRecord,
    capability_key,
    card_key,
)
from p2pnode.node.control import ControlServer, control_call
from p2pnode.node.frames import FrameKind, encode_hello
from p2pnode.node.observability import EventKind
from p2pnode.transport.net import Address, StreamListener
from tests.sim import (
    Inbox,
    dht_swarm,
    make_card,
    swarm,
    victim_honest_evil,
    virtual_ms,
    wait_until,
)

# The minimal poison cards found by fuzzing: endpoints whose transport is a list.
POISON_CARD = bytes.fromhex("81a9656e64706f696e74739181a97472616e73706f727490")
POISON_HELLO = bytes.fromhex(
    "920081a5636172647391c41881a9656e64706f696e74739181a97472616e73706f727480"
)


def mixed_key_card(owner: Identity) -> bytes:
    """A signed card's bytes with unknown capability keys of two types (bytes and str)."""
    plain = msgpack.unpackb(make_card(owner, ["x.y"]).to_bytes(), raw=False)
    plain["capabilities"][0].update({b"k": 1, "z": 2})
    return bytes(msgpack.packb(plain, use_bin_type=True))


def security_from(node: Any, peer: str) -> list[Any]:
    return [e for e in node.events.recent(kind=EventKind.SECURITY) if e.peer == peer]


async def test_poisoned_hellos_end_only_themselves(autojump_clock: Any) -> None:
    async with victim_honest_evil("europa", 3) as (victim, honest, evil, _):
        link = evil.links.link(victim.peer_id)
        evil_mixed = pack([FrameKind.HELLO, {"cards": [mixed_key_card(evil.identity)]}])
        for frame in (POISON_HELLO, evil_mixed, encode_hello([], ["not an address"])):
            await link.send(frame)
        await wait_until(lambda: len(security_from(victim, str(evil.peer_id))) >= 2)
        # The node still serves everyone, the sender of the poison included.
        assert (await honest.request("europa", "io", "hi")).payload == {"echo": "hi"}
        assert (await evil.request("mallory", "io", "me too")).payload == {"echo": "me too"}
        assert victim.status()["metrics"]["securityEvents"] >= 2


async def test_a_failing_interceptor_ends_only_its_envelope(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(source: Any, target: str, envelope: Envelope) -> None:
        raise TypeError("a defect in a protocol service")

    async with victim_honest_evil("europa", 3) as (victim, _, evil, inbox):
        victim.intercept_stream("poison", broken)
        batch = [
            evil.envelope("mallory", "io", MessageType.STREAM_DATA, {"poison": i}).to_dict()
            for i in range(3)
        ]
        batch.insert(2, evil.envelope("mallory", "io", MessageType.STREAM_DATA, "ok").to_dict())
        with caplog.at_level(logging.ERROR, logger="p2pnode.node"):
            await evil.links.link(victim.peer_id).send(pack([FrameKind.ENVELOPES, batch]))
            await wait_until(lambda: [e.payload for e in inbox.received] == ["ok"])
            await wait_until(lambda: victim.boundary.stats.unexpected["TypeError"] == 3)
        failed = [
            e for e in security_from(victim, str(evil.peer_id)) if e.code is ErrorCode.INPUT_FAILED
        ]
        assert len(failed) == 3 and "TypeError" in (failed[0].detail or "")
        # One traceback for the source and type, not one per envelope.
        tracebacks = [r for r in caplog.records if r.exc_info and "TypeError" in r.getMessage()]
        assert len(tracebacks) == 1


async def test_a_request_to_everyone_when_nobody_is_reachable(autojump_clock: Any) -> None:
    async with swarm(2) as (_, (a, b)):
        await a.add_agent("triton", Inbox(), tier=3)
        with pytest.raises(LocalError) as info:
            await a.request("triton", "*", "anyone?")
        assert info.value.code is ErrorCode.AGENT_NOT_FOUND
        # With a peer's agent in reach, the first answer comes back.
        await b.add_agent("io", Inbox(), tier=3)
        await a.connect(b.listen_address)
        reply = await a.request("triton", "*", "anyone?")
        assert reply.sender == "io" and reply.payload == {"echo": "anyone?"}


class FlakyListener(StreamListener):
    """A listener whose first ``failures`` accepts fail as if out of descriptors."""

    def __init__(self, inner: StreamListener, failures: int) -> None:
        self.inner = inner
        self.failures = failures
        self.attempts: list[float] = []

    @property
    def local_address(self) -> Address:
        return self.inner.local_address

    async def accept(self) -> trio.abc.Stream:
        self.attempts.append(trio.current_time())
        if len(self.attempts) <= self.failures:
            raise OSError(errno.EMFILE, "Too many open files")
        return await self.inner.accept()

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_accepting_pauses_when_out_of_descriptors_and_resumes(autojump_clock: Any) -> None:
    async with swarm(2) as (sim, (victim, peer)):
        await victim.add_agent("io", Inbox(), tier=3)
        await peer.add_agent("triton", Inbox(), tier=3)
        host = sim._hosts[victim.listen_address[0]]
        flaky = FlakyListener(await host.listen_stream((victim.listen_address[0], 7001)), 5)
        await victim.nursery.start(victim.links.accept_loop, flaky)
        await peer.connect(flaky.local_address)
        assert (await peer.request("triton", "io", "in")).payload == {"echo": "in"}
        busy = [e for e in victim.events.recent(kind=EventKind.ERROR) if e.code is ErrorCode.BUSY]
        assert len(busy) == 5
        gaps = [round(b - a, 3) for a, b in zip(flaky.attempts, flaky.attempts[1:], strict=False)]
        assert gaps[:5] == [0.1, 0.2, 0.4, 0.8, 1.0]  # doubling, capped


async def test_a_poisoned_dht_value_does_not_stop_a_lookup(
    autojump_clock: trio.testing.MockClock,
) -> None:
    rng = random.Random(5)
    async with dht_swarm(6) as (_, nodes):
        honest, victim, attacker = nodes[1], nodes[2], Identity(rng.randbytes(32))
        assert honest.identity is not None
        honest_card = make_card(honest.identity, ["plan.route"])
        await honest.provide(honest_card)
        expires = virtual_ms() + 3_600_000
        cap = capability_key("plan.route")
        card_record = SignedRecord.create(
            attacker, RecordKind.CARD, card_key(attacker.peer_id, "x"), 1, expires, POISON_CARD
        )
        provider = ProviderInfo("plan.route", "x", ()).to_bytes()
        provider_record = SignedRecord.create(
            attacker, RecordKind.PROVIDER, cap, 1, expires, provider
        )
        await nodes[3].put_records(card_key(attacker.peer_id, "x"), [card_record])
        await nodes[3].put_records(cap, [provider_record])
        found = await victim.find_providers("plan.route")
        assert [c.id for c in found] == [honest_card.id]
        assert victim.stats.records_rejected >= 1


@pytest.mark.slow
async def test_control_requests_fail_one_by_one(tmp_path: Path) -> None:
    async def status(request: dict[str, Any]) -> Any:
        return {"up": True}

    async def broken(request: dict[str, Any]) -> Any:
        empty: list[int] = []
        return empty[int(request.get("index", 0))]

    server = ControlServer(tmp_path / "control.sock", {"status": status, "broken": broken})
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        stream = await trio.open_unix_socket(str(server.path))
        replies = []
        async with stream:
            for line in (b"[" * 5000, b'{"op": "broken"}', b"\xff\xfe", b'{"op": "status"}'):
                await stream.send_all(line + b"\n")
                replies.append(json.loads(await _line(stream)))
        assert [r["ok"] for r in replies] == [False, False, False, True]
        assert replies[0]["error"]["code"] == ErrorCode.INVALID_ARGUMENT
        assert replies[1]["error"]["code"] == ErrorCode.INPUT_FAILED
        assert "IndexError" in replies[1]["error"]["message"]
        assert server.boundary.stats.unexpected == {"IndexError": 1}
        assert await control_call(server.path, {"op": "status"}) == {"up": True}
        with pytest.raises(LocalError) as refused:
            await control_call(server.path, {"op": "nope"})
        assert refused.value.code is ErrorCode.INVALID_ARGUMENT
        nursery.cancel_scope.cancel()


async def _line(stream: trio.abc.Stream) -> bytes:
    data = b""
    with trio.fail_after(5):
        while not data.endswith(b"\n"):
            data += await stream.receive_some(65536)
    return data
