"""The trio driver over the RPC core: timers, datagrams, waiters, containment (virtual time)."""

from __future__ import annotations

import logging
import random
from collections.abc import Container
from typing import Any

import pytest
import trio
import trio.testing

from p2pnode.core.errors import LocalError
from p2pnode.dht import rpcwire
from p2pnode.dht.calls import NO_REPLY, Calls
from p2pnode.dht.config import DhtConfig, DhtStatistics
from p2pnode.dht.peer import DhtPeer
from p2pnode.dht.records import RecordStore, SignedRecord, capability_key
from p2pnode.dht.routing import Contact, RoutingTable
from p2pnode.dht.rpc import Address, RpcCore
from p2pnode.simnet import LinkConditions, SimNetwork
from p2pnode.transport.net import DatagramEndpoint
from tests.sim import dht_swarm, make_card, virtual_ms, wait_until

OTHER_ID = b"\x0f" * 20


def _peer(sim: SimNetwork, **kw: Any) -> DhtPeer:
    host = sim.add_host()
    return DhtPeer(
        host, node_id=b"\x01" * 20, address=(host.host, 4000), rng=random.Random(1), **kw
    )


async def _endpoint(sim: SimNetwork) -> DatagramEndpoint:
    host = sim.add_host()
    return await host.bind_datagram((host.host, 5000))


async def test_a_call_nobody_answers_times_out_at_its_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sim = SimNetwork(random.Random(1))
    peer = _peer(sim, config=DhtConfig(rpc_hard_timeout=3.0, maintenance_interval=600.0))
    silent = await _endpoint(sim)
    async with peer:
        await trio.testing.wait_all_tasks_blocked()
        t0 = trio.current_time()
        # The receive loop sleeps until maintenance (300 s or more): the call pulls it in.
        assert await peer.ping(silent.local_address) is None
        assert trio.current_time() - t0 == pytest.approx(3.0, abs=0.01)
        assert (peer.stats.rpcs_sent, peer.stats.rpcs_timed_out) == (1, 1)
        assert peer.rpc.pending == 0
        # The loop goes on: a node that answers is still heard.
        host = sim.add_host()
        other = DhtPeer(host, node_id=OTHER_ID, address=(host.host, 4000), rng=random.Random(2))
        async with other:
            assert await peer.ping(other.address) == OTHER_ID


async def test_the_loop_does_not_wake_for_the_deadline_of_an_answered_call(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sim = SimNetwork(random.Random(8))
    peer = _peer(sim, config=DhtConfig(rpc_hard_timeout=3.0, maintenance_interval=600.0))
    host = sim.add_host()
    other = DhtPeer(host, node_id=OTHER_ID, address=(host.host, 4000), rng=random.Random(2))
    async with peer, other:
        await trio.testing.wait_all_tasks_blocked()
        assert await peer.ping(other.address) == OTHER_ID
        # No call is pending: the receive loop sleeps to its own timers (maintenance),
        # not to the answered ping's hard deadline 3 s on.
        assert peer.rpc.pending == 0
        assert peer.calls.wake is not None
        assert peer.calls.wake.deadline == peer.schedule.next_deadline()
        assert peer.schedule.next_deadline() - trio.current_time() > 200


async def test_handle_datagram_answers_one_request(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sim = SimNetwork(random.Random(2))
    peer = _peer(sim)
    caller = await _endpoint(sim)
    async with peer:
        request = rpcwire.encode_request(b"\x07" * 20, "ping", [OTHER_ID])
        await peer._handle_datagram(request, caller.local_address)
        # The answer, and a ping of the caller's address: a request alone admits nobody.
        got = [await caller.recvfrom(), await caller.recvfrom()]
        reply = (rpcwire.encode_response(b"\x07" * 20, peer.node_id), peer.address)
        assert reply in got
        (check,) = [rpcwire.decode_datagram_untrusted(d) for d, _ in got if (d, _) != reply]
        assert isinstance(check, rpcwire.Request)
        assert (check.method, check.args) == ("ping", [peer.node_id])
        assert OTHER_ID not in peer.table
        await caller.sendto(rpcwire.encode_response(check.msg_id, OTHER_ID), peer.address)
        await wait_until(lambda: OTHER_ID in peer.table)
        assert (peer.stats.checks_sent, peer.stats.contacts_admitted) == (1, 1)
        await peer._handle_datagram(b"\x01" * 30, caller.local_address)
        assert peer.stats.datagrams_dropped == 1
        assert peer.stats.requests_handled == 1


async def test_a_peer_that_checks_us_while_our_request_to_it_is_out_is_not_checked_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # dht.md §5.1: B answers our find_node and pings us to check us, the ping
    # queued first (no jitter: it arrives first). Our request to B is still out,
    # so its reply is the proof we need of B: no ping back.
    sim = SimNetwork(random.Random(5), default=LinkConditions(jitter=0.0))
    a = _peer(sim)
    host = sim.add_host()
    b = DhtPeer(host, node_id=OTHER_ID, address=(host.host, 4000), rng=random.Random(2))
    async with a, b:
        contact = Contact(OTHER_ID, *b.address)
        value = await a._call(b.address, "find_node", [a.node_id, a.node_id], contact=contact)
        assert value == []
        await wait_until(lambda: a.node_id in b.table)
        assert OTHER_ID in a.table
        assert (a.stats.checks_sent, b.stats.checks_sent) == (0, 1)
        assert a.stats.rpcs_sent == 1


class _BrokenStore(RecordStore):
    """A store with a defect: reading a key raises something that is not a P2PError."""

    def get(self, key: bytes, now_ms: int) -> list[SignedRecord]:
        raise ZeroDivisionError("defect")


async def test_a_datagram_whose_processing_raises_is_contained(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="p2pnode.dht")
    sim = SimNetwork(random.Random(3))
    peer = _peer(sim, store=_BrokenStore())
    caller = await _endpoint(sim)
    async with peer:
        key = capability_key("x")
        for i in range(3):
            msg_id = bytes([i]) * 20
            find = rpcwire.encode_request(msg_id, "find_value", [OTHER_ID, key])
            await caller.sendto(find, peer.address)
        await caller.sendto(rpcwire.encode_request(b"\x09" * 20, "ping", [OTHER_ID]), peer.address)
        answer = rpcwire.encode_response(b"\x09" * 20, peer.node_id)
        while (await caller.recvfrom())[0] != answer:  # the node still answers
            pass
    assert peer.stats.inputs_failed == 3
    assert peer.boundary.stats.unexpected == {"ZeroDivisionError": 3}
    assert any("inputs_failed=+1" in r.getMessage() for r in caplog.records)


async def test_handlers_read_the_current_table(autojump_clock: trio.testing.MockClock) -> None:
    sim = SimNetwork(random.Random(4))
    peer = _peer(sim)
    caller = await _endpoint(sim)
    async with peer:
        fresh = RoutingTable(peer.node_id)
        fresh.observe(rpcwire.parse_contacts_untrusted([[b"\x33" * 20, "10.1.1.1", 9]])[0], 0.0)
        peer.table = fresh
        ask = rpcwire.encode_request(b"\x05" * 20, "find_node", [OTHER_ID, b"\x30" * 20])
        await peer._handle_datagram(ask, caller.local_address)
        data, _ = await caller.recvfrom()
        reply = rpcwire.decode_datagram_untrusted(data)
        assert isinstance(reply, rpcwire.Response)
        assert reply.value == [[b"\x33" * 20, "10.1.1.1", 9]]


async def test_a_finished_lookup_leaves_its_calls_to_the_routing_table(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # dht.md §6: a request is a failure for the routing table at the hard timeout,
    # also when its lookup ended first (else a dead contact is never evicted).
    caplog.set_level(logging.DEBUG, logger="p2pnode.dht")
    async with dht_swarm(12, seed=5) as (_, nodes):
        owner = nodes[3]
        assert owner.identity is not None
        card = make_card(owner.identity, ["ocr"])
        await owner.provide(card)
        asker = nodes[8]
        caplog.clear()
        # A card read stops at the first hit, with other requests still out.
        assert await asker.find_card(card.peer_id, card.id) == card
        assert asker.rpc.pending > 0
        # They end in their reply (which proves its contact) or their hard timeout,
        # never dropped as nobody's.
        await wait_until(lambda: asker.rpc.pending == 0)
        stats = asker.stats
        assert stats.rpcs_sent == stats.rpcs_answered + stats.rpcs_timed_out
        assert not [r for r in caplog.records if "caller gave up" in r.getMessage()]


async def test_a_reply_whose_processing_raises_costs_its_lookup_one_contact(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Replies are handled in their calls' callbacks, in the receive loop: one that
    # raises is contained to it (a failed request), and the lookup goes on.
    async with dht_swarm(12, seed=7) as (_, nodes):
        asker = nodes[5]
        parse = rpcwire.named_contacts_untrusted
        calls = [0]

        def defective(value: Any, known: Container[bytes] = ()) -> Any:
            calls[0] += 1
            if calls[0] == 1:
                raise ZeroDivisionError("defect")
            return parse(value, known)

        monkeypatch.setattr(rpcwire, "named_contacts_untrusted", defective)
        failed = asker.stats.inputs_failed
        found = await asker.find_node(nodes[9].node_id)
        assert found[0].node_id == nodes[9].node_id
        assert asker.stats.inputs_failed == failed + 1
        assert asker.boundary.stats.unexpected.get("ZeroDivisionError") == 1


async def test_calls_beyond_max_pending_fail_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sim = SimNetwork(random.Random(6))
    peer = _peer(sim, config=DhtConfig(max_pending=2, rpc_hard_timeout=1.0))
    silent = await _endpoint(sim)
    async with peer, trio.open_nursery() as nursery:
        results: list[bytes | None] = []

        async def ping() -> None:
            results.append(await peer.ping(silent.local_address))

        for _ in range(2):
            nursery.start_soon(ping)
        await wait_until(lambda: peer.rpc.pending == 2)
        t0 = trio.current_time()
        assert await peer.ping(silent.local_address) is None
        assert trio.current_time() == t0  # refused, not waited for
        assert peer.stats.rpcs_sent == 2
    assert results == [None, None]


async def test_calls_need_a_running_node() -> None:
    peer = DhtPeer(SimNetwork(random.Random(7)).add_host(), node_id=OTHER_ID)
    with pytest.raises(LocalError):
        await peer.ping(("10.0.0.1", 4000))
    with pytest.raises(LocalError):
        _ = peer.address


class _FlakyEndpoint(DatagramEndpoint):
    """Sends the first ``ok`` datagrams, then fails before sending (as a closed one does)."""

    def __init__(self, ok: int) -> None:
        self.ok = ok
        self.sent: list[tuple[bytes, Address]] = []

    @property
    def local_address(self) -> Address:
        return ("10.0.0.1", 4000)

    async def sendto(self, data: bytes, address: Address) -> None:
        self.sendto_nowait(data, address)

    def sendto_nowait(self, data: bytes, address: Address) -> None:
        if len(self.sent) >= self.ok:
            raise trio.ClosedResourceError("interrupted")
        self.sent.append((data, address))

    async def recvfrom(self) -> tuple[bytes, Address]:
        raise NotImplementedError

    def close(self) -> None:
        pass


async def test_an_interrupted_flush_loses_no_datagram() -> None:
    core = RpcCore(rng=random.Random(1))
    calls = Calls(core, DhtStatistics())
    calls.endpoint = flaky = _FlakyEndpoint(ok=1)
    got: list[Any] = []
    for port in (1, 2, 3):
        calls.call_nowait(("10.0.0.2", port), "ping", [OTHER_ID], got.append)
    with pytest.raises(trio.ClosedResourceError):
        calls.flush()
    assert [a for _, a in flaky.sent] == [("10.0.0.2", 1)]
    flaky.ok = 10
    calls.flush()
    assert [a for _, a in flaky.sent] == [("10.0.0.2", p) for p in (1, 2, 3)]
    for event in core.handle_timer(trio.current_time() + core.timeout):
        calls.on_timeout(event)
    assert got == [NO_REPLY] * 3


async def test_the_card_api_keeps_its_records_published(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with dht_swarm(8, seed=8) as (_, nodes):
        owner = nodes[2]
        assert owner.identity is not None
        card = make_card(owner.identity, ["plan"], ttl_ms=24 * 3600 * 1000)
        await owner.provide(card)
        assert owner.publisher.kept == 3  # the card, "plan" and the agent's own id
        key = capability_key("plan")
        first = [r.expires_at for r in owner.records.get(key, virtual_ms())]
        assert len(first) == 1
        # Past the republish interval, a maintenance pass re-signs with a later expiry.
        await trio.sleep(owner.config.republish_interval + owner.config.maintenance_interval * 2)
        later = await nodes[6].get_records(key)
        assert [r.publisher for r in later] == [card.peer_id]
        assert later[0].expires_at > first[0]


async def test_the_node_hands_on_its_body_exception_and_obeys_cancellation(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sim = SimNetwork(random.Random(9))
    with pytest.raises(KeyError):  # not wrapped in the node's ExceptionGroup
        async with _peer(sim):
            raise KeyError("the body's own")
    with trio.move_on_after(5) as scope:
        async with _peer(sim) as peer:
            await trio.sleep_forever()
    assert scope.cancelled_caught
    with pytest.raises(LocalError):  # closed: no more calls
        await peer.ping(("10.0.0.1", 4000))


async def test_a_soft_timeout_sooner_than_the_lookups_first_is_kept(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The lookup's sleep only ever moves sooner; a soft timeout that a later request
    brings forward (its round trip was measured meanwhile) still frees its slot on time."""
    sim = SimNetwork(random.Random(3), default=LinkConditions(latency=0.01, jitter=0.0))
    config = DhtConfig(alpha=2, rto_initial=1.0, rto_floor=0.05, rpc_hard_timeout=5.0)
    peer = _peer(sim, config=config)
    answerer, silent, late_silent, last = [await _endpoint(sim) for _ in range(4)]
    ids = [bytes([first]) + bytes(19) for first in (0x40, 0x80, 0x03, 0x07)]
    asked_last: list[float] = []

    async def answer(ep: DatagramEndpoint, named: list[Any], times: list[float]) -> None:
        while True:
            data, source = await ep.recvfrom()
            times.append(trio.current_time())
            request = rpcwire.decode_datagram_untrusted(data)
            await ep.sendto(rpcwire.encode_response(request.msg_id, named), source)

    wire = [[ids[2], *late_silent.local_address], [ids[3], *last.local_address]]
    async with peer, trio.open_nursery() as nursery:
        nursery.start_soon(answer, answerer, wire, [])
        nursery.start_soon(answer, last, [], asked_last)
        now = trio.current_time()
        peer.table.observe(Contact(ids[0], *answerer.local_address), now)
        peer.table.observe(Contact(ids[1], *silent.local_address), now)
        t0 = trio.current_time()
        await peer.find_node(bytes(20))
        # The answerer replies at 0.02 s naming two nodes: the nearer is asked then, with
        # a soft timeout of 0.06 s (the measured round trip), while the silent seed holds
        # the other slot until 1.0 s. Its timeout frees the slot for the farther one.
        assert asked_last == [pytest.approx(t0 + 0.02 + 0.06 + 0.01, abs=1e-6)]
        nursery.cancel_scope.cancel()


class _Steps(trio.abc.Instrument):
    """Counts the steps of one task, or of the tasks whose name ends with ``name``."""

    def __init__(self, task: trio.lowlevel.Task | None = None, name: str = "") -> None:
        self.task, self.name, self.count = task, name, 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task or (self.name and task.name.endswith(self.name)):
            self.count += 1


async def test_under_the_driver_the_timers_run_without_waking_the_node(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The simulator's driver keeps the node's timers (SimNetwork.move_on_at): a lookup's
    soft timeouts, the calls' hard timeouts and the maintenance passes run from the
    driver's task at their times, and neither the receive loop nor the task that
    waits for the lookup wakes for them."""
    sim = SimNetwork(random.Random(4), default=LinkConditions(latency=0.01, jitter=0.0))
    config = DhtConfig(rto_initial=1.0, rpc_hard_timeout=3.0, maintenance_interval=10.0)
    peer = _peer(sim, config=config)
    silent = [await _endpoint(sim) for _ in range(3)]
    async with trio.open_nursery() as nursery:
        await nursery.start(sim.drive)
        async with peer:
            now = trio.current_time()
            for i, ep in enumerate(silent):
                peer.table.observe(
                    Contact(bytes([0x10 * i + 1]) + bytes(19), *ep.local_address), now
                )
            await trio.testing.wait_all_tasks_blocked()
            loop = _Steps(name="DhtPeer.serve")
            waiter = _Steps(trio.lowlevel.current_task())
            trio.lowlevel.add_instrument(loop)
            trio.lowlevel.add_instrument(waiter)
            t0 = trio.current_time()
            assert await peer.find_node(bytes(20)) == []
            # Nobody answers: soft timeouts at 1 s free the slots, with nobody left to
            # ask, and the hard timeouts at 3 s end the lookup.
            assert trio.current_time() - t0 == pytest.approx(3.0, abs=1e-6)
            assert peer.stats.rpcs_timed_out == 3
            assert waiter.count == 1  # woken once: the lookup ended
            first = peer.schedule.next_deadline()
            await trio.sleep_until(first + 25)  # passes at first, first + 10, first + 20
            assert peer.schedule.next_deadline() == pytest.approx(first + 30)
            trio.lowlevel.remove_instrument(loop)
            trio.lowlevel.remove_instrument(waiter)
        nursery.cancel_scope.cancel()
    assert loop.count == 0
