"""A DHT swarm with most nodes behind NATs, on the simulator in virtual time.

Scenario (docs/protocol/dht.md §5.3, reachability.md §5):

1. ``--nodes`` N nodes on a :class:`~p2pnode.simnet.nat.NatNetwork`; a share
   ``--behind-nat`` of them (60%) behind NATs, a third each full-cone,
   port-restricted and symmetric; the others public. Public nodes join first,
   bootstrapping off a random public node already joined, 10 at a time.
2. Each NAT'd node checks its UDP reachability before it joins: it sends ``stun``
   from its DHT socket to 3 random public checkers (the DHT RPC), takes the external
   address a quorum names (a consistent mapping) as its UDP candidate, and each
   checker dials it back with a DHT ``ping`` from a fresh socket
   (:class:`~p2pnode.services.reachability.dhtside.DhtReach`); the reports go to the
   service's own :func:`~p2pnode.services.reachability.verdict.decide` and
   :func:`~p2pnode.services.reachability.verdict.dht_mode`, which sets the node's DHT
   mode. The envelope request that carries the check between nodes is left out (the
   UDP parts are what the DHT depends on). Then it joins like a public node.
3. Every 10th node provides a card; ``--lookups`` reads of random cards from random
   nodes follow, 10 in flight.

Counted: lookup success, DHT lookup requests (``find_node``, ``find_value``,
``store``) sent to the address of a node in client mode (an unreachable NAT'd node;
it must be 0: no lookup routes through such a node), routing-table entries at such
addresses (0), the same for full-cone nodes (servers: they are reachable), virtual
and CPU time.

Usage: python scripts/bench_nat_sim.py [--nodes 1000] [--behind-nat 0.6] [--lookups 1000]
"""

from __future__ import annotations

import argparse
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import trio
import trio.testing

from p2pnode.core.card import AgentCard, Capability
from p2pnode.core.identity import Identity
from p2pnode.dht.config import DhtConfig, DhtMode
from p2pnode.dht.node import DhtNode
from p2pnode.dht.rpcwire import Request, RpcError, decode_datagram_untrusted
from p2pnode.services.reachability.dhtside import DhtReach
from p2pnode.services.reachability.verdict import Report, Verdict, decide, dht_mode
from p2pnode.services.reachability.wire import Candidate, Outcome, Transport
from p2pnode.simnet import LinkConditions
from p2pnode.simnet.nat import NatKind, NatNetwork
from p2pnode.transport.net import Address

EPOCH_MS = 1_800_000_000_000
#: Maintenance each minute; refresh and republish after the scenario's lookups.
CONFIG = DhtConfig(maintenance_interval=60.0, refresh_interval=600.0, republish_interval=1200.0)
#: Joins, checks, publications and lookups in flight at once.
PARALLEL = 10
#: Checkers each NAT'd node asks (reachability.md §4.1's default).
CHECKERS = 3
#: A dial-back gives up after this long (reachability.md §3).
DIAL_TIMEOUT = 3.0
#: NAT kinds nobody can send to unasked: nodes behind them must stay out of every path.
UNREACHABLE_KINDS = frozenset({NatKind.PORT_RESTRICTED, NatKind.SYMMETRIC})
#: Requests that make a lookup's path (a node asked these routes the lookup or stores).
LOOKUP_METHODS = frozenset({"find_node", "find_value", "store"})


def virtual_ms() -> int:
    return EPOCH_MS + int(trio.current_time() * 1000)


@dataclass(slots=True)
class Member:
    """One node of the swarm, its NAT kind (None: public) and its DHT side."""

    node: DhtNode
    kind: NatKind | None
    reach: DhtReach
    card: AgentCard | None = None


@dataclass(slots=True)
class NatFigures:
    """What a run measured."""

    nodes: int
    kinds: dict[str, int]
    verdicts: dict[str, int]
    clients: int
    lookups: int
    succeeded: int
    #: Lookup requests addressed to nodes behind port-restricted or symmetric NATs
    #: (which must be in client mode), and to nodes behind full-cone NATs.
    requests_to_clients: int
    requests_to_full_cone: int
    #: Routing-table entries (over all tables) at those two sets of addresses.
    clients_in_tables: int
    full_cone_in_tables: int
    sim_seconds: float
    cpu_seconds: float
    wall_seconds: float
    by_kind_mode: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def success(self) -> float:
        return self.succeeded / self.lookups if self.lookups else 1.0


class Tap:
    """Counts lookup requests sent to NAT'd public addresses (NatNetwork.inbound_tap)."""

    def __init__(self) -> None:
        self.to_host: Counter[str] = Counter()

    def __call__(self, source: Address, destination: Address, data: bytes) -> None:
        try:
            decoded = decode_datagram_untrusted(data)
        except RpcError:
            return
        if isinstance(decoded, Request) and decoded.method in LOOKUP_METHODS:
            self.to_host[destination[0]] += 1


def card_of(identity: Identity, i: int) -> AgentCard:
    issued = virtual_ms()
    card = AgentCard(
        id=f"agent-{i}",
        name="nat sim agent",
        version="1.0.0",
        public_key=identity.public_key,
        capabilities=(Capability(id=f"cap-{i % 8}", name="cap"),),
        revision=1,
        addresses=("10.0.0.1:7000",),
        issued_at=issued,
        expires_at=issued + 3 * 3600 * 1000,
    )
    return card.signed(identity)


async def start_members(
    sim: NatNetwork, n: int, behind_nat: float, rng: random.Random, stack: AsyncExitStack
) -> list[Member]:
    """``n`` running nodes, the first ``n - round(n * behind_nat)`` public."""
    kinds = list(NatKind)
    natted = round(n * behind_nat)
    members: list[Member] = []
    for i in range(n):
        kind = None if i < n - natted else kinds[i % len(kinds)]
        host = sim.add_host() if kind is None else sim.add_nat_host(kind)
        node = DhtNode(
            host,
            identity=Identity(rng.randbytes(32)),
            address=(host.host, 4000),
            config=CONFIG,
            rng=random.Random(rng.random()),
            wall_clock_ms=virtual_ms,
        )
        await stack.enter_async_context(node)
        reach = DhtReach(node, host, rng.randbytes(20), random.Random(rng.random()))
        members.append(Member(node, kind, reach))
    return members


async def udp_verdict(member: Member, checkers: Sequence[Member]) -> Verdict:
    """The member's UDP reachability as its checkers find it (see the module docstring)."""
    node = member.node
    mapped: list[Address | None] = [None] * len(checkers)

    async def stun(i: int, checker: Member) -> None:
        mapped[i] = await member.reach.stun(checker.node.address)

    async with trio.open_nursery() as nursery:
        for i, checker in enumerate(checkers):
            nursery.start_soon(stun, i, checker)
    first = decide([Report(f"c{i}", mapped=m) for i, m in enumerate(mapped)], [])
    external = first.external_udp or node.address
    candidate = Candidate(Transport.UDP, external[0], external[1])
    reports: list[Report] = []

    async def dial(i: int, checker: Member) -> None:
        seen = mapped[i]
        if seen is None:
            return  # no answer: this checker counts for nothing
        if seen[0] != candidate.host:
            outcome = Outcome.REFUSED  # the checker never dials another IP
        else:
            outcome = Outcome.UNREACHABLE
            with trio.move_on_after(DIAL_TIMEOUT):
                if await checker.reach.ping_from_fresh_socket(candidate.address, node.node_id):
                    outcome = Outcome.REACHED
        reports.append(Report(f"c{i}", {candidate: outcome}, seen, seen))

    async with trio.open_nursery() as nursery:
        for i, checker in enumerate(checkers):
            nursery.start_soon(dial, i, checker)
    return decide(reports, [candidate])


async def in_batches(count: int, work: Callable[[int], Awaitable[None]]) -> None:
    """Run ``work(i)`` for i in range(count), PARALLEL at a time."""
    limiter = trio.CapacityLimiter(PARALLEL)

    async def one(i: int) -> None:
        async with limiter:
            await work(i)

    async with trio.open_nursery() as nursery:
        for i in range(count):
            nursery.start_soon(one, i)


async def join(
    members: list[Member], rng: random.Random, verdicts: Counter[str], client_mode: bool
) -> None:
    """Public nodes join off public nodes already in; then each NAT'd node checks its
    reachability (setting its DHT mode, unless ``client_mode`` is off) and joins."""
    public = [m for m in members if m.kind is None]
    natted = [m for m in members if m.kind is not None]
    joined = [public[0]]

    async def join_public(i: int) -> None:
        member = public[i + 1]
        await member.node.bootstrap([rng.choice(joined).node.address])
        joined.append(member)

    await in_batches(len(public) - 1, join_public)

    async def join_natted(i: int) -> None:
        member = natted[i]
        verdict = await udp_verdict(member, rng.sample(public, CHECKERS))
        verdicts[verdict.reachability.value] += 1
        mode = dht_mode(verdict)
        if mode is not None and client_mode:
            member.node.set_mode(mode)
        await member.node.bootstrap([rng.choice(public).node.address])

    await in_batches(len(natted), join_natted)


async def read_cards(members: list[Member], rng: random.Random, count: int) -> int:
    """Publish every 10th member's card, then ``count`` reads of random ones; found."""
    owners = members[::10]

    async def publish(i: int) -> None:
        member = owners[i]
        assert member.node.identity is not None
        member.card = card_of(member.node.identity, i)
        await member.node.provide(member.card)

    await in_batches(len(owners), publish)
    found = 0

    async def read(i: int) -> None:
        nonlocal found
        owner, asker = rng.choice(owners), rng.choice(members)
        assert owner.card is not None
        card = await asker.node.find_card(owner.card.peer_id, owner.card.id)
        found += card is not None and card.revision == owner.card.revision

    await in_batches(count, read)
    return found


def table_entries(members: list[Member], hosts: set[str]) -> int:
    """Routing-table entries, over every node's table, at an address on ``hosts``."""
    return sum(1 for m in members for c in m.node.table.contacts() if c.host in hosts)


async def scenario(
    n: int, behind_nat: float, lookups: int, seed: int, client_mode: bool = True
) -> NatFigures:
    """Run the scenario (under trio's MockClock) and measure it."""
    rng = random.Random(seed)
    sim = NatNetwork(rng, default=LinkConditions(latency=0.02, jitter=0.01), tick=0.001)
    tap = Tap()
    sim.inbound_tap = tap
    t0, cpu0, v0 = time.perf_counter(), time.process_time(), trio.current_time()
    verdicts: Counter[str] = Counter()
    async with trio.open_nursery() as nursery:
        await nursery.start(sim.drive)
        async with AsyncExitStack() as stack:
            members = await start_members(sim, n, behind_nat, rng, stack)
            await join(members, rng, verdicts, client_mode)
            found = await read_cards(members, rng, lookups)
            figures = measure(sim, members, tap, verdicts, lookups, found)
        nursery.cancel_scope.cancel()
    figures.sim_seconds = trio.current_time() - v0
    figures.cpu_seconds = time.process_time() - cpu0
    figures.wall_seconds = time.perf_counter() - t0
    return figures


def measure(
    sim: NatNetwork,
    members: list[Member],
    tap: Tap,
    verdicts: Counter[str],
    lookups: int,
    found: int,
) -> NatFigures:
    public_ip = {m.node.address[0]: sim.nat_of(m.node.address[0]) for m in members}
    clients = {
        nat.public_ip for m in members if m.kind in UNREACHABLE_KINDS
        if (nat := public_ip[m.node.address[0]]) is not None
    }
    full_cone = {
        nat.public_ip for m in members if m.kind is NatKind.FULL_CONE
        if (nat := public_ip[m.node.address[0]]) is not None
    } - clients
    by_kind_mode: dict[str, dict[str, int]] = {}
    for m in members:
        kind = m.kind.value if m.kind is not None else "public"
        modes = by_kind_mode.setdefault(kind, {})
        modes[m.node.mode.value] = modes.get(m.node.mode.value, 0) + 1
    return NatFigures(
        nodes=len(members),
        kinds=dict(Counter(m.kind.value if m.kind else "public" for m in members)),
        verdicts=dict(verdicts),
        clients=sum(m.node.mode is DhtMode.CLIENT for m in members),
        lookups=lookups,
        succeeded=found,
        requests_to_clients=sum(tap.to_host[h] for h in clients),
        requests_to_full_cone=sum(tap.to_host[h] for h in full_cone),
        clients_in_tables=table_entries(members, clients),
        full_cone_in_tables=table_entries(members, full_cone),
        sim_seconds=0.0,
        cpu_seconds=0.0,
        wall_seconds=0.0,
        by_kind_mode=by_kind_mode,
    )


def run(
    n: int = 1000,
    behind_nat: float = 0.6,
    lookups: int = 1000,
    seed: int = 1,
    *,
    client_mode: bool = True,
) -> NatFigures:
    """The scenario in a trio run of its own on a MockClock (``client_mode`` off: the
    verdicts leave every node a server, the comparison)."""
    clock = trio.testing.MockClock(autojump_threshold=0)
    return trio.run(scenario, n, behind_nat, lookups, seed, client_mode, clock=clock)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--behind-nat", type=float, default=0.6)
    ap.add_argument("--lookups", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--no-client-mode", action="store_true", help="every node stays a server (comparison)"
    )
    args = ap.parse_args()
    f = run(
        args.nodes, args.behind_nat, args.lookups, args.seed, client_mode=not args.no_client_mode
    )
    print(f"nodes {f.nodes}: {f.kinds}")
    print(f"UDP verdicts of NAT'd nodes: {f.verdicts}; modes by kind: {f.by_kind_mode}")
    print(f"lookups: {f.succeeded}/{f.lookups} succeeded ({f.success:.4f})")
    print(f"lookup requests to port-restricted/symmetric NAT'd nodes: {f.requests_to_clients}")
    print(f"lookup requests to full-cone servers: {f.requests_to_full_cone}")
    print(f"table entries at port-restricted/symmetric NAT'd nodes: {f.clients_in_tables}")
    print(f"table entries at full-cone servers: {f.full_cone_in_tables}")
    print(
        f"virtual time {f.sim_seconds:.1f} s, CPU {f.cpu_seconds:.1f} s, "
        f"wall {f.wall_seconds:.1f} s"
    )
    target = f.success >= 0.999 and f.requests_to_clients == 0 and f.clients_in_tables == 0
    verdict = "met" if target else "NOT MET"
    print(f"target success >= 0.999, none through unreachable NAT'd nodes: {verdict}")


if __name__ == "__main__":
    main()
