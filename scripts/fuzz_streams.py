"""The fuzzer's byte-stream protocols: Noise handshakes, transport framing, agent sessions.

Inputs here are streams cut into the chunks they arrive in. Handshake inputs are
built with fixed ephemeral keys (:mod:`fuzz_seeds`), so a mutated payload can be
carried inside a message that still authenticates; transport inputs are frames
sealed with the receiver's key around hostile record layouts; agent-session
inputs are JSON lines of the agent protocol (``agent.sock``) with one line bent.
"""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass

from fuzz_mutate import mutate_any, mutate_bytes, mutate_json, mutate_msgpack, random_bytes
from fuzz_seeds import (
    INITIATOR,
    NOW_MS,
    RESPONDER,
    FixedKeys,
    reply_with_payload,
    transcript,
    transcripts,
)

from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode
from p2pnode.services.attach.session import (
    NEED_DATA,
    PAUSED,
    AgentSession,
    Answer,
    Attach,
    Closed,
    Detach,
    DocOp,
    Request,
    Send,
    SessionState,
)
from p2pnode.services.attach.wire import AttachError, object_untrusted
from p2pnode.transport.aead import seal_in_place
from p2pnode.transport.framing import TransportCodec
from p2pnode.transport.noise import IK, NN, XX, CipherState, HandshakeState, NoiseTransport
from p2pnode.transport.secure import PROLOGUE, HandshakeStage, SecureHandshake, SecureIdentity

# --------------------------------------------------------------------------- Noise


@dataclass(frozen=True, slots=True)
class HandshakeInput:
    """Bytes for one side of a handshake, cut into the chunks they arrive in."""

    initiator: bool
    pattern: str
    chunks: tuple[bytes, ...]


def run_handshake(x: HandshakeInput) -> None:
    hs = SecureHandshake(
        INITIATOR if x.initiator else RESPONDER,
        initiator=x.initiator,
        now=0.0,
        timeout=10.0,
        remote_static=RESPONDER.static_public if x.initiator and x.pattern == "IK" else None,
        generate_keypair=FixedKeys(1 if x.initiator else 2),
    )
    for i, chunk in enumerate(x.chunks):
        if hs.stage is HandshakeStage.DONE:
            break  # what follows belongs to the transport (the channel takes it over)
        hs.receive_data_untrusted(chunk, float(i))
        hs.data_to_send()
    if hs.stage is HandshakeStage.DONE:
        hs.result()


def cut(rng: random.Random, data: bytes) -> tuple[bytes, ...]:
    """``data`` as it may arrive: whole, or in a few pieces."""
    if not data or rng.random() < 0.6:
        return (data,)
    cuts = sorted(rng.randrange(len(data) + 1) for _ in range(rng.randrange(1, 4)))
    pieces, last = [], 0
    for c in [*cuts, len(data)]:
        pieces.append(data[last:c])
        last = c
    return tuple(p for p in pieces if p) or (data,)


def _payload_variant(rng: random.Random, payload: bytes) -> bytes:
    return mutate_msgpack(rng, payload) if rng.random() < 0.8 else mutate_any(rng, payload)


def handshake_input(rng: random.Random) -> HandshakeInput:
    pattern = rng.choice(("XX", "IK"))
    initiator = rng.random() < 0.4
    t = transcripts()[pattern]
    roll = rng.random()
    if initiator:
        if roll < 0.35:
            data = reply_with_payload(pattern, _payload_variant(rng, RESPONDER.payload))
        elif roll < 0.45:
            data = rng.choice((b"\x00\x00\x01", b"\x00\x00", b"\x04\x01" + bytes(1025)))
        else:
            data = mutate_any(rng, t.responder_reply) if roll < 0.97 else t.responder_reply
    elif roll < 0.35:
        mutated = _payload_variant(rng, INITIATOR.payload)
        alt = (
            transcript(pattern, first_payload=mutated)
            if pattern == "IK"
            else transcript(pattern, last_payload=mutated)
        )
        data = alt.initiator_first + alt.initiator_last
    elif roll < 0.45:
        data = rng.choice((b"\x02X", b"\x01Z", b"\x01", b"\x01X\x00\x00", b"\x01X\xff\xff"))
        data += random_bytes(rng)
    else:
        whole = t.initiator_first + t.initiator_last
        data = mutate_any(rng, whole) if roll < 0.97 else whole
    return HandshakeInput(initiator, pattern, cut(rng, data))


def run_payload(data: bytes) -> None:
    # A fresh identity per input: the verified-payload cache must not hide the parser.
    verifier = SecureIdentity(RESPONDER.identity, RESPONDER.static, verified_cache=0)
    verifier.verify_payload_untrusted(data, INITIATOR.static_public)


@dataclass(frozen=True, slots=True)
class NoiseInput:
    pattern: str
    message: bytes


_NOISE_PATTERNS = {"NN": NN, "XX": XX, "IK": IK}


def run_noise(x: NoiseInput) -> None:
    pattern = _NOISE_PATTERNS[x.pattern]
    state = HandshakeState(
        pattern,
        initiator=False,
        prologue=PROLOGUE,
        static=RESPONDER.static,
        generate_keypair=FixedKeys(3),
    )
    state.read_message_untrusted(x.message)


def noise_input(rng: random.Random) -> NoiseInput:
    pattern = rng.choice(("NN", "XX", "IK"))
    seed = transcripts()["IK" if pattern == "IK" else "XX"].initiator_first[4:]
    roll = rng.random()
    if roll < 0.05:
        message = bytes(rng.choice((65536, 65535, 0)))
    elif roll < 0.1:
        message = random_bytes(rng)
    else:
        message = mutate_any(rng, seed)
    return NoiseInput(pattern, message)


# --------------------------------------------------------------------------- transport framing

_KEY = bytes(range(32))
_MAX_MESSAGE = 10_000


@dataclass(frozen=True, slots=True)
class TransportInput:
    """Transport bytes arriving in ``chunks`` at the given times, then maybe EOF."""

    chunks: tuple[tuple[float, bytes], ...]
    eof: bool


def run_transport(x: TransportInput) -> None:
    transport = NoiseTransport(CipherState(bytes(32)), CipherState(_KEY), b"\x00" * 64, None)
    codec = TransportCodec(
        transport, now=0.0, max_message_size=_MAX_MESSAGE, idle_timeout=60.0, frame_timeout=5.0
    )
    for now, chunk in x.chunks:
        codec.handle_timer(now)
        codec.receive_data_untrusted(chunk, now)
        while codec.next_message() is not None:
            pass
    if x.eof:
        codec.receive_eof_untrusted()


def records_plaintext(rng: random.Random) -> bytes:
    """Transport plaintext: records of many sizes, some announcing a size they lack."""
    out = bytearray()
    for _ in range(rng.randrange(0, 6)):
        size = rng.choice((0, 1, 5, 100, 4000, _MAX_MESSAGE, _MAX_MESSAGE + 1, 70_000))
        announced = size if rng.random() < 0.85 else rng.choice((2**32 - 1, size + 1, 0))
        out += struct.pack(">I", announced) + rng.randbytes(min(size, 70_000))
    if rng.random() < 0.2:
        out += rng.randbytes(rng.randrange(1, 4))  # a record header cut short
    return bytes(out)


def seal_frames(rng: random.Random, plaintext: bytes, key: bytes = _KEY) -> list[bytes]:
    """``plaintext`` encrypted as transport frames of random sizes, nonces from 0."""
    frames: list[bytes] = []
    pos, nonce = 0, 0
    while pos < len(plaintext) or not frames:
        size = min(len(plaintext) - pos, rng.choice((1, 7, 100, 5000, 65519)))
        buf = bytearray(2 + size + 16)
        buf[2 : 2 + size] = plaintext[pos : pos + size]
        seal_in_place(key, struct.pack("<4xQ", nonce), buf, 0, size)
        frames.append(bytes(buf))
        pos += size
        nonce += 1
    return frames


def hostile_frames(rng: random.Random, key: bytes = _KEY) -> list[bytes]:
    """Sealed frames, sometimes one of them corrupted, dropped, replayed or re-sized."""
    frames = seal_frames(rng, records_plaintext(rng), key)
    roll = rng.random()
    if roll < 0.1:
        frames = [random_bytes(rng)]
    elif roll < 0.4:
        i = rng.randrange(len(frames))
        change = rng.randrange(4)
        if change == 0:
            frames[i] = mutate_any(rng, frames[i])
        elif change == 1:
            del frames[i]  # the nonces after it no longer match
        elif change == 2:
            frames.insert(i, frames[i])  # a replay
        else:
            frames[i] = rng.choice((b"\x00\x0f", b"\x00\x00", b"\xff\xff")) + frames[i][2:]
    return frames


def transport_input(rng: random.Random) -> TransportInput:
    stream = b"".join(hostile_frames(rng))
    chunks = cut(rng, stream)
    times = sorted(rng.choice((0.0, 1.0, 4.0, 6.0, 61.0)) for _ in chunks)
    return TransportInput(tuple(zip(times, chunks, strict=True)), rng.random() < 0.2)


# --------------------------------------------------------------------------- agent sessions

#: The request the node forwards to the attached agent, which its ``reply`` lines answer.
_FORWARDED = Envelope("req-1", "bravo", "helper", MessageType.REQUEST, NOW_MS, {"q": 1})
_ATTACH_LINE = {
    "v": 1,
    "op": "attach",
    "id": 1,
    "card": {
        "id": "helper",
        "name": "Helper",
        "description": "helps",
        "version": "1.0.0",
        "tier": 2,
        "sandboxId": "sb-1",
        "capabilities": [{"id": "plan.make", "name": "Plan", "inputSchema": {"type": "object"}}],
    },
}
_OP_LINES = (
    {"op": "send", "id": 2, "to": "bravo", "type": "notification", "payload": {"x": [1, 2]}},
    {"op": "request", "id": "r3", "to": "plan.make", "capability": True, "timeout": 5},
    {"op": "reply", "id": 4, "to": "req-1", "type": "response", "payload": {"ok": True}},
    {
        "op": "reply",
        "id": 5,
        "to": "req-1",
        "type": "error",
        "payload": {"code": "X", "message": "m", "details": {}},
    },
    {"op": "doc.subscribe", "id": 6, "doc": "d"},
    {"op": "doc.update", "id": 7, "doc": "d", "update": {"op": "counter.add", "path": ["n"]}},
    {"op": "doc.read", "id": 8, "doc": "d"},
    {"op": "detach", "id": 9},
)


def session_input(rng: random.Random) -> bytes:
    lines = [json.dumps(_ATTACH_LINE)]
    lines += [json.dumps(op) for op in rng.sample(_OP_LINES, rng.randrange(len(_OP_LINES) + 1))]
    roll = rng.random()
    if roll < 0.7:
        i = rng.randrange(len(lines))
        bent = mutate_json(rng, lines[i])
        lines[i] = bent.decode("utf-8", "replace") if isinstance(bent, bytes) else bent
    stream = ("\n".join(lines) + "\n").encode()
    return mutate_bytes(rng, stream) if roll > 0.9 else stream


def run_session(data: bytes) -> None:
    """Drive a session as the node's driver would (every op succeeds); the process must be
    able to read every line the node writes back. An error reply is the outcome."""
    session = AgentSession()
    session.receive_data(data)
    session.receive_data(b"")
    out = bytearray()
    for _ in range(1024):  # each turn consumes a line or ends the loop
        event = session.next_event()
        if event is NEED_DATA or isinstance(event, Closed):
            break
        if event is PAUSED:
            if session.state is SessionState.ATTACHING or not session.has_output():
                raise AssertionError(f"session paused with nothing to wait for ({session.state})")
        elif isinstance(event, Attach):
            session.attach_succeeded(event.card.id, {"agent": event.card.id})
            session.deliver(_FORWARDED, now=0.0)
        elif isinstance(event, Detach):
            session.op_succeeded(event.ref, None)
        elif isinstance(event, Send | Request | DocOp | Answer):
            session.op_succeeded(event.ref, {"done": True})
        out += session.data_to_send()
        session.send_done()
    out += session.data_to_send()
    errors = []
    for line in bytes(out).splitlines():
        try:
            reply = object_untrusted(line)
        except AttachError as exc:
            raise AssertionError(f"the node wrote a line no process can read: {exc}") from exc
        if reply.get("ok") is False:
            errors.append(reply["error"])
    if errors:
        code = errors[0].get("code")
        known = ErrorCode(code) if code in ErrorCode.__members__ else ErrorCode.INTERNAL
        raise AttachError(known, str(errors[0].get("message")))
