"""The fuzzer's table of parsers: every function that decodes peer bytes or values.

Each :class:`~fuzz_engine.Entry` names a parser, how its inputs are made
(mutations of the valid encodings in :mod:`fuzz_seeds`) and how one input is
run. Runners go a step past the parser where the node would: an accepted
card is encoded again, an accepted delta is joined into a replica and read
back, a decoded gossip frame is handled by a gossip core. A value the
parser accepted but the next step cannot handle is a parser bug too, so
only the layer's ``RemoteError`` may come out of a runner. The byte-stream
protocols (handshakes, transport frames, agent sessions) are in
:mod:`fuzz_streams`; :data:`ENTRIES` lists them all.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fuzz_engine import Entry
from fuzz_mutate import (
    Generator,
    from_json_seeds,
    from_seeds,
    mutate_bytes,
    mutate_json,
    mutate_tree,
    unpack_plain,
    wire_value,
)
from fuzz_seeds import (
    DOC,
    INITIATOR,
    NOW_MS,
    OWNER,
    base_replica,
    bulk_crdt_seeds,
    cards,
    clock_seeds,
    datagram_seeds,
    delta_seeds,
    envelope_json_seeds,
    envelope_seeds,
    frame_seeds,
    gossip_frames,
    gossip_payload_seeds,
    mutate_datagram,
    provider_payload,
    records,
    registry_seed,
    resigned_card,
    resigned_record,
    resigned_value,
    sealed_seeds,
    tool_seeds,
    value_seeds,
)
from fuzz_streams import (
    handshake_input,
    noise_input,
    run_handshake,
    run_noise,
    run_payload,
    run_session,
    run_transport,
    session_input,
    transport_input,
)

from p2pnode.core.card import AgentCard
from p2pnode.core.envelope import Envelope
from p2pnode.core.errors import RemoteError
from p2pnode.core.identity import PeerId
from p2pnode.core.registry import Registry
from p2pnode.core.wire import pack, unpack_untrusted
from p2pnode.crdt.clock import VectorClock
from p2pnode.crdt.delta import Delta, Opened
from p2pnode.crdt.gossip import Digest, GossipNode, decode_untrusted
from p2pnode.crdt.ops import CounterAdd
from p2pnode.crdt.replica import Replica
from p2pnode.dht import rpcwire
from p2pnode.dht.lookup import RecordCollector
from p2pnode.dht.records import (
    ProviderInfo,
    RecordKind,
    SignedRecord,
    decode_value_untrusted,
)
from p2pnode.dht.rpc import ReplyReceived, RpcCore
from p2pnode.node.config import parse_address
from p2pnode.node.frames import EnvelopeBatch, Hello, decode_frame_untrusted
from p2pnode.services.shared.docops import decode_gossip_payload_untrusted, value_to_json
from p2pnode.services.tools.audit import ToolInvocation

# --------------------------------------------------------------------------- cards, envelopes


def _use_card(card: AgentCard) -> None:
    # What a node does with a card it accepted: store, sign-check, re-encode, dial.
    card.to_bytes()
    card.to_json()
    card.is_signed_by_owner()
    card.capability_ids()
    for address in card.addresses:
        parse_address(address)


def run_card_bytes(data: bytes) -> None:
    _use_card(AgentCard.from_bytes_untrusted(data))


def run_card_json(text: str | bytes) -> None:
    _use_card(AgentCard.from_json_untrusted(text))


def run_card_dict(obj: object) -> None:
    _use_card(AgentCard.from_dict_untrusted(obj))


def _card_bytes(rng: random.Random) -> bytes:
    if rng.random() < 0.25:
        return resigned_card(rng, OWNER, cards()[:2])
    return from_seeds([c.to_bytes() for c in cards()])(rng)


def _tree_of(seeds: Callable[[], tuple[bytes, ...]]) -> Generator:
    """Decoded trees with one or two hostile nodes, handed to ``from_dict_untrusted``
    without an encoding: the values a msgpack decoder can produce, placed anywhere."""

    def generate(rng: random.Random) -> Any:
        obj = unpack_plain(rng.choice(seeds()))
        for _ in range(rng.choice((1, 1, 2))):
            obj = mutate_tree(rng, obj, wire_value)
        return obj

    return generate


def _card_seeds() -> tuple[bytes, ...]:
    return tuple(c.to_bytes() for c in cards())


def _use_envelope(envelope: Envelope) -> None:
    envelope.to_msgpack()
    envelope.to_dict()


def run_envelope_msgpack(data: bytes) -> None:
    _use_envelope(Envelope.from_msgpack_untrusted(data))


def run_envelope_json(text: str | bytes) -> None:
    _use_envelope(Envelope.from_json_untrusted(text))


def run_envelope_dict(obj: object) -> None:
    _use_envelope(Envelope.from_dict_untrusted(obj))


def run_frame(data: bytes) -> None:
    frame = decode_frame_untrusted(data)
    if isinstance(frame, Envelope):
        _use_envelope(frame)
    elif isinstance(frame, EnvelopeBatch):
        for envelope in frame.envelopes:
            _use_envelope(envelope)
    elif isinstance(frame, Hello):
        for card in frame.cards:
            _use_card(card)


def _frame_input(rng: random.Random) -> bytes:
    if rng.random() < 0.15:
        # A HELLO whose cards are valid after mutation (signed again by their owner).
        hello = unpack_plain(frame_seeds()[0])
        hello[1]["cards"] = [resigned_card(rng, OWNER, cards()[:2]) for _ in range(2)]
        return pack(hello)
    return from_seeds(frame_seeds())(rng)


def run_registry(data: bytes) -> None:
    registry = Registry.from_bytes_untrusted(data)
    registry.to_bytes()
    for card in registry:
        registry.find_by_capability(next(iter(card.capability_ids()), "x"))


def run_tool(text: str | bytes) -> None:
    ToolInvocation.from_json_untrusted(text).to_json()


# --------------------------------------------------------------------------- DHT


_REPLY_PARSERS = (
    rpcwire.parse_ping_reply_untrusted,
    rpcwire.parse_store_reply_untrusted,
    rpcwire.parse_contacts_untrusted,
    rpcwire.parse_find_value_reply_untrusted,
    rpcwire.parse_stun_reply_untrusted,
)
_ARG_PARSERS: dict[str, Callable[[list[Any]], object]] = {
    "ping": rpcwire.parse_ping_args_untrusted,
    "store": rpcwire.parse_store_args_untrusted,
    "find_node": rpcwire.parse_find_args_untrusted,
    "find_value": rpcwire.parse_find_args_untrusted,
    "stun": rpcwire.parse_stun_args_untrusted,
}
_KEYS = tuple({r.key for r in records()})


def read_value(value: Any) -> None:
    """What a DHT node does with a value: records per key, then their payloads."""
    for key in _KEYS:
        try:
            recs, _ = decode_value_untrusted(value, key, now_ms=NOW_MS)
        except RemoteError:
            continue
        for rec in recs:
            if rec.kind is RecordKind.CARD:
                AgentCard.from_bytes_untrusted(rec.payload)
            else:
                ProviderInfo.from_bytes_untrusted(rec.payload)


def run_datagram(data: bytes) -> None:
    msg = rpcwire.decode_datagram_untrusted(data)
    if isinstance(msg, rpcwire.Request):
        parsed = _ARG_PARSERS[msg.method](msg.args)
        if msg.method == "store" and isinstance(parsed, tuple):
            _try_remote(read_value, parsed[2])
        return
    for parse in _REPLY_PARSERS:
        _try_remote(parse, msg.value)
    if isinstance(msg.value, dict) and set(msg.value) == {"value"}:
        _try_remote(read_value, msg.value["value"])


def _try_remote(run: Callable[[Any], object], value: Any) -> None:
    # Each reply parser is tried on its own, as the caller that awaits that reply would.
    try:
        run(value)
    except RemoteError:
        pass


def _datagram_input(rng: random.Random) -> bytes:
    seed = rng.choice(datagram_seeds())
    return seed if rng.random() < 0.02 else mutate_datagram(rng, seed)


def run_value(data: bytes) -> None:
    read_value(data)
    decode_value_untrusted(data, _KEYS[0], now_ms=NOW_MS)


def _value_input(rng: random.Random) -> bytes:
    return resigned_value(rng) if rng.random() < 0.5 else from_seeds(value_seeds())(rng)


@dataclass(frozen=True, slots=True)
class RpcInput:
    """One datagram for an RPC core with three calls pending, from ``source`` at ``now``."""

    data: bytes
    source: tuple[str, int]
    now: float


_CALLED = ("10.0.0.5", 4000)
_CALLS = (("find_value", [bytes(20), bytes(20)]), ("find_node", [bytes(20), bytes(20)]),
          ("ping", [bytes(20)]))  # fmt: skip
_REPLY_PARSER = {
    "ping": rpcwire.parse_ping_reply_untrusted,
    "store": rpcwire.parse_store_reply_untrusted,
    "find_node": rpcwire.parse_contacts_untrusted,
    "find_value": rpcwire.parse_find_value_reply_untrusted,
    "stun": rpcwire.parse_stun_reply_untrusted,
}


def _rpc_core() -> RpcCore:
    core = RpcCore(rng=random.Random(9), timeout=5.0, remember=2)
    for method, args in _CALLS:
        core.call(_CALLED, method, args, now=0.0)
    return core


def _pending_ids() -> list[bytes]:
    rng = random.Random(9)  # the core draws its message ids from the same stream
    return [rng.randbytes(20) for _ in _CALLS]


def run_rpc(x: RpcInput) -> None:
    core = _rpc_core()
    for event in core.receive_datagram_untrusted(x.data, x.source, x.now):
        if isinstance(event, ReplyReceived):
            _REPLY_PARSER[event.method](event.value)  # what the driver does with a reply
    core.datagrams_to_send()


def _rpc_input(rng: random.Random) -> RpcInput:
    seed = rng.choice(datagram_seeds()[5:])  # the responses
    msg_id = rng.choice([*_pending_ids(), bytes(20)])
    data = seed[:1] + msg_id + seed[rpcwire.HEADER_BYTES :]
    if rng.random() < 0.9:
        data = mutate_datagram(rng, data)
    source = _CALLED if rng.random() < 0.8 else ("10.0.0.6", 4000)
    return RpcInput(data, source, rng.choice((0.0, 1.0, 4.99, 5.0, 60.0)))


def run_collector(values: tuple[Any, ...]) -> None:
    """A value lookup's collector fed one reply's value after another, then read."""
    collector = RecordCollector(records()[1].key, lambda _: None)
    refused: list[RemoteError] = []
    for value in values:
        try:
            collector.add_untrusted(value, NOW_MS)
        except RemoteError as exc:
            refused.append(exc)  # that reply's value as a whole is bad; the lookup goes on
    for rec in collector.records():
        ProviderInfo.from_bytes_untrusted(rec.payload)
    if refused:
        raise refused[0]  # reported as this input's outcome


def _collector_input(rng: random.Random) -> tuple[Any, ...]:
    values: list[Any] = [_value_input(rng) for _ in range(rng.randrange(1, 4))]
    if rng.random() < 0.1:
        values.append(wire_value(rng))  # a stock node's plain value, or anything else
    return tuple(values)


def run_record(data: bytes) -> None:
    rec = SignedRecord.from_bytes_untrusted(data, now_ms=NOW_MS)
    if rec.kind is RecordKind.CARD:
        AgentCard.from_bytes_untrusted(rec.payload)


def _record_input(rng: random.Random) -> bytes:
    if rng.random() < 0.5:
        return resigned_record(rng).to_bytes()
    return from_seeds([r.to_bytes() for r in records()])(rng)


def run_provider(data: bytes) -> None:
    ProviderInfo.from_bytes_untrusted(data).to_bytes()


# --------------------------------------------------------------------------- CRDT


def run_clock(data: bytes) -> None:
    clock = VectorClock.decode_untrusted(data)
    clock.merge(VectorClock({"a": 1}))
    clock.encode()


def _peers_accept(decode: Callable[[bytes], object], data: bytes) -> None:
    """Decode what this node would send: a typed error here is not the input's fault but
    a state the node accepted and can no longer serve, so it fails the input."""
    try:
        decode(data)
    except RemoteError as exc:
        raise AssertionError(f"peers would refuse what this node sends: {exc}") from exc


def _peer_decodes(sealed: bytes) -> None:
    # What a peer decodes of a sealed delta (the signature is the origin's business).
    Opened.open_untrusted(sealed).trusted()


def _check_replica(replica: Replica, doc: str) -> None:
    # An accepted update must leave a document that reads, serves and encodes in a form
    # peers accept: what it serves a new peer, its digest, its next local delta.
    value_to_json(replica.value(doc))
    for delta in replica.missing_for(doc, VectorClock(), limit=8):
        _peers_accept(_peer_decodes, delta.sealed_bytes())
    _peers_accept(decode_untrusted, Digest(doc, replica.clock(doc)).encode())
    _peers_accept(_peer_decodes, replica.update(doc, CounterAdd(("fuzz",), 1)).sealed_bytes())


def run_delta(data: bytes) -> None:
    delta = Delta.decode_untrusted(data)
    replica = base_replica()
    replica.apply_delta(delta)
    _check_replica(replica, delta.doc)


def run_sealed(data: bytes) -> None:
    delta = Opened.open_untrusted(data).verify()
    replica = base_replica()
    replica.apply_delta(delta)
    _check_replica(replica, delta.doc)


def run_gossip(data: bytes) -> None:
    msg = decode_untrusted(data)
    replica = base_replica()
    core = GossipNode(replica, peers=["p1", "p2", "p3"], docs=[DOC], rng=random.Random(0), now=0.0)
    core.receive("p1", msg)
    for _, out in core.take_outgoing():
        _peers_accept(decode_untrusted, out.encode())
    _check_replica(replica, DOC)


def run_gossip_payload(data: bytes) -> None:
    _, frame = decode_gossip_payload_untrusted(unpack_untrusted(data))
    decode_untrusted(frame)


def run_peer_id(data: bytes) -> None:
    obj = unpack_untrusted(data)
    if isinstance(obj, bytes):
        PeerId.from_bytes_untrusted(obj)
    else:
        PeerId.parse_untrusted(obj)


_PEER_ID_SEEDS = (pack(str(OWNER.peer_id)), pack(OWNER.peer_id.raw), pack(str(OWNER.peer_id)[:31]))


def _json_input(seeds: Callable[[], tuple[str, ...]]) -> Generator:
    def generate(rng: random.Random) -> str | bytes:
        seed = rng.choice(seeds())
        return seed if rng.random() < 0.02 else mutate_json(rng, seed)

    return generate


def _lazy(seeds: Callable[[], tuple[bytes, ...]]) -> Generator:
    def generate(rng: random.Random) -> bytes:
        return from_seeds(seeds())(rng)

    return generate


def _crdt(seeds: Callable[[], tuple[bytes, ...]]) -> Generator:
    """Mutations of ``seeds``, and now and then a large valid encoding (as is, or with a
    few bytes changed: structural mutation of half a megabyte is slow)."""

    def generate(rng: random.Random) -> bytes:
        if rng.random() < 0.01:
            bulk = rng.choice(bulk_crdt_seeds())
            return bulk if rng.random() < 0.5 else mutate_bytes(rng, bulk)
        return from_seeds(seeds())(rng)

    return generate


def _card_json_seeds() -> tuple[str, ...]:
    return tuple(c.to_json() for c in cards())


ENTRIES: list[Entry] = [
    Entry("frame", _frame_input, run_frame),
    Entry("card.msgpack", _card_bytes, run_card_bytes),
    Entry("card.json", _json_input(_card_json_seeds), run_card_json),
    Entry("card.dict", _tree_of(_card_seeds), run_card_dict),
    Entry("envelope.msgpack", _lazy(envelope_seeds), run_envelope_msgpack),
    Entry("envelope.json", _json_input(envelope_json_seeds), run_envelope_json),
    Entry("envelope.dict", _tree_of(envelope_seeds), run_envelope_dict),
    Entry("registry", _lazy(lambda: (registry_seed(),)), run_registry),
    Entry("tool.json", from_json_seeds(tool_seeds()), run_tool),
    Entry("dht.datagram", _datagram_input, run_datagram),
    Entry("dht.rpc", _rpc_input, run_rpc),
    Entry("dht.value", _value_input, run_value),
    Entry("dht.collector", _collector_input, run_collector),
    Entry("dht.record", _record_input, run_record),
    Entry(
        "dht.provider", _lazy(lambda: (provider_payload(), provider_payload("a", ""))), run_provider
    ),
    Entry("secure.handshake", handshake_input, run_handshake),
    Entry("secure.payload", _lazy(lambda: (INITIATOR.payload,)), run_payload),
    Entry("noise.message", noise_input, run_noise),
    Entry("framing", transport_input, run_transport),
    Entry("attach.session", session_input, run_session),
    Entry("crdt.clock", _lazy(clock_seeds), run_clock),
    Entry("crdt.delta", _crdt(delta_seeds), run_delta),
    Entry("crdt.sealed", _crdt(sealed_seeds), run_sealed),
    Entry("crdt.gossip", _crdt(gossip_frames), run_gossip),
    Entry("crdt.gossip_payload", _lazy(gossip_payload_seeds), run_gossip_payload),
    Entry("peer_id", _lazy(lambda: _PEER_ID_SEEDS), run_peer_id),
]
