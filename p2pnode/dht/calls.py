"""The trio side of outgoing RPCs: who waits for which call, and sending what the core queued.

Theory of operation: :class:`~p2pnode.dht.rpc.RpcCore` knows the pending
calls; :class:`Calls` knows who waits for each one. A call registers a
callback (:data:`OnResult`) under its message id; the node's receive loop
hands the core's :class:`~p2pnode.dht.rpc.ReplyReceived` and
:class:`~p2pnode.dht.rpc.CallTimedOut` events to :meth:`Calls.on_reply` and
:meth:`Calls.on_timeout`, which call it with the raw reply or
:data:`NO_REPLY`. Nothing here starts a task or opens a cancel scope per
call: a caller that awaits one result waits on an event (:meth:`Calls.call`),
a lookup takes each reply in its callback
(:class:`~p2pnode.dht.lookup_driver.LookupDriver`), a liveness ping just
updates the routing table from its callback.

Timers are the node's: its network sleeps to the node's next wake-up in one
timer (:meth:`~p2pnode.transport.net.Network.serve_datagrams`), exposed here as
:attr:`Calls.wake`; a new call whose deadline comes sooner pulls the timer's
deadline in.

:meth:`Calls.flush` sends what the core queued, each datagram with the
endpoint's ``sendto_nowait``: no pass of trio's scheduler per datagram and
no checkpoint, so a flush is never interrupted half-way by a timer. An
endpoint that raises (it was closed) gets the unsent datagrams back in the
core for the next flush.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import trio

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.dht.config import DhtStatistics
from p2pnode.dht.rpc import Address, CallTimedOut, ReplyReceived, RpcCore
from p2pnode.transport.net import DatagramEndpoint, Wake


class _NoReply(enum.Enum):
    NO_REPLY = "no reply"


#: What a call delivers when nobody answered before the hard timeout.
NO_REPLY = _NoReply.NO_REPLY
#: Gets a call's raw reply value, or :data:`NO_REPLY`.
OnResult = Callable[[Any], None]


class _Result:
    __slots__ = ("done", "value")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.value: Any = NO_REPLY

    def set(self, value: Any) -> None:
        self.value = value
        self.done.set()


class Calls:
    """Waiters of one node's outgoing calls, over its :class:`RpcCore` and endpoint."""

    __slots__ = ("_results", "core", "endpoint", "idle_wake", "stats", "wake")

    def __init__(self, core: RpcCore, stats: DhtStatistics) -> None:
        self.core = core
        self.stats = stats
        #: Where datagrams go out; set while the node runs.
        self.endpoint: DatagramEndpoint | None = None
        #: The node's timer while its network sleeps to it (None while the node works).
        self.wake: Wake | None = None
        #: When the receive loop must wake with no call pending (its other timers).
        self.idle_wake: Callable[[], float] | None = None
        self._results: dict[bytes, OnResult] = {}

    def call_nowait(
        self,
        address: Address,
        method: str,
        args: list[Any],
        on_result: OnResult,
        now: float | None = None,
    ) -> bytes | None:
        """Start one call at ``now`` (default: the clock's time); ``on_result`` gets the
        raw reply or NO_REPLY. :meth:`flush` sends it.

        Returns the message id, or None when ``max_pending`` calls are pending
        (``on_result`` then got NO_REPLY already, as for a call nobody answers).
        Raises LocalError(INVALID_ARGUMENT) while the node is not running.
        """
        if self.endpoint is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "node not started")
        try:
            if now is None:
                now = trio.current_time()
            msg_id, deadline = self.core.start(address, method, args, now)
        except LocalError as exc:
            if exc.code is not ErrorCode.BUSY:
                raise
            on_result(NO_REPLY)
            return None
        self.stats.rpcs_sent += 1
        self._results[msg_id] = on_result
        wake = self.wake
        if wake is not None and deadline < wake.deadline:
            wake.deadline = deadline
        return msg_id

    async def call(
        self,
        address: Address,
        method: str,
        args: list[Any],
        wrap: Callable[[OnResult], OnResult] | None = None,
    ) -> Any:
        """One call, awaited: the raw reply value, or NO_REPLY after the hard timeout.

        ``wrap`` may put bookkeeping around the result callback. A cancelled
        caller abandons the call.
        """
        result = _Result()
        on_result = result.set if wrap is None else wrap(result.set)
        msg_id = self.call_nowait(address, method, args, on_result)
        try:
            self.flush()
            await result.done.wait()
        finally:
            if msg_id is not None and not result.done.is_set():
                self.abandon(msg_id)
        return result.value

    async def call_each(
        self,
        targets: Sequence[tuple[Address, Callable[[OnResult], OnResult] | None]],
        method: str,
        args: list[Any],
    ) -> list[Any]:
        """The same call to every address of ``targets`` at once, each with its ``wrap``
        (as :meth:`call`); the raw replies (or NO_REPLY) in the order of ``targets``.

        No task per call: each result lands in its callback, and this task wakes
        once, when the last one is in. A cancelled caller abandons what is left.
        """
        values: list[Any] = [NO_REPLY] * len(targets)
        left = len(targets)
        done = trio.Event()

        def landed(i: int, value: Any) -> None:
            nonlocal left
            values[i] = value
            left -= 1
            if not left:
                done.set()

        ids = []
        for i, (address, wrap) in enumerate(targets):
            on_result = partial(landed, i)
            ids.append(
                self.call_nowait(
                    address, method, args, on_result if wrap is None else wrap(on_result)
                )
            )
        try:
            self.flush()
            if left:
                await done.wait()
        finally:
            if left:
                for msg_id in ids:
                    if msg_id is not None:
                        self.abandon(msg_id)
        return values

    def abandon(self, msg_id: bytes) -> None:
        """Nobody waits for ``msg_id`` any more: no callback, a late reply is dropped."""
        self.core.cancel(msg_id)
        self._results.pop(msg_id, None)
        self._compact()

    def on_reply(self, event: ReplyReceived) -> None:
        self.stats.rpcs_answered += 1
        on_result = self._results.pop(event.msg_id, None)
        if not self._results:
            self._results = {}  # _compact, written out: once per reply
        if not self.core.pending:
            self._sleep_on()
        if on_result is not None:
            on_result(event.value)

    def _sleep_on(self) -> None:
        # The last pending call was answered: the receive loop's timer still stands at
        # the first call's hard deadline. Move it to the loop's other timers instead of
        # waking it for nothing (one deadline moved per burst of calls, not a wake-up).
        wake, idle = self.wake, self.idle_wake
        if wake is not None and idle is not None:
            later = idle()
            if later > wake.deadline:
                wake.deadline = later

    def on_timeout(self, event: CallTimedOut) -> None:
        self.stats.rpcs_timed_out += 1
        on_result = self._results.pop(event.msg_id, None)
        self._compact()
        if on_result is not None:
            on_result(NO_REPLY)

    def _compact(self) -> None:
        # A dict never shrinks as it empties: a burst of calls would keep its peak
        # table (kilobytes) for the node's life.
        if not self._results:
            self._results = {}

    def flush(self) -> None:
        """Send every datagram the core has queued (see the module docstring)."""
        out = self.core.datagrams_to_send()
        if not out:
            return
        assert self.endpoint is not None  # nothing is queued before the node runs
        send = self.endpoint.sendto_nowait
        for i, (data, address) in enumerate(out):
            try:
                send(data, address)
            except BaseException:
                self.core.send_later(out[i:])
                raise


async def count_answers(
    ping: Callable[[Address], Awaitable[object | None]], addresses: list[Address]
) -> int:
    """Run ``ping`` on every address at once; how many gave something other than None."""
    answered = 0

    async def one(a: Address) -> None:
        nonlocal answered
        if await ping(a) is not None:
            answered += 1

    async with trio.open_nursery() as nursery:
        for a in addresses:
            nursery.start_soon(one, a)
    return answered


__all__ = [
    "NO_REPLY",
    "Calls",
    "OnResult",
    "count_answers",
]
