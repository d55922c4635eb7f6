"""Maintenance passes: what a quiet pass does without a task, and when it is not enough."""

from __future__ import annotations

import random

from p2pnode.core.identity import Identity
from p2pnode.dht.maintenance import quiet_pass
from p2pnode.dht.publish import Publisher
from p2pnode.dht.records import ProviderInfo, RecordKind, RecordStore, SignedRecord, capability_key
from p2pnode.dht.routing import Contact, RoutingTable

NOW_MS = 1_800_000_000_000
RNG = random.Random(3)
OWNER = Identity(RNG.randbytes(32))
REFRESH = 3600.0
REPUBLISH = 1800.0


def _record(expires_at: int) -> SignedRecord:
    info = ProviderInfo("translate", "agent-1", (("10.0.0.1", 7000),)).to_bytes()
    key = capability_key("translate")
    return SignedRecord.create(OWNER, RecordKind.PROVIDER, key, 1, expires_at, info)


async def _no_lookup(key: bytes) -> tuple[list[Contact], list[SignedRecord]]:
    return [], []


async def _no_store(contacts: list[Contact], key: bytes, value: bytes) -> int:
    return 0


def _setup(now: float) -> tuple[RoutingTable, RecordStore, Publisher]:
    table = RoutingTable(RNG.randbytes(20), now=now)
    table.observe(Contact(RNG.randbytes(20), "10.0.0.2", 4000), now)
    records = RecordStore()
    publisher = Publisher(
        records,
        _no_lookup,
        _no_store,
        wall_clock_ms=lambda: NOW_MS,
        republish_interval=REPUBLISH,
    )
    publisher.start(now)
    return table, records, publisher


def _quiet(
    table: RoutingTable,
    records: RecordStore,
    publisher: Publisher,
    now: float,
    now_ms: int = NOW_MS,
) -> bool:
    return quiet_pass(
        table=table,
        records=records,
        publisher=publisher,
        now=now,
        now_ms=now_ms,
        refresh_interval=REFRESH,
    )


def test_quiet_pass_expires_records_and_is_the_whole_pass() -> None:
    table, records, publisher = _setup(0.0)
    key = capability_key("translate")
    records.put(key, [_record(NOW_MS + 10)], NOW_MS - 1)
    assert _quiet(table, records, publisher, 60.0)
    assert records.total_bytes > 0
    assert _quiet(table, records, publisher, 60.0, NOW_MS + 10)
    assert records.total_bytes == 0
    assert records.keys() == []


def test_a_stale_bucket_needs_the_full_pass() -> None:
    table, records, publisher = _setup(0.0)
    assert _quiet(table, records, publisher, REFRESH - 1)
    assert not _quiet(table, records, publisher, REFRESH)


def test_a_republish_due_needs_the_full_pass() -> None:
    table, records, publisher = _setup(0.0)
    # Nothing kept: no republish is ever due.
    assert _quiet(table, records, publisher, REPUBLISH + 1)
    publisher.keep(capability_key("translate"), RecordKind.PROVIDER, lambda: _record(NOW_MS + 1))
    assert _quiet(table, records, publisher, REPUBLISH - 1)
    assert not publisher.republish_due(REPUBLISH - 1)
    assert publisher.republish_due(REPUBLISH)
    assert not _quiet(table, records, publisher, REPUBLISH)


def test_an_empty_table_has_no_bucket_to_refresh() -> None:
    table = RoutingTable(RNG.randbytes(20), now=0.0)
    _, records, publisher = _setup(0.0)
    assert _quiet(table, records, publisher, REFRESH * 2)
