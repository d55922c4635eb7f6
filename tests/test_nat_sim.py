"""The simulator's NATs (p2pnode/simnet/nat.py): the mapping and filtering rules of each
kind as properties of the sans-IO :class:`Nat`, the datagrams a :class:`NatNetwork`
translates, filters and never routes, and the DHT's ``stun`` and UDP dial-back over them
(the reachability check's view of each kind)."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.dht.node import DhtNode
from p2pnode.dht.rpcwire import Request, decode_datagram_untrusted, encode_response
from p2pnode.services.reachability.dhtside import PING_RESEND_S, PING_SENDS, DhtReach
from p2pnode.simnet.nat import UDP_MAPPING_LIFETIME, Nat, NatKind, NatNetwork
from p2pnode.transport.net import Address
from tests.sim import FAST_DHT, identity, virtual_ms

INSIDE: Address = ("192.168.0.2", 4000)
kinds = st.sampled_from(list(NatKind))
peers = st.lists(
    st.tuples(st.sampled_from(["10.0.0.1", "10.0.0.2", "10.0.0.3"]), st.integers(1, 4)),
    min_size=1,
    max_size=12,
)
gaps = st.floats(min_value=0.0, max_value=UDP_MAPPING_LIFETIME / 4)


@given(kinds, peers, st.lists(gaps, min_size=12, max_size=12))
def test_a_reply_from_where_the_host_sent_comes_in_while_the_mapping_lives(
    kind: NatKind, destinations: list[Address], waits: list[float]
) -> None:
    nat = Nat(kind, "100.64.0.1")
    now = 0.0
    sent: list[tuple[Address, Address]] = []
    for destination, wait in zip(destinations, waits, strict=False):
        now += wait
        sent.append((destination, nat.outbound(INSIDE, destination, now)))
    # Each destination sent to within the lifetime may answer at the address it saw.
    live = [(d, e) for d, e in sent if nat.external(INSIDE, d, now) == e]
    assert live, "the last datagram's mapping is live"
    for destination, external in live:
        assert external[0] == "100.64.0.1"
        assert nat.inbound(external[1], destination, now) == INSIDE


@given(kinds, peers)
def test_only_endpoint_dependent_mapping_gives_each_destination_its_own_port(
    kind: NatKind, destinations: list[Address]
) -> None:
    nat = Nat(kind, "100.64.0.1")
    ports = {d: nat.outbound(INSIDE, d, 1.0)[1] for d in destinations}
    if kind is NatKind.SYMMETRIC:
        assert len(set(ports.values())) == len(ports)
    else:
        assert len(set(ports.values())) == 1


@given(kinds, peers, st.sampled_from(["10.0.0.1", "10.0.0.9"]), st.integers(1, 9))
def test_a_source_never_sent_to_comes_in_only_through_a_full_cone(
    kind: NatKind, destinations: list[Address], host: str, port: int
) -> None:
    nat = Nat(kind, "100.64.0.1")
    externals = [nat.outbound(INSIDE, d, 1.0) for d in destinations]
    stranger = (host, port)
    if stranger in destinations:
        return
    let_in = [nat.inbound(e[1], stranger, 2.0) is not None for e in externals]
    assert all(let_in) if kind is NatKind.FULL_CONE else not any(let_in)


@given(kinds, st.floats(min_value=1.0, max_value=600.0), st.integers(0, 5))
def test_a_mapping_ends_its_lifetime_after_the_last_datagram_out(
    kind: NatKind, lifetime: float, replies: int
) -> None:
    nat = Nat(kind, "100.64.0.1", lifetime=lifetime)
    peer = ("10.0.0.1", 1)
    port = nat.outbound(INSIDE, peer, 10.0)[1]
    for i in range(replies):  # replies coming in do not keep the mapping
        assert nat.inbound(port, peer, 10.0 + i * lifetime / 10) == INSIDE
    assert nat.inbound(port, peer, 10.0 + lifetime * 0.999) == INSIDE
    assert nat.inbound(port, peer, 10.0 + lifetime) is None
    assert nat.external(INSIDE, peer, 10.0 + lifetime) is None


def test_expired_mappings_are_swept_so_memory_follows_the_live_ones() -> None:
    nat = Nat(NatKind.SYMMETRIC, "100.64.0.1", lifetime=10.0)
    for i in range(10_000):  # a new destination each 0.1 s: about 100 live at a time
        nat.outbound(INSIDE, ("10.0.0.1", 1 + i), i * 0.1)
    assert len(nat) <= 2 * 101 + 64
    assert nat.stats.mappings_made == 10_000


def test_a_lifetime_that_is_not_positive_is_refused() -> None:
    with pytest.raises(ValueError, match="lifetime"):
        Nat(NatKind.FULL_CONE, "100.64.0.1", lifetime=0)


async def _recv(endpoint: Any) -> tuple[bytes, Address] | None:
    with trio.move_on_after(1.0):
        got: tuple[bytes, Address] = await endpoint.recvfrom()
        return got
    return None


@pytest.mark.parametrize("kind", list(NatKind))
async def test_datagrams_leave_from_the_nat_and_only_allowed_ones_come_back(
    autojump_clock: Any, kind: NatKind
) -> None:
    sim = NatNetwork(random.Random(1))
    inside, server, stranger = sim.add_nat_host(kind), sim.add_host(), sim.add_host()
    nat = sim.nat_of(inside.host)
    assert nat is not None and sim.nat_of(server.host) is None
    a = await inside.bind_datagram((inside.host, 4000))
    s = await server.bind_datagram((server.host, 5000))
    x = await stranger.bind_datagram((stranger.host, 6000))
    await a.sendto(b"hello", s.local_address)
    got = await _recv(s)
    assert got is not None
    data, external = got
    assert data == b"hello"
    assert external[0] == nat.public_ip  # never the inside address
    await s.sendto(b"reply", external)
    assert await _recv(a) == (b"reply", s.local_address)
    await x.sendto(b"unasked", external)
    assert (await _recv(a) is not None) is (kind is NatKind.FULL_CONE)
    # The inside address itself is never routed from outside.
    await s.sendto(b"direct", a.local_address)
    assert await _recv(a) is None
    assert sim.nat_dropped >= 1


async def test_a_stream_to_an_address_behind_a_nat_is_never_answered(
    autojump_clock: Any,
) -> None:
    sim = NatNetwork(random.Random(1), connect_timeout=3.0)
    inside, outside = sim.add_nat_host(NatKind.FULL_CONE), sim.add_host()
    listener = await inside.listen_stream((inside.host, 7000))
    nat = sim.nat_of(inside.host)
    assert nat is not None
    for address in [(inside.host, 7000), (nat.public_ip, 7000)]:
        start = trio.current_time()
        with pytest.raises(OSError, match="timed out"):
            await outside.connect_stream(address)
        assert trio.current_time() - start >= 3.0
    # Outbound streams work (the inside host dials out as usual).
    back = await outside.listen_stream((outside.host, 7000))
    stream = await inside.connect_stream((outside.host, 7000))
    await stream.aclose()
    await back.aclose()
    await listener.aclose()


async def test_killing_an_inside_host_silences_its_public_address(autojump_clock: Any) -> None:
    sim = NatNetwork(random.Random(1))
    inside, server = sim.add_nat_host(NatKind.FULL_CONE), sim.add_host()
    a = await inside.bind_datagram((inside.host, 4000))
    s = await server.bind_datagram((server.host, 5000))
    await a.sendto(b"hello", s.local_address)
    got = await _recv(s)
    assert got is not None
    sim.kill(inside.host)
    await s.sendto(b"reply", got[1])
    assert await _recv(a) is None
    sim.revive(inside.host)
    await s.sendto(b"reply", got[1])
    assert await _recv(a) is not None


@pytest.mark.parametrize(
    ("kind", "consistent", "reached"),
    [
        (NatKind.FULL_CONE, True, True),
        (NatKind.PORT_RESTRICTED, True, False),
        (NatKind.SYMMETRIC, False, False),
    ],
)
async def test_stun_and_the_udp_dial_back_see_each_kind_as_a_real_nat_would(
    autojump_clock: Any, kind: NatKind, consistent: bool, reached: bool
) -> None:
    rng = random.Random(5)
    sim = NatNetwork(rng)
    hosts = [sim.add_host(), sim.add_host(), sim.add_nat_host(kind)]
    async with DhtNode(
        hosts[0], identity=identity(rng), address=(hosts[0].host, 4000), config=FAST_DHT,
        wall_clock_ms=virtual_ms,
    ) as c1, DhtNode(
        hosts[1], identity=identity(rng), address=(hosts[1].host, 4000), config=FAST_DHT,
        wall_clock_ms=virtual_ms,
    ) as c2, DhtNode(
        hosts[2], identity=identity(rng), address=(hosts[2].host, 4000), config=FAST_DHT,
        wall_clock_ms=virtual_ms,
    ) as natted:
        mine = DhtReach(natted, hosts[2], b"\x01" * 20, random.Random(1))
        seen = [await mine.stun(c.address) for c in (c1, c2)]
        assert seen[0] is not None and seen[1] is not None
        assert (seen[0] == seen[1]) is consistent
        checker = DhtReach(c1, hosts[0], b"\x02" * 20, random.Random(2))
        got = False  # unanswered within the dial timeout
        with trio.move_on_after(3.0):
            got = await checker.ping_from_fresh_socket(seen[0], natted.node_id)
        assert got is reached


@pytest.mark.parametrize("answered", [1, 2, 3, None])
async def test_the_udp_dial_back_resends_its_ping_until_one_is_answered(
    autojump_clock: Any, answered: int | None
) -> None:
    """reachability.md §2.3: the same request, 0.5 s apart, 3 datagrams at most; a lost
    datagram does not read as unreachable, and silence costs no more than 3 sends."""
    sim = NatNetwork(random.Random(3))
    checker_host, target_host = sim.add_host(), sim.add_host()
    target = await target_host.bind_datagram((target_host.host, 4000))
    node_id = b"\x07" * 20
    got: list[tuple[float, bytes]] = []

    async def serve() -> None:
        while True:
            data, source = await target.recvfrom()
            request = decode_datagram_untrusted(data)
            assert isinstance(request, Request) and request.method == "ping"
            got.append((trio.current_time(), request.msg_id))
            if len(got) == answered:
                await target.sendto(encode_response(request.msg_id, node_id), source)

    checker = DhtReach(None, checker_host, b"\x02" * 20, random.Random(2))  # type: ignore[arg-type]
    reached = False
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        with trio.move_on_after(3.0):  # the dial timeout
            reached = await checker.ping_from_fresh_socket(target.local_address, node_id)
        nursery.cancel_scope.cancel()
    assert reached is (answered is not None)
    assert len(got) == (answered or PING_SENDS)
    assert len({msg_id for _, msg_id in got}) == 1  # one request, sent again
    sent = [at for at, _ in got]
    assert all(abs(b - a - PING_RESEND_S) < 0.01 for a, b in itertools.pairwise(sent))
