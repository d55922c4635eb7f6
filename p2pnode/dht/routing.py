"""Kademlia routing table (sans-IO): k-buckets, liveness checks, replacement cache.

Theory of operation (Maymounkov & Mazières, "Kademlia", 2002):

* Ids are 160-bit; distance is XOR (§2.1). The table is a sorted list of
  buckets, each covering a half-open id range ``[lo, hi)`` and holding at most
  ``k`` contacts ordered least-recently seen first (§2.2).
* A bucket that is full and covers our own id splits in two (§2.4); so do
  full buckets whose depth is not a multiple of ``b = 5`` (the relaxation of
  §4.2 that the stock ``kademlia`` package also uses), which keeps the table
  well populated near and far from us.
* A new contact for a full bucket that cannot split is not inserted directly:
  it goes to the bucket's replacement cache and the table asks the driver to
  ping the least-recently-seen contact (:meth:`RoutingTable.observe` returns
  it). The driver reports with :meth:`RoutingTable.ping_result`: alive moves the
  old contact to the tail (old contacts are preferred, §2.2), dead evicts it
  and promotes the freshest replacement (§4.1).
* RPC timeouts are reported with :meth:`RoutingTable.record_failure`. A
  contact is evicted after ``max_failures`` consecutive failures, or after one
  when a replacement is waiting (§4.1: "a node ... can be removed
  immediately" only when there is someone to replace it).
* Buckets not touched for a refresh interval are reported by
  :meth:`RoutingTable.stale_buckets` so the driver can look up a random id in
  them (§2.3).
* Admission limits (docs/protocol/dht.md §5.1), over contacts and
  replacement caches together: one id per address, and at most
  ``max_per_host`` distinct ids per host (an IPv4 address, an IPv6 /64;
  loopback hosts count only with ``limit_loopback``).
  :meth:`RoutingTable.refusal` says why a contact would not be taken;
  :meth:`RoutingTable.observe` takes nothing it refuses. Whether a contact
  has proven its address is the driver's business (:mod:`p2pnode.dht.admission`).

Ids are raw 20-byte strings, so p2pnode peer ids and the SHA-1 ids of stock
``kademlia`` nodes mix freely. No clock reads: every call that needs the time
takes ``now``.

Memory: the simulator runs a hundred thousand tables in one process, each
holding a hundred or more contacts. The tables of one process share equal
contacts (:mod:`p2pnode.dht.contacts`), and the per-host count of ids keeps a
host's single id as it is, not in a dict of its own.
"""

from __future__ import annotations

import bisect
import enum
import ipaddress
import random
from collections.abc import Iterable

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.dht.contacts import ID_BITS, ID_BYTES, Contact, make_contact, shared

_SPACE = 1 << ID_BITS
_SPLIT_B = 5
# The canonical spellings of an IPv4 octet: a host of four of them is its own key.
_OCTETS = frozenset(str(i) for i in range(256))


class Refusal(enum.Enum):
    """Why the table will not take a contact (docs/protocol/dht.md §5.1)."""

    ADDRESS_TAKEN = "another id holds this address"
    HOST_FULL = "this host holds its limit of ids"


def host_key(host: str, *, limit_loopback: bool = True) -> str | None:
    """The group a host's ids are counted in: the IPv4 address, the IPv6 /64, the name
    of a host that is not an address; None for a loopback host unless ``limit_loopback``."""
    parts = host.split(".")
    if (
        len(parts) == 4
        and parts[0] in _OCTETS
        and parts[1] in _OCTETS
        and parts[2] in _OCTETS
        and parts[3] in _OCTETS
    ):
        # A canonical dotted quad (the common case, asked for every datagram) is its
        # own key, the same string: no parse, no new string.
        return None if parts[0] == "127" and not limit_loopback else host
    return parsed_host_key(host, limit_loopback)


def parsed_host_key(host: str, limit_loopback: bool) -> str | None:
    """:func:`host_key` by parsing ``host``, without the dotted-quad shortcut."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback and not limit_loopback:
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def id_int(node_id: bytes) -> int:
    """An id as a big-endian integer."""
    return int.from_bytes(node_id, "big")


def distance(a: bytes, b: bytes) -> int:
    """XOR distance between two 20-byte ids (Kademlia §2.1)."""
    return int.from_bytes(a, "big") ^ int.from_bytes(b, "big")


class _Bucket:
    __slots__ = (
        "contacts",
        "failures",
        "hi",
        "last_touched",
        "lo",
        "pinging",
        "replacements",
        "shift",
    )

    def __init__(self, lo: int, hi: int, now: float) -> None:
        self.lo = lo
        self.hi = hi
        # The range holds the ids that share lo's top ID_BITS - shift bits.
        self.shift = (hi - lo).bit_length() - 1
        # dicts keep insertion order: the first entry is the least recently seen.
        self.contacts: dict[bytes, Contact] = {}
        self.replacements: dict[bytes, Contact] = {}
        self.failures: dict[bytes, int] = {}
        self.last_touched = now
        self.pinging: bytes | None = None

    def depth(self) -> int:
        return ID_BITS - (self.hi - self.lo).bit_length() + 1


class RoutingTable:
    """k-bucket routing table around ``own_id``.

    Raises LocalError(INVALID_ARGUMENT) for ids that are not 20 bytes.
    """

    def __init__(
        self,
        own_id: bytes,
        *,
        k: int = 20,
        replacement_size: int = 20,
        max_failures: int = 2,
        max_per_host: int | None = None,
        limit_loopback: bool = True,
        now: float = 0.0,
    ) -> None:
        """``max_per_host`` bounds the distinct ids per host (None: no bound)."""
        _check_id(own_id)
        self.own_id = own_id
        self.k = k
        self.replacement_size = replacement_size
        self.max_failures = max_failures
        self.max_per_host = max_per_host
        self.limit_loopback = limit_loopback
        self._own = id_int(own_id)
        self._buckets: list[_Bucket] = [_Bucket(0, _SPACE, now)]
        self._los: list[int] = [0]
        # Over contacts and replacements: the id at each address, and per host
        # group the ids there, once per entry (an id may wait in a replacement
        # cache at a second address of the same host): a single id as it is, more
        # as a tuple. Hosts are counted only when there is a limit to apply.
        self._at: dict[tuple[str, int], bytes] = {}
        self._hosts: dict[str, bytes | tuple[bytes, ...]] = {}
        # For near(): the distances to our id of the k contacts nearest it, ascending
        # (of every contact while fewer than k are held), kept as contacts come; None
        # to gather them again (after one of them went: who is next is not known).
        self._near: list[int] | None = None

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return sum(len(b.contacts) for b in self._buckets)

    def __contains__(self, node_id: object) -> bool:
        if not isinstance(node_id, bytes) or len(node_id) != ID_BYTES:
            return False
        return node_id in self._bucket_for(int.from_bytes(node_id, "big")).contacts

    def get(self, node_id: bytes) -> Contact | None:
        """The contact with ``node_id``, if in the table."""
        return self._bucket_for(int.from_bytes(node_id, "big")).contacts.get(node_id)

    def contacts(self) -> list[Contact]:
        """Every contact, bucket by bucket, least recently seen first."""
        return [c for b in self._buckets for c in b.contacts.values()]

    def bucket_count(self) -> int:
        """Number of buckets (for tests and statistics)."""
        return len(self._buckets)

    def bucket_fill(self) -> list[int]:
        """Contacts per bucket, the farthest bucket from our id first (for ``status``)."""
        return [len(b.contacts) for b in sorted(self._buckets, key=self._nearest, reverse=True)]

    def holder(self, address: tuple[str, int]) -> bytes | None:
        """The id the table holds at ``address`` (as a contact or a replacement), if any."""
        return self._at.get(address)

    def host_full(self, host: str, node_id: bytes | None = None) -> bool:
        """True if ``host`` holds its limit of ids (``node_id`` not among them)."""
        if self.max_per_host is None:
            return False
        key = host_key(host, limit_loopback=self.limit_loopback)
        if key is None:
            return False
        ids = _ids(self._hosts.get(key))
        if node_id in ids:
            return False
        return len(ids) >= self.max_per_host and len(set(ids)) >= self.max_per_host

    def has_room(self, node_id: bytes) -> bool:
        """True if :meth:`observe` could make ``node_id`` a contact now: it is one, or
        its bucket has room or may split; False if it could only be a replacement."""
        bucket = self._bucket_for(int.from_bytes(node_id, "big"))
        if node_id in bucket.contacts or len(bucket.contacts) < self.k:
            return True
        splittable = bucket.lo <= self._own < bucket.hi or bucket.depth() % _SPLIT_B != 0
        return splittable and bucket.hi - bucket.lo > 1

    def bucket_size(self, node_id: bytes) -> int:
        """How many contacts the bucket ``node_id`` falls in holds."""
        return len(self._bucket_for(int.from_bytes(node_id, "big")).contacts)

    def near(self, node_id: bytes) -> bool:
        """True if ``node_id`` would be one of the k contacts nearest our own id: nearer
        than the k-th nearest held, or the table holds fewer than k."""
        near = self._near
        if near is None:
            near = self._near = [c.number ^ self._own for c in self.closest(self.own_id)]
        return len(near) < self.k or int.from_bytes(node_id, "big") ^ self._own < near[-1]

    def refusal(self, contact: Contact) -> Refusal | None:
        """Why :meth:`observe` would not take ``contact``, or None if it may."""
        held = self._at.get(contact.address)
        if held is not None and held != contact.node_id:
            return Refusal.ADDRESS_TAKEN
        if self.host_full(contact.host, contact.node_id):
            return Refusal.HOST_FULL
        return None

    def closest(
        self, target: bytes, count: int | None = None, *, excluding: Iterable[bytes | None] = ()
    ) -> list[Contact]:
        """The ``count`` (default k) contacts nearest ``target`` by XOR, nearest first,
        leaving out the contacts whose ids are in ``excluding`` (None there is ignored)."""
        _check_id(target)
        t = int.from_bytes(target, "big")
        n = self.k if count is None else count
        # The distances of the excluded ids: gathered contacts at those distances are
        # dropped by distance (no contact read), and one more is gathered for each.
        skip = [int.from_bytes(x, "big") ^ t for x in excluding if x is not None]
        # Buckets are id prefixes, in id order. Past the bucket holding ``t``, the ids
        # that agree with ``t`` above bit ``s`` and differ at it form a run of whole
        # buckets, all nearer ``t`` than any id that differs at a higher bit, and
        # adjacent to what was gathered so far (below it when bit ``s`` of ``t`` is set,
        # above it otherwise). Gather ``t``'s bucket, then those runs from ``s`` = its
        # width upward, one bucket at a time, until enough contacts are found:
        # everything left is farther than all of them (exact, not heuristic).
        buckets, los = self._buckets, self._los
        left = bisect.bisect_right(los, t) - 1
        right = left + 1  # buckets[left:right] are gathered
        s = buckets[left].shift
        # The contacts gathered by distance (one contact per id: distances differ), so
        # that what is sorted is the distances alone.
        found = {c.number ^ t: c for c in buckets[left].contacts.values()}
        while s < ID_BITS and len(found) < n + sum(d in found for d in skip):
            if (t >> s) & 1:
                lo = ((t >> s) ^ 1) << s  # the run is [lo, the first id gathered)
                while left and los[left - 1] >= lo:
                    left -= 1
                    found.update({c.number ^ t: c for c in buckets[left].contacts.values()})
            else:
                hi = ((t >> s) + 2) << s  # the run is [the last id gathered + 1, hi)
                while right < len(los) and los[right] < hi:
                    found.update({c.number ^ t: c for c in buckets[right].contacts.values()})
                    right += 1
            s += 1
        for d in skip:
            found.pop(d, None)  # an excluded contact may lie beyond what was gathered
        return [found[d] for d in sorted(found)[:n]]

    def stale_buckets(self, now: float, interval: float) -> list[tuple[int, int]]:
        """``[lo, hi)`` ranges of buckets untouched for ``interval`` (Kademlia §2.3)."""
        return [(b.lo, b.hi) for b in self._buckets if now - b.last_touched >= interval]

    def touch_range(self, target: bytes, now: float) -> None:
        """Mark the bucket covering ``target`` as refreshed (a lookup for it ran)."""
        self._bucket_for(id_int(target)).last_touched = now

    # ------------------------------------------------------------------ updates

    def observe(self, contact: Contact, now: float) -> Contact | None:
        """Record that ``contact`` answered us (or that a known contact was heard from).

        Returns a contact the driver should ping (the least recently seen of a
        full bucket) and report with :meth:`ping_result`, or None. A contact
        the table refuses (:meth:`refusal`) changes nothing.
        """
        _check_id(contact.node_id)
        if contact.node_id == self.own_id or self.refusal(contact) is not None:
            return None
        n = id_int(contact.node_id)
        while True:
            bucket = self._bucket_for(n)
            known = bucket.contacts.get(contact.node_id)
            if known is not None:
                if known.address != contact.address:
                    # Do not let anyone re-point a known id; the old address
                    # keeps it until it stops answering.
                    self._add_replacement(bucket, contact)
                    return None
                del bucket.contacts[contact.node_id]
                bucket.contacts[contact.node_id] = known
                bucket.failures.pop(contact.node_id, None)
                bucket.last_touched = now
                return None
            if len(bucket.contacts) < self.k:
                self._unindex(bucket.replacements.pop(contact.node_id, None))
                contact = shared(contact)
                bucket.contacts[contact.node_id] = contact
                self._index(contact)
                self._came_near(contact.number)
                bucket.last_touched = now
                return None
            splittable = bucket.lo <= self._own < bucket.hi or bucket.depth() % _SPLIT_B != 0
            if splittable and bucket.hi - bucket.lo > 1:
                self._split(bucket)
                continue
            self._add_replacement(bucket, contact)
            if bucket.pinging is None:
                head = next(iter(bucket.contacts.values()))
                bucket.pinging = head.node_id
                return head
            return None

    def seen(self, contact: Contact, now: float) -> bool:
        """:meth:`observe` for a contact the table holds at its address (the common
        case, without the limits' checks): moved to its bucket's tail. False, and
        nothing changed, when the table does not hold it there."""
        bucket = self._bucket_for(contact.number)
        known = bucket.contacts.get(contact.node_id)
        if known is None or known.address != contact.address:
            return False
        del bucket.contacts[contact.node_id]
        bucket.contacts[contact.node_id] = known
        if bucket.failures:
            bucket.failures.pop(contact.node_id, None)
        bucket.last_touched = now
        return True

    def seen_at(self, node_id: bytes, address: tuple[str, int], now: float) -> bool:
        """:meth:`seen` by id: the contact ``node_id`` if the table holds it at ``address``
        (one bucket search for both). False, and nothing changed, otherwise."""
        bucket = self._buckets[bisect.bisect_right(self._los, int.from_bytes(node_id, "big")) - 1]
        known = bucket.contacts.get(node_id)
        if known is None or known.address != address:
            return False
        del bucket.contacts[node_id]
        bucket.contacts[node_id] = known
        if bucket.failures:
            bucket.failures.pop(node_id, None)
        bucket.last_touched = now
        return True

    def ping_result(self, node_id: bytes, alive: bool, now: float) -> None:
        """Report the outcome of a liveness ping requested by :meth:`observe`."""
        bucket = self._bucket_for(id_int(node_id))
        if bucket.pinging == node_id:
            bucket.pinging = None
        known = bucket.contacts.get(node_id)
        if known is None:
            return
        if alive:
            self.observe(known, now)
        else:
            self._evict(bucket, node_id)

    def record_failure(self, node_id: bytes) -> None:
        """Report that an RPC to ``node_id`` timed out."""
        bucket = self._bucket_for(id_int(node_id))
        if node_id not in bucket.contacts:
            self._unindex(bucket.replacements.pop(node_id, None))
            return
        fails = bucket.failures.get(node_id, 0) + 1
        bucket.failures[node_id] = fails
        if fails >= self.max_failures or bucket.replacements:
            self._evict(bucket, node_id)

    def remove(self, node_id: bytes) -> None:
        """Drop ``node_id`` from the table (and its replacement cache)."""
        bucket = self._bucket_for(id_int(node_id))
        if node_id in bucket.contacts:
            self._evict(bucket, node_id)
        self._unindex(bucket.replacements.pop(node_id, None))

    # ------------------------------------------------------------------ internals

    def _came_near(self, number: int) -> None:
        """The contact ``number`` came: one of the k nearest our id if nearer than the k-th."""
        near = self._near
        if near is None:
            return
        d = number ^ self._own
        if len(near) < self.k:
            bisect.insort(near, d)
        elif d < near[-1]:
            bisect.insort(near, d)
            near.pop()

    def _went_near(self, number: int) -> None:
        """The contact ``number`` went: if it was one of the k nearest our id, they are
        gathered again when next asked for (unless every contact is among them)."""
        near = self._near
        if near is None:
            return
        d = number ^ self._own
        if len(near) < self.k:
            i = bisect.bisect_left(near, d)
            if i < len(near) and near[i] == d:
                del near[i]
        elif d <= near[-1]:
            self._near = None

    def _nearest(self, bucket: _Bucket) -> int:
        return _bound(bucket, self._own)

    def _bucket_for(self, n: int) -> _Bucket:
        return self._buckets[bisect.bisect_right(self._los, n) - 1]

    def _index(self, contact: Contact) -> None:
        self._at[contact.address] = contact.node_id
        key = self._host_group(contact.host)
        if key is not None:
            held = self._hosts.get(key)
            if held is None:
                self._hosts[key] = contact.node_id
            else:
                self._hosts[key] = (*_ids(held), contact.node_id)

    def _unindex(self, contact: Contact | None) -> None:
        if contact is None:
            return
        if self._at.get(contact.address) == contact.node_id:
            del self._at[contact.address]
        key = self._host_group(contact.host)
        ids = _ids(self._hosts.get(key)) if key is not None else ()
        if contact.node_id not in ids:
            return
        assert key is not None
        i = ids.index(contact.node_id)
        rest = ids[:i] + ids[i + 1 :]
        if not rest:
            del self._hosts[key]
        else:
            self._hosts[key] = rest[0] if len(rest) == 1 else rest

    def _host_group(self, host: str) -> str | None:
        """The key ``host`` is counted under, or None when nothing is counted."""
        if self.max_per_host is None:
            return None
        return host_key(host, limit_loopback=self.limit_loopback)

    def _add_replacement(self, bucket: _Bucket, contact: Contact) -> None:
        self._unindex(bucket.replacements.pop(contact.node_id, None))
        contact = shared(contact)
        bucket.replacements[contact.node_id] = contact
        self._index(contact)
        while len(bucket.replacements) > self.replacement_size:
            self._unindex(bucket.replacements.pop(next(iter(bucket.replacements))))

    def _evict(self, bucket: _Bucket, node_id: bytes) -> None:
        if node_id in bucket.contacts:
            self._went_near(id_int(node_id))
        self._unindex(bucket.contacts.pop(node_id, None))
        bucket.failures.pop(node_id, None)
        if bucket.pinging == node_id:
            bucket.pinging = None
        self._promote(bucket)

    def _promote(self, bucket: _Bucket) -> bool:
        """Move the freshest replacement into the contacts (§4.1: the likeliest to be
        alive); one whose id is a contact already (at its old address) waits."""
        for rid in reversed(bucket.replacements):
            if rid not in bucket.contacts:
                promoted = bucket.contacts[rid] = bucket.replacements.pop(rid)
                self._came_near(promoted.number)
                return True
        return False

    def _split(self, bucket: _Bucket) -> None:
        mid = (bucket.lo + bucket.hi) // 2
        low = _Bucket(bucket.lo, mid, bucket.last_touched)
        high = _Bucket(mid, bucket.hi, bucket.last_touched)
        for src, dst_attr in ((bucket.contacts, "contacts"), (bucket.replacements, "replacements")):
            for cid, c in src.items():
                target = low if id_int(cid) < mid else high
                getattr(target, dst_attr)[cid] = c
        for cid, f in bucket.failures.items():
            (low if id_int(cid) < mid else high).failures[cid] = f
        for half in (low, high):
            # Keep replacement caches bounded after the move.
            while len(half.replacements) > self.replacement_size:
                self._unindex(half.replacements.pop(next(iter(half.replacements))))
            # A replacement may fit now that the bucket has room.
            while len(half.contacts) < self.k and self._promote(half):
                pass
        if bucket.pinging is not None:
            holder = low if id_int(bucket.pinging) < mid else high
            holder.pinging = bucket.pinging
        i = self._buckets.index(bucket)
        self._buckets[i : i + 1] = [low, high]
        self._los[i : i + 1] = [low.lo, high.lo]


def _ids(held: bytes | tuple[bytes, ...] | None) -> tuple[bytes, ...]:
    """The ids of one host group's entry in the host index, once per entry."""
    if held is None:
        return ()
    return (held,) if isinstance(held, bytes) else held


def _bound(bucket: _Bucket, t: int) -> int:
    """The least XOR distance to ``t`` of any id in ``bucket`` (its range is an id prefix)."""
    s = bucket.shift
    return ((bucket.lo ^ t) >> s) << s


def random_id_in_range(lo: int, hi: int, rng: random.Random) -> bytes:
    """A uniformly random 20-byte id in ``[lo, hi)``, for bucket refresh."""
    return rng.randrange(lo, hi).to_bytes(ID_BYTES, "big")


def _check_id(node_id: bytes) -> None:
    if not isinstance(node_id, bytes) or len(node_id) != ID_BYTES:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "Kademlia ids are exactly 20 bytes")


__all__ = [
    "ID_BITS",
    "ID_BYTES",
    "Contact",
    "Refusal",
    "RoutingTable",
    "distance",
    "host_key",
    "id_int",
    "make_contact",
    "parsed_host_key",
    "random_id_in_range",
]
