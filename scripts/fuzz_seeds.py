"""Valid encodings for the fuzzer, made by the project's own constructors.

Every seed is a real object (identities from fixed seeds, cards built and
signed through :class:`AgentCard`, envelopes from an :class:`EnvelopeFactory`
with an injected clock and RNG, CRDT deltas from a signing :class:`Replica`, DHT
records from :meth:`SignedRecord.create`, handshake messages from
:class:`HandshakeState`), so the same seed always gives the same bytes.

Signed containers hide their insides from blind mutation: a flipped byte in
a record's payload only reaches the signature check. The *re-signing*
generators here mutate the inside first and sign the result again with the
fixed identity, so the parsers behind the signature see hostile data too.
"""

from __future__ import annotations

import functools
import random
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from fuzz_mutate import mutate_any, mutate_msgpack, unpack_plain

from p2pnode.core.card import AgentCard, Capability, Endpoint
from p2pnode.core.envelope import Envelope, EnvelopeFactory, MessageType, Metadata
from p2pnode.core.errors import P2PError
from p2pnode.core.identity import Identity
from p2pnode.core.registry import Registry
from p2pnode.core.wire import pack
from p2pnode.crdt.clock import VectorClock
from p2pnode.crdt.delta import Delta
from p2pnode.crdt.dots import DotContext
from p2pnode.crdt.gossip import DeltaBatch, DeltaPush, Digest, Graft, IHave, Prune
from p2pnode.crdt.ops import CounterAdd, MapRemove, RegisterSet, SetAdd, SetRemove
from p2pnode.crdt.replica import Document, Replica
from p2pnode.crdt.types import DocState
from p2pnode.dht import rpcwire
from p2pnode.dht.records import (
    MAX_TTL_MS,
    ProviderInfo,
    RecordKind,
    SignedRecord,
    agent_capability,
    capability_key,
    card_agent_id_untrusted,
    card_key,
    encode_value,
)
from p2pnode.node.frames import encode_envelope, encode_envelopes, encode_hello
from p2pnode.services.shared.docops import gossip_payload
from p2pnode.services.tools.audit import ToolInvocation
from p2pnode.transport.noise import IK, XX, HandshakeState, KeyPair
from p2pnode.transport.secure import PROLOGUE, SecureIdentity

#: Unix milliseconds every seed is stamped with (records and cards are valid then).
NOW_MS = 1_800_000_000_000
OWNER = Identity(bytes(range(32)))
PEER = Identity(b"\x02" * 32)
AUTHORITY = Identity(b"\xaa" * 32)
#: Signs the CRDT seeds' deltas and checkpoints (a replica id is its peer id text).
WRITER = Identity(b"\x0c" * 32)
BULK = Identity(b"\x0d" * 32)
DOC = "shared-doc"
CAPABILITY = "plan.make"
MSG_ID = bytes(range(20))


def card(owner: Identity, agent_id: str, *, tier: int = 1, rich: bool = True) -> AgentCard:
    """A signed card of ``owner``; ``rich`` fills every optional field."""
    base = AgentCard(
        id=agent_id,
        name=agent_id.title(),
        version="1.2.0",
        public_key=owner.public_key,
        tier=tier,
        capabilities=(Capability(CAPABILITY, "Make plans"),),
        issued_at=NOW_MS,
        expires_at=NOW_MS + 10 * 3600 * 1000,
    )
    if rich:
        schema = {"type": "object", "properties": {"goal": {"type": "string"}}, "x": [1, 2.5]}
        base = replace(
            base,
            description="plans things",
            endpoints=(Endpoint("tcp+noise", "10.0.0.2:7000"), Endpoint("local")),
            capabilities=(
                Capability(CAPABILITY, "Make plans", "a plan", schema, {"type": "array"}),
                Capability("agent.ping", "Ping"),
                Capability(f"crdt:{DOC}", "doc", "replicated"),
            ),
            revision=3,
            sandbox_id="sandbox-1",
            addresses=("10.0.0.2:7000", "[::1]:7001"),
            noise_static_key=SecureIdentity(owner).static_public,
        ).with_endorsement(AUTHORITY)
    return base.signed(owner)


@functools.cache
def cards() -> tuple[AgentCard, ...]:
    return (
        card(OWNER, "planner"),
        card(OWNER, "lean", rich=False),
        card(PEER, "bravo", tier=2),
        card(PEER, "gamma", tier=3, rich=False),
    )


def envelopes(sender: str = "bravo", recipient: str = "alpha") -> list[Envelope]:
    factory = EnvelopeFactory(clock_ms=lambda: NOW_MS, random_bytes=lambda n: b"\x07" * n)
    meta = Metadata(tier=2, sandbox_id="sandbox-1")
    request = factory.create(sender, recipient, MessageType.REQUEST, {"q": [1, "two", None]})
    frames = gossip_frames()
    return [
        request,
        factory.reply(request, sender, MessageType.RESPONSE, {"ok": True}),
        factory.create(sender, "*", MessageType.NOTIFICATION, "hello", metadata=meta),
        factory.create(
            sender,
            CAPABILITY,
            MessageType.REQUEST,
            [1.5, -3],
            metadata=Metadata(routing_hint="capability", escalation_justification="why not"),
        ),
        factory.create(
            sender,
            recipient,
            MessageType.STREAM_DATA,
            gossip_payload(DOC, frames[0]),
            metadata=meta,
        ),
        factory.create(sender, recipient, MessageType.STREAM_DATA, gossip_payload(DOC, frames[1])),
        factory.create(sender, recipient, MessageType.TASK_PROPOSAL, {"task": "t"}),
        factory.reply(request, sender, MessageType.ERROR, {"code": "INTERNAL", "message": "m"}),
    ]


@functools.cache
def envelope_seeds() -> tuple[bytes, ...]:
    return tuple(e.to_msgpack() for e in envelopes())


@functools.cache
def envelope_json_seeds() -> tuple[str, ...]:
    out = []
    for e in envelopes():
        if not isinstance(e.payload, dict) or "frame" not in e.payload:
            out.append(e.to_json())
    return tuple(out)


@functools.cache
def frame_seeds() -> tuple[bytes, ...]:
    envs = envelopes()
    return (
        encode_hello([cards()[2], cards()[3]], ["10.0.0.2:7000", "bad address"]),
        *(encode_envelope(e) for e in envs),
        encode_envelopes(envs[:3]),
        encode_envelopes(envs[4:6]),
    )


@functools.cache
def registry_seed() -> bytes:
    registry = Registry()
    for c in cards():
        registry.merge_remote(c, NOW_MS)
    return registry.to_bytes()


@functools.cache
def tool_seeds() -> tuple[str, ...]:
    return (
        ToolInvocation(
            "planner.search", "planner", {"q": "x"}, [1, 2], None, 1.5, NOW_MS
        ).to_json(),
        ToolInvocation("planner.fail", "planner", [], None, "boom", 3, NOW_MS).to_json(),
    )


# --------------------------------------------------------------------------- CRDT


@functools.cache
def crdt_replica_ops() -> tuple[Any, ...]:
    return (
        CounterAdd(("hits",), 3),
        CounterAdd(("grow",), 2, grow_only=True),
        RegisterSet(("title",), "draft", 5),
        RegisterSet(("blob",), b"\x00\x01", 6),
        SetAdd(("tags",), "red"),
        SetAdd(("tags",), 7),
        SetAdd(("nested", "deep", "set"), b"x"),
        SetRemove(("tags",), "red"),
        CounterAdd(("nested", "n"), -4),
        MapRemove(("grow",)),
    )


@functools.cache
def _busy_document() -> Document:
    replica = Replica("base", max_log=1024)
    for op in crdt_replica_ops():
        replica.update(DOC, op)
    for _ in range(1000):
        replica.update(DOC, CounterAdd(("hits",), 1))
    return replica.document(DOC)


#: The replica the CRDT inputs are applied to. No seed names it: inputs that forge this
#: replica's own operations at the counter limit stop its writes (LocalError), a known
#: consequence of unauthenticated replica ids rather than a decoding defect.
LOCAL_REPLICA = "fuzz-local"


def base_replica(replica_id: str = LOCAL_REPLICA) -> Replica:
    """A replica holding ``DOC`` with one value of every CRDT kind (written by ``"base"``)
    and a nearly full delta log (work proportional to the log shows), copied from one
    built once."""
    d = _busy_document()
    replica = Replica(replica_id, max_log=1024)
    copy = Document(
        d.state.copy(), d.applied.copy(), OrderedDict(d.log), dict(d.floor), dict(d.checkpoints)
    )
    replica.restore(DOC, copy)
    return replica


def signing_replica(identity: Identity, **kwargs: Any) -> Replica:
    """A replica that signs its deltas with ``identity``."""
    return Replica(str(identity.peer_id), signer=identity, **kwargs)


@functools.cache
def bulk_crdt_seeds() -> tuple[bytes, ...]:
    """Large valid encodings: a delta whose context names tens of thousands of origins, a
    checkpoint of a set of 5,000 elements, a batch of 1,024 deltas (what a peer can send
    within the size limits), all signed."""
    rng = random.Random(5)
    many = DotContext(
        {f"v{i}": rng.randrange(1, 9) for i in range(4096)},
        [(f"o{i}", rng.randrange(2, 9)) for i in range(60_000)],
    )
    bulk = str(BULK.peer_id)
    wide = Delta(DOC, bulk, 1, VectorClock({bulk: 1}), DocState(ctx=many)).sign(BULK).sealed
    writer = signing_replica(BULK)
    deltas = [writer.update(DOC, SetAdd(("tags",), i)) for i in range(5000)]
    doc = writer.document(DOC)
    big = Delta(DOC, bulk, 5000, doc.clock(), doc.state.copy(), first=1).sign(BULK)
    return (
        wide,
        big.sealed,
        big.encode(),
        DeltaBatch(tuple(d.sealed for d in deltas[-1024:])).encode(),
    )


@functools.cache
def deltas() -> tuple[Delta, ...]:
    """Signed deltas of every kind of operation, and the writer's checkpoints."""
    replica = signing_replica(WRITER, checkpoint_every=4)
    out = [replica.update(DOC, op) for op in crdt_replica_ops()]
    checkpoint = replica.checkpoint(DOC, replica.replica_id)
    assert checkpoint is not None and checkpoint.is_checkpoint
    return (*out, checkpoint)


@functools.cache
def delta_seeds() -> tuple[bytes, ...]:
    """Delta bodies (what the origin signs)."""
    return tuple(d.encode() for d in deltas())


@functools.cache
def sealed_seeds() -> tuple[bytes, ...]:
    """Sealed deltas and a checkpoint, as peers send them."""
    return tuple(d.sealed for d in deltas())


@functools.cache
def clock_seeds() -> tuple[bytes, ...]:
    return (
        VectorClock({"a": 1, "b": 2**40}).encode(),
        VectorClock().encode(),
        deltas()[-1].clock.encode(),
    )


@functools.cache
def gossip_frames() -> tuple[bytes, ...]:
    ds = deltas()
    return (
        DeltaPush.of(ds[0]).encode(),
        Digest(DOC, VectorClock({str(WRITER.peer_id): 2})).encode(),
        Digest(DOC, VectorClock(), reply=True).encode(),
        DeltaBatch(tuple(d.sealed for d in ds[:4])).encode(),
        DeltaPush.of(ds[-1]).encode(),  # the checkpoint
        DeltaPush.of(ds[5], hops=3).encode(),
        # The broadcast tree's control frames (gossip version 3).
        IHave(DOC, tuple((d.origin, d.first, d.seq) for d in ds[:3])).encode(),
        Graft(DOC).encode(),
        Graft(
            DOC, ((ds[0].origin, ds[0].first, ds[0].seq), (ds[-1].origin, 1, ds[-1].seq))
        ).encode(),
        Prune(DOC).encode(),
    )


@functools.cache
def gossip_payload_seeds() -> tuple[bytes, ...]:
    return tuple(pack(gossip_payload(DOC, f)) for f in gossip_frames())


# --------------------------------------------------------------------------- DHT


def provider_payload(cap: str = CAPABILITY, agent: str = "planner") -> bytes:
    return ProviderInfo(cap, agent, (("10.0.0.1", 7000), ("::1", 7001))).to_bytes()


@functools.cache
def records() -> tuple[SignedRecord, ...]:
    planner = cards()[0]
    exp = NOW_MS + 3600 * 1000
    ck = card_key(OWNER.peer_id, planner.id)
    return (
        SignedRecord.create(OWNER, RecordKind.CARD, ck, 3, exp, planner.to_bytes()),
        SignedRecord.create(
            OWNER, RecordKind.PROVIDER, capability_key(CAPABILITY), 3, exp, provider_payload()
        ),
        SignedRecord.create(
            PEER,
            RecordKind.PROVIDER,
            capability_key(CAPABILITY),
            1,
            exp,
            provider_payload(agent="bravo"),
        ),
        SignedRecord.create(
            OWNER,
            RecordKind.PROVIDER,
            capability_key(agent_capability("planner")),
            3,
            exp,
            provider_payload(agent_capability("planner")),
        ),
    )


@functools.cache
def value_seeds() -> tuple[bytes, ...]:
    recs = records()
    return (encode_value([recs[0]]), encode_value([recs[1], recs[2]]), encode_value([recs[3]]))


_RECORD_SIGNERS = {OWNER.public_key: OWNER, PEER.public_key: PEER}


def resigned_record(rng: random.Random) -> SignedRecord:
    """A record whose payload (and sometimes revision or expiry) is hostile but whose
    signature and key binding are right, so the payload parsers are reached."""
    seed = rng.choice(records())
    payload = seed.payload
    roll = rng.random()
    if roll < 0.7:
        payload = mutate_msgpack(rng, payload) if roll < 0.55 else mutate_any(rng, payload)
    key = seed.key
    try:
        if seed.kind is RecordKind.CARD:
            key = card_key(seed.publisher, card_agent_id_untrusted(payload))
        else:
            key = capability_key(ProviderInfo.from_bytes_untrusted(payload).capability)
    except Exception:  # the parsers' own bugs are for the runners to find, not here
        pass
    revision, expires = seed.revision, seed.expires_at
    if rng.random() < 0.15:
        revision = rng.choice((0, 2**63 - 1, 2**64 - 1))
    if rng.random() < 0.15:
        expires = rng.choice((0, NOW_MS, NOW_MS + MAX_TTL_MS + 1, 2**63 - 1))
    signer = _RECORD_SIGNERS[seed.public_key]
    return SignedRecord.create(signer, seed.kind, key, revision, expires, payload)


def resigned_value(rng: random.Random) -> bytes:
    recs = [resigned_record(rng) for _ in range(rng.choice((1, 1, 2, 3)))]
    if rng.random() < 0.3:
        recs.append(rng.choice(records()))
    return pack([r.to_bytes() for r in recs])


def resigned_card(rng: random.Random, owner: Identity, seeds: tuple[AgentCard, ...]) -> bytes:
    """A card's bytes mutated then, when the result is still a valid card, signed again by
    ``owner``: valid but unusual cards reach registries and policies."""
    data = mutate_msgpack(rng, rng.choice(seeds).to_bytes())
    try:
        parsed = AgentCard.from_bytes_untrusted(data, verify=False)
    except Exception:  # the parsers' own bugs are for the runners to find, not here
        return data
    if parsed.public_key != owner.public_key:
        return data
    try:
        return parsed.signed(owner).to_bytes()
    except P2PError:
        return data


@functools.cache
def datagram_seeds() -> tuple[bytes, ...]:
    node_id = OWNER.peer_id.raw
    key = capability_key(CAPABILITY)
    contacts = [[bytes([i]) * 20, f"10.0.0.{i}", 4000 + i] for i in range(1, 4)]
    return (
        rpcwire.encode_request(MSG_ID, "ping", [node_id]),
        rpcwire.encode_request(MSG_ID, "store", [node_id, key, value_seeds()[1]]),
        rpcwire.encode_request(MSG_ID, "find_node", [node_id, key]),
        rpcwire.encode_request(MSG_ID, "find_value", [node_id, key]),
        rpcwire.encode_request(MSG_ID, "stun", []),
        rpcwire.encode_response(MSG_ID, node_id),
        rpcwire.encode_response(MSG_ID, True),
        rpcwire.encode_response(MSG_ID, contacts),
        rpcwire.encode_response(MSG_ID, {"value": value_seeds()[1]}),
        rpcwire.encode_response(MSG_ID, ["10.0.0.9", 4000]),
    )


def mutate_datagram(rng: random.Random, datagram: bytes) -> bytes:
    """Mutate the msgpack body of a datagram (keeping or bending its 21-byte header)."""
    header, body = datagram[: rpcwire.HEADER_BYTES], datagram[rpcwire.HEADER_BYTES :]
    roll = rng.random()
    if roll < 0.1:
        return mutate_any(rng, datagram)
    if roll < 0.2:
        header = bytes([rng.choice((0, 1, 2, 255))]) + header[1 : rng.choice((21, 21, 5))]
    elif roll < 0.5 and body[:1] != b"":
        obj = unpack_plain(body)
        if isinstance(obj, list) and len(obj) == 2 and isinstance(obj[1], list):
            # A request: a hostile value in place of one argument, or a re-signed value.
            args = obj[1]
            if args and rng.random() < 0.5:
                args[rng.randrange(len(args))] = resigned_value(rng)
                return header + pack(obj)
    return header + mutate_any(rng, body)


# --------------------------------------------------------------------------- Noise


class FixedKeys:
    """Ephemeral keys from a seeded stream: handshakes replay byte for byte."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def __call__(self) -> KeyPair:
        return KeyPair.from_private(self._rng.randbytes(32))


INITIATOR = SecureIdentity(Identity(b"\x11" * 32))
RESPONDER = SecureIdentity(Identity(b"\x22" * 32))


@dataclass(frozen=True, slots=True)
class Transcript:
    """One valid handshake: what each side sends, with fixed ephemeral keys."""

    pattern: str
    initiator_first: bytes  # preamble + first message
    responder_reply: bytes  # framed second message
    initiator_last: bytes  # framed third message (XX), else b""


def _frame(message: bytes) -> bytes:
    return len(message).to_bytes(2, "big") + message


def _tag(pattern: str) -> bytes:
    return b"\x01" + (b"X" if pattern == "XX" else b"I")


def initiator_state(pattern: str) -> HandshakeState:
    return HandshakeState(
        XX if pattern == "XX" else IK,
        initiator=True,
        prologue=PROLOGUE,
        static=INITIATOR.static,
        remote_static=RESPONDER.static_public if pattern == "IK" else None,
        generate_keypair=FixedKeys(1),
    )


def responder_state(pattern: str) -> HandshakeState:
    return HandshakeState(
        XX if pattern == "XX" else IK,
        initiator=False,
        prologue=PROLOGUE,
        static=RESPONDER.static,
        generate_keypair=FixedKeys(2),
    )


def transcript(
    pattern: str, *, first_payload: bytes | None = None, last_payload: bytes | None = None
) -> Transcript:
    """A handshake of ``pattern``; the initiator's identity payload may be replaced."""
    ini, res = initiator_state(pattern), responder_state(pattern)
    default_first = INITIATOR.payload if pattern == "IK" else b""
    m1 = ini.write_message(default_first if first_payload is None else first_payload)
    res.read_message_untrusted(m1)
    m2 = res.write_message(RESPONDER.payload)
    ini.read_message_untrusted(m2)
    m3 = b""
    if pattern == "XX":
        m3 = _frame(ini.write_message(INITIATOR.payload if last_payload is None else last_payload))
    return Transcript(pattern, _tag(pattern) + _frame(m1), _frame(m2), m3)


@functools.cache
def transcripts() -> dict[str, Transcript]:
    return {p: transcript(p) for p in ("XX", "IK")}


@functools.cache
def xx_transport_key() -> bytes:
    """The initiator's sending key after the fixed-key XX transcript (frames it sends next)."""
    ini, res = initiator_state("XX"), responder_state("XX")
    res.read_message_untrusted(ini.write_message(b""))
    ini.read_message_untrusted(res.write_message(RESPONDER.payload))
    ini.write_message(INITIATOR.payload)
    key = ini.transport().send.key
    assert key is not None
    return key


def reply_with_payload(pattern: str, payload: bytes) -> bytes:
    """The responder's framed second message carrying ``payload`` instead of its identity."""
    ini, res = initiator_state(pattern), responder_state(pattern)
    first = INITIATOR.payload if pattern == "IK" else b""
    res.read_message_untrusted(ini.write_message(first))
    return _frame(res.write_message(payload))
