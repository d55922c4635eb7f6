"""Publishing signed records: read-merge-write, and the owner's republish schedule.

Theory of operation (docs/protocol/dht.md §4.4 and §7):

* **Read-merge-write.** :meth:`Publisher.put_records` runs a value lookup for
  the key (read), merges what it read with the node's own store and the new
  records (newest per publisher and kind wins), and stores the merged value
  at the k closest nodes that answered (write). Stock nodes overwrite the
  value they hold, so each publisher's write carries every other provider's
  records too. The new records go first, so when not everything fits a
  value they are the ones kept on equal expiry.
* **Makers.** The owner keeps, per ``(key, kind)``, a function that signs
  its record afresh (same revision, later expiry). :meth:`Publisher.republish_if_due`
  re-runs them every ``republish_interval``, well before a record's
  lifetime (at most ``record_ttl_ms``) runs out, so the record lives as long
  as its owner does and disappears within a lifetime after the owner leaves.
  A record's lifetime follows its card's (``min(card expiry, now + ttl)``): a
  card re-issued at half its lifetime is provided again, which replaces the
  makers. Records put while the routing table was empty reached nobody, so
  when the table holds contacts again they are all put at once
  (:meth:`Publisher.republish_now`), not a republish interval later.
* :func:`card_makers` turns an Agent Card into the makers of its card record
  and of one provider record per capability, including the pseudo-capability
  ``agent:<agent id>`` that lets readers find an agent by id (§4.1).

The publisher does no I/O of its own: it is given the value lookup and the
store RPCs it uses (all of one put at once, each landing in a callback: no
task per store). Keys
are put one after another, not all at once: publishing is background work,
and a burst of lookups and stores slows every other node's round trips.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable

from p2pnode.core.card import AgentCard
from p2pnode.core.identity import Identity
from p2pnode.dht.lookup import merge_records
from p2pnode.dht.records import (
    MAX_TTL_MS,
    ProviderInfo,
    RecordKind,
    RecordStore,
    SignedRecord,
    agent_capability,
    capability_key,
    card_key,
    encode_value,
)
from p2pnode.dht.routing import Contact

#: Signs one record afresh each time it is called.
Maker = Callable[[], SignedRecord]
#: A value lookup for a key: the nearest nodes that answered, and the records read.
ValueLookup = Callable[[bytes], Awaitable[tuple[list[Contact], list[SignedRecord]]]]
#: ``store`` RPCs of ``(key, value)`` at every contact at once: how many accepted.
StoreAll = Callable[[list[Contact], bytes, bytes], Awaitable[int]]

#: Addresses carried by a provider record (dht.md §4.2).
MAX_PROVIDER_ADDRESSES = 8


def merged_value(new: list[SignedRecord], *held: Iterable[SignedRecord]) -> bytes:
    """The DHT value of the records ``held`` (merged), the slots of ``new`` first.

    ``new`` only decides the order (its publishers survive a size cut on equal
    expiry); what is stored is what ``held`` merges to, so a record our own
    store refused is not spread either.
    """
    merged = merge_records(*held)
    mine = {(r.public_key, r.kind.value) for r in new}
    first = [r for r in merged if (r.public_key, r.kind.value) in mine]
    rest = [r for r in merged if (r.public_key, r.kind.value) not in mine]
    return encode_value(first + rest)


class Publisher:
    """Puts records into the DHT and keeps the owner's records republished."""

    __slots__ = (
        "_interval",
        "_last_republish",
        "_lookup",
        "_makers",
        "_records",
        "_store",
        "_wall_ms",
    )

    def __init__(
        self,
        records: RecordStore,
        lookup: ValueLookup,
        store: StoreAll,
        *,
        wall_clock_ms: Callable[[], int],
        republish_interval: float,
    ) -> None:
        self._records = records
        self._lookup = lookup
        self._store = store
        self._wall_ms = wall_clock_ms
        self._interval = republish_interval
        self._makers: dict[tuple[bytes, RecordKind], Maker] = {}
        self._last_republish = 0.0

    def start(self, now: float) -> None:
        """The node started at ``now``: the first republish is due an interval later."""
        self._last_republish = now

    def keep(self, key: bytes, kind: RecordKind, make: Maker) -> None:
        """Republish ``make()`` under ``key`` from now on (replaces the maker for ``kind``)."""
        self._makers[(key, kind)] = make

    @property
    def kept(self) -> int:
        """How many records the owner keeps republished."""
        return len(self._makers)

    async def put_records(self, key: bytes, records: list[SignedRecord]) -> int:
        """Read, merge, write ``records`` under ``key``; returns how many nodes accepted."""
        now_ms = self._wall_ms()
        closest, read = await self._lookup(key)
        self._records.put(key, records, now_ms)
        value = merged_value(records, read, self._records.get(key, now_ms))
        return await self.store_at(closest, key, value)

    async def store_at(self, contacts: list[Contact], key: bytes, value: bytes) -> int:
        """Store ``value`` at every contact at once; returns how many accepted."""
        return await self._store(contacts, key, value)

    async def publish(self, makers: Iterable[tuple[bytes, Maker]]) -> int:
        """Put a fresh record of each maker under its key, one key at a time; total accepted.
        A record that would be born expired (its card expired) is not put."""
        now_ms = self._wall_ms()
        return await self._put_all(
            [(key, record) for key, make in makers if (record := make()).expires_at > now_ms]
        )

    async def _put_all(self, records: list[tuple[bytes, SignedRecord]]) -> int:
        # One key after another: each put is a lookup and k stores, and a node that
        # publishes many keys at once (a card with its capabilities and tools)
        # would load the swarm in bursts that push round trips past the hard timeout.
        total = 0
        for key, record in records:
            total += await self.put_records(key, [record])
        return total

    def republish_due(self, now: float) -> bool:
        """True if :meth:`republish_if_due` has records to republish at ``now``."""
        return bool(self._makers) and now - self._last_republish >= self._interval

    async def republish_if_due(self, now: float) -> int:
        """Republish every kept record if ``republish_interval`` passed since the last time.

        A kept record whose card has expired is forgotten instead (§7: a record lives
        no longer than its card; an expired card is never announced again).
        """
        if not self.republish_due(now):
            return 0
        return await self.republish_now(now)

    async def republish_now(self, now: float) -> int:
        """Republish every kept record at once, as :meth:`republish_if_due` does when due.

        The driver calls it when the routing table holds contacts again after it was
        empty (dht.md §5.2): what was published or renewed meanwhile was stored here
        only, and would otherwise wait up to ``republish_interval`` (or its card's next
        renewal) to reach the nodes readers ask.
        """
        self._last_republish = now
        now_ms = self._wall_ms()
        fresh: list[tuple[bytes, SignedRecord]] = []
        for slot, make in list(self._makers.items()):
            record = make()
            if record.expires_at > now_ms:
                fresh.append((slot[0], record))
            else:
                del self._makers[slot]
        return await self._put_all(fresh)


def card_makers(
    card: AgentCard, identity: Identity, *, ttl_ms: int, wall_clock_ms: Callable[[], int]
) -> list[tuple[bytes, RecordKind, Maker]]:
    """Makers of ``card``'s card record (first) and of its provider records (§4.1-4.2).

    Each record lives until ``min(card expiry, now + ttl_ms)``, at the card's revision.
    """
    ttl = min(ttl_ms, MAX_TTL_MS)
    addresses = tuple(
        a
        for a in (_split_address(t) for t in card.addresses[:MAX_PROVIDER_ADDRESSES])
        if a is not None
    )

    def maker(kind: RecordKind, key: bytes, payload: bytes) -> Maker:
        def make() -> SignedRecord:
            expires = min(card.expires_at, wall_clock_ms() + ttl)
            return SignedRecord.create(identity, kind, key, card.revision, expires, payload)

        return make

    ck = card_key(card.peer_id, card.id)
    out = [(ck, RecordKind.CARD, maker(RecordKind.CARD, ck, card.to_bytes()))]
    for cap in [agent_capability(card.id), *sorted(card.provider_keys())]:
        key = capability_key(cap)
        info = ProviderInfo(cap, card.id, addresses).to_bytes()
        out.append((key, RecordKind.PROVIDER, maker(RecordKind.PROVIDER, key, info)))
    return out


def _split_address(text: str) -> tuple[str, int] | None:
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return (host, int(port))


__all__ = ["Maker", "Publisher", "StoreAll", "ValueLookup", "card_makers", "merged_value"]
