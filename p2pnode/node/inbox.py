"""The inboxes of a node's local agents, bounded by count and by bytes.

Each hosted agent (:class:`LocalAgent`) has a bounded memory channel that its
own task reads (p2pnode.node.agents). The count bound (``inbox_size``) gives
back-pressure; it does not bound memory, since an envelope may hold up to
4 MiB. So every envelope queued is also charged, at its approximate size
(:func:`p2pnode.core.envelope.envelope_size`), to the peer that sent it and to the
node's total in one :class:`InboxBudget` shared by the node's agents; the
charge is released when the agent's task takes the envelope. An envelope that
would take its peer's or the total past the budget is refused with ``BUSY``
instead of queued (docs/protocol/node.md "Limits"), so one peer cannot make
the node hold more than its share of bytes. What a peer queued is released as
the agent works through it, and once the peer left (no channel to it) its
envelopes are taken out unread.

The inbox is also where a request's *call* is found again. A request whose
handler waits (p2pnode.node.agents) becomes a :class:`RunningCall` in its
agent's :attr:`LocalAgent.calls`, keyed by the requesting peer, the
requesting agent and the request id, with the cancel scope that bounds it.
A cancel notification from that same requester (p2pnode.node.callcancel)
cancels it on delivery, without being queued. At most
:attr:`LocalAgent.max_calls` handlers of an agent wait at once; while that
many do and its inbox is full by count, a further request is refused with
``BUSY`` and a retry hint instead of holding its peer's channel.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import trio

from p2pnode.agent.definition import Agent
from p2pnode.core.card import AgentCard
from p2pnode.core.envelope import Envelope, MessageType, Metadata, envelope_size
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.identity import PeerId
from p2pnode.node.callcancel import CANCELLED, cancelled_request_untrusted

#: Bytes of envelopes from one peer queued in the node's inboxes at most.
DEFAULT_INBOX_BYTES_PER_PEER = 16 * 1024 * 1024
#: Bytes of envelopes queued in all of the node's inboxes at most.
DEFAULT_INBOX_BYTES = 128 * 1024 * 1024
#: The budget key of envelopes sent by the node's own agents.
LOCAL = "local"
#: Request handlers of one agent that may wait at once (``NodeConfig.agent_concurrency``).
DEFAULT_MAX_CALLS = 64

_NOTIFICATION = MessageType.NOTIFICATION
_REQUEST = MessageType.REQUEST

#: A running call's key: the requesting peer (None: this node), agent and request id.
CallKey = tuple[str | None, str, str]


class InboxBudget:
    """Bytes queued in a node's inboxes, per sending peer and in total (see the module
    docstring). Sync and exact: a charge is taken before an envelope is queued and
    released when it is taken out."""

    __slots__ = ("_by_peer", "_max_bytes", "_max_per_peer", "departed", "total")

    def __init__(
        self,
        max_bytes: int = DEFAULT_INBOX_BYTES,
        max_bytes_per_peer: int = DEFAULT_INBOX_BYTES_PER_PEER,
    ) -> None:
        self._max_bytes = max_bytes
        self._max_per_peer = max_bytes_per_peer
        self._by_peer: dict[str, int] = {}
        self.total = 0
        #: Peers that left with envelopes queued: those are taken out unread (routing's
        #: sweep sets it, p2pnode.node.routing.Routing.release_departed).
        self.departed: set[str] = set()

    def charge(self, peer: str, size: int) -> None:
        """Take ``size`` bytes for ``peer``. Raises LocalError(BUSY) over either budget."""
        held = self._by_peer.get(peer, 0)
        if held + size > self._max_per_peer or self.total + size > self._max_bytes:
            raise LocalError(
                ErrorCode.BUSY,
                f"inboxes full: {held} bytes queued from {peer} (budget "
                f"{self._max_per_peer}), {self.total} in all (budget {self._max_bytes})",
                queued=held,
                budget=self._max_per_peer,
            )
        self._by_peer[peer] = held + size
        self.total += size

    def release(self, peer: str, size: int) -> None:
        left = self._by_peer.get(peer, 0) - size
        if left > 0:
            self._by_peer[peer] = left
        else:
            self._by_peer.pop(peer, None)
        self.total -= size

    def peers(self) -> list[str]:
        """Remote peers with envelopes queued."""
        return [p for p in self._by_peer if p != LOCAL]

    def bytes_of(self, peer: str) -> int:
        """Bytes queued from ``peer``."""
        return self._by_peer.get(peer, 0)


@dataclass(slots=True)
class Queued:
    """An envelope in an inbox, with the peer it came from (None: a local agent) and the
    bytes charged for it."""

    envelope: Envelope
    peer: str | None
    size: int
    #: The sending peer's id (``peer`` is its text): the link an answer is written to.
    peer_id: PeerId | None = None


@dataclass(slots=True, eq=False)
class RunningCall:
    """A request whose handler is waiting: the scope that bounds it, and its deadline
    (trio clock). ``by_caller`` is set when its requester cancelled it."""

    key: CallKey
    #: The request, as it was queued (whom to answer).
    item: Queued
    scope: trio.CancelScope
    deadline: float
    #: The deadline's length in seconds, for the TIMEOUT answer.
    limit: float
    by_caller: bool = False

    def cancel_by_caller(self) -> None:
        self.by_caller = True
        self.scope.cancel()


@dataclass(slots=True)
class LocalAgent:
    """An agent hosted by this node: its card, definition (handlers) and bounded inbox."""

    card: AgentCard
    definition: Agent
    inbox_send: trio.MemorySendChannel[Queued]
    inbox_receive: trio.MemoryReceiveChannel[Queued]
    budget: InboxBudget = dataclasses.field(default_factory=InboxBudget)
    #: Request handlers that may wait at once (the module docstring).
    max_calls: int = DEFAULT_MAX_CALLS
    #: What its envelopes carry when the caller gives no metadata: built once per card.
    metadata: Metadata = dataclasses.field(init=False)
    #: Requests whose handler is waiting, by :data:`CallKey`.
    calls: dict[CallKey, RunningCall] = dataclasses.field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.set_card(self.card)

    def set_card(self, card: AgentCard) -> None:
        self.card = card
        self.metadata = Metadata(int(card.tier), card.sandbox_id)

    async def deliver(
        self,
        envelope: Envelope,
        peer: str | None = None,
        peer_id: PeerId | None = None,
        size: int | None = None,
    ) -> None:
        """Queue ``envelope`` (from ``peer``, whose id is ``peer_id``; None: a local agent)
        for the agent's handler; waits while the inbox is full by count (back-pressure).
        ``size`` is its :func:`~p2pnode.core.envelope.envelope_size` when the caller has it.

        Raises LocalError(BUSY) when its bytes would exceed the peer's or the node's
        inbox budget, or for a request when the inbox is full while :attr:`max_calls`
        handlers wait (``details.retryAfterMs``: when the first of them reaches its
        deadline); LocalError(CHANNEL_CLOSED) once the node closed the inbox.
        """
        if self.deliver_nowait(envelope, peer, peer_id, size):
            return
        if envelope.type is _REQUEST and len(self.calls) >= self.max_calls:
            raise self._saturated()
        if size is None:
            size = envelope_size(envelope)
        key = LOCAL if peer is None else peer
        self.budget.charge(key, size)
        try:
            await self.inbox_send.send(Queued(envelope, peer, size, peer_id))
        except BaseException as exc:
            self.budget.release(key, size)  # closed, or cancelled while waiting: never queued
            if isinstance(exc, trio.ClosedResourceError | trio.BrokenResourceError):
                raise self._closed() from None
            raise

    def deliver_nowait(
        self,
        envelope: Envelope,
        peer: str | None = None,
        peer_id: PeerId | None = None,
        size: int | None = None,
    ) -> bool:
        """Queue ``envelope`` as :meth:`deliver` does when the inbox has room: True when
        queued, False (nothing charged) when it is full by count. Raises as deliver.
        A cancel notification is taken here (True), never queued."""
        if envelope.type is _NOTIFICATION and self._take_cancel(envelope, peer):
            return True
        if size is None:
            size = envelope_size(envelope)
        key = LOCAL if peer is None else peer
        self.budget.charge(key, size)
        try:
            self.inbox_send.send_nowait(Queued(envelope, peer, size, peer_id))
        except trio.WouldBlock:
            self.budget.release(key, size)
            return False
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            self.budget.release(key, size)
            raise self._closed() from None
        return True

    def _take_cancel(self, envelope: Envelope, peer: str | None) -> bool:
        """True when ``envelope`` (from ``peer``) is a cancel notification: the call it
        names, from that requester, is cancelled; one naming no running call is ignored."""
        meta = envelope.metadata
        if meta is None or meta.capability != CANCELLED:
            return False
        request_id = cancelled_request_untrusted(envelope.payload)
        if request_id is not None:
            call = self.calls.get((peer, envelope.sender, request_id))
            if call is not None:
                call.cancel_by_caller()
        return True

    def _saturated(self) -> LocalError:
        """BUSY for a request that finds the agent at its limit of waiting handlers."""
        now = trio.current_time()
        soonest = min((c.deadline for c in self.calls.values()), default=now)
        retry_ms = max(1, math.ceil((soonest - now) * 1000))
        return LocalError(
            ErrorCode.BUSY,
            f"agent {self.card.id} is running {len(self.calls)} calls (its limit) and its "
            f"inbox is full: retry in {retry_ms} ms",
            retryAfterMs=retry_ms,
            limit=self.max_calls,
        )

    def _closed(self) -> LocalError:
        return LocalError(
            ErrorCode.CHANNEL_CLOSED, f"agent {self.card.id} is closed: the node is closing"
        )

    def taken(self, item: Queued) -> Envelope | None:
        """Release the charge of ``item``, just taken from the inbox; its envelope, or None
        when its peer left meanwhile (nobody to answer: it is dropped unread)."""
        self.budget.release(LOCAL if item.peer is None else item.peer, item.size)
        if item.peer is not None and item.peer in self.budget.departed:
            return None
        return item.envelope


__all__ = [
    "DEFAULT_INBOX_BYTES",
    "DEFAULT_INBOX_BYTES_PER_PEER",
    "DEFAULT_MAX_CALLS",
    "LOCAL",
    "CallKey",
    "InboxBudget",
    "LocalAgent",
    "Queued",
    "RunningCall",
]
