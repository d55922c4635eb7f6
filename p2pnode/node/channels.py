"""Channels: one long-lived link per peer, with an explicit lifecycle.

Theory of operation (seed R3, Properties 10-12):

* :class:`ChannelStateMachine` is the sans-IO lifecycle: ``CONNECTING ->
  OPEN -> RECONNECTING -> OPEN | CLOSED`` (and ``CONNECTING -> CLOSED`` when
  the first dial fails, ``OPEN -> CLOSED`` on close). Any other transition
  raises and leaves the state unchanged.
* :class:`PeerLink` is the trio driver for one remote peer. It owns at most
  one *send* channel (a :class:`~p2pnode.transport.channel.SecureChannel`) and a reader
  task per channel it holds. Senders share the channel: the secure channel
  serializes and coalesces concurrent writes, so per-link order is the order
  in which ``send`` calls start writing.
* Delivery: ``send`` queues the frame (a bounded queue: back-pressure) and
  waits until one writer task has written it. The writer takes whatever
  queued while it was busy, plus what the other runnable tasks queue during
  one scheduler pass, and writes it as one coalesced batch, so concurrent
  senders share AEAD calls and syscalls; consecutive ENVELOPE frames of a
  batch go as one ENVELOPES frame, so the peer also decodes and decides on
  them once. When a write fails the link goes to
  RECONNECTING and the batch is retried on a fresh channel up to
  ``max_retries`` times with exponential backoff (each delay double the last);
  then its senders get ``DELIVERY_FAILED``. A frame may thus arrive twice; the
  receiving node drops duplicate envelope ids.
* Timeouts: a write the peer does not drain within ``write_timeout``, and a
  channel on which nothing arrives for ``idle_timeout``, count as transport
  loss. A watchdog check per link looks at both every quarter of the shorter
  timeout (firing up to that late) instead of a trio cancel scope around every
  read and every write, which would cost microseconds on each message. A node
  runs the checks of all its links from one task (``own_watchdog=False``,
  :meth:`PeerLink.watch`), on a grid of that interval on trio's clock, so a
  node with thousands of quiet links wakes once per interval, not once per
  link.
* Keepalive: an empty message. A link that has sent nothing for a third of
  ``idle_timeout`` sends one, so a quiet but healthy channel stays open and
  only a peer that is gone (or stuck) hits the idle timeout.
* Transport loss while idle: the link redials in the background (IK, since
  it knows the peer's static key) with the same backoff, and closes after
  ``max_redials`` failures or ``redial_window`` seconds without a channel,
  whichever comes first: a peer that vanished is given up within a bound
  (idle timeout, a watchdog period, the redial window) whatever its
  addresses do with a SYN. :meth:`PeerLink.redial_now` cuts a backoff wait
  short (the node heard the peer is back). The node drops closed links; the
  next send makes a new one. Why the link closed (:attr:`PeerLink.loss`,
  :attr:`PeerLink.last_dial_error`) is kept for the one line the node logs.
* Simultaneous opens: when a second channel to the same peer arrives while
  one is open, both ends send on the channel dialed by the lower peer id, so
  both converge on the same connection; except that a direct channel always
  wins over a relayed one (the switch after a hole punch, node/holepunch.py).
  The other one is still read (frames already in flight on it are not lost)
  and closed after ``retire_grace``.
* Limits (:class:`LinkLimits`): the envelopes a peer sends go through a token
  bucket per link (an ENVELOPES frame costs one token per member, read from
  its msgpack header before decoding, a HELLO ``HELLO_COST``). A frame the
  bucket cannot pay for is dropped before it is decoded and counted; the
  link's reader goes on at once (other peers have readers of their own, so
  nobody waits on the flooder) and the node reports the drops as a security
  event at most once a minute per peer. Frames queued for a peer that does
  not read are bounded in bytes: a send beyond ``max_queue_bytes`` fails at
  once with BUSY instead of queueing (back-pressure on the local sender).
"""

from __future__ import annotations

import enum
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from p2pnode.core.errors import ErrorCode, LocalError, P2PError
from p2pnode.core.identity import PeerId
from p2pnode.node.frames import merge_envelope_frames
from p2pnode.node.limits import TokenBucket
from p2pnode.transport.channel import SecureChannel
from p2pnode.transport.net import MoveOnAt, Wake

logger = logging.getLogger("p2pnode.channels")


class ChannelState(enum.Enum):
    """What a link waits on."""

    CONNECTING = "connecting"
    OPEN = "open"
    RECONNECTING = "reconnecting"
    CLOSED = "closed"


TRANSITIONS: dict[ChannelState, frozenset[ChannelState]] = {
    ChannelState.CONNECTING: frozenset({ChannelState.OPEN, ChannelState.CLOSED}),
    ChannelState.OPEN: frozenset({ChannelState.RECONNECTING, ChannelState.CLOSED}),
    ChannelState.RECONNECTING: frozenset({ChannelState.OPEN, ChannelState.CLOSED}),
    ChannelState.CLOSED: frozenset(),
}


#: States a link's history keeps (the latest): a peer that reconnects for days would
#: otherwise grow it by a few entries per reconnection.
HISTORY_SIZE = 64


class ChannelStateMachine:
    """The lifecycle of a channel; illegal transitions raise and change nothing.
    ``history`` holds the last HISTORY_SIZE states."""

    __slots__ = ("history", "state")

    def __init__(self) -> None:
        self.state = ChannelState.CONNECTING
        self.history: deque[ChannelState] = deque([ChannelState.CONNECTING], HISTORY_SIZE)

    def can(self, new: ChannelState) -> bool:
        return new in TRANSITIONS[self.state]

    def transition(self, new: ChannelState) -> None:
        """Move to ``new``. Raises LocalError(ILLEGAL_TRANSITION) if the table forbids it."""
        if new not in TRANSITIONS[self.state]:
            raise LocalError(
                ErrorCode.ILLEGAL_TRANSITION,
                f"channel cannot go from {self.state.value} to {new.value}",
                state=self.state.value,
                target=new.value,
            )
        self.state = new
        self.history.append(new)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retries of a failed delivery and redials of a lost link."""

    max_retries: int = 3
    first_delay: float = 0.05
    factor: float = 2.0
    max_delay: float = 5.0
    max_redials: int = 6
    dial_timeout: float = 5.0
    #: Seconds a lost link keeps redialing (a dial in progress is cut at its end).
    redial_window: float = 10.0
    retire_grace: float = 10.0
    write_timeout: float = 30.0
    queue_size: int = 1024
    max_batch: int = 256

    def delays(self, count: int) -> list[float]:
        """The first ``count`` backoff delays: each ``factor`` times the previous."""
        out, delay = [], self.first_delay
        for _ in range(count):
            out.append(min(delay, self.max_delay))
            delay *= self.factor
        return out


@dataclass(frozen=True, slots=True)
class LinkLimits:
    """What one peer may cost a link (None: unlimited)."""

    #: Envelopes a second the peer may send, sustained.
    envelope_rate: float | None = None
    #: Envelopes it may send at once after a quiet spell.
    envelope_burst: int = 10_000
    #: Bytes of frames queued for the peer and not yet written.
    max_queue_bytes: int | None = None


#: Tokens a HELLO frame costs (up to 64 card signatures to check).
HELLO_COST = 64
_FRAME_HEAD = 0x92  # msgpack fixarray of 2: [kind, body]


def frame_cost(frame: bytes) -> int:
    """Envelopes a node frame carries, read from its msgpack header without decoding
    it (1 for anything that is not a well-formed ENVELOPES frame; HELLO_COST for a HELLO)."""
    if len(frame) < 3 or frame[0] != _FRAME_HEAD:
        return 1
    kind, head = frame[1], frame[2]
    if kind == 0:
        return HELLO_COST
    if kind != 2:
        return 1
    if 0x90 <= head <= 0x9F:
        return max(1, head & 0x0F)
    if head == 0xDC and len(frame) >= 5:
        return max(1, int.from_bytes(frame[3:5], "big"))
    if head == 0xDD and len(frame) >= 7:
        return max(1, int.from_bytes(frame[3:7], "big"))
    return 1


@dataclass(slots=True)
class _Outgoing:
    frames: list[bytes]
    size: int = 0
    done: trio.Event = field(default_factory=trio.Event)
    error: LocalError | None = None


KEEPALIVE = b""
Dialer = Callable[[], Awaitable[SecureChannel]]
FrameHandler = Callable[[PeerId, bytes], Awaitable[None]]
StateListener = Callable[["PeerLink", ChannelState], None]
#: Told of a frame dropped by the rate limit: the link and the envelopes it carried.
DropListener = Callable[["PeerLink", int], None]


def watch_interval(retry: RetryPolicy, idle_timeout: float | None) -> float:
    """Seconds between two watchdog checks of a link: a quarter of the shorter of
    ``write_timeout`` and ``idle_timeout``."""
    timeouts = [t for t in (retry.write_timeout, idle_timeout) if t is not None]
    return min(timeouts) / 4


async def sleep_to_grid(interval: float) -> None:
    """Sleep until the next multiple of ``interval`` on trio's clock. Periodic checks
    that wake on one grid (every link's watchdog, every node's) share their wake-ups:
    one timer pass for all of them instead of one each, at no cost to their bounds
    (each still runs once per ``interval``)."""
    await trio.sleep_until((math.floor(trio.current_time() / interval) + 1) * interval)


async def tick_on_grid(
    move_on_at: MoveOnAt, interval: float, tick: Callable[[float], None]
) -> None:
    """Call ``tick(now)`` at every multiple of ``interval`` on trio's clock, forever, as
    :func:`sleep_to_grid` in a loop would; but through the network's timer
    (``move_on_at``), so a network that runs timers itself (the simulator) calls
    ``tick`` from its own task and this task does not wake at all. ``tick`` must not
    block; what it raises ends the loop."""
    sleeping: list[Wake] = []
    due = [math.floor(trio.current_time() / interval) + 1]  # the next grid point's index

    def on_due(now: float) -> None:
        tick(now)
        due[0] = max(due[0] + 1, math.floor(trio.current_time() / interval) + 1)
        if sleeping:
            sleeping[0].deadline = due[0] * interval

    while True:
        with move_on_at(due[0] * interval, on_due) as wake:
            sleeping.append(wake)
            await trio.sleep_forever()
        sleeping.clear()
        tick(trio.current_time())
        # The next grid point after the tick: points it overran are skipped, not caught up.
        due[0] = max(due[0] + 1, math.floor(trio.current_time() / interval) + 1)


def describe_loss(exc: BaseException) -> str:
    """What a transport failure says, never empty and never ``None``."""
    if isinstance(exc, trio.TooSlowError):
        return "timed out"
    text = exc.message if isinstance(exc, P2PError) else str(exc)
    return text or type(exc).__name__


async def close_quietly(channel: SecureChannel) -> None:
    """Close ``channel`` at once, without waiting on the peer (trio's aclose_forcefully)."""
    with trio.CancelScope() as scope:
        scope.cancel()
        await channel.aclose()


class PeerLink:
    """The link to one remote peer (see the module docstring).

    ``own_watchdog``: the link runs its watchdog in a task of its own; False: its
    owner calls :meth:`watch` every :func:`watch_interval` (a node, for all its
    links at once).
    """

    #: The incarnation the peer's last HELLO named (None: none yet), and when the current
    #: channel was taken: what was written before went to that channel's predecessor,
    #: perhaps to a process that has since restarted.
    incarnation: bytes | None = None
    opened_at = -math.inf

    def __init__(
        self,
        local_peer_id: PeerId,
        peer_id: PeerId,
        nursery: trio.Nursery,
        dialer: Dialer,
        on_frame: FrameHandler,
        on_state: StateListener,
        retry: RetryPolicy = RetryPolicy(),
        idle_timeout: float | None = None,
        limits: LinkLimits = LinkLimits(),
        on_drop: DropListener | None = None,
        *,
        own_watchdog: bool = True,
    ) -> None:
        self.peer_id, self._local_peer_id, self._nursery = peer_id, local_peer_id, nursery
        self._dialer, self._on_frame, self._on_state = dialer, on_frame, on_state
        self._retry = retry
        self._idle_timeout = idle_timeout
        # The read and write paths only count; the watchdog notes when the counts move.
        self._messages_in = 0  # frames and keepalives
        self._last_heard = self._last_said = trio.current_time()
        self._heard_count = self._said_count = 0
        self._write_since: float | None = None  # when the write in progress started
        self._keepalive_pending: tuple[SecureChannel, float] | None = None  # and when
        self._machine = ChannelStateMachine()
        self._channel: SecureChannel | None = None
        self._channel_dialed_by: PeerId | None = None
        self._connected = trio.Event()
        self._dialing = False
        self._wake = trio.Event()  # set to cut a redial backoff short
        #: Why the last channel was lost (None: never lost), and why the last dial failed.
        self.loss: str | None = None
        self.last_dial_error: str | None = None
        #: True once the link closed because its redials failed (not closed by this node).
        self.gave_up = False
        #: The peer said it is leaving (it withdrew its agents): a lost channel is the end.
        self.departing = False
        #: Dials of the current round (0 while none runs; 1 during the first).
        self.dial_round = 0
        self._queue_in, self._queue_out = trio.open_memory_channel[_Outgoing](retry.queue_size)
        self._queued = 0  # frames handed to the writer and not yet written
        self._queued_bytes = 0  # their size
        self._max_queue_bytes = limits.max_queue_bytes
        self._bucket = (
            None
            if limits.envelope_rate is None
            else TokenBucket(limits.envelope_rate, limits.envelope_burst, trio.current_time())
        )
        self._on_drop = on_drop
        #: Frames (and the envelopes in them) dropped by the rate limit.
        self.frames_dropped = 0
        self.envelopes_dropped = 0
        self._inline_busy = False
        self._inline_done: trio.Event | None = None  # made only when the writer must wait
        self.frames_sent = 0
        self.frames_received = 0
        nursery.start_soon(self._write_loop)
        if own_watchdog:
            nursery.start_soon(self._watchdog)

    @property
    def state(self) -> ChannelState:
        return self._machine.state

    @property
    def writable_now(self) -> bool:
        """True when a send would be written at once: the channel is open and no frame
        waits for the writer or is being written inline."""
        return (
            self._channel is not None
            and self._queued == 0
            and not self._inline_busy
            and self._machine.state is ChannelState.OPEN
        )

    @property
    def remote_address(self) -> tuple[Any, ...] | None:
        """Where the open channel's connection comes from (None: no open channel, or
        its stream cannot say): the peer's address as this node observes it."""
        channel = self._channel
        return channel.remote_address if channel is not None else None

    @property
    def relayed(self) -> bool | None:
        """Whether the open channel goes through a relay (None: no open channel)."""
        channel = self._channel
        return channel.relayed if channel is not None else None

    @property
    def queued_bytes(self) -> int:
        """Bytes of frames waiting for the writer."""
        return self._queued_bytes

    @property
    def closed(self) -> bool:
        return self._machine.state is ChannelState.CLOSED

    @property
    def history(self) -> list[ChannelState]:
        return list(self._machine.history)

    def _set_state(self, new: ChannelState) -> None:
        if self._machine.state is new:
            return
        self._machine.transition(new)
        self._on_state(self, new)

    # -- channels ---------------------------------------------------------------------------

    def adopt(self, channel: SecureChannel, dialed_by: PeerId) -> bool:
        """Take a freshly handshaken channel. Returns False (and closes it) when the
        link keeps its current open channel by the lower-dialer rule."""
        if self.state is ChannelState.CLOSED:
            self._nursery.start_soon(close_quietly, channel)
            return False
        current = self._channel
        if current is not None and self.state is ChannelState.OPEN:
            keep_current = self._channel_dialed_by is not None and (
                self._channel_dialed_by.raw <= dialed_by.raw
            )
            if current.relayed != channel.relayed:
                # A direct channel replaces a relayed one (a hole punch succeeded), and
                # never the reverse; both ends see the same kinds, so both switch.
                keep_current = channel.relayed
            if keep_current:
                self._nursery.start_soon(self._read_loop, channel)
                self._nursery.start_soon(self._retire, channel)
                return False
            self._nursery.start_soon(self._retire, current)
        self._channel = channel
        self._channel_dialed_by = dialed_by
        self._last_heard = self.opened_at = trio.current_time()
        self._nursery.start_soon(self._read_loop, channel)
        self._set_state(ChannelState.OPEN)
        self._connected.set()
        return True

    async def _retire(self, channel: SecureChannel) -> None:
        # The losing channel of a simultaneous open is no longer written to, but frames
        # the peer wrote before it switched are still read; close it once both ends
        # have surely moved to the winner (or the node closes: it is closed then too).
        try:
            await trio.sleep(self._retry.retire_grace)
        finally:
            await close_quietly(channel)

    async def _read_loop(self, channel: SecureChannel) -> None:
        try:
            while True:
                data = await channel.receive_message()
                self._messages_in += 1
                if data:  # an empty message is a keepalive
                    self.frames_received += 1
                    bucket = self._bucket
                    if bucket is not None:
                        cost = frame_cost(data)
                        if not bucket.take(cost, trio.current_time()):
                            self._dropped(cost)
                            continue
                    await self._on_frame(self.peer_id, data)
        except (P2PError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            if channel is self._channel:
                logger.debug("link to %s lost: %s", self.peer_id, exc)
                self._channel_lost(channel, f"channel closed ({describe_loss(exc)})")

    def _dropped(self, envelopes: int) -> None:
        self.frames_dropped += 1
        self.envelopes_dropped += envelopes
        if self._on_drop is not None:
            self._on_drop(self, envelopes)

    async def _watchdog(self) -> None:
        interval = watch_interval(self._retry, self._idle_timeout)
        while not self.closed:
            await sleep_to_grid(interval)
            self.watch(trio.current_time())

    def watch(self, now: float) -> None:
        """The watchdog's check (module docstring): drop a channel whose write or whose
        silence outlasted its timeout, start a keepalive on one quiet for a third of
        ``idle_timeout``. Called every :func:`watch_interval` by the link's own task, or
        by its owner for all its links (``own_watchdog=False``)."""
        channel = self._channel
        if channel is None or self.closed:
            return
        if self._messages_in != self._heard_count:
            self._heard_count, self._last_heard = self._messages_in, now
        if self.frames_sent != self._said_count:
            self._said_count, self._last_said = self.frames_sent, now
        since = self._write_since
        pending = self._keepalive_pending
        if pending is not None and pending[0] is channel and (since is None or pending[1] < since):
            since = pending[1]  # a keepalive stuck in its write counts as one
        writing = now - since if since is not None else 0.0
        silent = now - self._last_heard
        if writing >= self._retry.write_timeout:
            self._channel_lost(channel, f"it read nothing for {writing:.1f} s")
        elif self._idle_timeout is not None and silent >= self._idle_timeout:
            self._channel_lost(channel, f"nothing heard for {silent:.1f} s")
        elif (
            self._idle_timeout is not None
            and now - self._last_said >= self._idle_timeout / 3
            # One keepalive at a time on a channel: a stuck one times out above.
            and (pending is None or pending[0] is not channel)
        ):
            self._last_said = now
            self._keepalive_pending = (channel, now)
            self._nursery.start_soon(self._keepalive, channel)

    async def _keepalive(self, channel: SecureChannel) -> None:
        # Its write is timed by the watchdog (``write_timeout``, as any write), not by
        # a cancel scope of its own: a keepalive is the most frequent write of all.
        try:
            await channel.send_message(KEEPALIVE)
        except (P2PError, trio.BrokenResourceError, trio.ClosedResourceError):
            self._channel_lost(channel, "a keepalive could not be written")
        finally:
            if self._keepalive_pending is not None and self._keepalive_pending[0] is channel:
                self._keepalive_pending = None

    def _channel_lost(self, channel: SecureChannel, why: str = "write failed") -> None:
        if channel is not self._channel:
            return
        logger.debug("channel to %s dropped: %s", self.peer_id, why)
        self.loss = why
        self._channel = None
        self._nursery.start_soon(close_quietly, channel)
        if self.departing:
            self._nursery.start_soon(self.aclose)  # no redial of a peer that left
        elif self.state is ChannelState.OPEN:
            self._connected = trio.Event()
            self._set_state(ChannelState.RECONNECTING)
            self._start_dialing()

    def _start_dialing(self) -> None:
        if not self._dialing and self.state is not ChannelState.CLOSED:
            self._dialing = True
            self._nursery.start_soon(self._dial_loop)

    def redial_now(self) -> None:
        """Cut the current redial backoff short (the peer showed it is back)."""
        self._wake.set()

    async def _dial_loop(self) -> None:
        try:
            retry = self._retry
            end = trio.current_time() + retry.redial_window
            for self.dial_round, delay in enumerate([0.0, *retry.delays(retry.max_redials - 1)], 1):
                with trio.move_on_after(delay):
                    await self._wake.wait()
                self._wake = trio.Event()
                if self._channel is not None or self.state is ChannelState.CLOSED:
                    return
                left = end - trio.current_time()
                if left <= 0:
                    break
                try:
                    with trio.fail_after(min(retry.dial_timeout, left)):
                        channel = await self._dialer()
                except (P2PError, OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
                    self.last_dial_error = describe_loss(exc)
                    logger.debug("dial %s failed: %s", self.peer_id, self.last_dial_error)
                    continue
                if self.closed:
                    await close_quietly(channel)
                    return
                self.adopt(channel, self._local_peer_id)
                return
            if self._channel is None:
                self.gave_up = True
                await self.aclose()
        finally:
            self._dialing = False
            self.dial_round = 0

    async def wait_open(self) -> SecureChannel:
        """The open channel, dialing if needed. Raises LocalError(CHANNEL_CLOSED) when none
        opens within the dial timeout."""
        if self.state is ChannelState.CLOSED:
            raise LocalError(ErrorCode.CHANNEL_CLOSED, f"link to {self.peer_id} is closed")
        if self._channel is None:
            self._start_dialing()
            with trio.move_on_after(self._retry.dial_timeout):
                await self._connected.wait()
        if self._channel is None:
            why = self.last_dial_error or f"no dial succeeded in {self._retry.dial_timeout:g} s"
            raise LocalError(ErrorCode.CHANNEL_CLOSED, f"no channel to {self.peer_id}: {why}")
        return self._channel

    # -- sending ----------------------------------------------------------------------------

    async def send(self, frame: bytes) -> None:
        """Deliver one frame, retrying on transport failure (see the module docstring).

        Raises LocalError(DELIVERY_FAILED) after ``max_retries`` retries or when
        the link closes meanwhile.
        """
        await self.send_many([frame])

    async def send_many(self, frames: list[bytes]) -> None:
        """Deliver ``frames`` in order, in one coalesced write when possible; as :meth:`send`."""
        if self.closed:
            raise LocalError(ErrorCode.DELIVERY_FAILED, f"link to {self.peer_id} is closed")
        channel = self._channel
        if (
            self._queued == 0
            and not self._inline_busy
            and channel is not None
            and self.state is ChannelState.OPEN
        ):
            # Nothing queued and no write in flight: write inline, saving the hop to the
            # writer task. Later senders queue behind this one, so order is kept.
            self._inline_busy = True
            try:
                await self._write(channel, frames)
            except LocalError:
                raise  # a frame over the size limit: the caller's fault, the channel is fine
            except (P2PError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self._channel_lost(channel, f"write failed ({describe_loss(exc)})")
            else:
                return
            finally:
                self._inline_busy = False
                if self._inline_done is not None:
                    self._inline_done.set()
                    self._inline_done = None
        size = sum(map(len, frames))
        limit = self._max_queue_bytes
        if limit is not None and self._queued_bytes and self._queued_bytes + size > limit:
            raise LocalError(
                ErrorCode.BUSY,
                f"{self._queued_bytes} bytes already wait for {self.peer_id} (limit {limit})",
                peer=str(self.peer_id),
                queued=self._queued_bytes,
                limit=limit,
            )
        item = _Outgoing(frames, size)
        # A cancelled caller queues nothing, as with the queue's own send, which would
        # also cost a scheduler round trip per frame when there is room.
        await trio.lowlevel.checkpoint_if_cancelled()
        self._queued += 1
        self._queued_bytes += size
        try:
            try:
                self._queue_in.send_nowait(item)
            except trio.WouldBlock:
                await self._queue_in.send(item)
        except BaseException as exc:  # not queued (closed, or cancelled while full)
            self._queued -= 1
            self._queued_bytes -= size
            if isinstance(exc, (trio.ClosedResourceError, trio.BrokenResourceError)):
                # Closed, or its writer is gone (the node's tasks were cancelled).
                raise LocalError(
                    ErrorCode.DELIVERY_FAILED, f"link to {self.peer_id} is closed"
                ) from None
            raise
        await item.done.wait()
        if item.error is not None:
            raise item.error

    async def _write_loop(self) -> None:
        async with self._queue_out:
            async for first in self._queue_out:
                if self._inline_busy:  # the inline write started first: it goes first
                    if self._inline_done is None:
                        self._inline_done = trio.Event()
                    await self._inline_done.wait()
                # One scheduler pass lets every runnable sender queue its frame too.
                await trio.lowlevel.checkpoint()
                batch = [first]
                while len(batch) < self._retry.max_batch:
                    try:
                        batch.append(self._queue_out.receive_nowait())
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                frames = merge_envelope_frames([frame for item in batch for frame in item.frames])
                error = await self._write_batch(frames)
                for item in batch:
                    item.error = error
                    item.done.set()
                    self._queued_bytes -= item.size
                self._queued -= len(batch)

    async def _write(self, channel: SecureChannel, frames: list[bytes]) -> None:
        # The watchdog drops the channel when a write stays unfinished (write_timeout).
        self._write_since = trio.current_time()
        try:
            if len(frames) == 1:
                await channel.send_message(frames[0])
            else:
                await channel.send_many(frames)
        finally:
            self._write_since = None
        self.frames_sent += len(frames)

    async def _write_batch(self, frames: list[bytes]) -> LocalError | None:
        delays = self._retry.delays(self._retry.max_retries)
        last_error: BaseException | None = None
        for attempt in range(self._retry.max_retries + 1):
            if attempt:
                await trio.sleep(delays[attempt - 1])
            if self.closed:
                break
            try:
                channel = await self.wait_open()
            except LocalError as exc:
                last_error = exc
                continue
            try:
                await self._write(channel, frames)
            except LocalError as exc:
                if exc.code is not ErrorCode.CHANNEL_CLOSED:
                    return exc
                last_error = exc
            except (P2PError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                last_error = exc
                self._channel_lost(channel, f"write failed ({describe_loss(exc)})")
            else:
                return None
        return LocalError(
            ErrorCode.DELIVERY_FAILED,
            f"delivery to {self.peer_id} failed ({self.state.value}): {self._why(last_error)}",
            peer=str(self.peer_id),
            retries=self._retry.max_retries,
        )

    def _why(self, error: BaseException | None) -> str:
        """Why a delivery failed, in words (never ``None``)."""
        if error is not None:
            return describe_loss(error)
        return self.last_dial_error or self.loss or "the link closed"

    async def aclose(self) -> None:
        """Close the link and its channel."""
        if self.state is ChannelState.CLOSED:
            return
        self._set_state(ChannelState.CLOSED)
        channel, self._channel = self._channel, None
        self._connected.set()
        self._queue_in.close()
        if channel is not None:
            await close_quietly(channel)
