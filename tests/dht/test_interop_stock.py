"""Interop with real stock ``kademlia`` 2.2.3 nodes in a separate OS process (127.0.0.1)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from p2pnode.core.identity import Identity
from p2pnode.dht.node import DhtConfig, DhtNode
from p2pnode.dht.records import capability_key, encode_value
from p2pnode.transport.net import TrioNetwork
from tests.sim import make_card

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("stock_peers.py")
CONFIG = DhtConfig(rpc_hard_timeout=2.0)


class StockPeers:
    """Line-oriented JSON control of the stock servers' process."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self._buf = bytearray()

    async def line(self) -> Any:
        assert self.proc.stdout is not None
        while b"\n" not in self._buf:
            chunk = await self.proc.stdout.receive_some(65536)
            if not chunk:
                raise RuntimeError("stock peers exited")
            self._buf += chunk
        raw, _, rest = bytes(self._buf).partition(b"\n")
        self._buf = bytearray(rest)
        return json.loads(raw)

    async def command(self, **cmd: Any) -> Any:
        assert self.proc.stdin is not None
        await self.proc.stdin.send_all(json.dumps(cmd).encode() + b"\n")
        return await self.line()


@asynccontextmanager
async def stock_peers(n: int) -> AsyncIterator[tuple[StockPeers, list[tuple[str, str, int]]]]:
    proc = await trio.lowlevel.open_process(
        [sys.executable, str(SCRIPT), str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        peers = StockPeers(proc)
        with trio.fail_after(20):
            hello = await peers.line()
        yield peers, [(str(x[0]), str(x[1]), int(x[2])) for x in hello["nodes"]]
    finally:
        proc.kill()
        with trio.move_on_after(5):
            await proc.wait()


async def test_mixed_network_with_stock_nodes() -> None:
    rng = random.Random(77)
    net = TrioNetwork()
    with trio.fail_after(60):
        async with stock_peers(4) as (stock, stock_nodes), AsyncExitStack() as stack:
            ours: list[DhtNode] = []
            for _ in range(3):
                node = DhtNode(
                    net,
                    identity=Identity(rng.randbytes(32)),
                    config=CONFIG,
                    rng=random.Random(rng.random()),
                )
                ours.append(await stack.enter_async_context(node))
            a, b, c = ours
            # Ours joins off one stock node and finds the other stock nodes.
            assert await a.bootstrap([(stock_nodes[0][1], stock_nodes[0][2])]) == 1
            known = {cn.node_id.hex() for cn in a.table.contacts()}
            assert {s[0] for s in stock_nodes} <= known
            # b and c only ever hear of stock nodes directly.
            assert await b.bootstrap([(stock_nodes[1][1], stock_nodes[1][2])]) == 1
            assert await c.bootstrap([(stock_nodes[2][1], stock_nodes[2][2])]) == 1

            assert a.identity is not None
            card = make_card(a.identity, ["translate"], now_ms=None)
            assert await a.provide(card) >= 4
            stored = a.records.get(capability_key("translate"), a.wall_clock_ms())
            # A stock node's get() of the documented key returns the bytes we stored.
            reply = await stock.command(op="get", node=3, key="p2pnode:cap:translate")
            assert reply["value_hex"] == encode_value(stored).hex()
            # Our lookups route through stock nodes: c finds a's card and providers.
            assert await c.find_card(card.peer_id, card.id) == card
            assert [x.peer_id for x in await c.find_providers("translate")] == [card.peer_id]
            # The stock table learned our nodes.
            table = await stock.command(op="table", node=0)
            assert a.node_id.hex() in table["ids"]


async def test_plain_stock_values_are_not_served_as_records() -> None:
    rng = random.Random(78)
    net = TrioNetwork()
    with trio.fail_after(60):
        async with (
            stock_peers(3) as (stock, stock_nodes),
            DhtNode(net, identity=Identity(rng.randbytes(32)), config=CONFIG) as ours,
        ):
            await ours.bootstrap([(stock_nodes[0][1], stock_nodes[0][2])])
            # A stock client stores an unsigned value under a capability key.
            await stock.command(op="set", node=1, key="p2pnode:cap:evil", value_hex=b"junk".hex())
            assert await ours.find_providers("evil") == []
            assert ours.records.get(capability_key("evil"), ours.wall_clock_ms()) == []
            assert ours.stats.records_rejected + ours.stats.datagrams_dropped >= 1
