"""Joining a swarm through bootstrap peers, and trying again until it works
(docs/protocol/node.md "Joining").

Theory of operation:

* An **attempt** (:meth:`Joining.attempt`) resolves each configured bootstrap
  address (an IP literal is taken as it is; a host name is resolved then, so a
  name that starts resolving later is picked up by a later attempt), skips the
  node's own address, opens a secure channel to every other one at once (each
  bounded by the dial timeout), bootstraps the DHT through all of them, and
  asks the DHT of each peer that opened no channel whether it answers (a
  DHT-only node, such as a stock ``kademlia`` one, is a bootstrap peer too).
  Each address ends the attempt in one :class:`Outcome`.
* The node has **joined** once an attempt reached one bootstrap peer (channel
  or DHT), or :meth:`Joining.connected` was told of a channel the program
  opened itself (``Kernel.connect``). Joining publishes the node's cards
  again: those published before the DHT had a contact reached nobody.
* A node that joined no one **keeps trying** (``Joining._keep_trying``) on
  the schedule of :class:`~p2pnode.dht.rejoin.Rejoin` (the DHT's own: 2 s
  doubling to 300 s, each delay ±25%), until an attempt or a connect joins it.
* **Logs**: an address that cannot be resolved or reached is one WARNING, the
  first time only (:class:`JoinLog`); a DHT-only peer one INFO; joining one
  INFO line. ``status`` and the daemon's ``ready`` line show
  :class:`JoinStatus`.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
import logging
import random
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from p2pnode.core.boundary import describe
from p2pnode.core.errors import ErrorCode, LocalError, P2PError
from p2pnode.dht.rejoin import Rejoin, RejoinState
from p2pnode.node.config import format_address
from p2pnode.transport.net import Address

logger = logging.getLogger("p2pnode.node")

#: Opens a secure channel to an address (the kernel's dial and HELLO wait).
OpenChannel = Callable[[Address], Awaitable[object]]
#: Asks the DHT at an address whether it answers.
ProbeDht = Callable[[Address], Awaitable[bool]]
#: Resolves a host name: ``(host, port)`` to an address to dial.
Resolve = Callable[[Address], Awaitable[Address]]


class JoinState(enum.Enum):
    """Where joining stands, named for what the node waits on."""

    ALONE = "alone"  # no bootstrap peer to join through: others join through this node
    JOINING = "joining"  # the first attempt to run or end
    RETRYING = "retrying"  # the next attempt (no bootstrap peer answered yet)
    JOINED = "joined"  # nothing: a bootstrap peer answered, or the program connected


_TRANSITIONS: dict[JoinState, frozenset[JoinState]] = {
    JoinState.ALONE: frozenset({JoinState.JOINING, JoinState.JOINED}),
    JoinState.JOINING: frozenset({JoinState.ALONE, JoinState.RETRYING, JoinState.JOINED}),
    JoinState.RETRYING: frozenset({JoinState.JOINED}),
    JoinState.JOINED: frozenset(),
}


class Outcome(enum.Enum):
    """What one bootstrap address gave in the last attempt."""

    UNRESOLVED = "unresolved"  # its host name did not resolve
    UNREACHABLE = "unreachable"  # no channel opened, and its DHT did not answer
    DHT_ONLY = "dht-only"  # its DHT answered; it runs no secure channels
    CHANNEL = "channel"  # a secure channel opened (cards exchanged)
    SELF = "self"  # this node's own address


#: Outcomes that count as a bootstrap peer reached.
REACHED = frozenset({Outcome.DHT_ONLY, Outcome.CHANNEL})


@dataclasses.dataclass(frozen=True, slots=True)
class JoinStatus:
    """What ``status`` and the ``ready`` line say about joining."""

    #: Where joining stands.
    state: JoinState
    #: Bootstrap addresses configured (the node's own not counted).
    bootstrap: int
    #: Of them, those the last attempt reached.
    reached: int
    #: Open secure channels (any peer, inbound ones included).
    peers: int
    #: Attempts made so far.
    attempts: int
    #: Seconds to the next attempt (None: none is scheduled).
    next_attempt_in: float | None

    @property
    def joined(self) -> bool:
        return self.state is JoinState.JOINED

    def summary(self) -> str:
        """One line: ``joined via 1 of 2 bootstrap peers, 3 peers`` and the like."""
        peers = _peers_text(self.peers)
        if self.state is JoinState.JOINED:
            if self.bootstrap:
                return f"joined via {self.reached} of {self.bootstrap} bootstrap peers, {peers}"
            return f"joined, {peers}"
        if self.state is JoinState.ALONE:
            return f"no bootstrap peers (others join through this node), {peers}"
        if self.state is JoinState.JOINING:
            return f"joining through {self.bootstrap} bootstrap peers, {peers}"
        wait = f" in {self.next_attempt_in:.0f} s" if self.next_attempt_in is not None else ""
        return f"not joined: no bootstrap peer answered; retrying{wait}, {peers}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "joined": self.joined,
            "bootstrap": self.bootstrap,
            "reached": self.reached,
            "peers": self.peers,
            "attempts": self.attempts,
            "nextAttemptIn": self.next_attempt_in,
            "summary": self.summary(),
        }


def _peers_text(count: int) -> str:
    return f"{count} peer{'' if count == 1 else 's'}"


class JoinLog:
    """The log lines of joining: one per address and kind of failure, at most once."""

    __slots__ = ("_said",)

    def __init__(self) -> None:
        self._said: set[tuple[str, Outcome]] = set()

    def outcome(self, where: str, outcome: Outcome, reason: str, *, retrying: bool) -> bool:
        """Log ``outcome`` of bootstrap address ``where`` unless said before; True if logged."""
        if outcome in (Outcome.CHANNEL, Outcome.SELF) or (where, outcome) in self._said:
            return False
        self._said.add((where, outcome))
        more = "; retrying with backoff" if retrying else ""
        if outcome is Outcome.DHT_ONLY:
            logger.info("bootstrap %s: no p2pnode channel there; joining by its DHT", where)
        elif outcome is Outcome.UNRESOLVED:
            logger.warning("bootstrap %s: cannot resolve the host: %s%s", where, reason, more)
        else:
            logger.warning("bootstrap %s: unreachable: %s%s", where, reason, more)
        return True


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def resolve_host(address: Address) -> Address:
    """``address`` with its host name resolved (an IP literal as it is), IPv4 first.

    Raises OSError (``socket.gaierror``) when the name does not resolve.
    """
    host, port = address[0], address[1]
    if is_ip_literal(host):
        return (host, port)
    infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    if not infos:
        raise OSError(f"no address for {host}")
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return (str(infos[0][4][0]), port)


class Joining:
    """Joins through the configured bootstrap peers and keeps trying until it has.

    The kernel gives it what it uses: ``dht_contacts`` is the DHT's routing table
    size (None without a DHT). :attr:`probe_dht`, set where a DHT runs, pings one
    address; without it a bootstrap peer that opened no channel counts as a DHT-only
    peer when the DHT has contacts after bootstrapping.
    """

    def __init__(
        self,
        bootstrap: Sequence[Address],
        *,
        open_channel: OpenChannel,
        bootstrap_dht: Callable[[list[Address]], Awaitable[None]],
        publish: Callable[[], Awaitable[None]],
        is_own: Callable[[Address], bool],
        peers: Callable[[], int],
        dht_contacts: Callable[[], int | None],
        dial_timeout: float,
        rng: random.Random | None = None,
        resolve: Resolve = resolve_host,
        first_delay: float = 2.0,
        max_delay: float = 300.0,
    ) -> None:
        self.bootstrap = tuple(dict.fromkeys(bootstrap))
        self.probe_dht: ProbeDht | None = None
        self._open_channel = open_channel
        self._bootstrap_dht = bootstrap_dht
        self._publish = publish
        self._is_own = is_own
        self._peers = peers
        self._dht_contacts = dht_contacts
        self._dial_timeout = dial_timeout
        self._resolve = resolve
        self._schedule = Rejoin(
            rng if rng is not None else random.Random(),
            first_delay=first_delay,
            max_delay=max_delay,
        )
        self._schedule.remember_bootstrap(self.bootstrap)
        self._state = JoinState.ALONE
        self._outcomes: dict[Address, Outcome] = {}
        self._attempts = 0
        self._log = JoinLog()

    @property
    def state(self) -> JoinState:
        return self._state

    @property
    def joined(self) -> bool:
        """Has the node joined (an attempt or a connect reached a peer)?"""
        return self._state is JoinState.JOINED

    @property
    def outcomes(self) -> dict[Address, Outcome]:
        """Each bootstrap address's outcome in the last attempt."""
        return dict(self._outcomes)

    def status(self, now: float) -> JoinStatus:
        """The snapshot ``status`` shows, at ``now`` (trio's clock)."""
        others = [a for a, o in self._outcomes.items() if o is not Outcome.SELF]
        configured = len(others) if self._outcomes else len(self.bootstrap)
        due = self._schedule.next_deadline()
        return JoinStatus(
            state=self._state,
            bootstrap=configured,
            reached=sum(1 for a in others if self._outcomes[a] in REACHED),
            peers=self._peers(),
            attempts=self._attempts,
            next_attempt_in=max(0.0, due - now) if due != float("inf") else None,
        )

    async def join(self, nursery: trio.Nursery) -> int:
        """One attempt now; when it reached nobody, the next ones in ``nursery``.
        Returns how many bootstrap peers opened a channel."""
        if not self.bootstrap:
            return 0
        if self._state is JoinState.ALONE:
            self._move(JoinState.JOINING)
        await self._attempt()
        if all(o is Outcome.SELF for o in self._outcomes.values()):
            if self._state is JoinState.JOINING:
                self._move(JoinState.ALONE)  # the list names only this node
            return 0
        if self._state is JoinState.JOINING:
            self._move(JoinState.RETRYING)
        if self._state is JoinState.RETRYING and self._schedule.state is RejoinState.JOINED:
            # No retry is scheduled yet (WAITING or RUNNING: one is): schedule the next.
            self._schedule.observe(0, trio.current_time())
            nursery.start_soon(self._keep_trying)
        return self._channels()

    def _channels(self) -> int:
        return sum(1 for o in self._outcomes.values() if o is Outcome.CHANNEL)

    async def _keep_trying(self) -> None:
        """Attempt again on the rejoin schedule until the node joined."""
        schedule = self._schedule
        while self._state is not JoinState.JOINED:
            await trio.sleep_until(schedule.next_deadline())
            if not schedule.handle_timer(trio.current_time()):
                continue
            try:
                await self._attempt()
            except Exception as exc:  # a background retry must not end the node: next one
                logger.error("joining: the attempt failed: %s", describe(exc))
                logger.debug("joining: the attempt failed", exc_info=exc)
            finally:
                schedule.finished(1 if self.joined else 0, trio.current_time())

    async def connected(self, address: Address) -> None:
        """The program opened a channel to ``address``: with a DHT that has no contact,
        bootstrap it through that peer and publish the cards."""
        if self._dht_contacts() == 0:
            with trio.move_on_after(self._dial_timeout):
                await self._bootstrap_dht([address])
            await self._publish()
        self._joined(f"connected to {format_address(address)}")

    async def _attempt(self) -> None:
        """Resolve, dial, bootstrap the DHT, probe, log; joined if anyone answered."""
        self._attempts += 1
        outcomes: dict[Address, Outcome] = {}
        reasons: dict[Address, str] = {}
        targets: dict[Address, Address] = {}  # configured -> resolved
        async with trio.open_nursery() as nursery:
            for address in self.bootstrap:
                nursery.start_soon(self._reach, address, targets, outcomes, reasons)
        if targets:
            await self._bootstrap_dht(list(targets.values()))
        await self._probe(targets, outcomes, reasons)
        self._outcomes = {a: outcomes[a] for a in self.bootstrap}
        reached = [a for a in self.bootstrap if outcomes[a] in REACHED]
        if reached:
            await self._publish()
        retrying = not reached and self._state is not JoinState.JOINED
        for address in self.bootstrap:
            reason = reasons.get(address, "")
            self._log.outcome(format_address(address), outcomes[address], reason, retrying=retrying)
        if reached:
            self._joined(f"bootstrap {', '.join(format_address(a) for a in reached)}")

    async def _reach(
        self,
        address: Address,
        targets: dict[Address, Address],
        outcomes: dict[Address, Outcome],
        reasons: dict[Address, str],
    ) -> None:
        """Resolve ``address`` (bounded by the dial timeout too: a resolver that hangs
        must not hold the attempt) and, unless it is this node, dial it."""
        try:
            with trio.fail_after(self._dial_timeout):
                resolved = await self._resolve(address)
        except (OSError, trio.TooSlowError) as exc:
            outcomes[address], reasons[address] = Outcome.UNRESOLVED, describe(exc)
            return
        if self._is_own(resolved) or self._is_own(address):
            outcomes[address] = Outcome.SELF
            return
        targets[address] = resolved
        try:
            with trio.fail_after(self._dial_timeout):
                await self._open_channel(resolved)
            outcomes[address] = Outcome.CHANNEL
        except (P2PError, OSError, trio.TooSlowError, trio.BrokenResourceError) as exc:
            outcomes[address] = Outcome.UNREACHABLE
            reasons[address] = f"no channel ({describe(exc)})"
            logger.debug("bootstrap %s: %s", format_address(address), describe(exc))

    async def _probe(
        self,
        targets: dict[Address, Address],
        outcomes: dict[Address, Outcome],
        reasons: dict[Address, str],
    ) -> None:
        """Ask the DHT of each target that opened no channel whether it answers."""
        probe = self.probe_dht
        silent = [a for a in targets if outcomes[a] is Outcome.UNREACHABLE]
        if not silent:
            return
        if not self._dht_contacts():  # the bootstrap just pinged them all: none answered
            for address in silent:
                reasons[address] += " and no DHT answer"
            return
        if probe is None:  # no per-address probe: a DHT with contacts says enough
            for address in silent:
                outcomes[address] = Outcome.DHT_ONLY
            return

        async def one(address: Address) -> None:
            if await probe(targets[address]):
                outcomes[address] = Outcome.DHT_ONLY
            else:
                reasons[address] += " and no DHT answer"

        async with trio.open_nursery() as nursery:
            for address in silent:
                nursery.start_soon(one, address)

    def _joined(self, via: str) -> None:
        if self._state is JoinState.JOINED:
            return
        self._move(JoinState.JOINED)
        logger.info("joined the swarm (%s), %s", via, _peers_text(self._peers()))

    def _move(self, new: JoinState) -> None:
        if new not in _TRANSITIONS[self._state]:
            raise LocalError(
                ErrorCode.ILLEGAL_TRANSITION, f"joining {self._state.value} -> {new.value}"
            )
        self._state = new


__all__ = [
    "JoinLog",
    "JoinState",
    "JoinStatus",
    "Joining",
    "Outcome",
    "is_ip_literal",
    "resolve_host",
]
