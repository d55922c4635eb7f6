"""Who may enter the routing table (sans-IO): proof of address, checks bounded.

Theory of operation (docs/protocol/dht.md §5.1). Kademlia adds the sender
of every message to the table (paper §2.2), so anyone who sends well-formed
requests from throwaway source ports, each with a fresh id, could fill it
with contacts that never answer and have them served to every asker. Here a
contact enters the table only once it has *proven* that it receives at its
address: it answered a request of ours, that is, a reply came from the exact
address the request went to and echoed the request's random 160-bit message
id (:mod:`p2pnode.dht.rpc` matches both), which nobody who does not receive
there can know. Stock ``kademlia`` nodes answer requests, so they prove
themselves without knowing any of this.

* Replies to our own calls (lookups, stores, pings) are the proof; the
  driver hands them to the table directly.
* A request from a sender the table does not hold at its source address is
  answered as usual, but the sender is only *checked*:
  :meth:`Admission.on_request` says whether to ping the source address now
  (:attr:`Verdict.CHECK`); the id the ping reply names is then admitted.
  Checks are bounded so that a flood cannot turn into a flood of pings:
  one check per address at a time; none of an address a request of ours
  waits on (its reply proves the address, and a peer that checks us while
  our request to it is out would otherwise be checked back: a ping for
  nothing); a check holds one of ``max_checks``
  slots, at most ``max_checks_per_host`` of them per host, for
  ``slot_time`` seconds or until it ends (a reply after that still counts);
  no check of a host that already holds its limit of ids
  (:meth:`~p2pnode.dht.routing.RoutingTable.host_full`), nor of a sender
  whose bucket is full and cannot split
  (:meth:`~p2pnode.dht.routing.RoutingTable.has_room`): the table could
  keep it only as a replacement, and replies to our own requests fill
  replacement caches without a ping each; nor of a sender that would not
  be one of the k contacts nearest our id while its bucket already holds
  ``check_fill`` contacts (:attr:`Verdict.ENOUGH`): that is enough to route
  through, replies to our own requests add more for free, and in a large
  swarm most requests come from such far senders (Kademlia §4.1 likewise
  spares traffic by learning about contacts from the messages it sends
  anyway); the nearest contacts, which decide where records go, are
  checked as before; and an address
  checked in the last ``retry_after`` seconds is not checked again (a
  memory of ``memory`` addresses, the oldest forgotten first; an address
  whose check admitted its id is not remembered: its requests are known).
* A sender that finds every slot taken waits for one, oldest first
  (:meth:`Admission.next_waiting`; at most ``max_waiting``), so that an
  honest node that joins during a flood from many ports of one loopback
  or unlimited host is checked once the flood's checks free their slots,
  rather than only when it next sends a request.
* A check whose ping went unanswered is tried again, up to ``attempts``
  pings in all: under a flood the receiver's socket buffer overflows, and
  the lost datagram may be the honest node's answer (or our ping), which
  sends one request when it joins and may send none for minutes after.
  The retry waits for a slot like a sender does; only after the last
  unanswered ping is the address left alone for ``retry_after`` seconds. A
  silent flood still costs at most the slots' pings in flight: a retry
  takes a slot like any check.
* The table applies its own limits to whatever is proven: one id per
  address, a few ids per host (:meth:`~p2pnode.dht.routing.RoutingTable.refusal`).

No clock reads: every method that needs the time takes ``now``.
"""

from __future__ import annotations

import enum
from collections import OrderedDict

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.dht.routing import RoutingTable, host_key
from p2pnode.dht.rpc import Address


class Verdict(enum.Enum):
    """What to do about the sender of one request."""

    KNOWN = "known"  # the table holds this id at this address: it was heard from
    CHECK = "check"  # ping the source address now; report with check_done()
    CHECKING = "checking"  # a check of this address is out already
    ASKED = "asked"  # a request of ours to this address is out: its reply is the proof
    BUSY = "busy"  # every check slot is taken (the sender waits for one), or its host's are
    RECENT = "recent"  # this address was checked less than retry_after ago
    HOST_FULL = "host full"  # this host holds its limit of ids in the table
    NO_ROOM = "no room"  # its bucket is full and cannot split: a replacement at best
    ENOUGH = "enough"  # not near us, and its bucket holds check_fill contacts already


class Admission:
    """Decides which unproven senders to check, and remembers the checks."""

    __slots__ = (
        "_attempts",
        "_checking",
        "_limit_loopback",
        "_per_host",
        "_recent",
        "_slots",
        "_waiting",
        "attempts",
        "check_fill",
        "max_checks",
        "max_checks_per_host",
        "max_waiting",
        "memory",
        "retry_after",
        "slot_time",
    )

    def __init__(
        self,
        *,
        max_checks: int = 32,
        max_checks_per_host: int = 2,
        slot_time: float = 1.0,
        retry_after: float = 60.0,
        memory: int = 4096,
        max_waiting: int = 256,
        attempts: int = 3,
        limit_loopback: bool = True,
        check_fill: int | None = None,
    ) -> None:
        """``check_fill``: a sender that would not be one of the k contacts nearest our
        id is checked only while its bucket holds fewer contacts (None: always).

        Raises LocalError(INVALID_ARGUMENT) for a bound below 1 or a time below 0.
        """
        if (
            min(max_checks, max_checks_per_host, memory, max_waiting, attempts) < 1
            or min(retry_after, slot_time) < 0
            or (check_fill is not None and check_fill < 0)
        ):
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "admission bounds must be >= 1")
        self.check_fill = check_fill
        self.max_checks = max_checks
        self.max_checks_per_host = max_checks_per_host
        self.slot_time = slot_time
        self.retry_after = retry_after
        self.memory = memory
        self.max_waiting = max_waiting
        self.attempts = attempts
        self._limit_loopback = limit_loopback
        # Addresses with a check out, until check_done(): address -> claimed id.
        self._checking: dict[Address, bytes] = {}
        # Unanswered pings of checks still to be tried again: address -> how many.
        # Oldest first; bounded by ``memory`` (a forgotten one starts over).
        self._attempts: OrderedDict[Address, int] = OrderedDict()
        # Checks holding a slot, until their slot time is over (insertion order is
        # deadline order); a reply after that still counts, the slot is free.
        self._slots: OrderedDict[Address, float] = OrderedDict()
        self._per_host: dict[str, int] = {}
        # address -> when it may be checked again; insertion order is age order.
        self._recent: OrderedDict[Address, float] = OrderedDict()
        # Senders turned away while every slot was taken: address -> claimed id.
        self._waiting: OrderedDict[Address, bytes] = OrderedDict()

    @property
    def checking(self) -> int:
        """How many checks are out."""
        return len(self._checking)

    @property
    def waiting(self) -> int:
        """How many senders wait for a check slot."""
        return len(self._waiting)

    def on_request(
        self,
        node_id: bytes,
        source: Address,
        table: RoutingTable,
        now: float,
        *,
        asked: bool = False,
    ) -> Verdict:
        """A request from ``source`` claims ``node_id``: what to do about the sender.

        ``asked``: a request of ours to ``source`` waits for its reply, which will
        prove the address if it comes (:attr:`Verdict.ASKED`, no check).
        After :attr:`Verdict.CHECK` the check counts as out until :meth:`check_done`.
        A sender turned away because every slot is taken waits for one
        (:meth:`next_waiting`), up to ``max_waiting`` of them, the oldest dropped.
        """
        verdict = self._verdict(node_id, source, table, now, asked)
        if verdict is Verdict.BUSY and len(self._slots) >= self.max_checks:
            self._wait(source, node_id)
        return verdict

    def _wait(self, source: Address, node_id: bytes) -> None:
        self._waiting.pop(source, None)
        self._waiting[source] = node_id
        while len(self._waiting) > self.max_waiting:
            self._waiting.popitem(last=False)

    def next_waiting(self, table: RoutingTable, now: float) -> tuple[bytes, Address] | None:
        """A waiting sender (or a check to try again) to check now (its check is out,
        as after CHECK), or None."""
        while self._waiting:
            self._free_slots(now)
            if len(self._slots) >= self.max_checks:
                return None
            source, node_id = self._waiting.popitem(last=False)
            if self._verdict(node_id, source, table, now) is Verdict.CHECK:
                return node_id, source
        return None

    def check_done(
        self, source: Address, now: float, *, answered: bool = True, admitted: bool = False
    ) -> bool:
        """The ping of ``source``'s check ended, ``answered`` or not; ``admitted``: the
        id it named is now a contact of the table at ``source``.

        Returns True when an unanswered check is to be tried again: the address
        then waits for a slot (:meth:`next_waiting`), ahead of nobody. Otherwise
        the address is not checked again for ``retry_after`` seconds, unless its
        id was admitted: while the table holds it there its requests need no
        check (:attr:`Verdict.KNOWN`), and a node keeps no memory per contact
        for nothing. An address without a check out is ignored (False).
        """
        node_id = self._checking.pop(source, None)
        if node_id is None:
            return False
        if source in self._slots:
            del self._slots[source]
            self._release(source)
        failed = 0 if answered else self._attempts.pop(source, 0) + 1
        if 0 < failed < self.attempts:
            self._attempts[source] = failed
            if len(self._attempts) > self.memory:
                self._attempts.popitem(last=False)
            self._wait(source, node_id)
            return True
        self._attempts.pop(source, None)
        self._recent.pop(source, None)
        if answered and admitted:
            return False
        self._recent[source] = now + self.retry_after
        while len(self._recent) > self.memory:
            self._recent.popitem(last=False)
        return False

    def _verdict(
        self, node_id: bytes, source: Address, table: RoutingTable, now: float, asked: bool = False
    ) -> Verdict:
        held = table.get(node_id)
        if held is not None and held.address == source:
            return Verdict.KNOWN
        if source in self._checking:
            return Verdict.CHECKING
        if asked:
            return Verdict.ASKED
        until = self._recent.get(source)
        if until is not None:
            if until > now:
                return Verdict.RECENT
            del self._recent[source]
        if table.host_full(source[0], node_id):
            return Verdict.HOST_FULL
        if not table.has_room(node_id):
            return Verdict.NO_ROOM
        fill = self.check_fill
        if fill is not None and table.bucket_size(node_id) >= fill and not table.near(node_id):
            return Verdict.ENOUGH
        self._free_slots(now)
        key = self._key(source)
        if len(self._slots) >= self.max_checks or (
            key is not None and self._per_host.get(key, 0) >= self.max_checks_per_host
        ):
            return Verdict.BUSY
        self._checking[source] = node_id
        self._slots[source] = now + self.slot_time
        if key is not None:
            self._per_host[key] = self._per_host.get(key, 0) + 1
        return Verdict.CHECK

    def _free_slots(self, now: float) -> None:
        slots = self._slots
        # Bounded by max_checks; each step frees one slot.
        while slots:
            source, deadline = next(iter(slots.items()))
            if deadline > now:
                return
            del slots[source]
            self._release(source)

    def _release(self, source: Address) -> None:
        key = self._key(source)
        if key is not None:
            left = self._per_host[key] - 1
            if left:
                self._per_host[key] = left
            else:
                del self._per_host[key]

    def _key(self, source: Address) -> str | None:
        return host_key(source[0], limit_loopback=self._limit_loopback)


__all__ = ["Admission", "Verdict"]
