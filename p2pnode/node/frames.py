"""Node frames: what one secure-channel message between two nodes carries.

Every application message on a node-to-node channel is one msgpack array
``[kind, body]``:

* ``[0, {"cards": [card bytes, ...], "addresses": ["host:port", ...],
  "withdrawn"?: [withdrawal bytes, ...], "incarnation"?: bytes}]`` — HELLO, sent
  by both sides right after the handshake and again whenever the sender's local
  cards change (with ``withdrawn`` when it stopped hosting agents: signed
  withdrawals, p2pnode.core.withdrawal). Each card and withdrawal must be owned by
  the authenticated peer; the receiver rejects the whole frame otherwise.
  Addresses that are not ``host:port`` (port 0-65535) are dropped.
  ``incarnation``, random per process start, tells a peer that restarted (under
  the same key) from one whose connection was only lost.
* ``[1, envelope plain form]`` — ENVELOPE (see the data-model chapter).
* ``[2, [envelope plain form, ...]]`` — ENVELOPES: several envelopes in one
  message, as :meth:`Node.send_many` writes a burst for one peer. Each one is
  checked on its own; an invalid one is dropped and reported, the others
  are accepted.

Unknown kinds are a protocol error (``MALFORMED_MESSAGE``): the channel stays
open, the frame is dropped and a security event names the peer.

A frame of envelopes that the decoder's limits refuse (a string over 1 MiB,
an array or map over 65,536 items, nesting past 32 levels) is read again
member by member: the members within the limits are decoded as usual, and of
each member over them the header fields alone (id, sender, recipient, type,
correlation id, timestamp, schema version; payload and metadata skipped
unread) identify a :class:`Refused` envelope, which the node answers
(docs/protocol/node.md, "Refusals"). What cannot be read so is the frame's
error, as before.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import msgpack

from p2pnode.core.card import AgentCard, is_address
from p2pnode.core.envelope import Envelope, EnvelopeError, envelope_header_untrusted
from p2pnode.core.errors import ErrorCode, RemoteError
from p2pnode.core.wire import (
    LIMIT_CODES,
    WireError,
    WireLimits,
    array_header,
    pack,
    unpack_untrusted,
)
from p2pnode.core.withdrawal import Withdrawal

MAX_FRAME_BYTES = 4 * 1024 * 1024
MAX_HELLO_CARDS = 64
#: Bytes of the incarnation a node sends (random at start); at most MAX_INCARNATION read.
INCARNATION_BYTES = 8
MAX_INCARNATION = 32
_LIMITS = WireLimits(max_size=MAX_FRAME_BYTES)


class FrameKind(enum.IntEnum):
    HELLO = 0
    ENVELOPE = 1
    ENVELOPES = 2


class FrameError(RemoteError):
    """A peer sent a frame that is not a valid node frame."""


@dataclass(frozen=True, slots=True)
class Hello:
    """A peer's current cards and listening addresses, and the withdrawals of the agents
    it stopped hosting (each still to be checked against the sending peer)."""

    cards: tuple[AgentCard, ...]
    addresses: tuple[str, ...]
    withdrawals: tuple[Withdrawal, ...] = ()
    #: Random per start of the sending process (None: a peer that sends none).
    incarnation: bytes | None = None


@dataclass(frozen=True, slots=True)
class Refused:
    """An envelope a decoding limit refused, known by its header fields."""

    #: The envelope without its payload (None) and metadata (None), which were not read.
    envelope: Envelope
    #: MESSAGE_TOO_LARGE, TOO_MANY_ITEMS or NESTING_TOO_DEEP; details ``bound``, ``limit``.
    error: RemoteError


@dataclass(frozen=True, slots=True)
class EnvelopeBatch:
    """The valid envelopes of an ENVELOPES frame, in order, and why the others were not:
    ``rejected`` the ones that cannot be attributed, ``refused`` the ones over a decoding
    limit whose header identifies them (a frame of one such envelope is a batch too)."""

    envelopes: tuple[Envelope, ...]
    rejected: tuple[RemoteError, ...] = ()
    refused: tuple[Refused, ...] = ()


Frame = Hello | Envelope | EnvelopeBatch


def encode_hello(
    cards: list[AgentCard],
    addresses: list[str],
    withdrawals: list[Withdrawal] | None = None,
    incarnation: bytes | None = None,
) -> bytes:
    """A HELLO frame; the ``withdrawn`` key only when there are withdrawals, so a HELLO
    without any reads as it always did, and ``incarnation`` when given."""
    body: dict[str, Any] = {"cards": [c.to_bytes() for c in cards], "addresses": addresses}
    if withdrawals:
        body["withdrawn"] = [w.to_bytes() for w in withdrawals]
    if incarnation is not None:
        body["incarnation"] = incarnation
    return pack([FrameKind.HELLO, body])


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
    raw_withdrawals = body.get("withdrawn", [])
    if not isinstance(raw_withdrawals, list) or len(raw_withdrawals) > MAX_HELLO_CARDS:
        raise FrameError(ErrorCode.MALFORMED_MESSAGE, "hello withdrawals must be a short list")
    withdrawals = []
    for raw in raw_withdrawals:
        if not isinstance(raw, bytes):
            raise FrameError(ErrorCode.MALFORMED_MESSAGE, "hello withdrawal must be bytes")
        withdrawals.append(Withdrawal.from_bytes_untrusted(raw))
    incarnation = body.get("incarnation")
    if incarnation is not None and (
        not isinstance(incarnation, bytes) or not 0 < len(incarnation) <= MAX_INCARNATION
    ):
        raise FrameError(
            ErrorCode.MALFORMED_MESSAGE, f"hello incarnation must be 1-{MAX_INCARNATION} bytes"
        )
    # Only what a node can dial: anything else is dropped here, not handed on.
    dialable = tuple([a for a in addresses if is_address(a)][:16])
    return Hello(tuple(cards), dialable, tuple(withdrawals), incarnation)


def decode_frame_untrusted(data: bytes) -> Frame:
    """Decode one node frame. Raises RemoteError (FrameError, EnvelopeError, WireError, card
    errors). A frame of envelopes over a decoding limit is an :class:`EnvelopeBatch` of its
    members within the limits and the :class:`Refused` ones (see the module docstring)."""
    try:
        obj = unpack_untrusted(data, _LIMITS)
    except WireError as exc:
        if exc.details.get("bound") not in LIMIT_CODES or exc.details.get("bound") == "size":
            raise
        return _salvage_untrusted(data, exc)
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


# -- frames over a decoding limit -------------------------------------------------------------

#: Limits for reading a frame's outline (its array, kind and member count); members are
#: skipped, which reads their bytes without building anything.
_OUTLINE = {
    "raw": False,
    "max_str_len": 0,
    "max_bin_len": 0,
    "max_array_len": _LIMITS.max_array_len,
    "max_map_len": 0,
    "max_ext_len": 0,
}


def _members_untrusted(data: bytes) -> tuple[list[memoryview], WireLimits]:
    """The bytes of each envelope of an ENVELOPE or ENVELOPES frame, and the limits a
    member is decoded with (the frame's, less the levels the frame's arrays take).
    Raises any exception when ``data`` is not such a frame (the caller translates)."""
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(data), 1), **_OUTLINE)
    unpacker.feed(data)
    if unpacker.read_array_header() != 2:
        raise ValueError("not [kind, body]")
    kind = unpacker.unpack()
    if type(kind) is not int or kind not in (FrameKind.ENVELOPE, FrameKind.ENVELOPES):
        raise ValueError("not a frame of envelopes")
    count, levels = (1, 1) if kind == FrameKind.ENVELOPE else (unpacker.read_array_header(), 2)
    if count > _LIMITS.max_array_len:  # read_array_header does not apply the limit
        raise ValueError("too many members")
    members = []
    view = memoryview(data)  # members are views: a frame of 4 MiB is not copied again
    for _ in range(count):
        start = unpacker.tell()
        unpacker.skip()
        members.append(view[start : unpacker.tell()])
    if unpacker.tell() != len(data):
        raise ValueError("trailing bytes")
    limits = WireLimits(max_size=_LIMITS.max_size, max_depth=_LIMITS.max_depth - levels)
    return members, limits


def _refusal(exc: WireError, bound: str) -> RemoteError:
    """The refusal of a member over a limit; depth is counted from the frame, as the
    decoder of a whole frame counts it, whatever kind of frame carried the member."""
    if bound == "depth":
        limit = _LIMITS.max_depth
        message = f"the envelope nests deeper than a frame's {limit} levels"
        return RemoteError(LIMIT_CODES[bound], message, bound=bound, limit=limit)
    return RemoteError(LIMIT_CODES[bound], exc.message, **exc.details)


def _salvage_untrusted(data: bytes, cause: WireError) -> EnvelopeBatch:
    """The batch of a frame of envelopes that ``cause`` (a decoding limit) refused. Raises
    ``cause`` when the frame cannot be read member by member."""
    try:
        members, limits = _members_untrusted(data)
    except Exception:  # msgpack's errors, a frame of another shape: the frame's error
        raise cause from None
    envelopes: list[Envelope] = []
    rejected: list[RemoteError] = []
    refused: list[Refused] = []
    for member in members:
        try:
            envelopes.append(Envelope.from_dict_untrusted(unpack_untrusted(member, limits)))
        except EnvelopeError as exc:
            rejected.append(exc)
        except WireError as exc:
            header = envelope_header_untrusted(member)
            bound = exc.details.get("bound")
            if header is None or bound not in LIMIT_CODES:
                rejected.append(exc)
            else:
                refused.append(Refused(header, _refusal(exc, bound)))
    if not refused and not envelopes:
        raise cause
    return EnvelopeBatch(tuple(envelopes), tuple(rejected), tuple(refused))


__all__ = [
    "EnvelopeBatch",
    "EnvelopeError",
    "Frame",
    "FrameError",
    "FrameKind",
    "Hello",
    "Refused",
    "decode_frame_untrusted",
    "encode_envelope",
    "encode_envelopes",
    "encode_hello",
    "merge_envelope_frames",
]
