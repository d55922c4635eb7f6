"""The Kademlia RPC as a sans-IO core: calls, the pending table, reply matching, timeouts.

Theory of operation (docs/protocol/dht.md §2-3). :class:`RpcCore` owns every
RPC transaction of one node and nothing else: no sockets, no trio, no clock
reads. Bytes and events go in and out:

* **Calls out.** :meth:`RpcCore.call` allocates a random 20-byte message id
  from the injected RNG, encodes the request (:mod:`p2pnode.dht.rpcwire`),
  queues the datagram for :meth:`RpcCore.datagrams_to_send` and records the
  call in the pending table with a hard deadline ``now + timeout``. At most
  ``max_pending`` calls are pending; one more is refused (LocalError BUSY),
  so a flood of work cannot grow the table without bound.
* **Datagrams in.** :meth:`RpcCore.receive_datagram_untrusted` decodes one
  datagram into events: a request becomes :class:`RequestReceived` (the
  driver answers it with :meth:`RpcCore.reply`); a response becomes
  :class:`ReplyReceived` only if its message id is pending *and* it comes
  from the address the request went to (§2; stock matches by id only, which
  lets anyone who learns an id answer for another node). Anything else is a
  :class:`DatagramDropped` with a :class:`DropReason`: malformed, unknown id,
  wrong address, a late reply after the timeout, or a reply to a call the
  caller abandoned. A call leaves the pending table on its first reply, so
  a duplicate never counts twice (it is a reply to an unknown id).
* **Time.** Deadlines are hard (§6: "abandoned after the hard timeout").
  :meth:`RpcCore.next_deadline` says when the driver must call
  :meth:`RpcCore.handle_timer`, which turns every expired call into a
  :class:`CallTimedOut`. :meth:`RpcCore.receive_datagram_untrusted` first
  expires what is due, so a reply processed after its deadline is late
  whether or not the driver's timer ran first.

Each call moves through :class:`CallState` by the transition table
``_TRANSITIONS``. A bounded memory of the calls that ended without their
reply (timed out or abandoned: the replies that can still come) lets such a
reply be reported for what it is rather than as unknown. Answered calls are
not remembered: most calls are answered, and the memory costs a node about
a hundred bytes per entry.
"""

from __future__ import annotations

import enum
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.dht import rpcwire

Address = tuple[str, int]
"""A UDP address, ``(host, port)`` (the same shape as :data:`p2pnode.transport.net.Address`)."""

#: Tries at drawing a message id that is not in use before giving up (a fair RNG
#: collides with probability 2**-160; a broken one must not loop for ever).
_ID_ATTEMPTS = 8


class CallState(enum.Enum):
    """Where one outgoing call stands."""

    PENDING = "pending"  # sent, waiting for its reply or its deadline
    ANSWERED = "answered"  # the matching reply arrived
    TIMED_OUT = "timed_out"  # the hard deadline passed first
    ABANDONED = "abandoned"  # the caller gave up (cancel)


_TRANSITIONS: dict[CallState, frozenset[CallState]] = {
    CallState.PENDING: frozenset({CallState.ANSWERED, CallState.TIMED_OUT, CallState.ABANDONED}),
    CallState.ANSWERED: frozenset(),
    CallState.TIMED_OUT: frozenset(),
    CallState.ABANDONED: frozenset(),
}


class DropReason(enum.Enum):
    """Why a datagram was dropped (the text is what the log says)."""

    MALFORMED = "malformed datagram"
    UNKNOWN_ID = "response to an unknown message id"
    WRONG_ADDRESS = "response from another address than the request went to"
    LATE = "response to a call that timed out"
    ABANDONED = "response to a call the caller gave up"


# A reply for a remembered call is dropped for the reason its final state gives.
_STRAY_REASON: dict[CallState, DropReason] = {
    CallState.TIMED_OUT: DropReason.LATE,
    CallState.ABANDONED: DropReason.ABANDONED,
}


# ---------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class RpcEvent:
    """Base of everything :class:`RpcCore` reports."""


@dataclass(frozen=True, slots=True)
class RequestReceived(RpcEvent):
    """A well-framed request to handle; ``args`` are not checked yet (rpcwire parsers do)."""

    msg_id: bytes
    method: str
    args: list[Any]
    #: Where the request came from, and where :meth:`RpcCore.reply` sends the answer.
    source: Address


@dataclass(frozen=True, slots=True)
class ReplyReceived(RpcEvent):
    """The reply to one of our calls, matched by message id and address."""

    msg_id: bytes
    method: str
    address: Address
    #: The bare msgpack value, not checked yet (the caller knows what ``method`` returns).
    value: Any
    #: Seconds between the call and this reply.
    rtt: float


@dataclass(frozen=True, slots=True)
class CallTimedOut(RpcEvent):
    """No reply to one of our calls before its hard deadline."""

    msg_id: bytes
    method: str
    address: Address


@dataclass(frozen=True, slots=True)
class DatagramDropped(RpcEvent):
    """A datagram that was not used; nothing is sent back (§2: failure is silence)."""

    source: Address
    reason: DropReason
    #: The reason with its particulars, for the log.
    detail: str


@dataclass(frozen=True, slots=True)
class OutgoingCall:
    """What :meth:`RpcCore.call` registered."""

    msg_id: bytes
    address: Address
    method: str
    #: When the call times out unless answered.
    deadline: float


class _Call:
    __slots__ = ("address", "deadline", "method", "msg_id", "sent_at", "state")

    def __init__(
        self, msg_id: bytes, address: Address, method: str, sent_at: float, deadline: float
    ) -> None:
        self.msg_id = msg_id
        self.address = address
        self.method = method
        self.sent_at = sent_at
        self.deadline = deadline
        self.state = CallState.PENDING


# ---------------------------------------------------------------------- the core


class RpcCore:
    """Sans-IO Kademlia RPC for one node: see the module docstring."""

    __slots__ = (
        "_finished",
        "_last_deadline",
        "_out",
        "_pending",
        "_remember",
        "_rng",
        "_to",
        "max_pending",
        "timeout",
    )

    def __init__(
        self,
        *,
        rng: random.Random,
        timeout: float = 5.0,
        max_pending: int = 1024,
        remember: int = 64,
    ) -> None:
        """``rng`` draws message ids; ``timeout`` is every call's hard timeout (seconds);
        ``remember`` bounds the memory of calls that ended without a reply (0: none).

        Raises LocalError(INVALID_ARGUMENT) for a non-positive timeout or bound.
        """
        if timeout <= 0 or max_pending < 1 or remember < 0:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "timeout and max_pending must be > 0")
        self.timeout = timeout
        self.max_pending = max_pending
        self._rng = rng
        self._remember = remember
        # Insertion order is deadline order (see call()), so the head is the next timer.
        self._pending: OrderedDict[bytes, _Call] = OrderedDict()
        # Pending calls per destination address (admission asks, for every request).
        self._to: dict[Address, int] = {}
        # Oldest first (dict order); bounded by ``remember``.
        self._finished: dict[bytes, CallState] = {}
        self._last_deadline = float("-inf")
        self._out: list[tuple[bytes, Address]] = []

    # ------------------------------------------------------------------ queries

    @property
    def pending(self) -> int:
        """How many calls wait for a reply."""
        return len(self._pending)

    def state_of(self, msg_id: bytes) -> CallState | None:
        """The state of ``msg_id`` while pending or remembered (not once answered), else None."""
        call = self._pending.get(msg_id)
        return call.state if call is not None else self._finished.get(msg_id)

    def awaiting(self, address: Address) -> bool:
        """True while a call to ``address`` waits for its reply."""
        return address in self._to

    def next_deadline(self) -> float | None:
        """When :meth:`handle_timer` has work: the earliest deadline pending, or None."""
        if not self._pending:
            return None
        return next(iter(self._pending.values())).deadline

    def datagrams_to_send(self) -> list[tuple[bytes, Address]]:
        """Datagrams to send now, oldest first, each with its destination; clears the queue."""
        out, self._out = self._out, []
        return out

    def send_later(self, datagrams: list[tuple[bytes, Address]]) -> None:
        """Put back datagrams the driver took but could not send, ahead of newer ones."""
        self._out[:0] = datagrams

    # ------------------------------------------------------------------ calls out

    def call(self, address: Address, method: str, args: list[Any], now: float) -> OutgoingCall:
        """Start one call: queue its request and hold it pending until a reply or the deadline.

        Raises LocalError: BUSY when ``max_pending`` calls are pending,
        MESSAGE_TOO_LARGE when the request does not fit a datagram,
        INVALID_ARGUMENT for a method that is not a Kademlia RPC.
        """
        msg_id, deadline = self.start(address, method, args, now)
        return OutgoingCall(msg_id, address, method, deadline)

    def start(
        self, address: Address, method: str, args: list[Any], now: float
    ) -> tuple[bytes, float]:
        """:meth:`call` without its :class:`OutgoingCall` record (for drivers that start
        calls by the thousand): the message id and the deadline. Raises as :meth:`call`."""
        # Calls past their deadline still count until handle_timer reports them:
        # the driver's timer runs at next_deadline(), so they never linger long.
        if len(self._pending) >= self.max_pending:
            raise LocalError(ErrorCode.BUSY, f"{self.max_pending} RPCs already pending")
        if method not in rpcwire.METHODS:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"unknown RPC {method!r}")
        msg_id = self._new_id()
        datagram = rpcwire.encode_request(msg_id, method, args)
        # Deadlines never decrease, so the pending table stays in deadline order
        # and the next timer is its head (a clock that steps back only delays a timeout).
        deadline = max(now + self.timeout, self._last_deadline)
        self._last_deadline = deadline
        self._pending[msg_id] = _Call(msg_id, address, method, now, deadline)
        self._to[address] = self._to.get(address, 0) + 1
        self._out.append((datagram, address))
        return msg_id, deadline

    def cancel(self, msg_id: bytes) -> bool:
        """The caller gives up on ``msg_id``: no event will follow, a later reply is dropped.

        Returns False if the call was not pending (already answered, timed out or unknown).
        """
        call = self._pending.pop(msg_id, None)
        if call is None:
            return False
        self._finish(call, CallState.ABANDONED)
        self._compact()
        return True

    def handle_timer(self, now: float) -> list[CallTimedOut]:
        """Time out every call whose deadline is at or before ``now``, oldest first."""
        out: list[CallTimedOut] = []
        pending = self._pending
        # Bounded by the table's size; each step removes one call.
        while pending:
            call = next(iter(pending.values()))
            if call.deadline > now:
                break
            pending.popitem(last=False)
            self._finish(call, CallState.TIMED_OUT)
            out.append(CallTimedOut(call.msg_id, call.method, call.address))
        self._compact()
        return out

    # ------------------------------------------------------------------ datagrams in

    def receive_datagram_untrusted(
        self, data: bytes, source: Address, now: float
    ) -> list[RpcEvent]:
        """Process one datagram from ``source``: the calls that timed out by ``now``
        (as :meth:`handle_timer`), then exactly one event for the datagram itself.

        Never raises for anything in ``data``: bad input is a :class:`DatagramDropped`.
        """
        events: list[RpcEvent] = []
        if self._pending and next(iter(self._pending.values())).deadline <= now:
            events.extend(self.handle_timer(now))
        try:
            is_request, msg_id, body = rpcwire.decode_parts_untrusted(data)
        except rpcwire.RpcError as exc:
            events.append(DatagramDropped(source, DropReason.MALFORMED, exc.message))
            return events
        if is_request:
            events.append(RequestReceived(msg_id, body[0], body[1], source))
        else:
            events.append(self._match(msg_id, body, source, now))
        return events

    def reply(self, request: RequestReceived, value: Any) -> None:
        """Queue the answer ``value`` to ``request`` (sent to where it came from).

        Raises LocalError(MESSAGE_TOO_LARGE) when the answer does not fit a datagram.
        """
        self._out.append((rpcwire.encode_response(request.msg_id, value), request.source))

    # ------------------------------------------------------------------ internals

    def _match(self, msg_id: bytes, value: Any, source: Address, now: float) -> RpcEvent:
        call = self._pending.get(msg_id)
        if call is None:
            held = self._finished.get(msg_id)
            reason = DropReason.UNKNOWN_ID if held is None else _STRAY_REASON[held]
            return DatagramDropped(source, reason, reason.value)
        if call.address != source:
            # The call stays pending: the node it went to may still answer.
            reason = DropReason.WRONG_ADDRESS
            return DatagramDropped(source, reason, f"{reason.value} ({call.method})")
        del self._pending[msg_id]
        self._finish(call, CallState.ANSWERED)
        self._compact()
        return ReplyReceived(call.msg_id, call.method, call.address, value, now - call.sent_at)

    def _finish(self, call: _Call, state: CallState) -> None:
        if state not in _TRANSITIONS[call.state]:
            raise LocalError(ErrorCode.ILLEGAL_TRANSITION, f"call {call.state} -> {state}")
        call.state = state
        left = self._to[call.address] - 1
        if left:
            self._to[call.address] = left
        else:
            del self._to[call.address]
        if self._remember and state is not CallState.ANSWERED:
            # Only the id and the outcome: a node makes many calls, and this
            # memory exists to name stray replies, not to keep calls alive.
            finished = self._finished
            finished[call.msg_id] = state
            if len(finished) > self._remember:
                del finished[next(iter(finished))]

    def _compact(self) -> None:
        # A dict never shrinks as it empties: a burst of calls (a publisher's stores)
        # would keep its peak table, kilobytes, for the node's life.
        if not self._pending:
            self._pending = OrderedDict()
            self._to = {}

    def _new_id(self) -> bytes:
        for _ in range(_ID_ATTEMPTS):
            msg_id = self._rng.randbytes(rpcwire.MSG_ID_BYTES)
            if msg_id not in self._pending and msg_id not in self._finished:
                return msg_id
        raise LocalError(ErrorCode.INTERNAL, "the message id generator repeats itself")


__all__ = [
    "Address",
    "CallState",
    "CallTimedOut",
    "DatagramDropped",
    "DropReason",
    "OutgoingCall",
    "ReplyReceived",
    "RequestReceived",
    "RpcCore",
    "RpcEvent",
]
