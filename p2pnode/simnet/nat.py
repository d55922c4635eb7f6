"""NATs in the simulated network: hosts behind a UDP mapping and a filter.

Theory of operation: a :class:`Nat` is the sans-IO model of one home router in front
of one inside host (RFC 4787's terms). Each datagram the inside host sends leaves
through a **mapping** from its inside ``(ip, port)`` to an external port on the NAT's
public IP, made at the first datagram and kept for ``lifetime`` seconds (120 s, RFC
4787 REQ-5) after the last datagram sent out through it (replies coming in do not
keep it). A datagram to the public IP comes in only through a live mapping and only
if the **filter** lets its source in:

============================  ====================================  =========================
kind                          mapping                               filter (inbound source)
============================  ====================================  =========================
``FULL_CONE``                 endpoint-independent (one per socket)  anyone
``PORT_RESTRICTED``           endpoint-independent                  an ``(ip, port)`` sent to
``SYMMETRIC``                 endpoint-dependent (one per           the one ``(ip, port)`` it
                              destination ``(ip, port)``)           was made for
============================  ====================================  =========================

Nothing else comes in: no port forwarding, no hairpinning, and an inside address is
never routed from outside. :class:`NatNetwork` is a
:class:`~p2pnode.simnet.network.SimNetwork` whose datagrams pass these NATs: its
:meth:`NatNetwork.add_nat_host` gives a host behind a new NAT, whose datagrams reach
others from the public address and whose inbound datagrams the NAT filters. Streams
(TCP): an inside host's connections reach the far end from the NAT's public IP (the
port kept), and a connection to an inside or NAT public address is never answered (a
SYN into a NAT without a forwarded port), so a dial-back over TCP fails as it does
behind a real NAT.
"""

from __future__ import annotations

import enum
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from p2pnode.simnet.network import LinkConditions, SimHost, SimNetwork
from p2pnode.simnet.streams import SimStream
from p2pnode.transport.net import Address

#: Seconds a UDP mapping lives after the last datagram sent out through it (RFC 4787 REQ-5).
UDP_MAPPING_LIFETIME = 120.0
#: External ports a NAT hands out, in turn (the dynamic range of RFC 6335).
FIRST_PORT, LAST_PORT = 49152, 65535


_PLAIN_LINK = LinkConditions()


class NatKind(enum.Enum):
    """The three NAT behaviours the simulator models (RFC 4787 §4.1, §5)."""

    #: Endpoint-independent mapping and filtering: anyone may send to the mapping.
    FULL_CONE = "full-cone"
    #: Endpoint-independent mapping, address-and-port-dependent filtering.
    PORT_RESTRICTED = "port-restricted"
    #: Endpoint-dependent mapping: a new external port per destination.
    SYMMETRIC = "symmetric"


#: What a mapping maps: the inside address, and for SYMMETRIC the destination too.
_Key = tuple[Address, Address | None]


@dataclass(slots=True)
class _Mapping:
    key: _Key
    inside: Address
    port: int
    expires: float
    #: Where the inside host sent through this mapping (the filter's allowed sources).
    sent_to: set[Address] = field(default_factory=set)


@dataclass(slots=True)
class NatStatistics:
    """A NAT's counters."""

    mappings_made: int = 0
    mappings_expired: int = 0
    #: Inbound datagrams let through, and dropped (no live mapping, or filtered).
    passed_in: int = 0
    filtered: int = 0


class Nat:
    """One NAT (see the module docstring). Sans-IO: ``now`` is a parameter."""

    def __init__(
        self, kind: NatKind, public_ip: str, *, lifetime: float = UDP_MAPPING_LIFETIME
    ) -> None:
        """Raises ValueError for a lifetime that is not positive."""
        if not lifetime > 0:
            raise ValueError("lifetime must be > 0")
        self.kind = kind
        self.public_ip = public_ip
        self.lifetime = lifetime
        self.stats = NatStatistics()
        # Mappings by what they map (the inside address, and for SYMMETRIC the
        # destination too) and by external port.
        self._by_key: dict[_Key, _Mapping] = {}
        self._by_port: dict[int, _Mapping] = {}
        self._ports = itertools.cycle(range(FIRST_PORT, LAST_PORT + 1))
        self._sweep_at = 64

    def __len__(self) -> int:
        """Mappings held (live, or expired and not yet swept)."""
        return len(self._by_key)

    def outbound(self, inside: Address, destination: Address, now: float) -> Address:
        """The external source of a datagram ``inside`` sends to ``destination`` at
        ``now``; makes or refreshes the mapping. Raises OSError when every port is taken."""
        key = (inside, destination if self.kind is NatKind.SYMMETRIC else None)
        mapping = self._by_key.get(key)
        if mapping is None or mapping.expires <= now:
            if mapping is not None:
                self._forget(mapping)
            mapping = self._make(key, inside, now)
        mapping.expires = now + self.lifetime
        mapping.sent_to.add(destination)
        return (self.public_ip, mapping.port)

    def inbound(self, port: int, source: Address, now: float) -> Address | None:
        """The inside address a datagram from ``source`` to the public ``port`` goes
        to at ``now``, or None when the NAT drops it."""
        mapping = self._by_port.get(port)
        if mapping is None or mapping.expires <= now:
            self.stats.filtered += 1
            return None
        if self.kind is not NatKind.FULL_CONE and source not in mapping.sent_to:
            self.stats.filtered += 1
            return None
        self.stats.passed_in += 1
        return mapping.inside

    def external(self, inside: Address, destination: Address, now: float) -> Address | None:
        """The live external address of ``inside`` towards ``destination`` (None: no
        mapping), without sending anything."""
        key = (inside, destination if self.kind is NatKind.SYMMETRIC else None)
        mapping = self._by_key.get(key)
        if mapping is None or mapping.expires <= now:
            return None
        return (self.public_ip, mapping.port)

    def _make(self, key: _Key, inside: Address, now: float) -> _Mapping:
        if len(self._by_key) >= self._sweep_at:
            self._sweep(now)
        for _ in range(LAST_PORT - FIRST_PORT + 1):
            port = next(self._ports)
            held = self._by_port.get(port)
            if held is None:
                break
            if held.expires <= now:  # an expired mapping gives its port back
                self._forget(held)
                break
        else:
            raise OSError(f"NAT {self.public_ip}: no external port free")
        mapping = _Mapping(key, inside, port, now + self.lifetime)
        self._by_key[key] = mapping
        self._by_port[port] = mapping
        self.stats.mappings_made += 1
        return mapping

    def _forget(self, mapping: _Mapping) -> None:
        if self._by_key.get(mapping.key) is mapping:
            del self._by_key[mapping.key]
        if self._by_port.get(mapping.port) is mapping:
            del self._by_port[mapping.port]
        self.stats.mappings_expired += 1

    def _sweep(self, now: float) -> None:
        """Drop expired mappings; the next sweep when the table has doubled (memory
        stays within twice the live mappings, at amortised constant cost)."""
        for mapping in list(self._by_key.values()):
            if mapping.expires <= now:
                self._forget(mapping)
        self._sweep_at = max(64, 2 * len(self._by_key))


class NatNetwork(SimNetwork):
    """A :class:`~p2pnode.simnet.network.SimNetwork` with hosts behind NATs."""

    def __init__(
        self,
        rng: random.Random,
        *,
        default: LinkConditions = _PLAIN_LINK,
        connect_timeout: float = 3.0,
        tick: float = 0.0,
    ) -> None:
        super().__init__(rng, default=default, connect_timeout=connect_timeout, tick=tick)
        self._nat_inside: dict[str, Nat] = {}  # inside host -> its NAT
        self._nat_public: dict[str, tuple[Nat, str]] = {}  # public IP -> NAT, inside host
        self._publics = itertools.count(1)
        #: Called with (source, public destination, data) for every datagram sent to a
        #: NAT's public address, before the NAT filters it (for tests' accounting).
        self.inbound_tap: Callable[[Address, Address, bytes], None] | None = None
        #: Datagrams no NAT let in (no mapping, filtered, or an inside address).
        self.nat_dropped = 0

    def add_host(self, host: str | None = None) -> SimHost:
        """A public host, which never connects a stream to an address behind a NAT."""
        made = super().add_host(host)
        self._hosts[made.host] = guarded = _NatAwareHost(self, made.host)
        return guarded

    def add_nat_host(self, kind: NatKind, *, lifetime: float = UDP_MAPPING_LIFETIME) -> SimHost:
        """A new host behind a new NAT of ``kind`` (inside ``192.168.x.y``, public
        ``100.64.x.y``: labels only, never real traffic)."""
        n = next(self._publics)
        inside = self.add_host(f"192.168.{(n >> 8) & 255}.{n & 255}" if n < 65536 else None)
        public = f"100.{64 + ((n >> 16) & 63)}.{(n >> 8) & 255}.{n & 255}"
        nat = Nat(kind, public, lifetime=lifetime)
        self._nat_inside[inside.host] = nat
        self._nat_public[public] = (nat, inside.host)
        return inside

    def nat_of(self, host: str) -> Nat | None:
        """The NAT in front of inside host ``host`` (None: a public host)."""
        return self._nat_inside.get(host)

    def behind_nat(self, host: str) -> bool:
        """True for an inside host or a NAT's public IP."""
        return host in self._nat_inside or host in self._nat_public

    def reachable(self, a: str, b: str) -> bool:
        """As :meth:`SimNetwork.reachable`, a NAT's public IP standing for its inside host."""
        public = self._nat_public
        if public:
            a = public[a][1] if a in public else a
            b = public[b][1] if b in public else b
        return super().reachable(a, b)

    def _send_datagram(self, src: Address, dst: Address, data: bytes) -> None:
        """Translate the source through the sender's NAT and the destination through
        the receiver's, then send as the plain network does."""
        now = self._step_time if self._step_time is not None else trio.current_time()
        nat = self._nat_inside.get(src[0])
        if nat is not None:
            src = nat.outbound(src, dst, now)
        target = self._nat_public.get(dst[0])
        if target is not None:
            if self.inbound_tap is not None:
                self.inbound_tap(src, dst, data)
            inside = target[0].inbound(dst[1], src, now)
            if inside is None:
                self._drop_at_nat()
                return
            dst = inside
        elif dst[0] in self._nat_inside and src[0] != dst[0]:
            self._drop_at_nat()  # a private address is not routed from outside
            return
        super()._send_datagram(src, dst, data)

    def _drop_at_nat(self) -> None:
        self.datagrams_sent += 1
        self.datagrams_dropped += 1
        self.nat_dropped += 1


class _NatAwareHost(SimHost):
    """A host of a :class:`NatNetwork`: its connections to an address behind a NAT
    are never answered (no forwarded port)."""

    __slots__ = ()

    async def connect_stream(self, address: Address) -> trio.abc.Stream:
        sim = self.sim
        assert isinstance(sim, NatNetwork)
        if sim.behind_nat(address[0]) and address[0] != self.host:
            await trio.sleep(sim.connect_timeout)
            raise OSError(f"connect to {address} timed out")
        stream = await super().connect_stream(address)
        nat = sim.nat_of(self.host)
        if nat is not None and isinstance(stream, SimStream) and stream._peer is not None:
            # The far end sees the connection come from the NAT's public IP (the port
            # kept as it is); no task ran since it was queued, so none saw it before.
            stream._peer.remote_address = (nat.public_ip, stream.local_address[1])
        return stream


__all__ = [
    "FIRST_PORT",
    "LAST_PORT",
    "UDP_MAPPING_LIFETIME",
    "Nat",
    "NatKind",
    "NatNetwork",
    "NatStatistics",
]
