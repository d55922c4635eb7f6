"""An in-memory network for simulating thousands of nodes in one process.

Theory of operation: a :class:`SimNetwork` owns a table of hosts (labels like
``"10.0.3.7"``; never real traffic), the bound datagram endpoints and stream
listeners, per-link conditions and a seeded :class:`random.Random`. Each host
is a :class:`SimHost`, which implements :class:`p2pnode.transport.net.Network`, so node
code cannot tell it from real sockets.

Time is trio's clock, so under ``trio.testing.MockClock(autojump_threshold=0)``
a simulated minute takes milliseconds. No task is spawned per message: a
datagram is pushed, with its delivery time, onto the destination endpoint's
heap, and the receiving task itself sleeps until the head of its heap is due
(a datagram that becomes the new head moves that sleep's deadline in).
Streams work the same way with an ordered queue per direction (delivery time
is kept monotonic, so bytes stay in order as TCP keeps them); under the driver
a stream's due times are the driver's too (rounded up to the ``tick`` like
datagrams'), and it wakes the reader when its chunk is due.

For a network of many thousands of hosts, :meth:`SimNetwork.drive` delivers
datagrams from one task instead: it waits until every other task is blocked,
moves the clock to the next delivery or timer of its own (or to trio's next
deadline, if that comes first) and wakes the receivers of what is due. Receivers then sleep
without a deadline of their own, so a datagram costs no cancel scope and no
``Cancelled`` raised through a receiver; delivery times, loss and ordering
are the same as without the driver.

An endpoint may also take its datagrams in a callback
(:meth:`_SimDatagramEndpoint.receive_with`): the driver then calls it for each
datagram as it falls due, and no receiver task wakes at all. A
:class:`~p2pnode.transport.net.DatagramReceiver` (the DHT node) run by
:meth:`SimHost.serve_datagrams` takes its datagrams so.

Timers likewise: :meth:`SimNetwork.move_on_at` is a cancel scope whose
deadline, while the driver runs, the driver keeps (in buckets by due time,
:mod:`p2pnode.simnet.timers`, not in trio's deadline heap with every other
node's timers), and whose due callback, if it has one, runs from the driver's
task instead of waking the scope's task (:meth:`SimHost.serve_datagrams` so
runs a receiver's timer). Datagrams in flight are kept in
buckets by due time too.

Otherwise each delivery is a pass of trio's scheduler (the driver's, then the
receivers'), and with jittered delays no two datagrams are due at the same
instant. A ``tick`` (say a millisecond, well inside the jitter) delivers
datagrams at the next multiple of it instead: everything due in one tick is
handed over in one pass and its receivers run in the next, together.

Faults, decided at send time from the seeded RNG so runs are reproducible:

* latency + uniform jitter per link (default or per pair of hosts);
* loss probability per link (datagrams only; streams are reliable);
* partitions: hosts in different groups cannot exchange anything; streams
  crossing the cut break, new connects fail after ``connect_timeout``;
* killed hosts: everything to or from them is dropped, their streams break,
  connects to them fail, until revived.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable, Container
from dataclasses import dataclass

import trio
import trio.testing

from p2pnode.simnet.streams import Pipe, SimListener, SimStream
from p2pnode.simnet.timers import BucketQueue, SimTimer, TimerWheel
from p2pnode.transport.net import (
    Address,
    DatagramEndpoint,
    DatagramReceiver,
    Network,
    StreamListener,
    run_receiver,
)

_MAX_QUEUE = 512  # datagrams buffered per endpoint, like a socket receive buffer


@dataclass(frozen=True, slots=True)
class LinkConditions:
    """Delay and loss on a link: one-way delay is ``latency ± jitter`` seconds."""

    latency: float = 0.02
    jitter: float = 0.005
    loss: float = 0.0


class SimNetwork:
    """A simulated network of hosts. Create hosts with :meth:`add_host`."""

    def __init__(
        self,
        rng: random.Random,
        *,
        default: LinkConditions = LinkConditions(),
        connect_timeout: float = 3.0,
        tick: float = 0.0,
    ) -> None:
        """``tick``: datagrams are delivered at the next multiple of ``tick`` seconds
        after their delay (0: at the delay itself). See the module docstring."""
        if tick < 0:
            raise ValueError("tick must be >= 0")
        self.rng = rng
        self.default = default
        self.connect_timeout = connect_timeout
        self.tick = tick
        self._links: dict[tuple[str, str], LinkConditions] = {}
        self._hosts: dict[str, SimHost] = {}
        self._killed: set[str] = set()
        self._group: dict[str, int] = {}
        self._datagram: dict[Address, _SimDatagramEndpoint] = {}
        self._listeners: dict[Address, SimListener] = {}
        self._streams: set[SimStream] = set()
        self._ports = itertools.count(40_000)
        self._seq = itertools.count()
        # While drive() runs: datagrams in flight by due time, (seq, endpoint, data,
        # source); the timers of move_on_at; where the driver waits when nothing is
        # in flight nor timed.
        self._driven = False
        self._flight: BucketQueue[tuple[int, _SimDatagramEndpoint, bytes, Address]] = BucketQueue()
        self._timers = TimerWheel()
        # Stream pipes by when their next chunks are due (streams.py).
        self._chunks: BucketQueue[Pipe] = BucketQueue()
        self._idle = trio.lowlevel.ParkingLot()
        # The time while the driver hands datagrams to handlers on a stopped clock
        # (what they send is sent then: no clock read per datagram), else None.
        self._step_time: float | None = None
        self.datagrams_sent = 0
        self.datagrams_dropped = 0

    # ------------------------------------------------------------------ topology

    def add_host(self, host: str | None = None) -> SimHost:
        """A new host (``10.0.x.y`` allocated when ``host`` is None)."""
        if host is None:
            n = len(self._hosts) + 1
            host = f"10.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}"
        if host in self._hosts:
            raise ValueError(f"host {host} exists")
        h = SimHost(self, host)
        self._hosts[host] = h
        return h

    def set_link(self, a: str, b: str, conditions: LinkConditions) -> None:
        """Override conditions between hosts ``a`` and ``b`` (both directions)."""
        self._links[(a, b)] = conditions
        self._links[(b, a)] = conditions

    def kill(self, host: str) -> None:
        """Cut ``host`` off: its traffic is dropped and its streams break."""
        self._killed.add(host)
        self._break_streams()

    def revive(self, host: str) -> None:
        """Undo :meth:`kill`."""
        self._killed.discard(host)

    def partition(self, *groups: set[str] | frozenset[str] | list[str]) -> None:
        """Split the network: hosts talk only within their group.

        Hosts not named in any group form one more group together.
        """
        self._group = {h: i for i, g in enumerate(groups) for h in g}
        self._break_streams()

    def heal(self) -> None:
        """Remove all partitions."""
        self._group = {}

    def reachable(self, a: str, b: str) -> bool:
        """True when traffic can currently flow between hosts ``a`` and ``b``."""
        if not self._killed and not self._group:
            # No fault in force (most of a run): the host names are not even read,
            # which in a swarm of many thousands means memory not fetched per datagram.
            return True
        if a in self._killed or b in self._killed:
            return False
        return not self._group or self._group.get(a, -1) == self._group.get(b, -1)

    def _delay(self, a: str, b: str) -> float | None:
        """One-way delay for a datagram a -> b, or None if it is lost."""
        cond = self._links.get((a, b), self.default) if self._links else self.default
        if not self.reachable(a, b):
            return None
        rng = self.rng
        if cond.loss and rng.random() < cond.loss:
            return None
        # rng.uniform(-jitter, jitter), written out (the same draw and arithmetic).
        jitter = cond.jitter
        return max(0.0, cond.latency + (-jitter + (jitter + jitter) * rng.random()))

    def _stream_delay(self, a: str, b: str) -> float:
        cond = self._links.get((a, b), self.default)
        return max(0.0, cond.latency + self.rng.uniform(-cond.jitter, cond.jitter))

    def _break_streams(self) -> None:
        for s in list(self._streams):
            if not self.reachable(s.local_host, s.remote_host):
                s._break()

    def _alloc(self, host: str, address: Address, taken: Container[Address]) -> Address:
        if address[0] not in (host, "", "0.0.0.0"):
            raise OSError(f"cannot bind {address}: not an address of {host}")
        port = address[1]
        if port == 0:
            port = next(self._ports)
            while (host, port) in taken:
                port = next(self._ports)
        if (host, port) in taken:
            raise OSError(f"address {(host, port)} in use")
        return (host, port)

    # ------------------------------------------------------------------ datagrams

    def _send_datagram(self, src: Address, dst: Address, data: bytes) -> None:
        self.datagrams_sent += 1
        endpoint = self._datagram.get(dst)
        delay = self._delay(src[0], dst[0])
        if (
            endpoint is None
            or delay is None
            or len(endpoint._heap) + endpoint._flying >= _MAX_QUEUE
        ):
            self.datagrams_dropped += 1
            return
        seq = next(self._seq)
        now = self._step_time
        due = (trio.current_time() if now is None else now) + delay
        if self.tick:
            due = math.ceil(due / self.tick) * self.tick
        if self._driven:
            endpoint._flying += 1
            if self._flight.push(due, (seq, endpoint, data, src)):
                self._idle.unpark_all()  # the driver may wait for a first datagram
            return
        heapq.heappush(endpoint._heap, (due, seq, data, src))
        if endpoint._heap[0][1] == seq:
            # Only a new head changes when the receiver must wake; otherwise it is
            # already sleeping until an earlier datagram is due.
            endpoint._wake_at(due)

    def _stream_due(self, pipe: Pipe, due: float) -> None:
        """While driven: wake ``pipe``'s reader at ``due`` (its chunks then due)."""
        if self._chunks.push(due, pipe):
            self._idle.unpark_all()  # the driver may wait for a first delivery

    # ------------------------------------------------------------------ driver

    def move_on_at(
        self, deadline: float, on_due: Callable[[float], None] | None = None
    ) -> SimTimer | trio.CancelScope:
        """A cancel scope with ``deadline``, as ``trio.move_on_at``; while :meth:`drive`
        runs its deadline is the driver's (a :class:`~p2pnode.simnet.timers.SimTimer`,
        not in trio's deadline heap), and when due ``on_due(now)``, if given, is
        called from the driver's task instead of cancelling the scope (the owner's
        task is not woken; the deadline is then infinite until set again).

        Without the driver, or after it stopped, the scope is cancelled at its
        deadline even with ``on_due``: its owner must handle both.
        """
        if self._driven:
            return SimTimer(self._timers, deadline, on_due)
        return trio.move_on_at(deadline)

    async def drive(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Deliver datagrams from this task until cancelled (see the module docstring).

        Needs a :class:`trio.testing.MockClock`: this task moves it, to the next
        delivery or to trio's next deadline, whenever every other task is
        blocked (the autojump would move it to the deadline alone). Raises
        RuntimeError under another clock or while another driver runs.
        """
        clock = trio.lowlevel.current_clock()
        if not isinstance(clock, trio.testing.MockClock):
            raise RuntimeError("SimNetwork.drive needs trio.testing.MockClock")
        if self._driven:
            raise RuntimeError("SimNetwork.drive is running already")
        self._driven = True
        for stream in self._streams:  # chunks sent before: their readers wait on trio
            if stream._send.chunks:
                self._chunks.push(stream._send.last_due, stream._send)
        try:
            task_status.started()
            timers = self._timers
            while True:
                await trio.testing.wait_all_tasks_blocked()
                self._drive_step(clock)
                if (
                    not self._flight
                    and not self._chunks
                    and math.isinf(timers.first())
                    and math.isinf(_seconds_to_deadline())
                ):
                    # Nothing timed: wait for a datagram or a timer.
                    timers.idle = self._idle.unpark_all
                    try:
                        await self._idle.park()
                    finally:
                        timers.idle = None
        finally:
            self._driven = False
            # Undelivered datagrams go back to their endpoints, and timers to trio,
            # to be delivered and to expire as without the driver.
            for due, (seq, endpoint, data, src) in self._flight.clear():
                endpoint._flying -= 1
                if not endpoint._closed:
                    heapq.heappush(endpoint._heap, (due, seq, data, src))
                    endpoint._wake_at(due)
            self._timers.stop()
            # Readers of chunks still in flight wake and sleep on trio until they are due.
            for _, pipe in self._chunks.clear():
                pipe.lot.unpark_all()

    def _drive_step(self, clock: trio.testing.MockClock) -> None:
        """Every task waits: deliver what is due and fire the timers due (in that
        order at one instant), else move the clock on."""
        now = trio.current_time()
        nearest = min(self._flight.first(), self._timers.first(), self._chunks.first())
        if nearest > now:
            deadline = now + _seconds_to_deadline()
            if deadline < nearest:
                if deadline > now:
                    clock.jump(deadline - now)  # trio expires it on its next pass
                return
            if math.isinf(nearest):
                return
            clock.jump(nearest - now)
            # The jump may land an ulp short of ``nearest``: it is due all the same.
            now = nearest
        landed = trio.current_time()
        self._step_time = landed if clock.rate == 0 else None
        try:
            self._deliver_due(now, landed)
            self._release_chunks(now)
            self._timers.fire_due(now)
        finally:
            self._step_time = None

    def _deliver_due(self, now: float, landed: float) -> None:
        """Hand over every datagram due by ``now`` (the clock reads ``landed``)."""
        flight = self._flight
        reachable = self.reachable
        # What handlers send is due a delay later (or now, on a link without one:
        # then it is handed over in this same step, in order, a bucket of its own).
        while (bucket := flight.pop_due(now)) is not None:
            due, items = bucket
            for seq, endpoint, data, src in items:
                endpoint._flying -= 1
                if endpoint._closed:
                    continue
                handler = endpoint._handler
                if handler is None:
                    heapq.heappush(endpoint._heap, (min(due, landed), seq, data, src))
                    endpoint._lot.unpark_all()
                elif (not self._killed and not self._group) or reachable(
                    src[0], endpoint._address[0]
                ):  # as recvfrom re-checks (reachable's own fast path, without its call)
                    handler(data, src)


    def _release_chunks(self, now: float) -> None:
        """Wake the readers of stream chunks due by ``now``."""
        chunks = self._chunks
        while (bucket := chunks.pop_due(now)) is not None:
            due, pipes = bucket
            for pipe in pipes:
                if due > pipe.released:
                    pipe.released = due
                pipe.lot.unpark_all()


class SimHost(Network):
    """One host of a :class:`SimNetwork`; implements :class:`p2pnode.transport.net.Network`."""

    __slots__ = ("host", "sim")

    def __init__(self, sim: SimNetwork, host: str) -> None:
        self.sim = sim
        self.host = host

    def __repr__(self) -> str:
        return f"SimHost({self.host})"

    def move_on_at(
        self, deadline: float, on_due: Callable[[float], None] | None = None
    ) -> SimTimer | trio.CancelScope:
        """:meth:`SimNetwork.move_on_at` (a timer the driver keeps while it runs)."""
        return self.sim.move_on_at(deadline, on_due)

    async def serve_datagrams(self, endpoint: DatagramEndpoint, receiver: DatagramReceiver) -> None:
        """Run ``receiver`` on ``endpoint`` until cancelled. While :meth:`SimNetwork.drive`
        runs, its datagrams and its timer are handed to it from the driver's task
        (:meth:`_SimDatagramEndpoint.receive_with`, :meth:`move_on_at`): this task
        does not wake for them. Without the driver, as any network does."""
        if isinstance(endpoint, _SimDatagramEndpoint):
            endpoint.receive_with(receiver.datagram_received)
        try:
            await run_receiver(endpoint, receiver, self.move_on_at)
        finally:
            if isinstance(endpoint, _SimDatagramEndpoint):
                endpoint.receive_with(None)

    async def bind_datagram(self, address: Address) -> DatagramEndpoint:
        await trio.lowlevel.checkpoint()
        bound = self.sim._alloc(self.host, address, self.sim._datagram)
        ep = _SimDatagramEndpoint(self.sim, bound)
        self.sim._datagram[bound] = ep
        return ep

    async def listen_stream(self, address: Address) -> StreamListener:
        await trio.lowlevel.checkpoint()
        bound = self.sim._alloc(self.host, address, self.sim._listeners)
        listener = SimListener(self.sim, bound)
        self.sim._listeners[bound] = listener
        return listener

    async def connect_stream(self, address: Address) -> trio.abc.Stream:
        sim = self.sim
        if not sim.reachable(self.host, address[0]):
            # A SYN into a partition or a dead host: nothing comes back.
            await trio.sleep(sim.connect_timeout)
            raise OSError(f"connect to {address} timed out")
        rtt = sim._stream_delay(self.host, address[0]) + sim._stream_delay(address[0], self.host)
        await trio.sleep(rtt)
        listener = sim._listeners.get(address)
        if listener is None or listener._closed:
            raise OSError(f"connection refused by {address}")
        if not sim.reachable(self.host, address[0]):
            raise OSError(f"connect to {address} failed")
        local = (self.host, next(sim._ports))
        a_to_b = Pipe()
        b_to_a = Pipe()
        mine = SimStream(sim, local, address, send=a_to_b, recv=b_to_a)
        theirs = SimStream(sim, address, local, send=b_to_a, recv=a_to_b)
        mine._peer = theirs
        theirs._peer = mine
        sim._streams.add(mine)
        sim._streams.add(theirs)
        if len(listener._backlog) >= 128:
            raise OSError(f"connection refused by {address} (backlog full)")
        listener._backlog.append(theirs)
        listener._lot.unpark_all()
        return mine


def _seconds_to_deadline() -> float:
    """Seconds until trio's next cancel scope deadline (inf: none)."""
    return trio.lowlevel.current_statistics().seconds_to_next_deadline


class _SimDatagramEndpoint(DatagramEndpoint):
    __slots__ = ("_address", "_closed", "_flying", "_handler", "_heap", "_lot", "_sim", "_wake")

    def __init__(self, sim: SimNetwork, address: Address) -> None:
        self._sim = sim
        self._address = address
        # Datagrams handed to this endpoint, (due, seq, data, source); under the
        # driver only those already due.
        self._heap: list[tuple[float, int, bytes, Address]] = []
        # Datagrams to this endpoint the driver holds in flight.
        self._flying = 0
        self._lot = trio.lowlevel.ParkingLot()
        # The scope a receiver sleeps in until the head of the heap is due.
        self._wake: trio.CancelScope | None = None
        self._closed = False
        # Takes each datagram from the driver instead of recvfrom (receive_with).
        self._handler: Callable[[bytes, Address], None] | None = None

    def receive_with(self, handler: Callable[[bytes, Address], None] | None) -> None:
        """Under :meth:`SimNetwork.drive`, hand each datagram to ``handler(data,
        source)`` from the driver's task when it is due, instead of to ``recvfrom``
        (None: to ``recvfrom`` again). ``handler`` must not block nor raise.

        Without the driver, and for what a stopped driver hands back, ``recvfrom``
        still delivers: a receiver keeps calling it and simply never wakes while
        the driver hands everything to ``handler``.
        """
        self._handler = handler

    def _wake_at(self, due: float) -> None:
        """A datagram due at ``due`` became the head: wake the receiver no later."""
        wake = self._wake
        if wake is not None and len(self._lot) == 1:
            wake.deadline = min(wake.deadline, due)
        else:
            self._lot.unpark_all()

    @property
    def local_address(self) -> Address:
        return self._address

    async def sendto(self, data: bytes, address: Address) -> None:
        if self._closed:
            raise trio.ClosedResourceError("endpoint closed")
        await trio.lowlevel.checkpoint()
        self.sendto_nowait(data, address)

    def sendto_nowait(self, data: bytes, address: Address) -> None:
        if self._closed:
            raise trio.ClosedResourceError("endpoint closed")
        if len(address) != 2 or type(address[0]) is not str or type(address[1]) is not int:
            address = (str(address[0]), int(address[1]))
        if type(data) is not bytes:
            data = bytes(data)
        self._sim._send_datagram(self._address, address, data)

    async def recvfrom(self) -> tuple[bytes, Address]:
        # A call that blocked has been a checkpoint; one that did not takes one.
        blocked = False
        while True:
            if self._closed:
                raise trio.ClosedResourceError("endpoint closed")
            if self._heap:
                due = self._heap[0][0]
                if due <= trio.current_time():
                    if not blocked:
                        await trio.lowlevel.checkpoint_if_cancelled()
                    _, _, data, src = heapq.heappop(self._heap)
                    # Re-check at delivery: the host may have been killed in flight.
                    if self._sim.reachable(src[0], self._address[0]):
                        if not blocked:
                            # Shielded: a cancel here must not lose the datagram just taken.
                            await trio.lowlevel.cancel_shielded_checkpoint()
                        return data, src
                    continue
                try:
                    with trio.move_on_at(due) as self._wake:
                        await self._lot.park()
                finally:
                    self._wake = None
            else:
                await self._lot.park()
            blocked = True

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._handler = None
            self._heap.clear()
            if self._sim._datagram.get(self._address) is self:
                del self._sim._datagram[self._address]
            self._lot.unpark_all()
