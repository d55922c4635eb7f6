"""Admission to the routing table (dht.md §5.1): the sans-IO rules, one by one."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import LocalError
from p2pnode.dht.admission import Admission, Verdict
from p2pnode.dht.config import DhtStatistics, LogSummary
from p2pnode.dht.routing import Contact, Refusal, RoutingTable, distance, host_key

OWN = b"\x00" * 20


def _id(n: int) -> bytes:
    return (0x80 + n).to_bytes(1, "big") + n.to_bytes(19, "big")


# ---------------------------------------------------------------------- the table's limits


def test_one_id_per_address() -> None:
    table = RoutingTable(OWN)
    table.observe(Contact(_id(1), "10.0.0.1", 7), 0.0)
    intruder = Contact(_id(2), "10.0.0.1", 7)
    assert table.refusal(intruder) is Refusal.ADDRESS_TAKEN
    assert table.observe(intruder, 1.0) is None
    assert _id(2) not in table
    assert table.holder(("10.0.0.1", 7)) == _id(1)
    # The address is free again once its id left.
    table.remove(_id(1))
    assert table.refusal(intruder) is None
    table.observe(intruder, 2.0)
    assert table.holder(("10.0.0.1", 7)) == _id(2)


def test_ids_per_host_are_bounded_and_freed_on_eviction() -> None:
    table = RoutingTable(OWN, max_per_host=2)
    for n in range(5):
        table.observe(Contact(_id(n), "10.0.0.9", 1000 + n), 0.0)
    assert [c.node_id for c in table.contacts()] == [_id(0), _id(1)]
    assert table.refusal(Contact(_id(3), "10.0.0.9", 2000)) is Refusal.HOST_FULL
    # An id it holds may still be seen again there, and other hosts are not affected.
    assert table.refusal(Contact(_id(1), "10.0.0.9", 1001)) is None
    table.observe(Contact(_id(9), "10.0.0.10", 1), 0.0)
    assert _id(9) in table
    table.record_failure(_id(0))
    table.record_failure(_id(0))
    assert _id(0) not in table
    table.observe(Contact(_id(3), "10.0.0.9", 1003), 1.0)
    assert _id(3) in table


def test_replacement_caches_count_toward_the_limits() -> None:
    table = RoutingTable(OWN, k=2, max_per_host=3)
    far = [bytes([0xF8 | i]) + bytes(19) for i in range(6)]
    table.observe(Contact(far[0], "10.0.0.1", 1), 0.0)
    table.observe(Contact(far[1], "10.0.0.1", 2), 0.0)
    table.observe(Contact(far[2], "10.0.0.1", 3), 0.0)  # to the replacement cache
    assert table.host_full("10.0.0.1")
    assert table.refusal(Contact(far[3], "10.0.0.1", 4)) is Refusal.HOST_FULL
    assert table.refusal(Contact(far[3], "10.0.0.2", 3)) is None
    assert table.refusal(Contact(far[3], "10.0.0.1", 3)) is Refusal.ADDRESS_TAKEN


@pytest.mark.parametrize(
    ("host", "limited", "key"),
    [
        ("10.1.2.3", True, "10.1.2.3"),
        ("127.0.0.1", False, None),
        ("127.0.0.1", True, "127.0.0.1"),
        ("::1", False, None),
        ("2001:db8:1:2:aaaa::1", True, "2001:db8:1:2::/64"),
        ("2001:db8:1:2:bbbb::7", True, "2001:db8:1:2::/64"),
        ("::ffff:10.1.2.3", True, "10.1.2.3"),
        ("peer.example", True, "peer.example"),
    ],
)
def test_host_groups(host: str, limited: bool, key: str | None) -> None:
    assert host_key(host, limit_loopback=limited) == key


def test_loopback_is_exempt_unless_limited() -> None:
    free = RoutingTable(OWN, max_per_host=1, limit_loopback=False)
    strict = RoutingTable(OWN, max_per_host=1, limit_loopback=True)
    for n in range(3):
        free.observe(Contact(_id(n), "127.0.0.1", 9000 + n), 0.0)
        strict.observe(Contact(_id(n), "127.0.0.1", 9000 + n), 0.0)
    assert (len(free), len(strict)) == (3, 1)


_op = st.tuples(
    st.sampled_from(["observe", "fail", "remove", "dead", "alive"]),
    st.integers(0, 40),  # id
    st.integers(0, 3),  # host
    st.integers(0, 3),  # port
)


def _apply(table: RoutingTable, op: str, node_id: bytes, host: str, port: int, now: float) -> None:
    """One of the _op operations on ``table``."""
    if op == "observe":
        table.observe(Contact(node_id, host, port), now)
    elif op == "fail":
        table.record_failure(node_id)
    elif op == "remove":
        table.remove(node_id)
    else:
        table.ping_result(node_id, op == "alive", now)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(_op, max_size=200))
def test_the_indexes_match_the_table_after_any_operations(
    ops: list[tuple[str, int, int, int]],
) -> None:
    table = RoutingTable(OWN, k=3, replacement_size=2, max_per_host=3)
    for i, (op, n, host, port) in enumerate(ops):
        _apply(table, op, bytes([n * 6]) + bytes(19), f"10.0.0.{host}", port, float(i))
    entries = [c for b in table._buckets for c in (*b.contacts.values(), *b.replacements.values())]
    assert table._at == {c.address: c.node_id for c in entries}
    assert len(table._at) == len(entries)  # one id per address
    hosts: dict[str, dict[bytes, int]] = {}
    for c in entries:
        ids = hosts.setdefault(c.host, {})
        ids[c.node_id] = ids.get(c.node_id, 0) + 1
    # The index keeps a host's single entry as the id itself, more as a tuple.
    assert all(isinstance(v, bytes) or len(v) >= 2 for v in table._hosts.values())
    counted = {h: Counter(v if isinstance(v, tuple) else (v,)) for h, v in table._hosts.items()}
    assert counted == hosts
    assert all(len(ids) <= 3 for ids in hosts.values())


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(_op, max_size=120), probe=st.integers(0, 255))
def test_near_is_nearer_than_the_kth_nearest_contact(
    ops: list[tuple[str, int, int, int]], probe: int
) -> None:
    """near() (cached between changes of the contacts) against a full scan."""
    table = RoutingTable(OWN, k=3, replacement_size=2)
    for i, (op, n, host, port) in enumerate(ops):
        _apply(table, op, bytes([n * 6]) + bytes(19), f"10.0.{host}.{n}", port, float(i))
        candidate = bytes([probe]) + bytes([i % 256]) * 19
        held = sorted(distance(c.node_id, OWN) for c in table.contacts())
        expected = len(held) < table.k or distance(candidate, OWN) < held[table.k - 1]
        assert table.near(candidate) == expected


def test_far_senders_are_checked_until_their_bucket_holds_check_fill() -> None:
    # Own id 0x00..: the near region fills buckets that split; ids 0x8.. are far.
    table = RoutingTable(OWN, k=4)
    for n in range(4):  # the k nearest: 0x00 0x01.., 0x00 0x02.., ...
        table.observe(Contact(b"\x00" + bytes([n + 1]) * 19, f"10.0.1.{n}", 1), 0.0)
    adm = Admission(check_fill=2)
    far = [bytes([0x80 + n]) + bytes(19) for n in range(4)]
    table.observe(Contact(far[0], "10.0.2.1", 1), 0.0)  # the full bucket splits
    assert table.bucket_size(far[1]) == 1
    assert adm.on_request(far[1], ("10.0.2.2", 1), table, 0.1) is Verdict.CHECK
    table.observe(Contact(far[1], "10.0.2.2", 1), 0.2)
    # Two contacts in that far bucket: enough to route through; no more pings there.
    assert table.has_room(far[2]) and not table.near(far[2])
    assert adm.on_request(far[2], ("10.0.2.3", 1), table, 0.2) is Verdict.ENOUGH
    assert adm.checking == 1
    # A sender that would be one of our k nearest is checked whatever its bucket holds.
    nearer = b"\x00" + b"\x00" * 18 + b"\x07"
    assert table.near(nearer)
    assert adm.on_request(nearer, ("10.0.3.1", 1), table, 0.3) is Verdict.CHECK
    # Without check_fill every sender with room is checked, as before.
    assert Admission().on_request(far[2], ("10.0.2.3", 1), table, 0.3) is Verdict.CHECK


def test_bucket_fill_runs_from_far_to_near() -> None:
    table = RoutingTable(OWN, k=2)
    for n, first in enumerate([0x80, 0x81, 0x40, 0x01, 0x02]):
        table.observe(Contact(bytes([first]) + bytes(19), f"10.0.0.{n}", 1), 0.0)
    # The far half (0x80, 0x81), the next quarter (0x40), then the quarter holding
    # our own id (0x01, 0x02).
    assert table.bucket_fill() == [2, 1, 2]


# ---------------------------------------------------------------------- checks of senders


def _admission(**kw: object) -> Admission:
    return Admission(max_checks=4, max_checks_per_host=2, retry_after=60.0, memory=8, **kw)  # type: ignore[arg-type]


def test_a_sender_is_checked_once_at_a_time_then_not_for_a_while() -> None:
    table = RoutingTable(OWN)
    adm = _admission()
    src = ("10.0.0.1", 5000)
    assert adm.on_request(_id(1), src, table, 0.0) is Verdict.CHECK
    assert adm.on_request(_id(2), src, table, 0.1) is Verdict.CHECKING
    adm.check_done(src, 1.0)
    assert adm.checking == 0
    assert adm.on_request(_id(3), src, table, 30.0) is Verdict.RECENT
    assert adm.on_request(_id(3), src, table, 61.0) is Verdict.CHECK


def test_an_unanswered_check_is_tried_again_before_the_address_rests() -> None:
    # Under a flood the ping or its answer may be lost in a full socket buffer: the
    # check is tried again (waiting for a slot like a sender), up to `attempts` pings.
    table = RoutingTable(OWN)
    adm = Admission(max_checks=1, attempts=3, retry_after=60.0)
    src, other = ("10.0.0.1", 5000), ("10.0.0.2", 5000)
    assert adm.on_request(_id(1), src, table, 0.0) is Verdict.CHECK
    assert adm.check_done(src, 5.0, answered=False) is True
    assert adm.waiting == 1 and adm.checking == 0
    # A request from elsewhere that finds the slot free takes it; the retry waits.
    assert adm.on_request(_id(2), other, table, 5.0) is Verdict.CHECK
    assert adm.next_waiting(table, 5.0) is None
    assert adm.check_done(other, 5.1) is False  # answered: done
    assert adm.next_waiting(table, 5.1) == (_id(1), src)
    assert adm.check_done(src, 10.1, answered=False) is True
    assert adm.next_waiting(table, 10.1) == (_id(1), src)
    # The third unanswered ping is the last: the address rests for retry_after.
    assert adm.check_done(src, 15.1, answered=False) is False
    assert adm.waiting == 0
    assert adm.on_request(_id(1), src, table, 20.0) is Verdict.RECENT
    assert adm.on_request(_id(1), src, table, 76.0) is Verdict.CHECK
    # An answer ends the count: the next check starts afresh.
    assert adm.check_done(src, 76.5, answered=False) is True
    assert adm.next_waiting(table, 76.5) == (_id(1), src)
    assert adm.check_done(src, 77.0) is False
    assert adm.on_request(_id(1), src, table, 140.0) is Verdict.CHECK
    assert adm.check_done(src, 145.0, answered=False) is True


@settings(max_examples=100, deadline=None)
@given(
    answers=st.lists(st.booleans(), min_size=1, max_size=30),
    attempts=st.integers(1, 4),
)
def test_pings_per_check_never_exceed_attempts(answers: list[bool], attempts: int) -> None:
    # However pings are answered, one address gets at most `attempts` pings in a row
    # without an answer before it rests for retry_after.
    table = RoutingTable(OWN)
    adm = Admission(max_checks=2, attempts=attempts, retry_after=60.0)
    src = ("10.0.0.1", 1)
    now, unanswered = 0.0, 0
    assert adm.on_request(_id(1), src, table, now) is Verdict.CHECK
    for answered in answers:
        now += 5.0
        again = adm.check_done(src, now, answered=answered)
        unanswered = 0 if answered else unanswered + 1
        assert unanswered <= attempts
        assert again == (not answered and unanswered < attempts)
        if again:
            assert adm.next_waiting(table, now) == (_id(1), src)
        else:
            assert adm.on_request(_id(1), src, table, now + 1.0) is Verdict.RECENT
            now += 61.0
            unanswered = 0
            assert adm.on_request(_id(1), src, table, now) is Verdict.CHECK


def test_a_contact_held_at_its_address_is_known() -> None:
    table = RoutingTable(OWN)
    table.observe(Contact(_id(1), "10.0.0.1", 5000), 0.0)
    adm = _admission()
    assert adm.on_request(_id(1), ("10.0.0.1", 5000), table, 0.0) is Verdict.KNOWN
    # The same id from another address is checked there (it may have moved).
    assert adm.on_request(_id(1), ("10.0.0.1", 5001), table, 0.0) is Verdict.CHECK


def test_checks_are_bounded_per_host_and_in_all() -> None:
    table = RoutingTable(OWN)
    adm = _admission()
    flood = [adm.on_request(_id(n), ("10.6.6.6", 1000 + n), table, 0.0) for n in range(50)]
    assert flood.count(Verdict.CHECK) == 2
    assert set(flood[2:]) == {Verdict.BUSY}
    others = [adm.on_request(_id(n), (f"10.0.0.{n}", 1), table, 0.0) for n in range(4)]
    assert others == [Verdict.CHECK, Verdict.CHECK, Verdict.BUSY, Verdict.BUSY]
    adm.check_done(("10.6.6.6", 1000), 1.0)
    assert adm.on_request(_id(99), ("10.0.0.99", 1), table, 1.0) is Verdict.CHECK


def test_a_slot_is_freed_after_its_time_but_the_check_stays_out() -> None:
    table = RoutingTable(OWN)
    adm = Admission(max_checks=1, slot_time=1.0)
    assert adm.on_request(_id(1), ("10.0.0.1", 1), table, 0.0) is Verdict.CHECK
    assert adm.on_request(_id(2), ("10.0.0.2", 1), table, 0.5) is Verdict.BUSY
    assert adm.on_request(_id(3), ("10.0.0.3", 1), table, 1.0) is Verdict.CHECK
    assert adm.on_request(_id(1), ("10.0.0.1", 1), table, 1.5) is Verdict.CHECKING
    assert adm.checking == 2
    adm.check_done(("10.0.0.1", 1), 4.0)  # its reply or its hard timeout, later
    adm.check_done(("10.0.0.3", 1), 4.0)
    assert adm.checking == 0


def test_senders_turned_away_by_a_full_house_wait_for_a_slot() -> None:
    table = RoutingTable(OWN)
    adm = Admission(max_checks=2, max_checks_per_host=2, slot_time=1.0, max_waiting=3)
    flood = [adm.on_request(_id(n), ("127.0.0.1", 1000 + n), table, 0.0) for n in range(2)]
    assert flood == [Verdict.CHECK, Verdict.CHECK]
    # Every slot is taken: these wait, the oldest dropped past max_waiting.
    for n in range(2, 6):
        assert adm.on_request(_id(n), ("10.0.0.9", 1000 + n), table, 0.1) is Verdict.BUSY
    assert adm.waiting == 3
    assert adm.next_waiting(table, 0.5) is None  # no slot free yet
    adm.check_done(("127.0.0.1", 1000), 0.6)
    assert adm.next_waiting(table, 0.6) == (_id(3), ("10.0.0.9", 1003))
    assert adm.next_waiting(table, 0.6) is None
    # At 1.0 the other slot's time is over: the next one gets it.
    assert adm.next_waiting(table, 1.0) == (_id(4), ("10.0.0.9", 1004))
    assert adm.on_request(_id(4), ("10.0.0.9", 1004), table, 1.0) is Verdict.CHECKING
    assert adm.waiting == 1  # _id(5)
    # A sender whose host holds its share of slots does not wait: its host is being checked.
    adm = Admission(max_checks=5, max_checks_per_host=1)
    assert adm.on_request(_id(1), ("10.0.0.9", 1), table, 0.0) is Verdict.CHECK
    assert adm.on_request(_id(2), ("10.0.0.9", 2), table, 0.0) is Verdict.BUSY
    assert adm.waiting == 0


def test_a_full_host_is_not_checked() -> None:
    table = RoutingTable(OWN, max_per_host=1)
    table.observe(Contact(_id(1), "10.6.6.6", 1), 0.0)
    adm = _admission()
    assert adm.on_request(_id(2), ("10.6.6.6", 2), table, 0.0) is Verdict.HOST_FULL


def test_the_memory_of_checked_addresses_is_bounded() -> None:
    table = RoutingTable(OWN)
    adm = _admission()
    for n in range(20):
        src = (f"10.0.0.{n}", 1)
        assert adm.on_request(_id(n), src, table, float(n)) is Verdict.CHECK
        adm.check_done(src, float(n))
    assert len(adm._recent) == 8
    assert adm.on_request(_id(0), ("10.0.0.0", 1), table, 21.0) is Verdict.CHECK  # forgotten
    assert adm.on_request(_id(19), ("10.0.0.19", 1), table, 21.0) is Verdict.RECENT
    adm.check_done(("10.9.9.9", 1), 0.0)  # no check out: ignored


def test_bad_bounds_are_caller_errors() -> None:
    with pytest.raises(LocalError):
        Admission(max_checks=0)
    with pytest.raises(LocalError):
        Admission(retry_after=-1.0)
    with pytest.raises(LocalError):
        Admission(max_waiting=0)
    with pytest.raises(LocalError):
        Admission(attempts=0)


# ---------------------------------------------------------------------- the log summary


def test_the_summary_reports_at_once_then_at_most_once_an_interval() -> None:
    stats = DhtStatistics()
    summary = LogSummary(60.0, poll=1.0)
    assert summary.due(0.0, stats) is None
    assert summary.next_deadline() == math.inf  # quiet: no timer
    stats.datagrams_dropped += 1
    stats.dropped_malformed += 1
    assert summary.due(0.5, stats) is None  # polled again only after a second
    assert summary.due(1.0, stats) == "dht.summary datagrams_dropped=+1 dropped_malformed=+1"
    assert summary.next_deadline() == 61.0
    for t in range(2, 61):
        stats.datagrams_dropped += 1000
        assert summary.due(float(t), stats) is None
    stats.records_rejected += 3
    assert summary.due(61.0, stats) == "dht.summary datagrams_dropped=+59000 records_rejected=+3"
    assert summary.due(121.0, stats) is None  # nothing new: quiet again
    assert summary.next_deadline() == math.inf


# ---------------------------------------------------------------------- full buckets


@settings(max_examples=60, deadline=None)
@given(
    own=st.binary(min_size=20, max_size=20),
    ids=st.lists(st.binary(min_size=20, max_size=20), min_size=1, max_size=120, unique=True),
)
def test_has_room_says_whether_observe_makes_a_contact(own: bytes, ids: list[bytes]) -> None:
    # A bucket that may split is "room" even when the newcomer's half stays full
    # (it may split again); a full bucket that may not split never takes one.
    table = RoutingTable(own, k=4)
    for n, node_id in enumerate(ids):
        if node_id == own:
            continue
        room = table.has_room(node_id)
        table.observe(Contact(node_id, "10.1.0.1", 1000 + n), 0.0)
        if not room:
            assert node_id not in table
        elif node_id not in table:
            # Only a split bucket whose newcomer's half was full again and not splittable.
            assert table.bucket_count() > 1


def test_a_sender_whose_bucket_is_full_is_not_checked() -> None:
    # Own id 0x00...: ids 0x80 0x03.. and on share their first 5 bits, so the far
    # half splits (depth 1-4 may, §5) down to a depth-5 bucket that may not.
    table = RoutingTable(OWN, k=2)
    for n in range(1, 12):
        table.observe(Contact(bytes([0x80, n]) + bytes(18), "10.0.0.1", n), 0.0)
    newcomer = bytes([0x80, 50]) + bytes(18)
    assert not table.has_room(newcomer)
    adm = Admission()
    assert adm.on_request(newcomer, ("10.0.0.3", 1), table, 0.0) is Verdict.NO_ROOM
    assert adm.checking == 0
    # A sender with room in its bucket is checked as before.
    near = b"\x00" + b"\x01" * 19
    assert table.has_room(near)
    assert adm.on_request(near, ("10.0.0.4", 1), table, 0.0) is Verdict.CHECK


def test_an_address_whose_check_admitted_its_id_is_not_remembered() -> None:
    table = RoutingTable(OWN)
    adm = Admission()
    admitted, refused = ("10.0.0.1", 1), ("10.0.0.2", 1)
    assert adm.on_request(_id(1), admitted, table, 0.0) is Verdict.CHECK
    assert adm.on_request(_id(2), refused, table, 0.0) is Verdict.CHECK
    table.observe(Contact(_id(1), *admitted), 0.5)
    assert adm.check_done(admitted, 0.5, admitted=True) is False
    assert adm.check_done(refused, 0.5) is False
    # Known while it stays in the table; once gone, checked again at once.
    assert adm.on_request(_id(1), admitted, table, 1.0) is Verdict.KNOWN
    table.remove(_id(1))
    assert adm.on_request(_id(1), admitted, table, 2.0) is Verdict.CHECK
    # Answered but not admitted: the address rests retry_after as before.
    assert adm.on_request(_id(2), refused, table, 2.0) is Verdict.RECENT
    # An unanswered ping is never "admitted".
    assert adm.check_done(admitted, 3.0, answered=False, admitted=True) is True


def test_a_sender_we_await_a_reply_from_is_not_checked() -> None:
    # Our request to that address is out: its reply proves the address, so a
    # ping would be a datagram for nothing (a peer that checks us while our
    # request to it is out would otherwise be checked back).
    table = RoutingTable(OWN)
    adm = Admission()
    src = ("10.0.0.1", 1)
    assert adm.on_request(_id(1), src, table, 0.0, asked=True) is Verdict.ASKED
    assert adm.checking == 0
    # Nothing is remembered of it: once no request of ours is out, it is checked.
    assert adm.on_request(_id(1), src, table, 0.1) is Verdict.CHECK
    # A contact held at its address is known, asked or not.
    table.observe(Contact(_id(2), "10.0.0.2", 1), 0.0)
    assert adm.on_request(_id(2), ("10.0.0.2", 1), table, 0.2, asked=True) is Verdict.KNOWN


def _table_after(ops: list[tuple[str, int, int, int]]) -> RoutingTable:
    """A small table after ``ops`` (observe, remove or fail; ids and addresses drawn)."""
    table = RoutingTable(OWN, k=3, replacement_size=2)
    for i, (op, n, host, p) in enumerate(ops):
        node_id = bytes([n * 6]) + bytes(19)
        if op == "observe":
            table.observe(Contact(node_id, f"10.0.0.{host}", p), float(i))
        elif op == "remove":
            table.remove(node_id)
        elif op == "fail":
            table.record_failure(node_id)
    return table


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(_op, max_size=80), pick=st.integers(0, 40), port=st.integers(0, 3))
def test_seen_is_observe_for_a_contact_held_at_its_address(
    ops: list[tuple[str, int, int, int]], pick: int, port: int
) -> None:
    """The fast path of requests and replies from known contacts changes the table as
    observe() would, and nothing when the table does not hold the contact there."""
    tables = [_table_after(ops), _table_after(ops)]
    fast, slow = tables
    contact = Contact(bytes([pick * 6]) + bytes(19), f"10.0.0.{pick % 4}", port)
    held = fast.get(contact.node_id)
    if fast.seen(contact, 99.0):
        assert held is not None and held.address == contact.address
        slow.observe(contact, 99.0)
    else:
        assert held is None or held.address != contact.address
    assert [c for b in fast._buckets for c in b.contacts.values()] == [
        c for b in slow._buckets for c in b.contacts.values()
    ]
    assert fast.stale_buckets(99.0, 1.0) == slow.stale_buckets(99.0, 1.0)


@settings(max_examples=100, deadline=None)
@given(ops=st.lists(_op, max_size=80), pick=st.integers(0, 40), port=st.integers(0, 3))
def test_seen_at_is_seen_by_id(ops: list[tuple[str, int, int, int]], pick: int, port: int) -> None:
    """seen_at(id, address) does what seen() does for the contact at that address."""
    tables = [_table_after(ops), _table_after(ops)]
    by_id, by_contact = tables
    contact = Contact(bytes([pick * 6]) + bytes(19), f"10.0.0.{pick % 4}", port)
    assert by_id.seen_at(contact.node_id, contact.address, 99.0) == by_contact.seen(contact, 99.0)
    assert [c for b in by_id._buckets for c in b.contacts.values()] == [
        c for b in by_contact._buckets for c in b.contacts.values()
    ]
    assert [dict(b.failures) for b in by_id._buckets] == [
        dict(b.failures) for b in by_contact._buckets
    ]
    assert by_id.stale_buckets(99.0, 1.0) == by_contact.stale_buckets(99.0, 1.0)
