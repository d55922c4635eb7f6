"""What a node concludes from its checkers' answers (docs/protocol/reachability.md §4).

Sans-IO: :func:`decide` takes one :class:`Report` per checker that answered and
returns a :class:`Verdict`; :func:`pick_checkers` chooses whom to ask. No clock,
no socket, no randomness of its own (the caller passes its RNG).

The rule is a quorum of agreeing checkers: a claim (an address reached, an external
IP, a UDP mapping) holds when at least :data:`QUORUM` checkers make it and more make
it than contradict it. With three checkers one liar never decides anything alone,
and any two that agree do.
"""

from __future__ import annotations

import enum
import random
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from p2pnode.dht.config import DhtMode
from p2pnode.services.reachability.wire import Address, Candidate, Outcome

#: Agreeing checkers needed for any conclusion.
QUORUM = 2
#: Checkers a node asks by default (at least QUORUM + 1, so one liar is outvoted).
DEFAULT_CHECKERS = 3

K = TypeVar("K", bound=Hashable)


class Reachability(enum.Enum):
    REACHABLE = "reachable"  # at least one candidate address confirmed
    UNREACHABLE = "unreachable"  # every candidate address denied
    UNKNOWN = "unknown"  # not enough agreeing answers


class NatMapping(enum.Enum):
    """How the node's NAT maps its UDP socket, seen from several checkers."""

    CONSISTENT = "consistent"  # the same external address towards each checker
    INCONSISTENT = "inconsistent"  # a different one per destination (symmetric NAT)
    UNKNOWN = "unknown"  # fewer than QUORUM observations


@dataclass(frozen=True, slots=True)
class Report:
    """One checker's word: per candidate what it found, where it saw the request come
    from (``observed``, the TCP channel's source) and where it saw the node's UDP
    socket (``mapped``, from a ``stun`` to it; None when it did not answer)."""

    checker: str
    outcomes: dict[Candidate, Outcome] = field(default_factory=dict)
    observed: Address | None = None
    mapped: Address | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    """The conclusion of one check."""

    reachability: Reachability
    #: Candidate addresses a quorum reached (the ones to advertise).
    confirmed: tuple[Candidate, ...]
    #: Candidate addresses a quorum did not reach.
    denied: tuple[Candidate, ...]
    #: The IP a quorum saw the node's connections come from.
    external_ip: str | None
    mapping: NatMapping
    #: The external UDP address a quorum saw (with a consistent mapping only).
    external_udp: Address | None
    #: Checkers whose answers went into the verdict.
    checkers: tuple[str, ...]

    def to_dict(self) -> dict[str, object]:
        """Plain data (for ``status``)."""
        udp = f"{self.external_udp[0]}:{self.external_udp[1]}" if self.external_udp else None
        return {
            "reachability": self.reachability.value,
            "confirmed": [str(c) for c in self.confirmed],
            "denied": [str(c) for c in self.denied],
            "externalIp": self.external_ip,
            "mapping": self.mapping.value,
            "externalUdp": udp,
            "checkers": list(self.checkers),
        }


def quorum_value(values: Iterable[K]) -> K | None:
    """The value at least QUORUM of ``values`` are, and more than any other; else None."""
    counts = Counter(values).most_common(2)
    if not counts or counts[0][1] < QUORUM:
        return None
    if len(counts) > 1 and counts[1][1] >= counts[0][1]:
        return None
    return counts[0][0]


def _settled(reports: Sequence[Report], candidate: Candidate) -> bool | None:
    """True: a quorum reached ``candidate``; False: a quorum did not; None: undecided.
    A refusal counts as "not reached" (the checker saw the request come from elsewhere)."""
    said = [r.outcomes[candidate] is Outcome.REACHED for r in reports if candidate in r.outcomes]
    return quorum_value(said)


def _mapping(reports: Sequence[Report]) -> tuple[NatMapping, Address | None]:
    mapped = [r.mapped for r in reports if r.mapped is not None]
    if len(mapped) < QUORUM:
        return NatMapping.UNKNOWN, None
    agreed = quorum_value(mapped)
    if agreed is None or Counter(mapped)[agreed] * 2 <= len(mapped):
        return NatMapping.INCONSISTENT, None
    return NatMapping.CONSISTENT, agreed


def decide(reports: Sequence[Report], candidates: Sequence[Candidate]) -> Verdict:
    """The verdict on ``candidates`` from the checkers' ``reports`` (one per checker;
    a checker reporting twice counts once, its first report)."""
    unique: dict[str, Report] = {}
    for report in reports:
        unique.setdefault(report.checker, report)
    counted = list(unique.values())
    settled = {c: _settled(counted, c) for c in candidates}
    confirmed = tuple(c for c, s in settled.items() if s is True)
    denied = tuple(c for c, s in settled.items() if s is False)
    if confirmed:
        reachability = Reachability.REACHABLE
    elif candidates and len(denied) == len(settled):
        reachability = Reachability.UNREACHABLE
    else:
        reachability = Reachability.UNKNOWN
    external_ip = quorum_value(r.observed[0] for r in counted if r.observed is not None)
    mapping, external_udp = _mapping(counted)
    return Verdict(
        reachability,
        confirmed,
        denied,
        external_ip,
        mapping,
        external_udp,
        tuple(unique),
    )


def pick_checkers(
    looked_up: Sequence[K],
    met: Sequence[K],
    rng: random.Random,
    *,
    count: int = DEFAULT_CHECKERS,
    exclude: Iterable[K] = (),
) -> list[K]:
    """Up to ``count`` distinct peers, alternating between ``looked_up`` (the DHT's
    answer for a random key: peers the network chose) and ``met`` (bootstrap peers and
    others with a channel open), each shuffled; the first comes from ``looked_up`` when
    it has any, so the checkers are never all of the node's own choosing."""
    skip = set(exclude)
    pools = [list(dict.fromkeys(p for p in looked_up if p not in skip))]
    pools.append(list(dict.fromkeys(p for p in met if p not in skip)))
    for pool in pools:
        rng.shuffle(pool)
    chosen: list[K] = []
    while len(chosen) < count and any(pools):
        for pool in pools:
            while pool:
                peer = pool.pop()
                if peer not in chosen:
                    chosen.append(peer)
                    break
            if len(chosen) == count:
                break
    return chosen


#: The DHT mode each reachability calls for (§5); UNKNOWN leaves the mode as it is.
_DHT_MODES: dict[Reachability, DhtMode | None] = {
    Reachability.REACHABLE: DhtMode.SERVER,
    Reachability.UNREACHABLE: DhtMode.CLIENT,
    Reachability.UNKNOWN: None,
}


def dht_mode(verdict: Verdict) -> DhtMode | None:
    """The DHT mode ``verdict`` calls for (reachability.md §5): a node nobody can
    reach answers no DHT request, so it stays out of routing tables; None: keep the
    mode (not enough agreeing answers)."""
    return _DHT_MODES[verdict.reachability]


__all__ = [
    "DEFAULT_CHECKERS",
    "QUORUM",
    "NatMapping",
    "Reachability",
    "Report",
    "Verdict",
    "decide",
    "dht_mode",
    "pick_checkers",
    "quorum_value",
]
