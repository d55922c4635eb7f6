"""Presence on links, in the simulator on trio's virtual clock with the default
channel settings (docs/protocol/node.md "Channels"):

* a peer that vanishes without a word (its packets stop, no FIN) is given up within
  30 s by a node with a channel to it, in one INFO line;
* a request pending on a peer that left fails at once with DELIVERY_FAILED naming the
  peer and why, instead of waiting out its timeout;
* a peer that restarts is reached within 2 s of its return, also by a node that spent
  its dial budget on it during the outage;
* failed dials are summarised: one line per peer per minute, never one per attempt.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import trio

from p2pnode.core.envelope import Envelope
from p2pnode.core.errors import ErrorCode, LocalError, P2PError
from p2pnode.node.channels import ChannelState
from p2pnode.runtime import Node, NodeConfig
from p2pnode.simnet import LinkConditions
from tests.sim import Inbox, connect_all, open_swarm, swarm, wait_until

#: Defaults everywhere but the request timeout, long so that failing fast shows.
CONFIG = NodeConfig(request_timeout=60.0)
#: Node loggers whose INFO lines an operator reads.
LOGGERS = ("p2pnode.node", "p2pnode.channels")


def lines_about(
    caplog: pytest.LogCaptureFixture, node: Node, level: int = logging.INFO
) -> list[str]:
    """INFO (or higher) lines of the node loggers that name ``node``'s peer id."""
    peer = str(node.peer_id)
    return [
        r.getMessage()
        for r in caplog.records
        if r.name in LOGGERS and r.levelno >= level and peer in r.getMessage()
    ]


class NeverAnswers:
    """A handler that takes a request and never answers it."""

    def __init__(self) -> None:
        self.asked = trio.Event()

    async def __call__(self, envelope: Envelope) -> Any:
        self.asked.set()
        await trio.sleep_forever()


async def test_a_peer_that_vanishes_silently_is_given_up_within_30_s(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with swarm(2, CONFIG) as (sim, (a, b)):
        await a.add_agent("asker", Inbox())
        await b.add_agent("echo", Inbox())
        await connect_all([a, b])
        link = a.links.get(b.peer_id)
        assert link is not None
        await trio.sleep(30.0)  # quiet, healthy: keepalives hold the channel open
        assert link.history == [ChannelState.CONNECTING, ChannelState.OPEN]
        caplog.clear()
        # b's packets stop and nothing answers a SYN (a cable pulled, a device frozen).
        start = trio.current_time()
        sim.set_link(a.listen_address[0], b.listen_address[0], LinkConditions(latency=1e6))
        await wait_until(lambda: link.closed, 30.0, interval=0.25)
        assert trio.current_time() - start <= 30.0
        assert link.gave_up and link.loss is not None and "nothing heard" in link.loss
        card = a.registry.find("echo")
        assert card is not None and not a.registry.is_live(card, None)
        # One INFO line about b: that it left, why, and how many agents went with it.
        said = lines_about(caplog, b)
        assert len(said) == 1, said
        assert said[0].startswith(f"peer {b.peer_id} left: nothing heard")
        assert "1 agents unreachable" in said[0] and "None" not in said[0]
        assert lines_about(caplog, b, logging.DEBUG)  # the detail is still there
        sim.set_link(a.listen_address[0], b.listen_address[0], LinkConditions())


async def test_a_request_pending_on_a_peer_that_left_fails_at_once(
    autojump_clock: Any,
) -> None:
    async with swarm(2, CONFIG) as (sim, (a, b)):
        await a.add_agent("asker", Inbox())
        stuck = NeverAnswers()
        await b.add_agent("stuck", stuck)
        await connect_all([a, b])
        failure: list[LocalError] = []

        async def ask() -> None:
            with pytest.raises(LocalError) as info:
                await a.request("asker", "stuck", "hello?")
            failure.append(info.value)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await stuck.asked.wait()
            start = trio.current_time()
            sim.kill(b.listen_address[0])  # b is gone: its streams break, SYNs go unanswered
        (error,) = failure
        elapsed = trio.current_time() - start
        assert error.code is ErrorCode.DELIVERY_FAILED
        # Within the redial window (10 s), far from the 60 s request timeout.
        assert elapsed <= 10.0 + 1.0, elapsed
        assert str(b.peer_id) in error.message and "left" in error.message
        assert "None" not in error.message
        assert error.details["peer"] == str(b.peer_id)
        assert not a.routing.pending


async def test_a_restarted_peer_is_reached_within_2_s_of_its_return(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with open_swarm(config=CONFIG) as sw:
        target = await sw.add(agent="echo")
        await sw.add(agent="asker")
        await sw.add(agent="watcher")
        await connect_all(sw.nodes)  # the sender and the bystander each have a channel to it
        s, by = sw.nodes[1:]
        target_id = target.identity.peer_id.raw
        failures: list[str] = []
        reached: list[float] = []  # seconds from the target's return to each answer
        for trial in range(5):
            # A crash: nothing leaves the host (no withdrawal, no goodbye), then the
            # process is gone while the host still answers: connections are refused.
            sw.sim.kill(target.host)
            await sw.stop(target)
            sw.sim.revive(target.host)
            # During the outage the sender keeps asking (spending its dial budget).
            outage_end = trio.current_time() + 20.0 + 7 * trial
            spent = False
            for _ in range(400):
                now = trio.current_time()
                spent = spent or s.links.dials.next_allowed(target_id, now) > now
                if now >= outage_end:
                    break
                try:
                    await s.request("asker", "echo", "anyone?")
                except P2PError as exc:
                    failures.append(exc.message)
                await trio.sleep(0.1)
            assert spent  # the sender used up its dial budget on the target
            node = await sw.start(target)  # same identity, host and port: "ready"
            back = trio.current_time()
            for asker, agent in ((s, "asker"), (by, "watcher")):
                with trio.fail_after(2.0):
                    reply = await asker.request(agent, "echo", trial)
                assert reply.payload == {"echo": trial}
                reached.append(trio.current_time() - back)
                back = trio.current_time()
            assert node.peer_id == target.identity.peer_id
        print("reached after", [round(r, 3) for r in reached])
        assert max(reached) <= 2.0, reached
        assert failures and not [f for f in failures if "None" in f]
        # The outages cost the sender a few summary lines about the target, not one per attempt.
        said = [line for line in lines_about(caplog, node) if "cannot reach" in line]
        assert len(said) <= 5 * 2 + 2, said


async def test_a_peer_that_shows_it_is_back_resets_the_dial_budget(autojump_clock: Any) -> None:
    async with open_swarm(config=CONFIG) as sw:
        a = await sw.add(agent="asker")
        b = await sw.add(agent="echo")
        assert a.node is not None and b.node is not None
        await connect_all([a.node, b.node])
        sw.sim.kill(b.host)  # a crash (see above)
        await sw.stop(b)
        sw.sim.revive(b.host)
        dials, peer = a.node.links.dials, b.identity.peer_id.raw
        for _ in range(20):  # bounded: until the budget is spent
            if dials.next_allowed(peer, trio.current_time()) > trio.current_time():
                break
            with pytest.raises(P2PError):
                await a.node.request("asker", "echo", "down?")
        assert dials.next_allowed(peer, trio.current_time()) > trio.current_time()
        node = await sw.start(b)
        await node.connect(a.node.listen_address)  # b dials in: an inbound channel and a HELLO
        assert dials.next_allowed(peer, trio.current_time()) == trio.current_time()
        assert (await a.node.request("asker", "echo", 1)).payload == {"echo": 1}


async def test_a_request_pending_on_a_peer_that_stops_fails_at_once(autojump_clock: Any) -> None:
    async with open_swarm(config=CONFIG) as sw:
        a = await sw.add(agent="asker")
        b = await sw.add()
        assert a.node is not None and b.node is not None
        stuck = NeverAnswers()
        await b.node.add_agent("stuck", stuck)
        await connect_all([a.node, b.node])
        failure: list[LocalError] = []

        async def ask() -> None:
            assert a.node is not None
            with pytest.raises(LocalError) as info:
                await a.node.request("asker", "stuck", "hello?")
            failure.append(info.value)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            await stuck.asked.wait()
            start = trio.current_time()
            await sw.close(b)  # the orderly way: it withdraws its agents, then hangs up
        (error,) = failure
        assert error.code is ErrorCode.DELIVERY_FAILED
        assert trio.current_time() - start <= 3.0
        assert str(b.identity.peer_id) in error.message and "None" not in error.message


async def test_a_fresh_card_of_a_peer_resets_its_dial_budget(autojump_clock: Any) -> None:
    async with open_swarm(config=CONFIG) as sw:
        a = await sw.add(agent="asker")
        b = await sw.add(agent="echo")
        assert a.node is not None and b.node is not None
        await connect_all([a.node, b.node])
        (card,) = b.node.registry.list_local()
        sw.sim.kill(b.host)  # a crash (see above)
        await sw.stop(b)
        sw.sim.revive(b.host)
        dials, peer = a.node.links.dials, b.identity.peer_id.raw
        for _ in range(20):  # bounded: until the budget is spent
            if dials.next_allowed(peer, trio.current_time()) > trio.current_time():
                break
            with pytest.raises(P2PError):
                await a.node.request("asker", "echo", "down?")
        assert dials.next_allowed(peer, trio.current_time()) > trio.current_time()
        # The same card again is no news; a newer revision (from the DHT, say) is.
        a.node.routing.cards.learn(card)
        assert dials.next_allowed(peer, trio.current_time()) > trio.current_time()
        newer = dataclasses.replace(card, revision=card.revision + 1).signed(b.identity)
        assert a.node.routing.cards.learn(newer)
        assert dials.next_allowed(peer, trio.current_time()) == trio.current_time()
