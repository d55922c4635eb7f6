"""Routing table: closest-k against brute force, bucket bounds, eviction protocol."""

from __future__ import annotations

import gc
import random
import sys
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import LocalError
from p2pnode.dht.routing import (
    Contact,
    RoutingTable,
    distance,
    host_key,
    id_int,
    make_contact,
    parsed_host_key,
    random_id_in_range,
)

ids = st.binary(min_size=20, max_size=20)


def _c(node_id: bytes, port: int = 1) -> Contact:
    # One host per id: the table keeps one id per address.
    return Contact(node_id, node_id.hex(), port)


@settings(max_examples=150, deadline=None)
@given(own=ids, others=st.lists(ids, max_size=300), target=ids, count=st.integers(1, 40))
def test_closest_matches_brute_force(
    own: bytes, others: list[bytes], target: bytes, count: int
) -> None:
    table = RoutingTable(own, k=8)
    for i, o in enumerate(others):
        table.observe(_c(o, i), float(i))
    present = table.contacts()
    expected = sorted(present, key=lambda c: distance(c.node_id, target))[:count]
    assert [c.node_id for c in table.closest(target, count)] == [c.node_id for c in expected]


@settings(max_examples=150, deadline=None)
@given(
    own=ids,
    others=st.lists(ids, max_size=300),
    target=ids,
    count=st.integers(1, 40),
    picks=st.lists(st.integers(0, 299), max_size=3),
    strangers=st.lists(ids, max_size=2),
)
def test_closest_excluding_matches_brute_force(
    own: bytes,
    others: list[bytes],
    target: bytes,
    count: int,
    picks: list[int],
    strangers: list[bytes],
) -> None:
    """Leaving ids out (held ones, ids the table does not hold, None, the target
    itself) is the full sort of the other contacts, cut to ``count``."""
    table = RoutingTable(own, k=8)
    for i, o in enumerate(others):
        table.observe(_c(o, i), float(i))
    present = table.contacts()
    left_out: list[bytes | None] = [present[p % len(present)].node_id for p in picks if present]
    left_out += [*strangers, None, target]
    expected = sorted(
        (c for c in present if c.node_id not in left_out),
        key=lambda c: distance(c.node_id, target),
    )[:count]
    got = table.closest(target, count, excluding=left_out)
    assert [c.node_id for c in got] == [c.node_id for c in expected]


@settings(max_examples=100, deadline=None)
@given(own=ids, others=st.lists(ids, max_size=300, unique=True))
def test_bucket_invariants(own: bytes, others: list[bytes]) -> None:
    table = RoutingTable(own, k=5)
    for o in others:
        table.observe(_c(o), 0.0)
    got = table.contacts()
    assert own not in {c.node_id for c in got}
    assert len({c.node_id for c in got}) == len(got)
    for b in table._buckets:
        assert len(b.contacts) <= 5
        assert len(b.replacements) <= table.replacement_size
        for cid in b.contacts:
            assert b.lo <= id_int(cid) < b.hi
    # Buckets tile the id space.
    assert table._buckets[0].lo == 0
    for a, b in zip(table._buckets, table._buckets[1:], strict=False):
        assert a.hi == b.lo
    assert table._buckets[-1].hi == 1 << 160
    # With few contacts nothing is lost: every contact fits.
    if len(others) <= 5:
        assert len(got) == len([o for o in others if o != own])


def test_full_far_bucket_asks_for_ping_then_evicts() -> None:
    own = b"\x00" * 20
    table = RoutingTable(own, k=2)
    # Ids with the top bit set share the far bucket at depth 1 (1 % 5 != 0 would split),
    # so fill a depth-5 bucket instead: prefix 1111 1 (depth 5, does not cover own id).
    far = [bytes([0xF8 | i]) + bytes(19) for i in range(4)]
    pinged = [table.observe(_c(f), 1.0) for f in far[:2]]
    assert pinged == [None, None]
    head = table.observe(_c(far[2]), 2.0)
    assert head is not None
    assert head.node_id == far[0]  # least recently seen
    assert table.observe(_c(far[3]), 2.0) is None  # one ping at a time per bucket
    table.ping_result(far[0], alive=False, now=3.0)
    ids_now = {c.node_id for c in table.contacts()}
    assert far[0] not in ids_now
    assert far[3] in ids_now  # freshest replacement promoted


def test_alive_ping_keeps_old_contact() -> None:
    own = b"\x00" * 20
    table = RoutingTable(own, k=2)
    far = [bytes([0xF8 | i]) + bytes(19) for i in range(3)]
    table.observe(_c(far[0]), 1.0)
    table.observe(_c(far[1]), 1.0)
    head = table.observe(_c(far[2]), 2.0)
    assert head is not None
    table.ping_result(head.node_id, alive=True, now=3.0)
    ids_now = [c.node_id for c in table.contacts()]
    assert far[2] not in ids_now
    assert ids_now[-1] == far[0]  # moved to the tail


def test_failures_evict_after_threshold() -> None:
    table = RoutingTable(b"\x00" * 20, k=20, max_failures=2)
    node = b"\x80" + bytes(19)
    table.observe(_c(node), 0.0)
    table.record_failure(node)
    assert node in table
    table.observe(_c(node), 1.0)  # a reply resets the count
    table.record_failure(node)
    assert node in table
    table.record_failure(node)
    assert node not in table


def test_address_change_does_not_repoint_known_id() -> None:
    table = RoutingTable(b"\x00" * 20)
    node = b"\x80" + bytes(19)
    table.observe(Contact(node, "10.0.0.1", 1), 0.0)
    table.observe(Contact(node, "10.6.6.6", 1), 1.0)
    got = table.get(node)
    assert got is not None
    assert got.host == "10.0.0.1"


def test_stale_buckets_and_refresh_ids() -> None:
    table = RoutingTable(b"\x00" * 20, k=2, now=0.0)
    rng = random.Random(3)
    for _ in range(50):
        table.observe(_c(rng.randbytes(20)), 0.0)
    stale = table.stale_buckets(now=4000.0, interval=3600.0)
    assert len(stale) == table.bucket_count()
    for lo, hi in stale:
        rid = random_id_in_range(lo, hi, rng)
        assert lo <= id_int(rid) < hi
        table.touch_range(rid, 4000.0)
    assert table.stale_buckets(now=4000.0, interval=3600.0) == []


_octet = st.one_of(
    st.integers(0, 300).map(str), st.sampled_from(["00", "01", "007", "", "a", "-1"])
)


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(_octet, min_size=1, max_size=5), limit=st.booleans(), loop=st.booleans())
def test_host_key_shortcut_agrees_with_the_parse(parts: list[str], limit: bool, loop: bool) -> None:
    host = ".".join(["127", *parts[1:]] if loop else parts)
    assert host_key(host, limit_loopback=limit) == parsed_host_key(host, limit)


def test_equal_contacts_are_shared_between_tables_while_held() -> None:
    node = b"\x80" + bytes(19)
    one, two = RoutingTable(b"\x00" * 20), RoutingTable(b"\x01" * 20)
    one.observe(Contact(node, "10.0.0.1", 1), 0.0)
    two.observe(Contact(node, "10.0.0.1", 1), 0.0)
    held = one.get(node)
    assert held is not None
    assert held is two.get(node)
    assert held.address == ("10.0.0.1", 1)
    assert held.address is held.address  # built once
    # Another address for the id is a contact of its own, equal only to itself.
    three = RoutingTable(b"\x02" * 20)
    three.observe(Contact(node, "10.0.0.2", 1), 0.0)
    moved = three.get(node)
    assert moved is not None
    assert moved.address == ("10.0.0.2", 1)
    assert moved != held
    # Nothing outlives the tables that hold it.
    ref = weakref.ref(held)
    del one, two, held
    gc.collect()
    assert ref() is None


def test_make_contact_reuses_a_held_contact() -> None:
    node = b"\x81" + bytes(19)
    table = RoutingTable(b"\x00" * 20)
    table.observe(Contact(node, "10.0.0.1", 1), 0.0)
    assert make_contact(node, "10.0.0.1", 1) is table.get(node)
    other = make_contact(node, "10.0.0.1", 2)
    assert other == Contact(node, "10.0.0.1", 2)
    assert other is not table.get(node)
    host = "".join(["10.0.0.", "9"])  # built at run time, not a constant
    assert make_contact(b"\x82" + bytes(19), host, 1).host is sys.intern("10.0.0.9")


def test_bad_ids_are_caller_errors() -> None:
    with pytest.raises(LocalError):
        RoutingTable(b"short")
    table = RoutingTable(b"\x00" * 20)
    with pytest.raises(LocalError):
        table.closest(b"x")
    assert b"x" not in table


def test_package_exports() -> None:
    import p2pnode.dht as dht

    for name in dht.__all__:
        assert getattr(dht, name).__module__.startswith("p2pnode.dht.")
    assert {"RpcCore", "Lookup", "RoutingTable", "DhtConfig"} <= set(dht.__all__)
    # The trio drivers are imported from their modules, never from the namespace.
    assert not {"DhtNode", "DhtPeer"} & set(dht.__all__)
