"""What the routing driver (p2pnode.node.routing) holds while an envelope is on its way:
a route waiting for its peer's batch to be written, the frames of a burst, and a
request waiting for its reply."""

from __future__ import annotations

import math
from dataclasses import dataclass

import trio

from p2pnode.core.card import AgentCard
from p2pnode.core.envelope import Envelope
from p2pnode.node.frames import MAX_FRAME_BYTES, encode_envelope, encode_envelopes
from p2pnode.node.replystream import ReplyStream
from p2pnode.node.router import RoutingResult


@dataclass(slots=True)
class Route:
    """An envelope routed to a remote agent, waiting for its peer's batch to be written."""

    envelope: Envelope
    target: AgentCard
    start: float
    result: RoutingResult | None = None

    def done(self) -> RoutingResult:
        assert self.result is not None, "results are read only after a successful write"
        return self.result


def frames_of(envelopes: list[Envelope]) -> list[bytes]:
    """One ENVELOPES frame for a burst; one ENVELOPE frame each when there is one, or
    when together they exceed the frame limit (the channel then refuses only the
    envelope that is too large by itself)."""
    if len(envelopes) > 1:
        frame = encode_envelopes(envelopes)
        if len(frame) <= MAX_FRAME_BYTES:
            return [frame]
    return [encode_envelope(e) for e in envelopes]


class PendingRequest:
    """A request waiting for its response (or for its deadline, on the trio clock)."""

    __slots__ = ("deadline", "event", "reply", "stream", "targets")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.reply: Envelope | None = None
        #: The parts of an answer streamed before the response (p2pnode.node.replystream).
        self.stream: ReplyStream | None = None
        # The agents that may answer (several for a broadcast); known once routing
        # resolved the recipient.
        self.targets: tuple[str, ...] | None = None
        self.deadline = math.inf  # set once the request is on its way


__all__ = ["PendingRequest", "Route", "frames_of"]
