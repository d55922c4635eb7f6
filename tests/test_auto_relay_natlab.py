"""Automatic relays through a real NAT (tests/natlab.py, root and nft): three public
nodes that each run a relay (as ``p2pnode run --relay`` does) check a node behind a
port-restricted NAT that was given no relay; it picks two of them by itself, lists
them in its card, and a fourth public node that never met it reaches its agent by
capability through one (a circuit opens on a relay). In-process nodes on the real
network (TrioNetwork), each on a thread inside its namespace, as in
tests/test_reachability_natlab.py."""

from __future__ import annotations

import queue
import threading
from functools import partial
from typing import Any

import pytest
import trio

from p2pnode.core.card import Capability
from p2pnode.core.envelope import Envelope
from p2pnode.core.identity import Identity
from p2pnode.runtime import NodeConfig, open_node
from p2pnode.transport.net import Address, TrioNetwork
from p2pnode.transport.relay import format_relay_address
from p2pnode.transport.relayserve import RelayServer
from tests.natlab import NatKind, nat_lab, require_lab, start_in
from tests.sim import wait_until
from tests.test_reachability_natlab import LAB_DHT, PORT

pytestmark = pytest.mark.slow

RELAYS = 3
RELAY_PORT = 4100
STEP = 30.0  # seconds any one wait may take before the test fails naming it
REVERSE = Capability(id="text.reverse", name="reverse")

Result = tuple[str, Any]


async def _quiet(envelope: Envelope) -> Any:
    return None


async def _reverse(envelope: Envelope) -> Any:
    return {"reversed": str(envelope.payload)[::-1]}


def _config(ip: str, bootstrap: tuple[Address, ...] = ()) -> NodeConfig:
    return NodeConfig(listen=(ip, PORT), dht_listen=(ip, 0), bootstrap=bootstrap, dht=LAB_DHT)


async def _until(event: threading.Event, limit: float) -> None:
    """Wait for ``event`` (set by another thread), at most ``limit`` seconds, polling."""
    with trio.move_on_after(limit):
        while not event.is_set():  # noqa: ASYNC110 (a thread sets it: no trio.Event)
            await trio.sleep(0.05)


async def _relaying(
    i: int, ip: str, first: Address | None, out: queue.Queue[Result], stop: threading.Event
) -> None:
    """Public node ``i``, relaying and offering its relay, until ``stop``; reports its
    relay's circuits opened when it ends."""
    bootstrap = (first,) if first is not None else ()
    async with open_node(Identity.generate(), TrioNetwork(), _config(ip, bootstrap)) as node:
        server = RelayServer(TrioNetwork(), node.peer_id)
        await node.nursery.start(server.serve, (ip, RELAY_PORT))
        relay = format_relay_address((ip, RELAY_PORT), node.peer_id)
        node.reachability.offer_relay(relay)
        await node.add_agent(f"pub{i}", _quiet, tier=3)
        await node.join()
        out.put(("up", relay))
        await _until(stop, 10 * STEP)
        out.put(("circuits", server.statistics().circuits_opened))


async def _natted(
    bootstrap: tuple[Address, ...], ip: str, out: queue.Queue[Result], stop: threading.Event
) -> None:
    """The node behind the NAT: reports the relays its card lists once it holds two."""
    try:
        async with open_node(Identity.generate(), TrioNetwork(), _config(ip, bootstrap)) as node:
            await node.add_agent("worker", _reverse, tier=3, capabilities=(REVERSE,))
            await node.join()
            await wait_until(lambda: len(node.auto_relay.listed) == 2, 2 * STEP, interval=0.2)
            card = node.registry.find("worker")
            assert card is not None
            out.put(("natted", (card.addresses, [e.address for e in card.endpoints])))
            await _until(stop, 4 * STEP)
    except Exception as exc:
        out.put(("natted", exc))


async def _caller(bootstrap: tuple[Address, ...], ip: str, out: queue.Queue[Result]) -> None:
    """A public node that never met the NAT'd one asks its agent by capability."""
    try:
        async with open_node(Identity.generate(), TrioNetwork(), _config(ip, bootstrap)) as node:
            await node.add_agent("asker", _quiet, tier=3)
            await node.join()
            reply = await node.request("asker", REVERSE.id, "abc", capability=True, timeout=STEP)
            out.put(("caller", reply.payload))
    except Exception as exc:
        out.put(("caller", exc))


def _get(out: queue.Queue[Result], what: str) -> Any:
    """The next result, which must be ``what``'s (a failure there is raised)."""
    name, value = out.get(timeout=3 * STEP)
    assert name == what, (name, value)
    if isinstance(value, BaseException):
        raise value
    return value


def test_a_node_behind_a_port_restricted_nat_picks_relays_and_is_reached() -> None:
    require_lab()
    with nat_lab(publics=RELAYS + 1, kinds=(NatKind.PORT_RESTRICTED,)) as lab:
        stop = threading.Event()
        out: queue.Queue[Result] = queue.Queue()
        threads = []
        try:
            offered = []
            for i in range(RELAYS):
                first = (lab.public_ip(0), PORT) if i else None
                run = partial(trio.run, _relaying, i, lab.public_ip(i), first, out, stop)
                threads.append(start_in(lab.public(i), run))
                offered.append(_get(out, "up"))  # each joins the one before it is up
            bootstrap = tuple((lab.public_ip(i), PORT) for i in range(RELAYS))
            site = lab.sites[NatKind.PORT_RESTRICTED]
            run = partial(trio.run, _natted, bootstrap, site.inner_ip, out, stop)
            threads.append(start_in(site.inner, run))
            addresses, endpoints = _get(out, "natted")
            assert addresses == ()  # its verdict: unreachable
            relayed = [e for e in endpoints if e.startswith("relay:")]
            assert len(set(relayed)) == 2 and set(relayed) <= set(offered)
            run = partial(trio.run, _caller, bootstrap, lab.public_ip(RELAYS), out)
            threads.append(start_in(lab.public(RELAYS), run))
            assert _get(out, "caller") == {"reversed": "cba"}
        finally:
            stop.set()
            for thread in threads:
                thread.join(STEP)
        circuits = [value for name, value in list(out.queue) if name == "circuits"]
        assert len(circuits) == RELAYS
        assert sum(circuits) >= 1  # the caller came through a relay
