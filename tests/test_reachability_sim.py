"""The reachability service on the simulator (docs/protocol/reachability.md): a node whose
listeners answer is confirmed reachable; one whose addresses nobody answers at is not; a
lying checker is outvoted; a checker refuses bad and too frequent requests, never dials
an IP the request did not come from, and answers with the address it saw."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from p2pnode.agent.definition import Agent, Reply
from p2pnode.core.card import AgentCard
from p2pnode.core.envelope import Envelope, MessageType, Metadata
from p2pnode.core.errors import ErrorCode, RemoteError
from p2pnode.runtime import Node, NodeConfig
from p2pnode.services.reachability import (
    METHOD,
    Candidate,
    NatMapping,
    Outcome,
    Reachability,
    Transport,
)
from p2pnode.services.reachability.wire import NONCE_BYTES, DialAnswer, parse_request_untrusted
from tests.sim import Swarm, met, open_swarm, wait_until


async def echo(envelope: Envelope) -> Any:
    return None


@asynccontextmanager
async def joined(count: int) -> AsyncIterator[Swarm]:
    """``count`` nodes with their DHT, each hosting agent ``a<i>``, all met."""
    async with open_swarm(count, NodeConfig(), seed=3, dht=True) as sw:
        for i, node in enumerate(sw.nodes):
            await node.add_agent(f"a{i}", echo, tier=3)
        for node in sw.nodes:
            await node.join()
        nodes = sw.nodes
        await wait_until(lambda: all(met(nodes[0], n) for n in nodes[1:]))
        # The last node has met the others too (its checkers are then every other node).
        for node in nodes[1:-1]:
            await nodes[-1].connect(node.listen_address)
        await wait_until(lambda: all(met(nodes[-1], n) for n in nodes[:-1]))
        yield sw


async def test_a_node_whose_listeners_answer_is_confirmed(autojump_clock: Any) -> None:
    async with joined(4) as sw:
        node = sw.nodes[-1]
        verdict = await node.check_reachability()
        host, port = node.listen_address
        assert verdict.reachability is Reachability.REACHABLE
        assert {(c.transport, c.host) for c in verdict.confirmed} == {
            (Transport.TCP, host),
            (Transport.UDP, host),
        }
        assert Candidate(Transport.TCP, host, port) in verdict.confirmed
        assert verdict.external_ip == host
        assert len(verdict.checkers) == 3
        assert node.status()["reachability"]["verdict"]["reachability"] == "reachable"


async def test_addresses_nobody_answers_at_are_not_confirmed(autojump_clock: Any) -> None:
    async with joined(4) as sw:
        node = sw.nodes[-1]
        host = node.listen_address[0]
        dead = [Candidate(Transport.TCP, host, 7999), Candidate(Transport.UDP, host, 7999)]
        verdict = await node.reachability.check(dead)
        assert verdict.reachability is Reachability.UNREACHABLE
        assert verdict.denied == tuple(dead)
        # The node's real listener on the same host is confirmed: the refusal above was
        # the port, not the host.
        assert (await node.check_reachability()).reachability is Reachability.REACHABLE


async def test_a_check_asks_as_an_agent_the_policy_lets_reach_the_checkers(
    autojump_clock: Any,
) -> None:
    # The node's first agent is tier 2; every checker hosts only tier-3 agents, which a
    # tier-2 agent may not send a request to. Its tier-3 agent asks instead.
    async with joined(4) as sw:
        node = sw.nodes[-1]
        await node.remove_agent(f"a{len(sw.nodes) - 1}")
        await node.add_agent("planner", echo, tier=2)
        await node.add_agent("helper", echo, tier=3)
        assert node.default_agent() == "planner"
        verdict = await node.check_reachability()
        assert verdict.reachability is Reachability.REACHABLE
        assert len(verdict.checkers) == 3


class Liar:
    """A checker that says every candidate was reached, seen from a made-up address."""

    async def serve(
        self, agent: Agent, envelope: Envelope, method: str, sender: AgentCard
    ) -> Reply | None:
        request = parse_request_untrusted(envelope.payload)
        outcomes = tuple(Outcome.REACHED for _ in request.candidates)
        answer = DialAnswer(request.nonce, ("198.51.100.66", 1), outcomes)
        return Reply(MessageType.RESPONSE, answer.to_payload())

    def deadline(self, agent: Agent, envelope: Envelope) -> float:
        return 5.0


async def test_a_lying_checker_is_outvoted(autojump_clock: Any) -> None:
    async with joined(4) as sw:
        liar = sw.nodes[0]
        liar.serve_methods([METHOD], None)
        liar.serve_methods([METHOD], Liar())
        node = sw.nodes[-1]
        host = node.listen_address[0]
        dead = [Candidate(Transport.TCP, host, 7999)]
        verdict = await node.reachability.check(dead)
        assert str(liar.peer_id) in verdict.checkers
        assert verdict.reachability is Reachability.UNREACHABLE
        assert verdict.external_ip == host  # not the liar's 198.51.100.66


async def _ask(node: Node, target: str, payload: Any) -> Envelope:
    return await node.request(
        node.default_agent(), target, payload, metadata=Metadata(3, capability=METHOD)
    )


async def test_a_checker_refuses_bad_and_too_frequent_requests(autojump_clock: Any) -> None:
    async with joined(3) as sw:
        checker, node = sw.nodes[0], sw.nodes[-1]
        host, port = node.listen_address
        with pytest.raises(RemoteError) as info:
            await _ask(node, "a0", {"nonce": b"short", "addrs": [["tcp", host, port]]})
        assert info.value.code is ErrorCode.INVALID_INPUT
        assert checker.reachability.refused == 1
        # Another IP than the request's is never dialed: refused, not unreachable.
        third = sw.nodes[1].listen_address
        request = {"nonce": b"n" * NONCE_BYTES, "addrs": [["tcp", host, port], ["tcp", *third]]}
        reply = await _ask(node, "a0", request)
        assert reply.payload["results"] == ["reached", "refused"]
        assert reply.payload["observed"][0] == host
        # The burst (2) is spent with the next one; the one after is BUSY with a retry time.
        await _ask(node, "a0", request)
        with pytest.raises(RemoteError) as info:
            await _ask(node, "a0", request)
        assert info.value.code is ErrorCode.BUSY
        assert info.value.details["retryAfterMs"] > 0


async def test_the_mapping_of_a_node_seen_by_three_checkers_is_consistent(
    autojump_clock: Any,
) -> None:
    async with joined(4) as sw:
        node = sw.nodes[-1]
        verdict = await node.check_reachability()
        assert verdict.mapping is NatMapping.CONSISTENT
        assert verdict.external_udp is not None
        assert verdict.external_udp[0] == node.listen_address[0]


async def test_a_checker_that_cannot_tell_where_the_requester_is_answers_nothing(
    autojump_clock: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its channel to the requester closed after the request came: "refused" for every
    # candidate would count as denials, and two such checkers would make a reachable node
    # unreachable (its cards then list no address). It answers CHANNEL_CLOSED: no vote.
    async with joined(4) as sw:
        node = sw.nodes[-1]
        blind = sw.nodes[:2]
        for checker in blind:
            monkeypatch.setattr(checker.links, "get", lambda peer: None)
        verdict = await node.reachability.check()
        assert verdict.checkers == (str(sw.nodes[2].peer_id),)  # the one that answered
        assert verdict.reachability is Reachability.UNKNOWN
        assert not verdict.denied
        assert [checker.reachability.refused for checker in blind] == [1, 1]
        host, port = node.listen_address
        request = {"nonce": b"n" * NONCE_BYTES, "addrs": [["tcp", host, port]]}
        with pytest.raises(RemoteError) as info:
            await _ask(node, "a0", request)
        assert info.value.code is ErrorCode.CHANNEL_CLOSED


async def test_a_check_sent_as_an_id_another_owner_holds_is_answered_for_its_sender(
    autojump_clock: Any,
) -> None:
    # Two owners claim "twin" (a device back under a new key does); the checkers hold the
    # first one's card. The second one's check is dialed back at the second one's address:
    # the checker takes the sender's peer from the channel it came on, not from the id.
    async with open_swarm(5, NodeConfig(), seed=4, dht=True) as sw:
        checkers, first, second = sw.nodes[:3], sw.nodes[3], sw.nodes[4]
        for i, node in enumerate(checkers):
            await node.add_agent(f"a{i}", echo, tier=3)
        await first.add_agent("twin", echo, tier=3)
        for node in sw.nodes[:4]:
            await node.join()
        await wait_until(lambda: all(met(c, first) for c in checkers))
        await second.add_agent("twin", echo, tier=3)
        await second.join()
        for checker in checkers:
            await second.connect(checker.listen_address)
        await wait_until(lambda: all(len(c.registry.owners("twin")) == 2 for c in checkers))
        assert all(c.registry.owners("twin")[0].peer_id == first.peer_id for c in checkers)
        verdict = await second.reachability.check()
        assert verdict.reachability is Reachability.REACHABLE
        host, port = second.listen_address
        assert Candidate(Transport.TCP, host, port) in verdict.confirmed
        assert verdict.external_ip == host
