"""The reachability check through real NATs (tests/natlab.py): three public nodes check
a node behind each kind of NAT, and a public node.

Each node is an in-process node on the real network (TrioNetwork), its trio loop on a
thread inside its namespace. Behind every NAT the node learns the router's address as
its external IP, and its private addresses are denied; its UDP mapping is consistent
behind both cone kinds (the same external port towards every checker), and that external
UDP address is checked too: reached behind the full cone (anyone may send to the
mapping), denied behind the port-restricted one. Behind the symmetric NAT the mapping is
inconsistent and there is no external address to check. The public node is reachable at
both of its addresses."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import trio

from p2pnode.core.envelope import Envelope
from p2pnode.core.identity import Identity
from p2pnode.dht.config import DhtConfig
from p2pnode.runtime import NodeConfig, open_node
from p2pnode.services.reachability import NatMapping, Reachability, Transport, Verdict
from p2pnode.transport.net import Address, TrioNetwork
from tests.natlab import LabError, NatKind, NatLab, nat_lab, require_lab, start_in
from tests.sim import wait_until

pytestmark = pytest.mark.slow

PORT = 7400
CHECKERS = 3
STEP = 20.0  # seconds any one wait may take before the test fails naming it


async def _quiet(envelope: Envelope) -> Any:
    return None


#: Every host of the lab is a veth away (well under a millisecond): a DHT request
#: unanswered after half a second will not be answered. The askers' NATs keep them out
#: of reach of all but the checkers they talked to, so the others' lookups meet them as
#: dead contacts; short timeouts keep the joins meeting them short.
LAB_DHT = DhtConfig(rto_initial=0.2, rto_ceiling=0.5, rpc_hard_timeout=0.5)


def _config(ip: str, bootstrap: tuple[Address, ...] = ()) -> NodeConfig:
    return NodeConfig(listen=(ip, PORT), dht_listen=(ip, 0), bootstrap=bootstrap, dht=LAB_DHT)


async def _serve(
    i: int, ip: str, first: Address | None, ready: queue.Queue[str], stop: threading.Event
) -> None:
    """Public checker ``i``: up, joined through ``first``, until ``stop`` is set."""
    bootstrap = (first,) if first is not None else ()
    async with open_node(Identity.generate(), TrioNetwork(), _config(ip, bootstrap)) as node:
        await node.add_agent(f"pub{i}", _quiet, tier=3)
        await node.join()
        ready.put(ip)
        # Until the fixture's teardown (bounded, should it never come).
        await _until(stop, 10 * STEP)


async def _until(event: threading.Event, limit: float) -> None:
    """Wait for ``event``, at most ``limit`` seconds, by polling: never in a trio worker
    thread, which trio caches process-wide and which would keep this thread's network
    namespace (a later test's process started from it would be born in the lab)."""
    with trio.move_on_after(limit):
        while not event.is_set():  # noqa: ASYNC110 (a thread sets it: no trio.Event)
            await trio.sleep(0.05)


@pytest.fixture(scope="module")
def lab() -> Iterator[NatLab]:
    require_lab()
    with nat_lab(publics=CHECKERS + 1) as built:
        stop = threading.Event()
        ready: queue.Queue[str] = queue.Queue()
        threads = []
        try:
            for i in range(CHECKERS):
                ip = built.public_ip(i)
                first = (built.public_ip(0), PORT) if i else None
                serve = partial(trio.run, _serve, i, ip, first, ready, stop)
                threads.append(start_in(built.public(i), serve))
                ready.get(timeout=STEP)  # each joins the one before it is up
            yield built
        finally:
            stop.set()
            for thread in threads:
                thread.join(STEP)


async def _check(
    bootstrap: tuple[Address, ...],
    ip: str,
    name: str,
    results: queue.Queue[tuple[str, Verdict | BaseException]],
    done: threading.Event,
) -> None:
    """A node at ``ip``, joined to the public checkers: its check's verdict (or what
    failed) goes to ``results``; the node stays up until ``done``, so no node asking
    later meets it dead in the checkers' DHT tables (and waits out its timeouts)."""
    try:
        async with open_node(Identity.generate(), TrioNetwork(), _config(ip, bootstrap)) as node:
            await node.add_agent(f"asker-{name}", _quiet, tier=3)
            await node.join()
            await wait_until(
                lambda: all(node.registry.find(f"pub{i}") for i in range(CHECKERS)), STEP
            )
            results.put((name, await node.check_reachability()))
            await _until(done, 3 * STEP)  # set once all answered
    except Exception as exc:
        results.put((name, exc))


@pytest.fixture(scope="module")
def verdicts(lab: NatLab) -> dict[str, Verdict]:
    """The verdict of a node behind each NAT (by kind value) and of a public one
    ("public"), all checked at once."""
    bootstrap = tuple((lab.public_ip(i), PORT) for i in range(CHECKERS))
    askers = {kind.value: (site.inner, site.inner_ip) for kind, site in lab.sites.items()}
    askers["public"] = (lab.public(CHECKERS), lab.public_ip(CHECKERS))
    results: queue.Queue[tuple[str, Verdict | BaseException]] = queue.Queue()
    done = threading.Event()
    threads = [
        start_in(ns, partial(trio.run, _check, bootstrap, ip, name, results, done))
        for name, (ns, ip) in askers.items()
    ]
    try:
        got = dict(results.get(timeout=3 * STEP) for _ in askers)
    finally:
        done.set()
        for thread in threads:
            thread.join(STEP)
    failed = {name: r for name, r in got.items() if isinstance(r, BaseException)}
    if failed:
        raise LabError(f"checks failed: {failed}")
    return {name: r for name, r in got.items() if isinstance(r, Verdict)}


@pytest.mark.parametrize("kind", list(NatKind), ids=lambda k: k.value)
def test_a_node_behind_a_nat_is_reached_only_through_a_full_cone_mapping(
    lab: NatLab, verdicts: dict[str, Verdict], kind: NatKind
) -> None:
    site = lab.sites[kind]
    verdict = verdicts[kind.value]
    print(kind.value, verdict.to_dict())
    assert len(verdict.checkers) == CHECKERS
    assert verdict.external_ip == site.wan_ip  # the router's address, not the private one
    denied = {(c.transport, c.host) for c in verdict.denied}
    assert {(Transport.TCP, site.inner_ip), (Transport.UDP, site.inner_ip)} <= denied
    if kind.endpoint_independent_mapping:
        assert verdict.mapping is NatMapping.CONSISTENT
        assert verdict.external_udp == (site.wan_ip, PORT)  # masquerade kept the port
    else:
        assert verdict.mapping is NatMapping.INCONSISTENT
        assert verdict.external_udp is None
    external = (Transport.UDP, site.wan_ip, PORT)
    if kind.endpoint_independent_filtering:  # the full cone lets the checkers' dial-back in
        assert verdict.reachability is Reachability.REACHABLE
        assert {(c.transport, c.host, c.port) for c in verdict.confirmed} == {external}
        assert denied == {(Transport.TCP, site.inner_ip), (Transport.UDP, site.inner_ip)}
    else:
        assert verdict.reachability is Reachability.UNREACHABLE
        assert not verdict.confirmed
        outside = {(c.transport, c.host, c.port) for c in verdict.denied if c.host != site.inner_ip}
        assert outside == ({external} if kind.endpoint_independent_mapping else set())


def test_a_public_node_is_reachable_at_both_addresses(
    lab: NatLab, verdicts: dict[str, Verdict]
) -> None:
    ip = lab.public_ip(CHECKERS)
    verdict = verdicts["public"]
    print("public", verdict.to_dict())
    assert verdict.reachability is Reachability.REACHABLE
    assert {(c.transport, c.host, c.port) for c in verdict.confirmed} == {
        (Transport.TCP, ip, PORT),
        (Transport.UDP, ip, PORT),
    }
    assert verdict.external_ip == ip
    assert verdict.mapping is NatMapping.CONSISTENT
    assert verdict.external_udp == (ip, PORT)
