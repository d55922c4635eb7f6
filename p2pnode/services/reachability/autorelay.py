"""Automatic relays: a node nobody can dial keeps reservations on relays it picked
itself (docs/protocol/reachability.md §7), as libp2p's AutoRelay does.

Theory of operation:

* **Offers.** A checker that relays (``p2pnode run --relay``) names its own relay in
  its dial-back answers (``relay``, §2.2). The requester keeps an offer only when it
  names the checker itself (the relay's peer id is the checker's) at the IP its
  channel to the checker comes from: nobody can point a node at a third party.
  :class:`RelayBook` (sans-IO) holds at most ``max_offers`` of them, one per relay.
* **Choice.** :func:`choose_relays` is the rule, a pure function: no automatic relay
  while the node has configured relays or its last decisive verdict is not
  ``unreachable``; otherwise up to ``count`` offers that are not backing off, relays
  already held first (no churn), then the fewest failures and the oldest offer, never
  two on one IP (a host running many relays counts once).
* **Failures.** A relay that refuses the reservation, or holds none for
  ``reserve_timeout`` (it went away), is dropped and skipped for ``backoff_min``
  seconds, doubling up to ``backoff_max``; after ``max_failures`` failures in a row
  its offer is forgotten (a later check must offer it again).
* :class:`AutoRelay` drives the book on trio's clock: it starts and stops the
  relays' listeners (the kernel's links), lists the relays that hold a reservation as
  the cards' relayed endpoints, and asks for an early check when it knows no relay to
  try (a check brings new offers). It looks every ``poll`` seconds only while the node
  wants or holds automatic relays; otherwise an offer or a new verdict wakes it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import trio

from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.identity import PeerId
from p2pnode.services.reachability.verdict import Reachability, Verdict
from p2pnode.transport.relay import RelayAddress

logger = logging.getLogger("p2pnode.reachability")

#: Reservations a node keeps on relays of its own choice (reachability.md §7).
AUTO_RELAYS = 2


@dataclass(frozen=True, slots=True)
class AutoRelayConfig:
    """Automatic relays' limits and timers (seconds; defaults: reachability.md §7)."""

    #: False: the node never picks relays by itself.
    enabled: bool = True
    #: Reservations kept at once.
    relays: int = AUTO_RELAYS
    #: Offers remembered (one per relay peer id).
    max_offers: int = 16
    #: A chosen relay that holds no reservation this long has failed.
    reserve_timeout: float = 15.0
    #: A failed relay is skipped this long, doubling per failure in a row, at most max.
    backoff_min: float = 60.0
    backoff_max: float = 960.0
    #: Failures in a row after which an offer is forgotten.
    max_failures: int = 4
    #: How often the chosen relays' reservations are looked at while the node wants or
    #: holds automatic relays (otherwise it waits for a verdict or an offer).
    poll: float = 5.0

    def __post_init__(self) -> None:
        timers = (self.reserve_timeout, self.backoff_min, self.backoff_max, self.poll)
        if min(timers) <= 0 or self.backoff_min > self.backoff_max:
            raise LocalError(ErrorCode.CONFIG_ERROR, "automatic relay timers must be positive")
        if self.relays < 0 or self.max_offers < 1 or self.max_failures < 1:
            raise LocalError(ErrorCode.CONFIG_ERROR, "automatic relay limits must be positive")


@dataclass(frozen=True, slots=True)
class Offer:
    """A relay a checker offered: itself."""

    relay: RelayAddress
    #: When it was first offered (seconds, trio's clock).
    seen: float
    #: Failures in a row (a held reservation resets it).
    failures: int = 0
    #: Not tried again before this time.
    retry_at: float = 0.0


def choose_relays(
    offers: Sequence[Offer],
    *,
    configured: Sequence[str],
    unreachable: bool,
    held: Sequence[RelayAddress],
    own: PeerId,
    now: float,
    count: int,
) -> tuple[RelayAddress, ...]:
    """The relays to keep reservations on (see the module docstring): none with
    ``configured`` relays or unless ``unreachable``; else up to ``count`` offers not
    backing off at ``now``, those ``held`` first, one per IP and per relay peer id,
    never ``own``."""
    if configured or not unreachable or count <= 0:
        return ()
    usable = [o for o in offers if o.retry_at <= now and o.relay.relay_id != own]
    order = sorted(usable, key=lambda o: (o.relay not in held, o.failures, o.seen))
    chosen: list[RelayAddress] = []
    hosts: set[str] = set()
    ids: set[PeerId] = set()
    for offer in order:
        relay = offer.relay
        if relay.address[0] in hosts or relay.relay_id in ids:
            continue
        chosen.append(relay)
        hosts.add(relay.address[0])
        ids.add(relay.relay_id)
        if len(chosen) == count:
            break
    return tuple(chosen)


class RelayBook:
    """Offers, failures and the last decisive verdict (sans-IO; time comes in as ``now``)."""

    def __init__(self, config: AutoRelayConfig, own: PeerId, configured: Sequence[str]) -> None:
        self.config = config
        self._own = own
        self._configured = tuple(configured)
        self._offers: dict[PeerId, Offer] = {}
        #: The last decisive verdict was ``unreachable``.
        self.unreachable = False
        #: Offers dropped because the book was full, and relays that failed, in all.
        self.dropped = 0
        self.failures = 0

    def offers(self) -> list[Offer]:
        return list(self._offers.values())

    def verdict(self, verdict: Verdict) -> None:
        """A check of the node's own addresses ended: ``unknown`` changes nothing."""
        if verdict.reachability is not Reachability.UNKNOWN:
            self.unreachable = verdict.reachability is Reachability.UNREACHABLE

    def offered(self, relay: RelayAddress, now: float) -> None:
        """A checker offered ``relay`` (already checked to name the checker itself). A
        new address of a known relay replaces the old and keeps its failures; a new
        relay takes a free place, else that of a relay backing off, else is dropped."""
        known = self._offers.get(relay.relay_id)
        if known is not None:
            self._offers[relay.relay_id] = replace(known, relay=relay)
            return
        if len(self._offers) >= self.config.max_offers:
            backing_off = [o for o in self._offers.values() if o.retry_at > now]
            if not backing_off:
                self.dropped += 1
                return
            worst = max(backing_off, key=lambda o: (o.failures, o.retry_at))
            del self._offers[worst.relay.relay_id]
        self._offers[relay.relay_id] = Offer(relay, now)

    def held(self, relay: RelayAddress) -> None:
        """``relay`` granted a reservation: its failures are forgotten."""
        offer = self._offers.get(relay.relay_id)
        if offer is not None and (offer.failures or offer.retry_at):
            self._offers[relay.relay_id] = replace(offer, failures=0, retry_at=0.0)

    def failed(self, relay: RelayAddress, now: float) -> None:
        """``relay`` refused or went away: skipped for a doubling backoff, forgotten
        after ``max_failures`` in a row."""
        self.failures += 1
        offer = self._offers.get(relay.relay_id)
        if offer is None:
            return
        failures = offer.failures + 1
        if failures >= self.config.max_failures:
            del self._offers[relay.relay_id]
            return
        cfg = self.config
        backoff = min(cfg.backoff_min * 2 ** (failures - 1), cfg.backoff_max)
        self._offers[relay.relay_id] = replace(offer, failures=failures, retry_at=now + backoff)

    def wanted(self, now: float, held: Sequence[RelayAddress]) -> tuple[RelayAddress, ...]:
        """The relays to keep now (:func:`choose_relays`)."""
        return choose_relays(
            list(self._offers.values()),
            configured=self._configured,
            unreachable=self.unreachable and self.config.enabled,
            held=held,
            own=self._own,
            now=now,
            count=self.config.relays,
        )

    @property
    def seeking(self) -> bool:
        """Whether the node wants automatic relays at all: enabled, none configured,
        its last decisive verdict ``unreachable``."""
        return (
            self.config.enabled and not self._configured and self.unreachable
            and self.config.relays > 0
        )  # fmt: skip

    def next_deadline(self, now: float) -> float:
        """When a relay's backoff ends next (inf: none backs off)."""
        waits = [o.retry_at for o in self._offers.values() if o.retry_at > now]
        return min(waits, default=float("inf"))


class Reserving(Protocol):
    """A relay's listener as the driver watches it (a
    :class:`~p2pnode.transport.relayserve.RelayListener`)."""

    @property
    def reservation(self) -> object | None: ...

    @property
    def failure(self) -> BaseException | None: ...


@dataclass(frozen=True, slots=True)
class RelaySide:
    """What the driver uses of the node (given by the composition root)."""

    #: Start keeping a reservation on a relay and accepting channels through it.
    start: Callable[[RelayAddress], Reserving]
    #: Stop that (the reservation ends).
    stop: Callable[[RelayAddress], None]
    #: List these relayed addresses as the cards' automatic relayed endpoints.
    publish: Callable[[tuple[str, ...]], Awaitable[bool]]
    #: The node's last verdict on its own addresses (None before the first).
    verdict: Callable[[], Verdict | None]
    #: Ask for a check of the node's addresses soon (it brings offers).
    want_offers: Callable[[], None]


@dataclass(slots=True)
class _Running:
    listener: Reserving
    since: float  # started, or last seen holding a reservation
    reserved: bool = False


class AutoRelay:
    """Runs a :class:`RelayBook` (see the module docstring). ``statistics()`` for status."""

    def __init__(self, side: RelaySide, book: RelayBook) -> None:
        self._side = side
        self.book = book
        self._running: dict[RelayAddress, _Running] = {}
        self._verdict: Verdict | None = None
        self._listed: tuple[str, ...] = ()
        self._ask_at = -float("inf")
        self._ask_gap = book.config.backoff_min
        self._wake = trio.Event()

    def offered(self, relay: RelayAddress) -> None:
        """A checker offered ``relay`` (the service's hook)."""
        self.book.offered(relay, trio.current_time())
        self._wake.set()

    def poke(self) -> None:
        """Look again now (the node's verdict on its own addresses changed)."""
        self._wake.set()

    @property
    def listed(self) -> tuple[str, ...]:
        """The relayed addresses the cards list now (reservations held)."""
        return self._listed

    def statistics(self) -> dict[str, object]:
        return {
            "offers": len(self.book.offers()),
            "chosen": [str(r) for r in self._running],
            "listed": list(self._listed),
            "failures": self.book.failures,
        }

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the chosen relays, forever (ends when cancelled, with the node)."""
        task_status.started()
        if not self.book.config.enabled:
            return
        while True:
            # Made before the step: an offer or a verdict during it wakes the next wait.
            wake = self._wake = trio.Event()
            now = trio.current_time()
            await self.step(now)
            deadline = self.book.next_deadline(now)
            if self._running or self.book.seeking:
                deadline = min(deadline, now + self.book.config.poll)
            with trio.move_on_at(deadline):
                await wake.wait()

    async def step(self, now: float) -> None:
        """One look: note a new verdict, fail relays that hold nothing, start and stop
        relays to match the choice, and list those holding a reservation."""
        verdict = self._side.verdict()
        if verdict is not None and verdict is not self._verdict:
            self._verdict = verdict
            self.book.verdict(verdict)
        self._watch(now)
        wanted = self.book.wanted(now, list(self._running))
        for relay in [r for r in self._running if r not in wanted]:
            self._stop(relay)
        for relay in wanted:
            if relay not in self._running:
                self._start(relay, now)
        if self.book.seeking and len(wanted) < self.book.config.relays:
            self._ask_for_offers(now)
        elif len(wanted) == self.book.config.relays:
            self._ask_gap = self.book.config.backoff_min
        listed = tuple(str(r) for r, run in self._running.items() if run.reserved)
        if listed != self._listed:
            self._listed = listed
            await self._side.publish(listed)

    def _watch(self, now: float) -> None:
        timeout = self.book.config.reserve_timeout
        for relay, run in list(self._running.items()):
            if run.listener.reservation is not None:
                run.since, run.reserved = now, True
                self.book.held(relay)
                continue
            run.reserved = False
            failure = run.listener.failure
            refused = isinstance(failure, RemoteError) and failure.code is ErrorCode.RELAY_REFUSED
            if refused or now - run.since >= timeout:
                logger.info("reachability: relay %s failed: %s", relay, failure or "no reservation")
                self.book.failed(relay, now)
                self._stop(relay)

    def _start(self, relay: RelayAddress, now: float) -> None:
        try:
            listener = self._side.start(relay)
        except LocalError as exc:  # the node is closing: its links start nothing more
            logger.debug("reachability: relay %s not started: %s", relay, exc)
            return
        logger.info("reachability: reserving on relay %s", relay)
        self._running[relay] = _Running(listener, now)

    def _stop(self, relay: RelayAddress) -> None:
        del self._running[relay]
        self._side.stop(relay)

    def _ask_for_offers(self, now: float) -> None:
        """Too few relays to try: an early check brings offers. Then not again for
        ``backoff_min``, doubling up to ``backoff_max`` until the node holds all it
        wants, so a node in a swarm without relays does not check in a loop."""
        if now >= self._ask_at:
            cfg = self.book.config
            self._ask_at = now + self._ask_gap
            self._ask_gap = min(2 * self._ask_gap, cfg.backoff_max)
            self._side.want_offers()


__all__ = [
    "AUTO_RELAYS",
    "AutoRelay",
    "AutoRelayConfig",
    "Offer",
    "RelayBook",
    "RelaySide",
    "Reserving",
    "choose_relays",
]
