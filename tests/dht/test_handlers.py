"""The callee side (sans-IO): what a find_node reply holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.wire import unpack_untrusted
from p2pnode.dht.config import DhtStatistics
from p2pnode.dht.handlers import RequestHandlers
from p2pnode.dht.records import RecordStore
from p2pnode.dht.routing import Contact, RoutingTable, distance
from p2pnode.dht.rpc import Address

ids = st.binary(min_size=20, max_size=20)
OWN = b"\x80" + b"\x00" * 19


@dataclass
class _Host:
    table: RoutingTable
    node_id: bytes = OWN
    records: RecordStore = field(default_factory=RecordStore)
    stats: DhtStatistics = field(default_factory=DhtStatistics)
    wall_clock_ms: Callable[[], int] = lambda: 0


@settings(max_examples=150, deadline=None)
@given(
    others=st.lists(ids, max_size=120, unique=True),
    key=ids,
    asker=st.one_of(st.none(), st.integers(0, 239)),
    key_held=st.booleans(),
    hosts=st.integers(1, 40),
)
def test_find_node_reply_is_the_k_nearest_but_the_asker_and_the_key(
    others: list[bytes], key: bytes, asker: int | None, key_held: bool, hosts: int
) -> None:
    """Brute force over every contact of the table: the k nearest to ``key`` except the
    one at the asker's address and the one whose id is the key, nearest first."""
    table = RoutingTable(OWN, k=8, max_per_host=2)
    if key_held:
        others = [key, *others]
    for i, o in enumerate(others):
        table.observe(Contact(o, f"10.0.0.{i % hosts}", 4000 + i), 0.0)
    present = table.contacts()
    source: Address = ("10.9.9.9", 1)
    # The asker may be a contact or wait in a replacement cache (then it is no contact).
    waiting = [r.address for b in table._buckets for r in b.replacements.values()]
    addresses = [c.address for c in present] + waiting
    if asker is not None and addresses:
        source = addresses[asker % len(addresses)]
    handlers = RequestHandlers(_Host(table), lambda node_id, address, now: None)
    reply = handlers.answer_untrusted("find_node", source, [b"\x01" * 20, key], 0.0)
    expected = sorted(
        (c for c in present if c.address != source and c.node_id != key),
        key=lambda c: distance(c.node_id, key),
    )[:8]
    assert [tuple(x) for x in unpack_untrusted(reply.body)] == [
        (c.node_id, c.host, c.port) for c in expected
    ]
