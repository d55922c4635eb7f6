"""Node frames: what one secure-channel message between two nodes carries.

Every application message on a node-to-node channel is one msgpack array
``[kind, body]``:

* ``[0, {"cards": [card bytes, ...], "addresses": ["host:port", ...]}]`` —
  HELLO, sent by both sides right after the handshake and again whenever the
  sender's local cards change. Each card must be owned by the authenticated
  peer; the receiver rejects the whole frame otherwise. Addresses that are
  not ``host:port`` (port 0-65535) are dropped.
* ``[1, envelope plain form]`` — ENVELOPE (see the data-model chapter).
* ``[2, [envelope plain form, ...]]`` — ENVELOPES: several envelopes in one
  message, as :meth:`Node.send_many` writes a burst for one peer. Each one is
  checked on its own; an invalid one is dropped and reported, the others
  are accepted.

Unknown kinds are a protocol error (``MALFORMED_MESSAGE``): the channel stays
open, the frame is dropped and a security event names the peer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from p2pnode.card import AgentCard, is_address
from p2pnode.envelope import Envelope, EnvelopeError
from p2pnode.errors import ErrorCode, RemoteError
from p2pnode.wire import WireLimits, array_header, pack, unpack_untrusted

MAX_FRAME_BYTES = 4 * 1024 * 1024
MAX_HELLO_CARDS = 64
_LIMITS = WireLimits(max_size=MAX_FRAME_BYTES)


class FrameKind(enum.IntEnum):
    HELLO = 0
    ENVELOPE = 1
    ENVELOPES = 2


class FrameError(RemoteError):
    """A peer sent a frame that is not a valid node frame."""


@dataclass(frozen=True, slots=True)
class Hello:
    """A peer's current cards and listening addresses."""

    cards: tuple[AgentCard, ...]
    addresses: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class EnvelopeBatch:
    """The valid envelopes of an ENVELOPES frame, in order, and why the others were not."""

    envelopes: tuple[Envelope, ...]
    rejected: tuple[RemoteError, ...] = ()


Frame = Hello | Envelope | EnvelopeBatch


def encode_hello(cards: list[AgentCard], addresses: list[str]) -> bytes:
    return pack([FrameKind.HELLO, {"cards": [c.to_bytes() for c in cards], "addresses": addresses}])


def encode_envelope(envelope: Envelope) -> bytes:
    return pack([FrameKind.ENVELOPE, envelope.to_dict()])


def encode_envelopes(envelopes: list[Envelope]) -> bytes:
    """One ENVELOPES frame carrying ``envelopes`` in order."""
    return pack([FrameKind.ENVELOPES, [e.to_dict() for e in envelopes]])


_ENVELOPE_HEAD = bytes([0x92, FrameKind.ENVELOPE])  # msgpack fixarray of 2, kind 1
_ENVELOPES_HEAD = bytes([0x92, FrameKind.ENVELOPES])
_MAX_ARRAY_HEAD = 3  # msgpack array 16: 0xdc and two bytes of length


def merge_envelope_frames(frames: list[bytes], limit: int = MAX_FRAME_BYTES) -> list[bytes]:
    """``frames`` with each run of ENVELOPE frames rewritten as ENVELOPES frames of at
    most ``limit`` bytes: the same envelopes in the same order, in fewer messages for
    the peer to decrypt, decode and decide on. Other frames stay as and where they are."""
    if len(frames) < 2:
        return frames
    merged: list[bytes] = []
    run: list[bytes] = []
    run_size = len(_ENVELOPES_HEAD) + _MAX_ARRAY_HEAD
    for frame in frames:
        if frame[:2] != _ENVELOPE_HEAD:
            if run:
                merged.append(_envelopes_frame(run))
                run = []
            merged.append(frame)
            continue
        body_size = len(frame) - 2
        if run and (run_size + body_size > limit or len(run) == 0xFFFF):
            merged.append(_envelopes_frame(run))
            run = []
        if not run:
            run_size = len(_ENVELOPES_HEAD) + _MAX_ARRAY_HEAD
        run.append(frame)
        run_size += body_size
    if run:
        merged.append(_envelopes_frame(run))
    return merged


def _envelopes_frame(run: list[bytes]) -> bytes:
    """One ENVELOPES frame of the bodies of the ENVELOPE frames in ``run``, spliced as
    bytes (each body is already a complete msgpack map)."""
    if len(run) == 1:
        return run[0]
    return b"".join([_ENVELOPES_HEAD, array_header(len(run)), *[frame[2:] for frame in run]])


def _decode_envelopes_untrusted(body: Any) -> EnvelopeBatch:
    if not isinstance(body, list):
        raise FrameError(ErrorCode.MALFORMED_MESSAGE, "an envelopes body is an array")
    envelopes, rejected = [], []
    for plain in body:
        try:
            envelopes.append(Envelope.from_dict_untrusted(plain))
        except EnvelopeError as exc:
            rejected.append(exc)
    return EnvelopeBatch(tuple(envelopes), tuple(rejected))


def _decode_hello_untrusted(body: Any) -> Hello:
    if not isinstance(body, dict):
        raise FrameError(ErrorCode.MALFORMED_MESSAGE, "hello body must be a map")
    raw_cards, addresses = body.get("cards"), body.get("addresses", [])
    if not isinstance(raw_cards, list) or len(raw_cards) > MAX_HELLO_CARDS:
        raise FrameError(ErrorCode.MALFORMED_MESSAGE, "hello cards must be a short list")
    if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
        raise FrameError(ErrorCode.MALFORMED_MESSAGE, "hello addresses must be strings")
    cards = []
    for raw in raw_cards:
        if not isinstance(raw, bytes):
            raise FrameError(ErrorCode.MALFORMED_MESSAGE, "hello card must be bytes")
        cards.append(AgentCard.from_bytes_untrusted(raw))
    # Only what a node can dial: anything else is dropped here, not handed on.
    return Hello(tuple(cards), tuple([a for a in addresses if is_address(a)][:16]))


def decode_frame_untrusted(data: bytes) -> Frame:
    """Decode one node frame. Raises RemoteError (FrameError, EnvelopeError, card errors)."""
    obj = unpack_untrusted(data, _LIMITS)
    if not isinstance(obj, list) or len(obj) != 2 or not isinstance(obj[0], int):
        raise FrameError(ErrorCode.MALFORMED_MESSAGE, "a frame is [kind, body]")
    kind, body = obj
    if kind == FrameKind.ENVELOPE:
        return Envelope.from_dict_untrusted(body)
    if kind == FrameKind.ENVELOPES:
        return _decode_envelopes_untrusted(body)
    if kind == FrameKind.HELLO:
        return _decode_hello_untrusted(body)
    raise FrameError(ErrorCode.MALFORMED_MESSAGE, f"unknown frame kind {kind}")


__all__ = [
    "EnvelopeBatch",
    "EnvelopeError",
    "Frame",
    "FrameError",
    "FrameKind",
    "Hello",
    "decode_frame_untrusted",
    "encode_envelope",
    "encode_envelopes",
    "encode_hello",
    "merge_envelope_frames",
]
