"""The one network interface every piece of node code uses.

Theory of operation: node code never touches sockets. It receives a
:class:`Network` and asks it for datagram endpoints (``bind_datagram``),
stream listeners (``listen_stream``) and outgoing streams
(``connect_stream``). Streams are plain :class:`trio.abc.Stream` objects, so
any layer that wraps a trio stream (the Noise secure channel, the node's
framed channels) runs unchanged over them.

Two implementations exist:

* :class:`TrioNetwork` here: real trio UDP and TCP sockets. Its TCP streams
  are :class:`p2pnode.transport.tcpstream.TcpStream`, which reads data already waiting
  without a pass of trio's scheduler.
* :class:`p2pnode.simnet.SimNetwork`: an in-memory network with per-link
  latency, jitter, loss, partitions and killed hosts, driven by trio's
  (virtual) clock and a seeded :class:`random.Random`.

A long-lived receiver of datagrams (the DHT node) is a
:class:`DatagramReceiver`: callbacks for a datagram and for its timer, and
the time it next wants the timer. :meth:`Network.serve_datagrams` runs it:
one task reads the endpoint and sleeps to the receiver's timer in one cancel
scope (a :class:`Wake`) that the receiver may pull in. The receiver never
sees how it is run: the simulator's network runs the same callbacks from its
own task (:meth:`p2pnode.simnet.SimHost.serve_datagrams`).

Addresses are ``(host, port)`` tuples in both. Datagram delivery is
best-effort, as UDP is: ``sendto`` never reports a lost datagram, and an
unreachable destination is not an error. ``sendto_nowait`` sends without a
pass of trio's scheduler: a node answering thousands of datagrams a second
spends a pass per datagram otherwise.

Received datagrams are read into one buffer shared by every endpoint of the
process and copied out at their exact size (the read and the copy happen
with no checkpoint between them). Reading each into a fresh 64 KB buffer and
shrinking it, as ``socket.recvfrom`` does, leaves the C heap fragmented: at
1,000 nodes in a process, 17 KB of resident memory per node that the heap
holds free but cannot return.
"""

from __future__ import annotations

import abc
import logging
import socket as _stdlib_socket
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import trio

from p2pnode.transport.tcpstream import TcpStream

Address = tuple[str, int]
"""A network address: host (IP literal or simulator label) and port."""

MAX_DATAGRAM = 65_507
"""Largest UDP payload over IPv4; ``recvfrom`` never returns more."""

_log = logging.getLogger("p2pnode.transport.net")

# Where every real endpoint of the process reads datagrams (see the module docstring).
_RECV_BUFFER = bytearray(MAX_DATAGRAM)
_RECV_VIEW = memoryview(_RECV_BUFFER)


class DatagramEndpoint(abc.ABC):
    """A bound datagram socket: unreliable, unordered, message-oriented."""

    @property
    @abc.abstractmethod
    def local_address(self) -> Address:
        """The address peers send to to reach this endpoint."""

    @abc.abstractmethod
    async def sendto(self, data: bytes, address: Address) -> None:
        """Send one datagram. Delivery is best-effort; loss is silent.

        Raises trio.ClosedResourceError if this endpoint was closed.
        """

    @abc.abstractmethod
    def sendto_nowait(self, data: bytes, address: Address) -> None:
        """Send one datagram now, without a checkpoint. Best-effort as :meth:`sendto`;
        a datagram that cannot leave at once (a full send buffer, a host that is
        not an IP literal of the endpoint's family: nothing is resolved) is dropped.

        Raises trio.ClosedResourceError if this endpoint was closed.
        """

    @abc.abstractmethod
    async def recvfrom(self) -> tuple[bytes, Address]:
        """Wait for the next datagram and return it with its source address.

        Raises trio.ClosedResourceError if this endpoint is (or gets) closed.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release the endpoint; pending and later calls raise ClosedResourceError."""


class StreamListener(abc.ABC):
    """A listening stream socket."""

    @property
    @abc.abstractmethod
    def local_address(self) -> Address:
        """The address peers connect to."""

    @abc.abstractmethod
    async def accept(self) -> trio.abc.Stream:
        """Wait for and return the next inbound stream."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Stop listening."""


class Wake(Protocol):
    """The timer a task sleeps to: a cancel scope's ``deadline``, settable."""

    @property
    def deadline(self) -> float: ...
    @deadline.setter
    def deadline(self, value: float) -> None: ...


class DatagramReceiver(Protocol):
    """What :meth:`Network.serve_datagrams` drives: a datagram in, a timer due, and when
    the timer is next due. None of the three may block; the first two never raise."""

    def datagram_received(self, data: bytes, source: Address) -> None:
        """One datagram from ``source``."""

    def timer_due(self, now: float) -> None:
        """The time :meth:`next_wake` gave has come (or passed: ``now``)."""

    def next_wake(self) -> float:
        """When :meth:`timer_due` should run next (inf: not until asked again)."""

    def sleeping_in(self, wake: Wake | None) -> None:
        """The timer its runner sleeps to until :meth:`next_wake` (None while the
        receiver works): the receiver sets its ``deadline`` sooner when it needs to."""


#: ``move_on_at(deadline, on_due)``: a cancel scope with ``deadline``. When it is due
#: either the scope is cancelled (its task wakes), or ``on_due(now)`` runs from another
#: task and the deadline turns infinite (the task sleeps on); :func:`run_receiver`
#: handles both.
MoveOnAt = Callable[[float, Callable[[float], None] | None], AbstractContextManager[Wake]]


def trio_move_on_at(
    deadline: float, on_due: Callable[[float], None] | None = None
) -> trio.CancelScope:
    """``trio.move_on_at``: the scope is cancelled when due (``on_due`` is not used)."""
    return trio.move_on_at(deadline)


async def run_receiver(
    endpoint: DatagramEndpoint,
    receiver: DatagramReceiver,
    move_on_at: MoveOnAt = trio_move_on_at,
) -> None:
    """Hand ``receiver`` each datagram ``endpoint`` receives and run its timer, until
    cancelled. One cancel scope per timer wake-up, not one per datagram."""
    # The scope slept in now: on_due runs while it is open, from the network's task.
    sleeping: list[Wake] = []

    def on_due(now: float) -> None:
        receiver.timer_due(now)
        if sleeping:
            sleeping[0].deadline = receiver.next_wake()

    while True:
        with move_on_at(receiver.next_wake(), on_due) as wake:
            sleeping.append(wake)
            receiver.sleeping_in(wake)
            while True:
                data, source = await endpoint.recvfrom()
                receiver.datagram_received(data, source)
        sleeping.clear()
        receiver.sleeping_in(None)
        receiver.timer_due(trio.current_time())


class Network(abc.ABC):
    """Factory for endpoints, listeners and outbound streams."""

    async def serve_datagrams(self, endpoint: DatagramEndpoint, receiver: DatagramReceiver) -> None:
        """Run ``receiver`` on ``endpoint`` (bound by this network) until cancelled:
        :func:`run_receiver` in this task."""
        await run_receiver(endpoint, receiver)

    def move_on_at(
        self, deadline: float, on_due: Callable[[float], None] | None = None
    ) -> AbstractContextManager[Wake]:
        """The timer of a periodic task (:data:`MoveOnAt`): here ``trio.move_on_at``; a
        simulated network may keep it and run ``on_due`` from its own task instead."""
        return trio_move_on_at(deadline, on_due)

    @abc.abstractmethod
    async def bind_datagram(self, address: Address) -> DatagramEndpoint:
        """Bind a datagram endpoint at ``address`` (port 0 picks a free port).

        Raises OSError if the address is in use or not local.
        """

    @abc.abstractmethod
    async def listen_stream(self, address: Address) -> StreamListener:
        """Listen for streams at ``address`` (port 0 picks a free port).

        Raises OSError if the address is in use or not local.
        """

    @abc.abstractmethod
    async def connect_stream(self, address: Address) -> trio.abc.Stream:
        """Open a stream to ``address``.

        Raises OSError when the peer refuses or is unreachable. Callers bound
        the wait with their own cancel scope.
        """


# --------------------------------------------------------------------- real sockets


class _TrioDatagramEndpoint(DatagramEndpoint):
    __slots__ = ("_address", "_family", "_raw", "_sock")

    def __init__(
        self, sock: trio.socket.SocketType, raw: _stdlib_socket.socket, address: Address
    ) -> None:
        self._sock = sock  # trio's wrapper: async sendto (resolves names), close
        self._raw = raw  # the same socket, non-blocking: reads and sendto_nowait
        self._family = raw.family
        self._address = address

    @property
    def local_address(self) -> Address:
        return self._address

    async def sendto(self, data: bytes, address: Address) -> None:
        if self._sock.fileno() == -1:
            raise trio.ClosedResourceError("endpoint closed")
        try:
            await self._sock.sendto(data, address)
        except OSError as exc:
            # UDP is best-effort: an unreachable peer or a full buffer is a lost datagram.
            _log.debug("sendto %s failed: %s", address, exc)

    def sendto_nowait(self, data: bytes, address: Address) -> None:
        raw = self._raw
        try:
            # A name would be resolved by a blocking lookup: only literals are sent.
            _stdlib_socket.inet_pton(self._family, address[0])
            raw.sendto(data, address)
        except OSError as exc:
            if raw.fileno() == -1:
                raise trio.ClosedResourceError("endpoint closed") from exc
            _log.debug("sendto %s failed: %s", address, exc)

    async def recvfrom(self) -> tuple[bytes, Address]:
        raw = self._raw
        await trio.lowlevel.checkpoint_if_cancelled()
        waited = False
        while True:
            try:
                n, source = raw.recvfrom_into(_RECV_BUFFER)
            except BlockingIOError:
                # Raises ClosedResourceError when the endpoint closes meanwhile.
                await trio.lowlevel.wait_readable(raw)
                waited = True
                continue
            except OSError as exc:
                if raw.fileno() == -1:
                    raise trio.ClosedResourceError("endpoint closed") from exc
                # ICMP errors surface here on some platforms; they are not datagrams.
                _log.debug("recvfrom error ignored: %s", exc)
                continue
            data = bytes(_RECV_VIEW[:n])  # copied before anyone else reads the buffer
            if not waited:
                await trio.lowlevel.cancel_shielded_checkpoint()
            return data, (str(source[0]), int(source[1]))

    def close(self) -> None:
        self._sock.close()


class _TrioStreamListener(StreamListener):
    __slots__ = ("_address", "_listener")

    def __init__(self, listener: trio.SocketListener, address: Address) -> None:
        self._listener = listener
        self._address = address

    @property
    def local_address(self) -> Address:
        return self._address

    async def accept(self) -> trio.abc.Stream:
        return TcpStream.adopt(await self._listener.accept())

    async def aclose(self) -> None:
        await self._listener.aclose()


class TrioNetwork(Network):
    """The real network: trio UDP and TCP sockets (IPv4 and IPv6 literals)."""

    async def bind_datagram(self, address: Address) -> DatagramEndpoint:
        raw = _stdlib_socket.socket(_family(address[0]), _stdlib_socket.SOCK_DGRAM)
        sock = trio.socket.from_stdlib_socket(raw)  # makes it non-blocking
        try:
            await sock.bind(address)
        except BaseException:
            sock.close()
            raise
        bound = sock.getsockname()
        return _TrioDatagramEndpoint(sock, raw, (str(bound[0]), int(bound[1])))

    async def listen_stream(self, address: Address) -> StreamListener:
        family = _family(address[0])
        sock = trio.socket.socket(family, trio.socket.SOCK_STREAM)
        try:
            sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
            await sock.bind(address)
            if hasattr(trio.socket, "SO_REUSEPORT"):
                # Set after bind, so a port in use still fails the bind: a hole punch
                # connects from the listening port (node/holepunch.py), and the kernel
                # lets only a socket of the same user that sets it too share the port.
                sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEPORT, 1)
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
        bound = sock.getsockname()
        return _TrioStreamListener(trio.SocketListener(sock), (str(bound[0]), int(bound[1])))

    async def connect_stream(self, address: Address) -> trio.abc.Stream:
        return TcpStream.adopt(await trio.open_tcp_stream(address[0], address[1]))


def _family(host: str) -> int:
    return _stdlib_socket.AF_INET6 if ":" in host else _stdlib_socket.AF_INET
