"""Answers too large for one envelope, sent as a stream (docs/protocol/tools.md §5).

A peer refuses a frame holding a string over 1 MiB (the envelope decoding
limits), so an answer whose msgpack encoding is larger than
:data:`INLINE_LIMIT` cannot go in one ``response``. The answering agent
sends, in order, all correlated to the request:

1. ``stream-start``: ``{"bytes": n, "chunks": k, "sha256": hex}``;
2. ``k`` ``stream-data``: ``{"seq": i, "data": base64}``, ``i = 0..k-1``, each
   carrying at most :data:`CHUNK_BYTES` of the answer's msgpack encoding;
3. ``stream-end``: ``{"chunks": k}``;
4. the ``response``: ``{"stream": {"bytes": n, "chunks": k, "sha256": hex}}``.

The requester's node collects the parts of a request it is waiting for
(:class:`ReplyStream`, before any policy, as it does replies: only the agents
the request went to may answer it), then checks the count, the size and the
digest and decodes the answer in place of the response's payload. Answers
over :data:`MAX_STREAMED_BYTES` are refused by both ends
(``MESSAGE_TOO_LARGE``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Awaitable, Callable
from typing import Any

from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.core.jsonutil import b64decode, b64encode, is_flat_json_map, is_json_value
from p2pnode.core.wire import WireLimits, pack, unpack_untrusted
from p2pnode.node.router import REPLY_STREAM_TYPES

#: An answer whose msgpack is larger than this is streamed (the largest string a
#: peer decodes in one frame).
INLINE_LIMIT = 1024 * 1024
#: Answer bytes per ``stream-data`` (base64 of it stays well under the string limit).
CHUNK_BYTES = 512 * 1024
#: The largest answer streamed.
MAX_STREAMED_BYTES = 64 * 1024 * 1024
STREAM_TYPES = REPLY_STREAM_TYPES
_ANSWER_LIMITS = WireLimits(
    max_size=MAX_STREAMED_BYTES,
    max_str_len=MAX_STREAMED_BYTES,
    max_bin_len=MAX_STREAMED_BYTES,
)


def stream_parts(payload: Any) -> tuple[list[tuple[MessageType, Any]], Any] | None:
    """The stream parts and the final response payload for ``payload``, or None when it
    fits one envelope. Raises LocalError(MESSAGE_TOO_LARGE) past MAX_STREAMED_BYTES."""
    if surely_inline(payload):
        return None
    data = pack(payload)
    if len(data) <= INLINE_LIMIT:
        return None
    if len(data) > MAX_STREAMED_BYTES:
        raise LocalError(
            ErrorCode.MESSAGE_TOO_LARGE,
            f"the answer is {len(data)} bytes, more than {MAX_STREAMED_BYTES} streamed",
        )
    chunks = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
    summary = {
        "bytes": len(data),
        "chunks": len(chunks),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    parts: list[tuple[MessageType, Any]] = [(MessageType.STREAM_START, summary)]
    parts += [
        (MessageType.STREAM_DATA, {"seq": i, "data": b64encode(c)}) for i, c in enumerate(chunks)
    ]
    parts.append((MessageType.STREAM_END, {"chunks": len(chunks)}))
    return parts, {"stream": summary}


def surely_inline(payload: Any) -> bool:
    """True when ``payload`` packs within INLINE_LIMIT, known at a glance: a scalar, or a
    map of at most 16 entries with keys and strings of at most 4,096 characters and
    scalars, at most 16 * 2 * (5 + 4 * 4,096) + 5 = 524,453 bytes (most tool answers)."""
    kind = type(payload)
    if kind is float or kind is bool or payload is None:
        return True
    if kind is int:
        return bool(-(2**63) <= payload < 2**64)  # what msgpack packs
    return is_flat_json_map(payload, max_str_len=4096, max_items=16, max_key_len=4096)


#: Answers ``to`` from local agent ``sender`` (see Routing.reply).
ReplyFunction = Callable[[str, Envelope, MessageType, Any, str | None], Awaitable[ErrorCode | None]]


async def reply_streamed(
    reply: ReplyFunction,
    sender: str,
    to: Envelope,
    type: MessageType,
    payload: Any,
    peer: str | None = None,
) -> ErrorCode | None:
    """``reply``, streaming a response too large for one envelope first (the module
    docstring); one too large even for that is answered with ``MESSAGE_TOO_LARGE``."""
    try:
        streamed = stream_parts(payload) if type is MessageType.RESPONSE else None
    except P2PError as exc:
        error = RemoteError(exc.code, exc.message, agentId=sender)
        return await reply(sender, to, MessageType.ERROR, error.to_dict(), peer)
    if streamed is None:
        return await reply(sender, to, type, payload, peer)
    parts, final = streamed
    for part_type, part in parts:
        code = await reply(sender, to, part_type, part, peer)
        if code is not None:
            return code
    return await reply(sender, to, type, final, peer)


class ReplyStream:
    """The stream parts received for one pending request (see the module docstring).
    A part out of protocol ends the stream with :attr:`problem` set; what was
    buffered is dropped, so a peer cannot grow it past what it declared."""

    __slots__ = ("_chunks", "_declared", "_ended", "_received", "problem")

    def __init__(self) -> None:
        self._declared: dict[str, Any] | None = None
        self._chunks: list[bytes] = []
        self._received = 0
        self._ended = False
        self.problem: str | None = None

    def take(self, envelope: Envelope) -> None:
        """Add one part. Never raises: a violation sets :attr:`problem`."""
        if self.problem is not None:
            return
        try:
            self._take(envelope.type, envelope.payload)
        except (KeyError, TypeError, ValueError) as exc:
            self._fail(f"malformed {envelope.type.value}: {exc}")

    def _take(self, type: MessageType, payload: Any) -> None:
        if not isinstance(payload, dict):
            raise TypeError("payload is not an object")
        if type is MessageType.STREAM_START:
            size, count, digest = payload["bytes"], payload["chunks"], payload["sha256"]
            if self._declared is not None:
                return self._fail("a second stream-start")
            if not (isinstance(size, int) and 0 < size <= MAX_STREAMED_BYTES):
                return self._fail(f"bytes must be 1-{MAX_STREAMED_BYTES}")
            if not (isinstance(count, int) and count == -(-size // CHUNK_BYTES)):
                return self._fail("chunks does not match bytes")
            if not (isinstance(digest, str) and len(digest) == 64):
                return self._fail("sha256 must be 64 hex digits")
            self._declared = {"bytes": size, "chunks": count, "sha256": digest}
        elif type is MessageType.STREAM_DATA:
            if self._declared is None or self._ended:
                return self._fail("stream-data outside a stream")
            data = b64decode(payload["data"])
            if payload["seq"] != len(self._chunks) or data is None or len(data) > CHUNK_BYTES:
                return self._fail("stream-data out of order or malformed")
            self._received += len(data)
            if self._received > self._declared["bytes"]:
                return self._fail("more data than declared")
            self._chunks.append(data)
        else:
            if self._declared is None or payload["chunks"] != len(self._chunks):
                return self._fail("stream-end does not match the data")
            self._ended = True
        return None

    def _fail(self, problem: str) -> None:
        self.problem = problem
        self._chunks = []

    def assemble(self, reply: Envelope) -> Envelope:
        """``reply`` (the response ending the stream) with the streamed answer as its
        payload. Raises RemoteError(MALFORMED_MESSAGE) for a stream out of protocol."""
        summary = reply.payload.get("stream") if isinstance(reply.payload, dict) else None
        problem = self.problem
        if problem is None and (not self._ended or summary != self._declared):
            problem = "the response does not match the stream"
        data = b"".join(self._chunks)
        declared = self._declared or {}
        if problem is None and hashlib.sha256(data).hexdigest() != declared.get("sha256"):
            problem = "sha256 does not match"
        if problem is None:
            try:
                answer = unpack_untrusted(data, _ANSWER_LIMITS)
            except P2PError as exc:
                problem = exc.message
            else:
                if is_json_value(answer):
                    return dataclasses.replace(reply, payload=answer)
                problem = "the answer is not JSON data"
        raise RemoteError(
            ErrorCode.MALFORMED_MESSAGE,
            f"streamed answer from {reply.sender}: {problem}",
            responder=reply.sender,
        )


__all__ = [
    "CHUNK_BYTES",
    "INLINE_LIMIT",
    "MAX_STREAMED_BYTES",
    "STREAM_TYPES",
    "ReplyFunction",
    "ReplyStream",
    "reply_streamed",
    "stream_parts",
    "surely_inline",
]
