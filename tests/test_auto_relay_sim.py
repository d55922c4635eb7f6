"""Automatic relays in the simulator, on trio's virtual clock (reachability.md §7): a
node behind a port-restricted or symmetric NAT, with no configured relay, learns the
relays its checkers run from their dial-back answers, keeps reservations on two of
them once its verdict is ``unreachable``, lists them in its cards, and a node that
never met it reaches its agent by capability through one; when a chosen relay stops,
the node moves to the third and is reached again."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import trio

from p2pnode.cli.node import _relay_status
from p2pnode.core.card import Capability
from p2pnode.core.envelope import Envelope
from p2pnode.core.identity import Identity
from p2pnode.runtime import Node, NodeConfig
from p2pnode.services.reachability import Reachability
from p2pnode.simnet.nat import NatKind
from p2pnode.transport.relay import format_relay_address
from p2pnode.transport.relayserve import RelayServer
from tests.sim import Swarm, wait_until
from tests.sim.nat import LastBehindNat

REVERSE = Capability(id="text.reverse", name="reverse")
RELAY_PORT = 4100


async def reverse(envelope: Envelope) -> Any:
    return {"reversed": str(envelope.payload)[::-1]}


async def echo(envelope: Envelope) -> Any:
    return None


@dataclass
class Relaying:
    """A public node that also runs a relay and offers it to the nodes it checks."""

    node: Node
    server: RelayServer
    address: str
    scope: trio.CancelScope

    def holds(self, peer: Node) -> bool:
        return self.server.core.reservation(peer.peer_id) is not None


async def _serve(
    server: RelayServer,
    address: tuple[str, int],
    scope: trio.CancelScope,
    *,
    task_status: trio.TaskStatus[tuple[str, int]],
) -> None:
    with scope:
        await server.serve(address, task_status=task_status)


@asynccontextmanager
async def relaying_swarm(
    kind: NatKind | None,
    seed: int,
    config: NodeConfig | None = None,
    sim: LastBehindNat | None = None,
) -> AsyncIterator[tuple[Swarm, list[Relaying], Node]]:
    """Three public relaying nodes and, last, one behind a NAT of ``kind`` (None: a
    public one) hosting an agent with ``REVERSE``, with ``config`` (default: no relay
    configured)."""
    sim = sim if sim is not None else LastBehindNat(random.Random(seed))
    async with trio.open_nursery() as nursery:
        sw = Swarm(sim, nursery, config=NodeConfig(), dht=True)
        relays: list[Relaying] = []
        for i in range(3):
            member = await sw.add()
            node = member.node
            assert node is not None
            await node.add_agent(f"r{i}", echo, tier=3)
            server = RelayServer(member.network, node.peer_id)
            scope = trio.CancelScope()
            await nursery.start(_serve, server, (member.host, RELAY_PORT), scope)
            address = format_relay_address((member.host, RELAY_PORT), node.peer_id)
            node.reachability.offer_relay(address)
            relays.append(Relaying(node, server, address, scope))
        sim.next_kind = kind
        natted = (await sw.add(config=config)).node
        assert natted is not None
        await natted.add_agent("worker", reverse, tier=3, capabilities=(REVERSE,))
        for node in sw.nodes:
            await node.join()
        yield sw, relays, natted
        await sw.aclose()
        nursery.cancel_scope.cancel()


def relayed_endpoints(node: Node) -> list[str]:
    card = node.registry.find("worker")
    assert card is not None
    return [e.address for e in card.endpoints if e.address and e.address.startswith("relay:")]


async def new_caller(sw: Swarm, name: str) -> Node:
    """A public node that never met anyone but the first member (its bootstrap)."""
    caller = (await sw.add()).node
    assert caller is not None
    await caller.add_agent(name, echo, tier=3)
    await caller.join()
    return caller


async def ask_by_capability(caller: Node, sender: str) -> Any:
    reply = await caller.request(sender, REVERSE.id, "abc", capability=True, timeout=30)
    return reply.payload


@pytest.mark.parametrize("kind", [NatKind.PORT_RESTRICTED, NatKind.SYMMETRIC])
async def test_a_natted_node_reserves_on_offered_relays_and_moves_when_one_stops(
    autojump_clock: Any, kind: NatKind
) -> None:
    async with relaying_swarm(kind, seed=21) as (sw, relays, natted):
        auto = natted.auto_relay
        await wait_until(
            lambda: natted.reachability.own_verdict is not None
            and natted.reachability.own_verdict.reachability is Reachability.UNREACHABLE,
            timeout=120,
        )
        # Every checker offered its relay; two are kept, on two hosts.
        await wait_until(lambda: len(auto.listed) == 2, timeout=60)
        assert len(auto.book.offers()) == 3
        held = [r for r in relays if r.holds(natted)]
        assert sorted(r.address for r in held) == sorted(auto.listed)
        await wait_until(lambda: sorted(relayed_endpoints(natted)) == sorted(auto.listed))
        card = natted.registry.find("worker")
        assert card is not None and card.addresses == ()
        status = natted.status()["reachability"]["autoRelay"]
        assert sorted(status["listed"]) == sorted(auto.listed)
        shown = _relay_status(natted, None)["relays"]
        assert sorted(r["relay"] for r in shown) == sorted(auto.listed)
        assert {(r["chosen"], r["reserved"]) for r in shown} == {("auto", True)}

        # A node that never met it finds its agent by capability and reaches it through
        # one of the relays: the channel is relayed and a circuit opened.
        caller = await new_caller(sw, "asker")
        assert await ask_by_capability(caller, "asker") == {"reversed": "cba"}
        link = caller.links.get(natted.peer_id)
        assert link is not None and link.relayed
        assert sum(r.server.statistics().circuits_opened for r in held) >= 1

        # One chosen relay stops: its reservation is gone; the node moves to the third.
        gone, spare = held[0], next(r for r in relays if r not in held)
        gone.scope.cancel()
        await wait_until(lambda: spare.holds(natted), timeout=120)
        await wait_until(
            lambda: sorted(auto.listed) == sorted([held[1].address, spare.address]), timeout=30
        )
        await wait_until(lambda: gone.address not in relayed_endpoints(natted))
        assert spare.address in relayed_endpoints(natted)
        assert auto.book.failures >= 1

        # Reached again: a fresh caller, through the relays the card lists now.
        again = await new_caller(sw, "asker2")
        assert await ask_by_capability(again, "asker2") == {"reversed": "cba"}
        link = again.links.get(natted.peer_id)
        assert link is not None and link.relayed


async def test_a_reachable_node_keeps_no_automatic_relay(autojump_clock: Any) -> None:
    """The last node is public: its verdict is ``reachable``, it learns the offers but
    reserves on none and its card lists no relayed endpoint."""
    async with relaying_swarm(None, seed=22) as (_, relays, natted_public):
        await wait_until(
            lambda: natted_public.reachability.own_verdict is not None, timeout=120
        )
        verdict = natted_public.reachability.own_verdict
        assert verdict is not None and verdict.reachability is Reachability.REACHABLE
        await wait_until(lambda: len(natted_public.auto_relay.book.offers()) == 3)
        await trio.sleep(30)  # a span of virtual time in which a wrong choice would show
        assert natted_public.auto_relay.listed == ()
        assert not any(r.holds(natted_public) for r in relays)
        assert relayed_endpoints(natted_public) == []


async def test_a_configured_relay_is_kept_and_no_relay_is_picked(autojump_clock: Any) -> None:
    """``--use-relay``: the node keeps its configured reservation through its
    ``unreachable`` verdict, takes the offers, and picks no relay of its own."""
    sim_relay = Identity(b"\x72" * 32)
    async with trio.open_nursery() as outer:
        # The configured relay runs on a host of its own, added before the swarm's.
        sim = LastBehindNat(random.Random(23))
        host = sim.add_host()
        server = RelayServer(host, sim_relay.peer_id)
        await outer.start(server.serve, (host.host, RELAY_PORT))
        configured = format_relay_address((host.host, RELAY_PORT), sim_relay.peer_id)
        config = NodeConfig(relays=(configured,))
        async with relaying_swarm(
            NatKind.PORT_RESTRICTED, seed=23, config=config, sim=sim
        ) as (_, relays, natted):
            await wait_until(
                lambda: natted.reachability.own_verdict is not None
                and natted.reachability.own_verdict.reachability is Reachability.UNREACHABLE,
                timeout=120,
            )
            await wait_until(lambda: len(natted.auto_relay.book.offers()) == 3)
            await trio.sleep(60)  # a span of virtual time in which a wrong choice would show
            assert natted.auto_relay.listed == ()
            assert not any(r.holds(natted) for r in relays)
            assert server.core.reservation(natted.peer_id) is not None
            assert relayed_endpoints(natted) == [configured]
            shown = _relay_status(natted, None)["relays"]
            assert [(r["relay"], r["chosen"]) for r in shown] == [(configured, "configured")]
        outer.cancel_scope.cancel()
