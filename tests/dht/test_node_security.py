"""Hostile peers against a DhtNode on the simulated network."""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
import trio
import trio.testing

from p2pnode.core.identity import Identity
from p2pnode.core.wire import pack
from p2pnode.dht import rpcwire
from p2pnode.dht.node import DhtNode
from p2pnode.dht.records import (
    ProviderInfo,
    RecordKind,
    SignedRecord,
    capability_key,
    encode_value,
)
from p2pnode.simnet import SimNetwork
from p2pnode.transport.net import DatagramEndpoint
from tests.sim import virtual_ms, wait_until

KEY = capability_key("translate")
ATTACKER_ID = b"\xee" * 20


def _record(
    who: Identity, *, rev: int = 1, ttl: int = 600_000, cap: str = "translate"
) -> SignedRecord:
    info = ProviderInfo(cap, "agent", ()).to_bytes()
    return SignedRecord.create(
        who, RecordKind.PROVIDER, capability_key(cap), rev, virtual_ms() + ttl, info
    )


class Attacker:
    def __init__(self, ep: DatagramEndpoint, target: tuple[str, int]) -> None:
        self.ep = ep
        self.target = target
        self.rng = random.Random(5)

    async def request(self, method: str, args: list[Any], *, wait: bool = True) -> Any:
        msg_id = self.rng.randbytes(20)
        # Framed by hand: an attacker ignores our own size limit.
        await self.ep.sendto(b"\x00" + msg_id + pack([method, args]), self.target)
        if not wait:
            return None
        with trio.move_on_after(2):
            while True:
                data, _ = await self.ep.recvfrom()
                msg = rpcwire.decode_datagram_untrusted(data)
                if isinstance(msg, rpcwire.Response) and msg.msg_id == msg_id:
                    return msg.value
        return "no reply"

    async def store(self, value: Any, key: bytes = KEY) -> Any:
        return await self.request("store", [ATTACKER_ID, key, value])

    async def served(self, key: bytes = KEY) -> Any:
        reply = await self.request("find_value", [ATTACKER_ID, key])
        return reply.get("value") if isinstance(reply, dict) else None


@pytest.fixture
def sim() -> SimNetwork:
    return SimNetwork(random.Random(2))


async def _victim_and_attacker(sim: SimNetwork) -> tuple[DhtNode, Attacker]:
    host = sim.add_host()
    node = DhtNode(
        host,
        identity=Identity(random.Random(1).randbytes(32)),
        address=(host.host, 4000),
        wall_clock_ms=virtual_ms,
        rng=random.Random(3),
    )
    ep = await sim.add_host().bind_datagram(("", 5000))
    return node, Attacker(ep, (host.host, 4000))


async def test_bad_stores_never_accepted_or_served(
    autojump_clock: trio.testing.MockClock, sim: SimNetwork
) -> None:
    node, attacker = await _victim_and_attacker(sim)
    rng = random.Random(9)
    alice, bob = Identity(rng.randbytes(32)), Identity(rng.randbytes(32))
    async with node:
        good = _record(alice, rev=5)
        assert await attacker.store(encode_value([good])) is True
        forged = bytearray(_record(bob).to_bytes())
        forged[-1] ^= 1
        replay = _record(alice, rev=4, ttl=900_000)
        expired = _record(bob, ttl=-1)
        for bad in (
            pack([bytes(forged)]),  # forged signature
            encode_value([replay]),  # older revision of a held record
            pack([expired.to_bytes()]),  # expired
            b"\x90" + b"x" * 8200,  # oversized
            "plain unsigned string",  # unsigned value for a record key
            b"unsigned bytes",
            encode_value([_record(bob, cap="other")]),  # record for another key
        ):
            reply = await attacker.store(bad)
            assert reply in (False, "no reply")
        served = await attacker.served()
        assert served == encode_value([good])
        assert node.records.get(KEY, virtual_ms()) == [good]
        assert len(node.records) == 1


async def test_flood_from_one_peer_stays_bounded(
    autojump_clock: trio.testing.MockClock, sim: SimNetwork
) -> None:
    node, attacker = await _victim_and_attacker(sim)
    rng = random.Random(4)
    async with node:
        # 10,000 forged stores: none accepted.
        forged = bytearray(_record(Identity(rng.randbytes(32))).to_bytes())
        forged[-3] ^= 0x40
        forged_value = pack([bytes(forged)])
        handled = node.stats.requests_handled
        for _ in range(10_000):
            await attacker.request("store", [ATTACKER_ID, KEY, forged_value], wait=False)
            await trio.sleep(0.0001)  # the flood's rate: 10,000 stores a second
        await wait_until(lambda: node.stats.requests_handled >= handled + 10_000)
        assert len(node.records) == 0
        assert await attacker.served() is None
        # Validly signed stores from one address are rate-limited and bounded.
        signers = [Identity(rng.randbytes(32)) for _ in range(300)]
        t0 = trio.current_time()
        handled = node.stats.requests_handled
        for who in signers:
            value = encode_value([_record(who, cap=f"cap{rng.randrange(10**9)}")])
            await attacker.request("store", [ATTACKER_ID, KEY, value], wait=False)
            await trio.sleep(0.0001)
        await wait_until(lambda: node.stats.requests_handled >= handled + len(signers))
        elapsed = trio.current_time() - t0
        store = node.records
        assert len(store) <= store.source_burst + store.source_rate * elapsed + 1
        assert node.stats.stores_rate_limited > 0
        assert store.total_bytes <= store.max_bytes


async def test_malformed_datagrams_counted_and_summarised(
    autojump_clock: trio.testing.MockClock, sim: SimNetwork, caplog: pytest.LogCaptureFixture
) -> None:
    node, attacker = await _victim_and_attacker(sim)
    caplog.set_level(logging.DEBUG, logger="p2pnode.dht")
    async with node:
        for junk in (b"\x00" * 5, b"\x07" + b"\x01" * 25, b"\x00" + b"\x01" * 20 + b"\xc1"):
            await attacker.ep.sendto(junk, attacker.target)
        assert await attacker.request("evil", []) == "no reply"
        assert await attacker.request("ping", [b"short"]) == "no reply"
        await attacker.ep.sendto(b"\x00" * 9000, attacker.target)
        assert await attacker.request("ping", [ATTACKER_ID]) == node.node_id
        # More of the same within the minute: counted, and one more summary line
        # once the minute is over.
        for _ in range(200):
            await attacker.ep.sendto(b"\x00" * 5, attacker.target)
            await trio.sleep(0.01)
        await trio.sleep(61)
    messages = [r.getMessage() for r in caplog.records if r.name == "p2pnode.dht"]
    debug = [r for r in caplog.records if r.levelno == logging.DEBUG and "dht.drop" in r.msg]
    assert len(debug) >= 205  # one line each, at DEBUG only
    info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert [m for m in info if "drop" in m and not m.startswith("dht.summary")] == []
    summaries = [m for m in messages if m.startswith("dht.summary")]
    assert len(summaries) == 2  # the first drop at once, the rest after the minute
    assert "dropped_malformed=+1" in summaries[0]
    assert node.stats.datagrams_dropped >= 205
    assert node.stats.dropped_malformed >= 204
    assert node.stats.dropped_requests == 1  # the short ping id
    assert f"datagrams_dropped=+{node.stats.datagrams_dropped - 1}" in summaries[1]


async def test_responses_matched_by_id_and_address(
    autojump_clock: trio.testing.MockClock, sim: SimNetwork
) -> None:
    node, attacker = await _victim_and_attacker(sim)
    honest = await sim.add_host().bind_datagram(("", 6000))
    async with node, trio.open_nursery() as nursery:
        result: list[bytes | None] = []

        async def do_ping() -> None:
            result.append(await node.ping(honest.local_address))

        nursery.start_soon(do_ping)
        data, src = await honest.recvfrom()
        req = rpcwire.decode_datagram_untrusted(data)
        # The attacker learned the id (say, by sniffing) and answers first from its own address.
        await attacker.ep.sendto(rpcwire.encode_response(req.msg_id, ATTACKER_ID), src)
        await wait_until(lambda: node.stats.datagrams_dropped >= 1)
        assert result == []
        await honest.sendto(rpcwire.encode_response(req.msg_id, b"\x11" * 20), src)
    assert result == [b"\x11" * 20]
    assert node.stats.datagrams_dropped == 1
