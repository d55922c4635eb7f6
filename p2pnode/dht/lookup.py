"""Iterative node lookup (sans-IO) with adaptive per-RPC timeouts.

Theory of operation (Kademlia §2.3, with the "strict parallelism" of §4.1
instead of lockstep rounds):

* The lookup keeps every contact it has heard of, ordered by XOR distance to
  the target, each in a :class:`PeerState`.
* The *shortlist* is the ``k`` nearest contacts that have not failed and
  are not known to be slow. :meth:`Lookup.next_requests` keeps ``alpha``
  requests in flight at all times, always to the nearest not-yet-asked
  contact of the shortlist: an answer frees one slot and the driver asks the
  next contact at once, without waiting for the rest of a round.
* Each request gets a deadline ``now + rto``, with ``rto`` from an
  :class:`RttEstimator` (RFC 6298: ``srtt + 4·rttvar``, clamped). When the
  deadline passes (:meth:`Lookup.handle_timer`), the contact becomes
  ``SLOW``: its slot is freed and it leaves the shortlist, so a slow or dead
  node never holds the lookup back beyond its timeout. A late answer from a
  slow contact is still used.
* The lookup is done when every contact of the shortlist has answered (the
  ``k`` nearest seen have all answered), when no contact is left to ask, or
  when ``max_queries`` requests were sent (a bound against hostile replies
  that keep inventing nearer ids), but never with no answer at all while
  slow requests are still out: it then waits for a late answer or the hard
  timeout. When every request is slow, the process or the network is
  overloaded rather than every node dead, and each passed timeout doubles
  the next (RFC 6298 §5.5). The driver may also :meth:`Lookup.finish`
  early (a value lookup that found what it wanted). A lookup that decides
  where records are stored runs without soft timeouts: each request holds
  its slot and its place until answered or failed. Under load, dropping
  slow nodes would store records farther out than the ``k`` closest, where
  readers do not look, and every freed slot would add a request to a
  process that is already late.

Value lookups (§6 of docs/protocol/dht.md) read records from every node that
returns a hit: a :class:`RecordCollector` verifies each hit's value
(:func:`~p2pnode.dht.records.decode_value_untrusted`, a record already seen
is not verified twice) and keeps the newest record per publisher and kind
(:func:`merge_records`, the §4.4 merge rule).

No clock reads: every method that needs the time takes ``now``.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from p2pnode.dht.contacts import make_contact
from p2pnode.dht.records import SignedRecord, decode_value_untrusted
from p2pnode.dht.routing import Contact, id_int


class RttEstimator:
    """Retransmission timeout from measured round-trip times (RFC 6298 §2, §5).

    A request that passes its timeout unanswered doubles the timeout
    (:meth:`backoff`, RFC 6298 §5.5) until the next answer is measured: when the
    process or the network is overloaded, every round-trip grows at once, and
    a timeout learned at rest would mark every node slow.
    """

    __slots__ = ("_backoff", "_initial", "ceiling", "floor", "rttvar", "srtt")

    def __init__(self, *, initial: float = 1.0, floor: float = 0.05, ceiling: float = 5.0) -> None:
        self.srtt: float | None = None
        self.rttvar = initial / 2
        self.floor = floor
        self.ceiling = ceiling
        self._initial = initial
        self._backoff = 1.0

    def sample(self, rtt: float) -> None:
        """Feed one measured round-trip time (seconds) of an answered request."""
        self._backoff = 1.0
        if self.srtt is None:
            self.srtt = rtt
            self.rttvar = rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt

    def backoff(self) -> None:
        """A request passed its timeout: double the timeout until the next sample."""
        if self.timeout() < self.ceiling:
            self._backoff *= 2.0

    def timeout(self) -> float:
        """The current per-request timeout, clamped to ``[floor, ceiling]``."""
        rto = self._initial if self.srtt is None else self.srtt + 4 * self.rttvar
        return min(self.ceiling, max(self.floor, rto) * self._backoff)


class PeerState(enum.Enum):
    """Where a contact stands in one lookup."""

    CANDIDATE = "candidate"  # heard of, not asked yet
    IN_FLIGHT = "in_flight"  # asked, waiting, within its deadline
    SLOW = "slow"  # asked, deadline passed; a late answer is still welcome
    ANSWERED = "answered"
    FAILED = "failed"  # the driver gave up on it (hard timeout or bad reply)


# Legal transitions (state machine as data); anything else is ignored.
_TRANSITIONS: dict[PeerState, frozenset[PeerState]] = {
    PeerState.CANDIDATE: frozenset({PeerState.IN_FLIGHT}),
    PeerState.IN_FLIGHT: frozenset({PeerState.SLOW, PeerState.ANSWERED, PeerState.FAILED}),
    PeerState.SLOW: frozenset({PeerState.ANSWERED, PeerState.FAILED}),
    PeerState.ANSWERED: frozenset(),
    PeerState.FAILED: frozenset(),
}

_SHORTLISTED = (PeerState.CANDIDATE, PeerState.IN_FLIGHT, PeerState.ANSWERED)


#: A contact as a reply names it, ``[id, host, port]`` (checked by the rpcwire parser).
Named = Sequence[Any]


@dataclass(slots=True)
class _Entry:
    #: None for a contact known only as ``named`` until it is asked (:meth:`made`).
    contact: Contact | None
    dist: int
    state: PeerState = PeerState.CANDIDATE
    deadline: float = 0.0
    sent_at: float = 0.0
    named: Named | None = None

    def made(self) -> Contact:
        """The contact, made of what the reply named the first time it is needed."""
        c = self.contact
        if c is None:
            assert self.named is not None
            node_id, host, port = self.named
            c = self.contact = make_contact(node_id, host, port)
        return c


class Lookup:
    """One iterative lookup for ``target`` (sans-IO)."""

    def __init__(
        self,
        target: bytes,
        seeds: Iterable[Contact],
        *,
        rtt: RttEstimator,
        own_id: bytes | None = None,
        k: int = 20,
        alpha: int = 3,
        max_queries: int = 256,
        soft_timeouts: bool = True,
    ) -> None:
        """Without ``soft_timeouts`` a request holds its slot and its place until it is
        answered or fails (a lookup that decides where records are stored must find
        the k closest live nodes, and must not add requests when answers are late)."""
        self.target = target
        self.k = k
        self.alpha = alpha
        self.max_queries = max_queries
        self.queries = 0
        self._t = id_int(target)
        self._rtt = rtt
        self._own = own_id
        self._entries: dict[bytes, _Entry] = {}
        self._order: list[_Entry] = []  # sorted by distance
        self._dists: list[int] = []  # their distances, to bisect without a key function
        # Requests within their deadline (at most alpha) and past it, kept apart so
        # that timers and the end test do not scan every contact heard of.
        self._flying: list[_Entry] = []
        self._slow = 0
        self._soft = soft_timeouts
        self._finished = False
        # The shortlist until it changes: a request, an answer or a hard-timeout reply
        # that lands far out leaves it as it is, and the driver asks for it (and
        # whether the lookup is done) after every one.
        self._short: list[_Entry] | None = None
        # Bumped by every change that _converged depends on (a state moved, the
        # shortlist rebuilt); its verdict is kept until then: the driver asks after
        # every reply, and for every round of requests.
        self._version = 0
        self._verdict: tuple[int, bool] = (-1, False)
        self.add_contacts(seeds)

    # ------------------------------------------------------------------ inputs

    def add_contacts(self, contacts: Iterable[Contact]) -> None:
        """Merge newly heard-of contacts (duplicates and our own id ignored)."""
        self._add((c.node_id, c, None) for c in contacts)

    def add_named(self, named: Iterable[Named]) -> None:
        """:meth:`add_contacts` for contacts as a reply names them (``[id, host, port]``,
        checked): each becomes a contact only if it is asked, as few of them are."""
        self._add([(item[0], None, item) for item in named])

    def _add(self, heard: Iterable[tuple[bytes, Contact | None, Named | None]]) -> None:
        short = self._short
        # Past the last of a full shortlist, a newcomer does not enter it.
        bound = short[-1].dist if short is not None and len(short) >= self.k else None
        for node_id, contact, named in heard:
            if node_id == self._own or node_id in self._entries:
                continue
            number = contact.number if contact is not None else int.from_bytes(node_id, "big")
            d = number ^ self._t
            e = self._entries[node_id] = _Entry(contact, d, PeerState.CANDIDATE, 0.0, 0.0, named)
            i = bisect.bisect(self._dists, d)
            self._dists.insert(i, d)
            self._order.insert(i, e)
            if bound is None or d < bound:
                self._short = None
                self._version += 1

    def handle_response(
        self,
        node_id: bytes,
        contacts: Iterable[Contact],
        now: float,
        *,
        named: Iterable[Named] = (),
    ) -> None:
        """``node_id`` answered (possibly late) and named ``contacts`` (and ``named``, as
        :meth:`add_named` takes them)."""
        e = self._entries.get(node_id)
        if e is None or not self._move(e, PeerState.ANSWERED):
            return
        if e.sent_at <= now:
            self._rtt.sample(now - e.sent_at)
        self.add_contacts(contacts)
        self.add_named(named)

    def handle_failure(self, node_id: bytes) -> None:
        """The driver gave up on ``node_id`` (hard timeout, bad reply)."""
        e = self._entries.get(node_id)
        if e is not None:
            self._move(e, PeerState.FAILED)

    def handle_timer(self, now: float) -> None:
        """Mark requests whose deadline passed as slow, freeing their slots."""
        if not self._soft:
            return
        for e in [e for e in self._flying if e.deadline <= now]:
            self._move(e, PeerState.SLOW)
            self._rtt.backoff()

    def finish(self) -> None:
        """Stop early: :attr:`done` becomes true and no more requests are issued."""
        self._finished = True

    # ------------------------------------------------------------------ outputs

    def next_requests(self, now: float) -> list[Contact]:
        """Contacts to ask now; each is marked in flight with a fresh deadline."""
        short = self._shortlist()
        if self._finished or self._converged(short):
            return []
        in_flight = len(self._flying)
        out: list[Contact] = []
        rto = self._rtt.timeout()
        for e in short:
            if in_flight >= self.alpha or self.queries >= self.max_queries:
                break
            if e.state is PeerState.CANDIDATE:
                e.sent_at = now
                e.deadline = now + rto
                self._move(e, PeerState.IN_FLIGHT)
                in_flight += 1
                self.queries += 1
                out.append(e.made())
        return out

    def next_deadline(self) -> float | None:
        """The earliest deadline of a request in flight, or None."""
        if not self._soft:
            return None
        return min((e.deadline for e in self._flying), default=None)

    @property
    def done(self) -> bool:
        """True when the lookup has converged, run dry, hit its bound or was finished."""
        return self._finished or self._converged(self._shortlist())

    def _converged(self, short: list[_Entry]) -> bool:
        """:attr:`done` but for :meth:`finish`, given the shortlist (the verdict is
        kept until something it depends on changes)."""
        version, verdict = self._verdict
        if version != self._version:
            verdict = self._converged_now(short)
            self._verdict = (self._version, verdict)
        return verdict

    def _converged_now(self, short: list[_Entry]) -> bool:
        # The states as a list: counted and searched at C speed (states are singletons).
        states = [e.state for e in short]
        if states.count(PeerState.ANSWERED) == len(states):
            # Nobody answered yet but requests are out, all past their timeout: the
            # nodes (or this process) are overloaded, not all dead. Wait for a late
            # answer or the hard timeout rather than end with nothing.
            return bool(short) or not self._slow
        return bool(
            not self._flying
            and (self.queries >= self.max_queries or PeerState.CANDIDATE not in states)
        )

    def closest_answered(self, count: int | None = None) -> list[Contact]:
        """The nearest contacts that answered, nearest first (the lookup's result)."""
        n = self.k if count is None else count
        out = []
        for e in self._order:
            if e.state is PeerState.ANSWERED:
                out.append(e.made())
                if len(out) >= n:
                    break
        return out

    @property
    def heard(self) -> Container[bytes]:
        """The ids this lookup has heard of (a live view): :meth:`add_contacts` ignores them."""
        return self._entries.keys()

    def state_of(self, node_id: bytes) -> PeerState | None:
        """The state of ``node_id`` in this lookup (for tests and statistics)."""
        e = self._entries.get(node_id)
        return None if e is None else e.state

    # ------------------------------------------------------------------ internals

    def _shortlist(self) -> list[_Entry]:
        out = self._short
        if out is not None:
            return out
        out = []
        for e in self._order:
            if e.state in _SHORTLISTED:
                out.append(e)
                if len(out) >= self.k:
                    break
        self._short = out
        return out

    def _move(self, e: _Entry, new: PeerState) -> bool:
        old = e.state
        if new not in _TRANSITIONS[old]:
            return False
        self._version += 1
        if (old in _SHORTLISTED) != (new in _SHORTLISTED):  # it leaves or (late) re-enters
            self._short = None
        if old is PeerState.IN_FLIGHT:
            self._flying.remove(e)
        elif old is PeerState.SLOW:
            self._slow -= 1
        if new is PeerState.IN_FLIGHT:
            self._flying.append(e)
        elif new is PeerState.SLOW:
            self._slow += 1
        e.state = new
        return True


# ---------------------------------------------------------------------- values


def merge_records(*groups: Iterable[SignedRecord]) -> list[SignedRecord]:
    """The newest record per (publisher, kind) of ``groups`` (§4.4: higher
    ``(revision, expires_at)`` wins), in order of first appearance."""
    merged: dict[tuple[bytes, str], SignedRecord] = {}
    for group in groups:
        for r in group:
            slot = (r.public_key, r.kind.value)
            held = merged.get(slot)
            if held is None or r.newer_than(held):
                merged[slot] = r
    return list(merged.values())


class RecordCollector:
    """The merged records of one value lookup for ``key`` (sans-IO)."""

    def __init__(self, key: bytes, known: Callable[[bytes], SignedRecord | None]) -> None:
        """``known`` maps record bytes verified earlier (the node's store) to the record."""
        self.key = key
        #: Replies whose value held at least one valid record.
        self.hits = 0
        self._known = known
        self._found: dict[tuple[bytes, str], SignedRecord] = {}
        self._seen: dict[bytes, SignedRecord] = {}

    def add_untrusted(self, value: Any, now_ms: int) -> int:
        """Merge the records of one hit's ``value``; returns how many of them were rejected.

        Raises RecordError when the value as a whole is not a record list.
        """
        # Replies from different nodes mostly repeat the same records: verify once.
        seen = self._seen

        def known(encoded: bytes) -> SignedRecord | None:
            return seen.get(encoded) or self._known(encoded)

        recs, rejected = decode_value_untrusted(value, self.key, now_ms=now_ms, known=known)
        for r in recs:
            seen[r.encoded] = r
            slot = (r.public_key, r.kind.value)
            held = self._found.get(slot)
            if held is None or r.newer_than(held):
                self._found[slot] = r
        if recs:
            self.hits += 1
        return rejected

    def records(self) -> list[SignedRecord]:
        """The newest record per (publisher, kind) read so far."""
        return list(self._found.values())
