"""The one network interface every piece of node code uses.

Theory of operation: node code never touches sockets. It receives a
:class:`Network` and asks it for datagram endpoints (``bind_datagram``),
stream listeners (``listen_stream``) and outgoing streams
(``connect_stream``). Streams are plain :class:`trio.abc.Stream` objects, so
any layer that wraps a trio stream (the Noise secure channel, the node's
framed channels) runs unchanged over them.

Two implementations exist:

* :class:`TrioNetwork` here: real trio UDP and TCP sockets.
* :class:`p2pnode.simnet.SimNetwork`: an in-memory network with per-link
  latency, jitter, loss, partitions and killed hosts, driven by trio's
  (virtual) clock and a seeded :class:`random.Random`.

Addresses are ``(host, port)`` tuples in both. Datagram delivery is
best-effort, as UDP is: ``sendto`` never reports a lost datagram, and an
unreachable destination is not an error.
"""

from __future__ import annotations

import abc
import logging
import socket as _stdlib_socket

import trio

Address = tuple[str, int]
"""A network address: host (IP literal or simulator label) and port."""

MAX_DATAGRAM = 65_507
"""Largest UDP payload over IPv4; ``recvfrom`` never returns more."""

_log = logging.getLogger("p2pnode.net")


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


class Network(abc.ABC):
    """Factory for endpoints, listeners and outbound streams."""

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
    __slots__ = ("_address", "_sock")

    def __init__(self, sock: trio.socket.SocketType, address: Address) -> None:
        self._sock = sock
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

    async def recvfrom(self) -> tuple[bytes, Address]:
        while True:
            try:
                data, source = await self._sock.recvfrom(MAX_DATAGRAM)
            except OSError as exc:
                if self._sock.fileno() == -1:
                    raise trio.ClosedResourceError("endpoint closed") from exc
                # ICMP errors surface here on some platforms; they are not datagrams.
                _log.debug("recvfrom error ignored: %s", exc)
                continue
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
        return await self._listener.accept()

    async def aclose(self) -> None:
        await self._listener.aclose()


class TrioNetwork(Network):
    """The real network: trio UDP and TCP sockets (IPv4 and IPv6 literals)."""

    async def bind_datagram(self, address: Address) -> DatagramEndpoint:
        family = _family(address[0])
        sock = trio.socket.socket(family, trio.socket.SOCK_DGRAM)
        try:
            await sock.bind(address)
        except BaseException:
            sock.close()
            raise
        bound = sock.getsockname()
        return _TrioDatagramEndpoint(sock, (str(bound[0]), int(bound[1])))

    async def listen_stream(self, address: Address) -> StreamListener:
        family = _family(address[0])
        sock = trio.socket.socket(family, trio.socket.SOCK_STREAM)
        try:
            sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_REUSEADDR, 1)
            await sock.bind(address)
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
        bound = sock.getsockname()
        return _TrioStreamListener(trio.SocketListener(sock), (str(bound[0]), int(bound[1])))

    async def connect_stream(self, address: Address) -> trio.abc.Stream:
        return await trio.open_tcp_stream(address[0], address[1])


def _family(host: str) -> int:
    return _stdlib_socket.AF_INET6 if ":" in host else _stdlib_socket.AF_INET
