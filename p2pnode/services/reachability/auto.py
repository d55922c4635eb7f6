"""Automatic checks of a node's own addresses, and the card addresses they allow
(docs/protocol/reachability.md §6).

Theory of operation:

* :class:`CheckSchedule` (sans-IO) says when the next check is due. It waits for
  enough peers to make a quorum of checkers (``WAIT_PEERS``), checks once shortly
  after they are there, then every ``interval`` seconds ± ``jitter``; a check that
  reached no verdict (``unknown``: too few checkers answered) is retried sooner, with
  a doubling backoff; a change of the node's own addresses (its candidates or its
  relays) calls for a check soon. Time comes in as ``now``; ``next_deadline()`` is
  the timer to arm.
* :func:`card_addresses` is the rule: no decisive verdict keeps the node's own
  addresses (None: the kernel's default); a ``reachable`` or ``unreachable``
  verdict lists exactly the confirmed TCP addresses.
* :class:`AutoCheck` drives the schedule on trio's clock in the node's nursery: it
  runs each check (bounded by ``check_timeout``), hands the card addresses to the
  kernel's hook (which re-issues the cards only when the list changed), and ends
  with the nursery when the node closes.
"""

from __future__ import annotations

import enum
import logging
import random
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass

import trio

from p2pnode.core.errors import ErrorCode, LocalError, P2PError
from p2pnode.services.reachability.verdict import QUORUM, Reachability, Verdict
from p2pnode.services.reachability.wire import Transport

logger = logging.getLogger("p2pnode.reachability")


@dataclass(frozen=True, slots=True)
class ScheduleConfig:
    """Timers (seconds) of the automatic checks (defaults: reachability.md §6)."""

    #: False: checks run only on demand (``Node.check_reachability``).
    enabled: bool = True
    #: A check this long after enough peers are first there (their cards arrive).
    settle: float = 5.0
    #: Between checks that reached a verdict, ± ``jitter`` (a fraction of it).
    interval: float = 600.0
    jitter: float = 0.1
    #: After a check without a verdict: ``retry_min``, doubling, at most ``retry_max``.
    retry_min: float = 30.0
    retry_max: float = 600.0
    #: How often peers and the node's own addresses are looked at while waiting.
    poll: float = 5.0
    #: A check gives up after this long (its verdict is then ``unknown``).
    check_timeout: float = 60.0
    #: Peers (open channels and DHT contacts) needed before a check is worth it.
    min_peers: int = QUORUM

    def __post_init__(self) -> None:
        timers = (self.settle, self.interval, self.retry_min, self.retry_max, self.poll)
        if min(timers) <= 0 or self.check_timeout <= 0 or not 0 <= self.jitter < 1:
            raise LocalError(ErrorCode.CONFIG_ERROR, "reachability timers must be positive")
        if self.retry_min > self.retry_max or self.min_peers < 1:
            raise LocalError(ErrorCode.CONFIG_ERROR, "retry_min > retry_max, or min_peers < 1")


class Phase(enum.Enum):
    """What the schedule waits on."""

    WAIT_PEERS = "wait_peers"  # fewer peers than a quorum of checkers
    WAIT_TIMER = "wait_timer"  # the next check's time
    CHECKING = "checking"  # a check runs


_TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.WAIT_PEERS: frozenset({Phase.WAIT_TIMER}),
    Phase.WAIT_TIMER: frozenset({Phase.WAIT_TIMER, Phase.CHECKING}),
    Phase.CHECKING: frozenset({Phase.WAIT_TIMER}),
}


class CheckSchedule:
    """When the next automatic check is due (sans-IO; see the module docstring)."""

    def __init__(self, config: ScheduleConfig, rng: random.Random) -> None:
        self.config = config
        self._rng = rng
        self.phase = Phase.WAIT_PEERS
        self._due = float("inf")
        self._retry = config.retry_min
        self._recheck = False  # the addresses changed while a check ran
        #: Checks started, and those that ended without a verdict.
        self.checks = 0
        self.undecided = 0

    def _to(self, phase: Phase) -> None:
        if phase not in _TRANSITIONS[self.phase]:
            raise LocalError(
                ErrorCode.INVALID_ARGUMENT, f"schedule: {self.phase.value} -> {phase.value}"
            )
        self.phase = phase

    def next_deadline(self) -> float:
        """When a check is due (inf while waiting for peers or checking)."""
        return self._due if self.phase is Phase.WAIT_TIMER else float("inf")

    def peers_seen(self, now: float, count: int) -> None:
        """``count`` peers are known: the first check is due ``settle`` after a quorum."""
        if self.phase is Phase.WAIT_PEERS and count >= self.config.min_peers:
            self._to(Phase.WAIT_TIMER)
            self._due = now + self.config.settle

    def addresses_changed(self, now: float) -> None:
        """The node's own addresses changed: check again ``settle`` from now."""
        if self.phase is Phase.CHECKING:
            self._recheck = True
        elif self.phase is Phase.WAIT_TIMER:
            self._due = min(self._due, now + self.config.settle)

    def start(self, now: float) -> bool:
        """True (and CHECKING) when a check is due at ``now``."""
        if self.phase is not Phase.WAIT_TIMER or now < self._due:
            return False
        self._to(Phase.CHECKING)
        self.checks += 1
        return True

    def finished(self, now: float, decided: bool) -> float:
        """A check ended (``decided``: its verdict is not ``unknown``); the next due time.
        Raises LocalError(INVALID_ARGUMENT) when no check runs."""
        if self.phase is not Phase.CHECKING:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "schedule: no check runs")
        self._to(Phase.WAIT_TIMER)
        cfg = self.config
        if decided:
            self._retry = cfg.retry_min
            delay = cfg.interval * (1 + cfg.jitter * (2 * self._rng.random() - 1))
        else:
            self.undecided += 1
            delay, self._retry = self._retry, min(2 * self._retry, cfg.retry_max)
        if self._recheck:
            self._recheck, delay = False, min(delay, cfg.settle)
        self._due = now + delay
        return self._due


def card_addresses(verdict: Verdict | None) -> list[str] | None:
    """The direct addresses the node's cards list after ``verdict`` (§6): None (the
    node's own addresses, as without checks) when there is no decisive verdict, else
    exactly the confirmed TCP candidates, in order, as ``host:port``."""
    if verdict is None or verdict.reachability is Reachability.UNKNOWN:
        return None
    out = []
    for c in verdict.confirmed:
        if c.transport is Transport.TCP:
            out.append(f"[{c.host}]:{c.port}" if ":" in c.host else f"{c.host}:{c.port}")
    return out


@dataclass(frozen=True, slots=True)
class AutoSide:
    """What the automatic checks use of the node (given by the composition root)."""

    #: Run one check of the node's own addresses (the service's ``check``).
    check: Callable[[], Awaitable[Verdict]]
    #: Peers known: open channels and DHT contacts.
    peers: Callable[[], int]
    #: The node's own addresses and relays, compared to see a change.
    addresses: Callable[[], Hashable]
    #: Give the cards these direct addresses (None: the node's own); True if they changed.
    publish: Callable[[list[str] | None], Awaitable[bool]]


class AutoCheck:
    """Runs :class:`CheckSchedule` (see the module docstring). ``statistics()`` for status."""

    def __init__(self, side: AutoSide, config: ScheduleConfig, rng: random.Random) -> None:
        self._side = side
        self.schedule = CheckSchedule(config, rng)
        #: The card addresses last handed to the kernel (None: its default).
        self.listed: list[str] | None = None
        #: Times the card addresses changed (the cards were re-issued).
        self.republished = 0

    def statistics(self) -> dict[str, object]:
        s = self.schedule
        return {
            "auto": s.config.enabled,
            "phase": s.phase.value,
            "checks": s.checks,
            "undecided": s.undecided,
            "republished": self.republished,
        }

    async def apply(self, verdict: Verdict) -> None:
        """Make the cards list what ``verdict`` allows (unchanged on ``unknown``)."""
        listed = card_addresses(verdict)
        if listed is None or listed == self.listed:
            return
        self.listed = listed
        if await self._side.publish(listed):
            self.republished += 1
            logger.info("reachability: cards now list %s", listed or "no direct address")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Check now and then, forever (ends when cancelled, with the node)."""
        task_status.started()
        if not self.schedule.config.enabled:
            return
        seen = self._side.addresses()
        while True:
            now = trio.current_time()
            self.schedule.peers_seen(now, self._side.peers())
            current = self._side.addresses()
            if current != seen:
                seen = current
                self.schedule.addresses_changed(now)
            if self.schedule.start(now):
                await self._one()
                continue
            wake = min(self.schedule.next_deadline(), now + self.schedule.config.poll)
            await trio.sleep_until(wake)

    async def _one(self) -> None:
        verdict: Verdict | None = None
        with trio.move_on_after(self.schedule.config.check_timeout):
            try:
                verdict = await self._side.check()
            except P2PError as exc:  # no agent to ask as yet, no checker answered ...
                logger.info("reachability: automatic check failed: %s", exc)
        decided = verdict is not None and verdict.reachability is not Reachability.UNKNOWN
        self.schedule.finished(trio.current_time(), decided)
        if verdict is not None:
            await self.apply(verdict)


__all__ = ["AutoCheck", "AutoSide", "CheckSchedule", "Phase", "ScheduleConfig", "card_addresses"]
