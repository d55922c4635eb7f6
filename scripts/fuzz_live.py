"""The fuzzer's live handlers: real nodes on the in-memory simulator.

Each :class:`~fuzz_engine.LiveEntry` opens its nodes once (trio's virtual
clock, :class:`~p2pnode.simnet.SimNetwork`) and feeds one input at a time to
the handler a peer's bytes reach:

* ``live.dht_datagram``: :meth:`DhtPeer._handle_datagram` of a DHT node in a
  small swarm, from a rotating set of source hosts (so the per-host store
  rate limit does not turn every store away);
* ``live.dht_lookup``: a hostile DHT peer answers every request of a node's
  ``find_providers`` and ``find_card`` with the input (re-signed records with
  hostile payloads, or hostile reply bodies), which reaches the value
  reading of a lookup (``_collect``, provider reading, ``_card_from``);
* ``live.node_frame``: :meth:`Node._on_frame` of a node connected to a real
  peer node, with frames as that peer could send them (HELLOs with re-signed
  cards, envelopes from its agents, gossip for a shared document);
* ``live.control``: :meth:`ControlServer._dispatch` with the daemon's real
  operations on a node with shared state open;
* ``live.channel``: :func:`accept_secure` and ``receive_message`` of a secure
  channel over a memory stream, against hostile handshakes and, after a valid
  handshake, hostile transport frames (the channel has no boundary of its own:
  only its ``RemoteError`` may come out).

Nothing may escape a handler, and the failure boundary it runs behind must
count no unexpected exception: the harness finds each boundary by attribute
(:func:`fuzz_engine.require_boundary`) and refuses to open without it.
"""

from __future__ import annotations

import dataclasses
import json
import random
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import trio
import trio.testing
from fuzz_engine import Harness, LiveEntry, require_boundary
from fuzz_mutate import from_json_seeds, mutate_any, pack_plain, unpack_plain
from fuzz_seeds import (
    CAPABILITY,
    DOC,
    NOW_MS,
    OWNER,
    PEER,
    RESPONDER,
    FixedKeys,
    card,
    cards,
    datagram_seeds,
    envelopes,
    frame_seeds,
    mutate_datagram,
    records,
    resigned_card,
    resigned_record,
    transcripts,
    xx_transport_key,
)
from fuzz_streams import cut, hostile_frames

from p2pnode.cli.node import _node_ops, echo_handler
from p2pnode.core.boundary import FailureBoundary
from p2pnode.core.card import Capability
from p2pnode.core.envelope import MessageType
from p2pnode.core.errors import P2PError, RemoteError
from p2pnode.core.identity import Identity, PeerId
from p2pnode.core.wire import pack
from p2pnode.dht import rpcwire
from p2pnode.dht.node import DhtNode
from p2pnode.dht.records import RecordKind, SignedRecord, card_key, encode_value
from p2pnode.dht.routing import Contact, RoutingTable
from p2pnode.node.control import ControlServer
from p2pnode.node.frames import encode_envelopes, encode_hello
from p2pnode.runtime import Node, NodeConfig
from p2pnode.services.shared.service import SharedConfig
from p2pnode.simnet import LinkConditions, SimNetwork
from p2pnode.transport.channel import ChannelConfig, accept_secure

_LINK = LinkConditions(latency=0.005, jitter=0.0)


def _wall_ms() -> int:
    # Fixed, so records signed for NOW_MS stay valid however far the virtual clock runs.
    return NOW_MS


# --------------------------------------------------------------------------- DHT datagrams


class DatagramHarness:
    def __init__(self, victim: DhtNode) -> None:
        self.victim = victim
        self._boundary = require_boundary(victim)
        self._count = 0

    def boundaries(self) -> dict[str, FailureBoundary]:
        return {"dht": self._boundary}

    def outcomes(self) -> dict[str, int]:
        return _dht_outcomes(self.victim)

    async def feed(self, data: Any) -> None:
        assert isinstance(data, bytes)
        # The source follows from the bytes: deterministic, and spread over many hosts.
        n = zlib.crc32(data) % 1024
        source = (f"10.9.{n >> 8}.{n & 255}", 4000)
        try:
            await self.victim._handle_datagram(data, source)
        except P2PError as exc:
            # The receive loop contains what one datagram raises; a typed error is the
            # expected way for a bad one to end. Anything else escapes to the driver.
            self._boundary.contain(f"{source[0]}:{source[1]}", "datagram", exc)
        self._count += 1
        if self._count % 64 == 0:
            await trio.sleep(1.0)  # let the node's own tasks (pings, replies) run


@asynccontextmanager
async def open_dht_datagram() -> AsyncIterator[Harness]:
    sim = SimNetwork(random.Random(11), default=_LINK)
    async with AsyncExitStack() as stack:
        nodes: list[DhtNode] = []
        for i in range(3):
            host = sim.add_host()
            node = DhtNode(
                host,
                identity=Identity(bytes([0x30 + i]) * 32),
                address=(host.host, 4000),
                rng=random.Random(i),
                wall_clock_ms=_wall_ms,
            )
            nodes.append(await stack.enter_async_context(node))
        for node in nodes[1:]:
            await node.bootstrap([nodes[0].address])
        yield DatagramHarness(nodes[0])


def _datagram_input(rng: random.Random) -> bytes:
    return mutate_datagram(rng, rng.choice(datagram_seeds()))


def _dht_outcomes(node: DhtNode) -> dict[str, int]:
    stats = node.statistics()
    return {
        "requests handled": stats.requests_handled,
        "datagrams dropped": stats.datagrams_dropped,
        "records rejected": stats.records_rejected,
        "stores rate-limited": stats.stores_rate_limited,
        "records held": len(node.records),
    }


# --------------------------------------------------------------------------- DHT lookups


@dataclass(frozen=True, slots=True)
class LookupInput:
    """What the hostile peer answers: find_value of the capability key, of a card key,
    and (when set) one raw reply body for every request instead."""

    providers: bytes
    card: bytes
    raw: bytes | None = None


class Hostile:
    """A DHT peer that answers with the current input."""

    def __init__(self, sim: SimNetwork) -> None:
        self.host = sim.add_host()
        self.node_id = b"\xe7" * 20
        self.current = LookupInput(b"", b"")

    async def serve(self, *, task_status: trio.TaskStatus[tuple[str, int]]) -> None:
        endpoint = await self.host.bind_datagram((self.host.host, 4000))
        task_status.started(endpoint.local_address)
        while True:
            data, source = await endpoint.recvfrom()
            msg = rpcwire.decode_datagram_untrusted(data)  # our victim's own requests
            if isinstance(msg, rpcwire.Request):
                body = self._answer(msg)
                await endpoint.sendto(b"\x01" + msg.msg_id + body, source)

    def _answer(self, msg: rpcwire.Request) -> bytes:
        x = self.current
        if x.raw is not None:
            return x.raw
        if msg.method == "ping":
            return pack(self.node_id)
        if msg.method == "find_value":
            key = msg.args[1]
            return pack({"value": x.providers if key == records()[1].key else x.card})
        return pack([])


class LookupHarness:
    def __init__(self, victim: DhtNode, hostile: Hostile, address: tuple[str, int]) -> None:
        self.victim = victim
        self.hostile = hostile
        self.contact = Contact(hostile.node_id, *address)
        self._boundary = require_boundary(victim)
        self.found = 0

    def boundaries(self) -> dict[str, FailureBoundary]:
        return {"dht": self._boundary}

    def outcomes(self) -> dict[str, int]:
        out = _dht_outcomes(self.victim)
        out["providers found"] = self.found
        return out

    async def feed(self, data: Any) -> None:
        assert isinstance(data, LookupInput)
        victim = self.victim
        # Every input starts from the same table: the hostile peer alone.
        victim.table = RoutingTable(victim.node_id, k=victim.config.k)
        victim.table.observe(self.contact, trio.current_time())
        self.hostile.current = data
        self.found += len(await victim.find_providers(CAPABILITY))
        await victim.find_card(OWNER.peer_id, "planner")


@asynccontextmanager
async def open_dht_lookup() -> AsyncIterator[Harness]:
    sim = SimNetwork(random.Random(12), default=_LINK)
    hostile = Hostile(sim)
    host = sim.add_host()
    async with trio.open_nursery() as nursery:
        address = await nursery.start(hostile.serve)
        victim = DhtNode(
            host,
            identity=Identity(b"\x40" * 32),
            address=(host.host, 4000),
            rng=random.Random(3),
            wall_clock_ms=_wall_ms,
        )
        async with victim:
            yield LookupHarness(victim, hostile, address)
        nursery.cancel_scope.cancel()


def _card_record_value(rng: random.Random) -> bytes:
    """A value holding the planner's card record, its card mutated and signed again."""
    if rng.random() < 0.3:
        return encode_value([resigned_record(rng)])
    payload = resigned_card(rng, OWNER, cards()[:1])
    seed = records()[0]
    try:
        agent_id = unpack_plain(payload)["id"]
        key = card_key(OWNER.peer_id, agent_id) if isinstance(agent_id, str) else seed.key
    except Exception:  # the mutation broke the map itself
        key = seed.key
    rec = SignedRecord.create(OWNER, RecordKind.CARD, key, 4, NOW_MS + 60_000, payload)
    return encode_value([rec])


def _lookup_input(rng: random.Random) -> LookupInput:
    providers = encode_value([records()[1], records()[2]])
    if rng.random() < 0.5:
        providers = pack([resigned_record(rng).to_bytes() for _ in range(rng.choice((1, 2)))])
    elif rng.random() < 0.3:
        providers = mutate_any(rng, providers)
    raw = None
    if rng.random() < 0.25:
        reply = rng.choice(
            (pack({"value": providers}), pack([[b"\x01" * 20, "10.0.0.1", 4000]]), pack(True))
        )
        raw = mutate_any(rng, reply)
    return LookupInput(providers, _card_record_value(rng), raw)


# --------------------------------------------------------------------------- node frames

# Small de-duplication windows: the node's bounded caches fill early in a run, so memory
# that still grows after the warm-up is a leak, not a cache on its way to its bound.
_NODE_CONFIG = NodeConfig(request_timeout=5.0, dedup_window=4096)


FrameHandler = Callable[[PeerId, bytes], Awaitable[None]]


def frame_handler(node: Node) -> FrameHandler:
    """The coroutine a node's links hand every frame to (``Node._on_frame``, or the
    ``on_frame`` of its routing part); raises when the node has neither."""
    for owner, name in ((getattr(node, "routing", None), "on_frame"), (node, "_on_frame")):
        handler = getattr(owner, name, None) if owner is not None else None
        if callable(handler):
            return cast(FrameHandler, handler)
    raise RuntimeError("the node has no frame handler (routing.on_frame or _on_frame)")


class FrameHarness:
    def __init__(self, victim: Node, peer: Node) -> None:
        self.victim = victim
        self.peer = peer
        self._boundary = require_boundary(victim)
        self._on_frame = frame_handler(victim)
        self._count = 0

    def boundaries(self) -> dict[str, FailureBoundary]:
        return {"node": self._boundary}

    def outcomes(self) -> dict[str, int]:
        metrics = self.victim.events.metrics()
        return {
            "envelopes received": metrics.messages_received,
            "security events": metrics.security_events,
            "known agents": len(self.victim.registry),
        }

    async def feed(self, data: Any) -> None:
        assert isinstance(data, bytes)
        await self._on_frame(self.peer.peer_id, data)
        self._count += 1
        if self._count % 16 == 0:
            await trio.sleep(0.5)  # replies, gossip and handlers run in the node's tasks


async def _open_node(
    stack: AsyncExitStack, sim: SimNetwork, identity: Identity, agents: dict[str, int]
) -> Node:
    host = sim.add_host()
    config = dataclasses.replace(_NODE_CONFIG, listen=(host.host, 7000))
    node = await stack.enter_async_context(Node(identity, host, config, clock_ms=_wall_ms))
    for agent_id, tier in agents.items():
        await node.add_agent(
            agent_id, echo_handler, tier=tier, capabilities=(Capability(CAPABILITY, "Plan"),)
        )
    shared = await node.open_shared(SharedConfig(), rng=random.Random(1))
    await shared.subscribe(next(iter(agents)), DOC)
    return node


@asynccontextmanager
async def _two_nodes() -> AsyncIterator[tuple[Node, Node]]:
    sim = SimNetwork(random.Random(13), default=_LINK)
    async with AsyncExitStack() as stack:
        victim = await _open_node(stack, sim, OWNER, {"alpha": 2, "beta": 3})
        peer = await _open_node(stack, sim, PEER, {"bravo": 2, "gamma": 3})
        await victim.connect(peer.listen_address)
        await trio.sleep(1.0)
        yield victim, peer


@asynccontextmanager
async def open_node_frame() -> AsyncIterator[Harness]:
    async with _two_nodes() as (victim, peer):
        yield FrameHarness(victim, peer)


def _with_fresh_ids(rng: random.Random, frame: bytes) -> bytes:
    # The node drops an envelope id it has seen: give every input's envelopes new ids.
    obj = unpack_plain(frame)
    body = obj[1]
    for env in body if isinstance(body, list) else [body]:
        if isinstance(env, dict) and "id" in env:
            env["id"] = f"fz-{rng.getrandbits(48):x}"
    return pack_plain(obj)


def _peer_frames() -> tuple[bytes, ...]:
    envs = envelopes("bravo", "alpha")
    hello = encode_hello([card(PEER, "bravo", tier=2)], ["10.0.0.2:7000"])
    return (hello, *frame_seeds()[1:], encode_envelopes(envs))


#: Addresses a HELLO may announce: out of range, empty parts, digits int() refuses.
_HOSTILE_ADDRESSES = [
    "10.0.0.2:65536",
    "[::1]:99999999999999999999",
    ":7000",
    "10.0.0.2:",
    "host:\u00b2",
    "host:\u0663",
    "[]:1",
    "a" * 300 + ":1",
    "10.0.0.2:-1",
]


def _frame_input(rng: random.Random) -> bytes:
    seeds = _peer_frames()
    roll = rng.random()
    if roll < 0.15:
        owned = (card(PEER, "bravo", tier=2), card(PEER, "gamma", tier=3, rich=False))
        addresses = ["10.0.0.2:7000", *rng.sample(_HOSTILE_ADDRESSES, rng.randrange(3))]
        hello = [0, {"cards": [resigned_card(rng, PEER, owned)], "addresses": addresses}]
        return pack(hello)
    frame = _with_fresh_ids(rng, rng.choice(seeds[1:]))
    return frame if roll < 0.25 else mutate_any(rng, frame)


# --------------------------------------------------------------------------- control


class ControlHarness:
    def __init__(self, server: ControlServer) -> None:
        self.server = server
        self._boundary = require_boundary(server)
        self.replies: Counter[str] = Counter()

    def boundaries(self) -> dict[str, FailureBoundary]:
        return {"control": self._boundary}

    def outcomes(self) -> dict[str, int]:
        return dict(self.replies)

    async def feed(self, data: Any) -> None:
        line = data.encode() if isinstance(data, str) else data
        assert isinstance(line, bytes)
        reply = await self.server._dispatch(line)
        error = reply.get("error")
        self.replies[f"error {error.get('code')}" if isinstance(error, dict) else "ok"] += 1


@asynccontextmanager
async def open_control() -> AsyncIterator[Harness]:
    async with _two_nodes() as (victim, _):
        yield ControlHarness(ControlServer(Path("/nonexistent/control.sock"), _node_ops(victim)))


_CONTROL_SEEDS = tuple(
    json.dumps(r)
    for r in (
        {"op": "status"},
        {"op": "find", "capability": CAPABILITY},
        {"op": "send", "from": "alpha", "to": "bravo", "type": "notification", "payload": {"x": 1}},
        {"op": "send", "to": "bravo", "payload": "hi"},
        {"op": "send", "to": CAPABILITY, "capability": True, "payload": [1, 2]},
        {"op": "send", "to": "*", "type": str(MessageType.NOTIFICATION), "payload": None},
        {"op": "doc.subscribe", "doc": DOC, "agent": "beta"},
        {"op": "doc.update", "doc": DOC, "update": {"op": "counter.add", "path": ["n"]}},
        {
            "op": "doc.update",
            "doc": DOC,
            "update": {"op": "register.set", "path": "t", "value": "v", "timestamp": 5},
        },
        {"op": "doc.update", "doc": DOC, "update": {"op": "set.add", "path": ["s"], "element": 1}},
        {"op": "doc.update", "doc": DOC, "update": {"op": "map.remove", "path": ["n"]}},
        {"op": "doc.read", "doc": DOC},
    )
)


# --------------------------------------------------------------------------- secure channels

_CHANNEL_CONFIG = ChannelConfig(
    handshake_timeout=5.0, idle_timeout=30.0, frame_timeout=3.0, max_message_size=10_000
)


@dataclass(frozen=True, slots=True)
class ChannelInput:
    """What a dialer sends a listener: hostile handshake bytes, or a valid XX handshake
    followed by hostile transport bytes; in the chunks they are written in."""

    chunks: tuple[bytes, ...]
    after_handshake: bool


class ChannelHarness:
    """:func:`accept_secure`, then :meth:`SecureChannel.receive_message` until the peer's
    bytes end: only RemoteError may come out (the channel's one way to fail)."""

    def __init__(self) -> None:
        self.outcomes_seen: Counter[str] = Counter()

    def boundaries(self) -> dict[str, FailureBoundary]:
        return {}

    def outcomes(self) -> dict[str, int]:
        return dict(self.outcomes_seen)

    async def feed(self, data: Any) -> None:
        assert isinstance(data, ChannelInput)
        victim_stream, dialer_stream = trio.testing.memory_stream_pair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._dial, dialer_stream, data)
            try:
                channel = await accept_secure(
                    victim_stream, RESPONDER, config=_CHANNEL_CONFIG, generate_keypair=FixedKeys(2)
                )
                async with channel:
                    for _ in range(64):
                        await channel.receive_message()
                        self.outcomes_seen["message"] += 1
            except RemoteError as exc:
                self.outcomes_seen[f"{type(exc).__name__}:{exc.code}"] += 1
            nursery.cancel_scope.cancel()

    @staticmethod
    async def _dial(stream: trio.abc.Stream, data: ChannelInput) -> None:
        try:
            if data.after_handshake:
                xx = transcripts()["XX"]
                await stream.send_all(xx.initiator_first + xx.initiator_last)
            for chunk in data.chunks:
                await stream.send_all(chunk)
            if isinstance(stream, trio.abc.HalfCloseableStream):
                await stream.send_eof()
            await trio.sleep_forever()  # the listener decides when it is over
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the listener hung up on us: expected


@asynccontextmanager
async def open_channel() -> AsyncIterator[Harness]:
    yield ChannelHarness()


def _channel_input(rng: random.Random) -> ChannelInput:
    if rng.random() < 0.5:
        xx = transcripts()[rng.choice(("XX", "IK"))]
        whole = xx.initiator_first + xx.initiator_last
        return ChannelInput(cut(rng, mutate_any(rng, whole)), after_handshake=False)
    stream = b"".join(hostile_frames(rng, xx_transport_key()))
    return ChannelInput(cut(rng, stream), after_handshake=True)


LIVE_ENTRIES: list[LiveEntry] = [
    LiveEntry("live.dht_datagram", _datagram_input, open_dht_datagram),
    LiveEntry("live.dht_lookup", _lookup_input, open_dht_lookup, share=0.5),
    LiveEntry("live.node_frame", _frame_input, open_node_frame),
    LiveEntry("live.control", from_json_seeds(_CONTROL_SEEDS), open_control),
    LiveEntry("live.channel", _channel_input, open_channel, share=0.5),
]
