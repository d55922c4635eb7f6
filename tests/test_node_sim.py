"""Nodes in the in-memory simulator on trio's virtual clock: channels, routing,
retries, reconnects, policy and spoofing (seed R3, R4, R10, R11; Properties 10-17, 29-31)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.card import Capability
from p2pnode.core.envelope import Envelope, MessageType, Metadata
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.core.identity import Identity
from p2pnode.core.wire import pack
from p2pnode.node.channels import (
    TRANSITIONS,
    ChannelState,
    ChannelStateMachine,
    RetryPolicy,
)
from p2pnode.node.frames import FrameKind, encode_envelope, encode_hello
from p2pnode.node.observability import EventKind, Outcome
from p2pnode.node.policy import PolicyConfig, TierRule
from p2pnode.node.router import BoundedSet
from p2pnode.runtime import Node, NodeConfig
from p2pnode.simnet import SimNetwork
from p2pnode.transport.channel import ChannelConfig
from tests.sim import (
    FAST_NODE,
    Inbox,
    connect_all,
    met,
    swarm,
    victim_honest_evil,
    wait_until,
)

# -- the channel state machine ------------------------------------------------------------------


@settings(max_examples=300)
@given(st.lists(st.sampled_from(list(ChannelState)), max_size=12))
def test_channel_state_machine_follows_the_table(steps: list[ChannelState]) -> None:
    machine = ChannelStateMachine()
    for target in steps:
        before = machine.state
        if target in TRANSITIONS[before]:
            machine.transition(target)
            assert machine.state is target
        else:
            with pytest.raises(LocalError) as info:
                machine.transition(target)
            assert info.value.code is ErrorCode.ILLEGAL_TRANSITION
            assert machine.state is before
    assert machine.history[0] is ChannelState.CONNECTING


def test_lifecycle_of_the_seed() -> None:
    machine = ChannelStateMachine()
    for state in (ChannelState.OPEN, ChannelState.RECONNECTING, ChannelState.OPEN):
        machine.transition(state)
    machine.transition(ChannelState.CLOSED)
    assert not any(machine.can(s) for s in ChannelState)


@given(st.integers(1, 10), st.floats(0.001, 1.0))
def test_retry_delays_double(count: int, first: float) -> None:
    delays = RetryPolicy(first_delay=first, max_delay=1e9).delays(count)
    assert len(delays) == count
    assert all(b >= 2 * a * 0.999 for a, b in itertools.pairwise(delays))


@settings(max_examples=300)
@given(st.integers(1, 6), st.lists(st.integers(0, 12).map(str), max_size=80))
def test_bounded_set_remembers_at_least_the_last_size_keys(size: int, keys: list[str]) -> None:
    remembered = BoundedSet(size)
    added: list[str] = []  # keys whose add() returned True, oldest first
    for key in keys:
        fresh = remembered.add(key)
        if key in added[-size:]:
            assert not fresh  # among the last `size` additions: must be remembered
        elif key not in added:
            assert fresh  # never seen: must be new
        if fresh:
            added.append(key)
        assert key in remembered
        assert sum(k in remembered for k in set(keys)) <= 2 * size


# -- routing ------------------------------------------------------------------------------------


async def test_request_response_direct_and_by_capability(autojump_clock: Any) -> None:
    async with swarm(3) as (_, (a, b, c)):
        inbox_c = Inbox()
        await a.add_agent("sun", Inbox(), tier=0)
        await b.add_agent("earth", Inbox(), tier=1)
        await c.add_agent("io", inbox_c, tier=3, capabilities=(Capability("test.unit", "T"),))
        await connect_all([a, b, c])
        reply = await a.request("sun", "io", {"n": 1})
        assert reply.type is MessageType.RESPONSE
        assert reply.payload == {"echo": {"n": 1}}
        assert reply.correlation_id == inbox_c.received[-1].id
        reply = await a.request("sun", "test.unit", {"n": 2}, capability=True)
        assert reply.sender == "io"
        events = [e for e in a.events.recent(kind=EventKind.ROUTING_DECISION)]
        assert events[-1].envelope_id is not None
        assert events[-1].latency_ms is not None


async def test_unknown_agent_and_capability(autojump_clock: Any) -> None:
    async with swarm(1) as (_, (a,)):
        await a.add_agent("sun", Inbox(), tier=0)
        with pytest.raises(LocalError) as info:
            await a.request("sun", "nobody", None)
        assert info.value.code is ErrorCode.AGENT_NOT_FOUND
        with pytest.raises(LocalError) as info:
            await a.request("sun", "no.such.cap", None, capability=True)
        assert info.value.code is ErrorCode.CAPABILITY_NOT_FOUND


async def test_broadcast_reaches_every_agent_of_the_swarm(autojump_clock: Any) -> None:
    async with swarm(4) as (_, nodes):
        inboxes: dict[str, Inbox] = {}
        await nodes[0].add_agent("sun", Inbox(), tier=0)
        for i, node in enumerate(nodes):
            for j in range(2):
                name = f"agent{i}x{j}"
                inboxes[name] = Inbox()
                await node.add_agent(name, inboxes[name], tier=3)
        for node in nodes[1:]:
            await nodes[0].connect(node.listen_address)
        await wait_until(lambda: all(met(nodes[0], node) for node in nodes[1:]))
        result = await nodes[0].send(
            nodes[0].envelope("sun", "*", MessageType.NOTIFICATION, {"go": True})
        )
        assert result.path == "broadcast"
        await wait_until(lambda: all(inbox.received for inbox in inboxes.values()))
        assert sorted(result.targets) == sorted(inboxes)
        for inbox in inboxes.values():
            assert [e.payload for e in inbox.received] == [{"go": True}]


async def test_per_channel_order_is_kept(autojump_clock: Any) -> None:
    async with swarm(2) as (_, (a, b)):
        inbox = Inbox()
        await a.add_agent("sun", Inbox(), tier=0)
        await b.add_agent("io", inbox, tier=3)
        await connect_all([a, b])
        for i in range(200):
            await a.send(a.envelope("sun", "io", MessageType.STREAM_DATA, i))
        await wait_until(lambda: len(inbox.received) >= 200)
        assert [e.payload for e in inbox.received] == list(range(200))


async def test_concurrent_sends_share_frames_and_each_keeps_its_order(autojump_clock: Any) -> None:
    async with swarm(2) as (_, (a, b)):
        inbox = Inbox()
        await a.add_agent("sun", Inbox(), tier=0)
        await b.add_agent("io", inbox, tier=3)
        await connect_all([a, b])
        link = b.links.get(a.peer_id)
        assert link is not None
        frames_before = link.frames_received

        async def sender(task: int) -> None:
            for i in range(20):
                await a.send(a.envelope("sun", "io", MessageType.STREAM_DATA, [task, i]))

        async with trio.open_nursery() as nursery:
            for task in range(16):
                nursery.start_soon(sender, task)
        await wait_until(lambda: len(inbox.received) >= 320)
        payloads = [e.payload for e in inbox.received]
        for task in range(16):
            assert [i for t, i in payloads if t == task] == list(range(20))
        # Envelopes queued behind a write travel together in ENVELOPES frames.
        assert link.frames_received - frames_before <= 320 // 4


async def test_a_request_without_an_answer_times_out(autojump_clock: Any) -> None:
    async def silent(envelope: Envelope) -> Any:
        await trio.sleep_forever()

    async with swarm(2) as (_, (a, b)):
        await a.add_agent("probe", Inbox(), tier=3)
        await b.add_agent("io", silent, tier=3)
        await connect_all([a, b])
        start = trio.current_time()
        # The requester's own timer, or the owner's deadline (the same request timeout)
        # cancelling the handler and answering TIMEOUT: whichever comes first.
        with pytest.raises(P2PError) as info:
            await a.request("probe", "io", "anyone?")
        assert info.value.code is ErrorCode.TIMEOUT
        waited = trio.current_time() - start
        assert FAST_NODE.request_timeout <= waited <= FAST_NODE.request_timeout * 1.125 + 0.01
        assert a.routing.pending == {}


async def test_send_many_routes_each_envelope_and_keeps_order(autojump_clock: Any) -> None:
    async with swarm(3) as (_, (a, b, c)):
        on_a, on_b, on_c = Inbox(), Inbox(), Inbox()
        await a.add_agent("probe", Inbox(), tier=3)
        await a.add_agent("lander", on_a, tier=3)
        await b.add_agent("io", on_b, tier=3)
        await c.add_agent("europa", on_c, tier=3)
        await connect_all([a, b, c])
        targets = ["io", "europa", "lander"] * 40
        targets[60] = "*"  # a broadcast in the middle of the burst keeps its place too
        envelopes = [
            a.envelope("probe", t, MessageType.STREAM_DATA, i) for i, t in enumerate(targets)
        ]
        results = await a.send_many(envelopes)
        assert [r.envelope_id for r in results] == [e.id for e in envelopes]
        assert [r.targets for r in results if r.path != "broadcast"] == [
            (t,) for t in targets if t != "*"
        ]
        assert results[60].path == "broadcast"
        inboxes = {"io": on_b, "europa": on_c, "lander": on_a}
        expected = {n: [i for i, t in enumerate(targets) if t in (n, "*")] for n in inboxes}
        await wait_until(lambda: all(len(inboxes[n].received) >= len(expected[n]) for n in inboxes))
        for name, inbox in inboxes.items():
            assert [e.payload for e in inbox.received] == expected[name]
        decisions = a.events.recent(kind=EventKind.ROUTING_DECISION)
        assert {e.envelope_id for e in decisions} >= {e.id for e in envelopes}


async def test_send_many_stops_at_the_first_refusal(autojump_clock: Any) -> None:
    async with swarm(2) as (_, (a, b)):
        inbox = Inbox()
        await a.add_agent("probe", Inbox(), tier=3)
        await b.add_agent("io", inbox, tier=3)
        await connect_all([a, b])
        envelopes = [
            a.envelope("probe", "io", MessageType.STREAM_DATA, 0),
            a.envelope("probe", "nobody", MessageType.STREAM_DATA, 1),
            a.envelope("probe", "io", MessageType.STREAM_DATA, 2),
        ]
        with pytest.raises(LocalError) as info:
            await a.send_many(envelopes)
        assert info.value.code is ErrorCode.AGENT_NOT_FOUND
        await wait_until(lambda: inbox.received)
        # The one before the refusal; that envelope 2 was never sent is the decisions' check.
        assert [e.payload for e in inbox.received] == [0]
        decisions = {e.envelope_id: e for e in a.events.recent(kind=EventKind.ROUTING_DECISION)}
        assert decisions[envelopes[0].id].outcome is Outcome.DELIVERED
        assert decisions[envelopes[1].id].code is ErrorCode.AGENT_NOT_FOUND
        assert envelopes[2].id not in decisions


async def test_an_oversized_envelope_is_refused_and_the_channel_stays(autojump_clock: Any) -> None:
    async with swarm(2) as (_, (a, b)):
        inbox = Inbox()
        await a.add_agent("probe", Inbox(), tier=3)
        await b.add_agent("io", inbox, tier=3)
        await connect_all([a, b])
        link = a.links.link(b.peer_id)
        huge = a.envelope("probe", "io", MessageType.STREAM_DATA, b"x" * (4 * 1024 * 1024))
        with pytest.raises(LocalError) as info:
            await a.send(huge)
        assert info.value.code is ErrorCode.MESSAGE_TOO_LARGE
        await a.send(a.envelope("probe", "io", MessageType.STREAM_DATA, "small"))
        await wait_until(lambda: inbox.received)
        assert [e.payload for e in inbox.received] == ["small"]  # the huge one was never sent
        assert link.history == [ChannelState.CONNECTING, ChannelState.OPEN]


# -- channels: reconnect and delivery failure ----------------------------------------------------


async def test_reconnects_after_transport_loss(autojump_clock: Any) -> None:
    async with swarm(2) as (sim, (a, b)):
        await a.add_agent("sun", Inbox(), tier=0)
        await b.add_agent("io", Inbox(), tier=3)
        await connect_all([a, b])
        link = a.links.link(b.peer_id)
        sim.kill(b.listen_address[0])
        # The loss is noticed at once (within 10 ms of virtual time).
        await wait_until(lambda: link.state is ChannelState.RECONNECTING, 0.01, interval=0.001)
        sim.revive(b.listen_address[0])
        reply = await a.request("sun", "io", "after")
        assert reply.payload == {"echo": "after"}
        assert link.history[-2:] == [ChannelState.RECONNECTING, ChannelState.OPEN]


async def test_a_quiet_channel_is_kept_open_by_keepalives(autojump_clock: Any) -> None:
    config = dataclasses.replace(FAST_NODE, channel=ChannelConfig(idle_timeout=20.0))
    async with swarm(2, config) as (_, (a, b)):
        await a.add_agent("probe", Inbox(), tier=3)
        await b.add_agent("io", Inbox(), tier=3)
        await connect_all([a, b])
        links = [a.links.link(b.peer_id), b.links.link(a.peer_id)]
        await trio.sleep(5 * 20.0)  # the behaviour under test: five idle timeouts pass quietly
        for link in links:
            assert link.history == [ChannelState.CONNECTING, ChannelState.OPEN]
            assert link.frames_received <= 2  # keepalives are not frames
        assert (await a.request("probe", "io", "still there")).payload == {"echo": "still there"}


async def test_a_peer_that_goes_silent_is_dropped_after_the_idle_timeout(
    autojump_clock: Any,
) -> None:
    from p2pnode.node.channels import PeerLink
    from p2pnode.transport.channel import SecureChannel, accept_secure, connect_secure
    from p2pnode.transport.secure import SecureIdentity

    client, server = SecureIdentity(Identity.generate()), SecureIdentity(Identity.generate())
    states: list[tuple[float, ChannelState]] = []
    async with trio.open_nursery() as nursery:

        async def dial() -> SecureChannel:
            ours, theirs = trio.testing.memory_stream_pair()

            async def mute_peer() -> None:
                channel = await accept_secure(theirs, server)
                with contextlib.suppress(RemoteError):  # until the link hangs up
                    while True:  # reads (keepalives included), never writes
                        await channel.receive_message()

            nursery.start_soon(mute_peer)
            # As a node's links do: the link's watchdog, not the channel, times out.
            quiet = ChannelConfig(idle_timeout=None)
            return await connect_secure(
                ours, client, expected_peer_id=server.peer_id, config=quiet
            )

        async def on_frame(peer: object, data: bytes) -> None:
            raise AssertionError("the mute peer sends nothing")

        link = PeerLink(
            client.peer_id, server.peer_id, nursery, dial, on_frame,
            lambda _link, state: states.append((trio.current_time(), state)),
            RetryPolicy(max_redials=1), idle_timeout=20.0,
        )  # fmt: skip
        start = trio.current_time()
        link.adopt(await dial(), client.peer_id)
        await trio.sleep(60.0)  # the behaviour under test: past the 20 s idle timeout
        dropped = [at for at, state in states if state is ChannelState.RECONNECTING]
        assert dropped, states
        assert 20.0 <= dropped[0] - start <= 20.0 + 20.0 / 4 + 0.1
        await link.aclose()
        nursery.cancel_scope.cancel()


async def test_delivery_fails_after_retries(autojump_clock: Any) -> None:
    async with swarm(2) as (sim, (a, b)):
        await a.add_agent("sun", Inbox(), tier=0)
        await b.add_agent("io", Inbox(), tier=3)
        await connect_all([a, b])
        sim.kill(b.listen_address[0])
        start = trio.current_time()
        with pytest.raises(LocalError) as info:
            await a.send(a.envelope("sun", "io", MessageType.NOTIFICATION, 1))
        assert info.value.code is ErrorCode.DELIVERY_FAILED
        assert trio.current_time() - start >= 0.05 + 0.1  # backed off before giving up
        failed = [e for e in a.events.recent(kind=EventKind.ROUTING_DECISION)]
        assert failed[-1].code is ErrorCode.DELIVERY_FAILED


# -- policy ---------------------------------------------------------------------------------------


async def test_tier_violation_on_egress_and_cross_tier_audit(autojump_clock: Any) -> None:
    async with swarm(2) as (_, (a, b)):
        await a.add_agent("mercury", Inbox(), tier=1)
        inbox = Inbox()
        await b.add_agent("io", inbox, tier=3)
        await connect_all([a, b])
        with pytest.raises(LocalError) as info:
            await a.request("mercury", "io", None)
        assert info.value.code is ErrorCode.TIER_VIOLATION
        assert a.events.recent(kind=EventKind.SECURITY)[-1].code is ErrorCode.TIER_VIOLATION
        # L3 may address L1, and L1 may answer the request it accepted.
        reply = await b.request("io", "mercury", "q")
        assert reply.sender == "mercury"
        audits = a.events.recent(kind=EventKind.AUDIT)
        assert (audits[-1].source_tier, audits[-1].target_tier) == (3, 1)


async def test_escalation_required_for_low_to_high_task_proposals(autojump_clock: Any) -> None:
    async with swarm(2) as (_, (a, b)):
        await a.add_agent("io", Inbox(), tier=3)
        inbox = Inbox()
        await b.add_agent("sun", inbox, tier=0)
        await connect_all([a, b])
        with pytest.raises(LocalError) as info:
            await a.send(a.envelope("io", "sun", MessageType.TASK_PROPOSAL, {}))
        assert info.value.code is ErrorCode.ESCALATION_REQUIRED
        meta = Metadata(escalation_justification="the build is on fire")
        await a.send(a.envelope("io", "sun", MessageType.TASK_PROPOSAL, {}, metadata=meta))
        await wait_until(lambda: inbox.received)
        assert len(inbox.received) == 1  # the refused proposal was never sent


async def test_sandbox_routing_and_discovery(autojump_clock: Any) -> None:
    async with swarm(2) as (_, (a, b)):
        await a.add_agent("boxed", Inbox(), tier=3, sandbox_id="sb1",
                          capabilities=(Capability("x", "X"),))  # fmt: skip
        await a.add_agent("free", Inbox(), tier=3)
        await b.add_agent("outside", Inbox(), tier=3, capabilities=(Capability("x", "X"),))
        await b.add_agent("sibling", Inbox(), tier=3, sandbox_id="sb1")
        await connect_all([a, b])
        with pytest.raises(LocalError) as info:
            await a.request("boxed", "outside", None)
        assert info.value.code is ErrorCode.SANDBOX_VIOLATION
        assert (await a.request("boxed", "sibling", None)).sender == "sibling"
        # Capability routing never picks an agent outside the sandbox.
        with pytest.raises(LocalError):
            await a.request("boxed", "x", None, capability=True)
        assert (await a.request("free", "x", None, capability=True)).sender in ("boxed", "outside")


# -- hostile peers --------------------------------------------------------------------------------


async def test_spoofed_sender_is_rejected_and_reported(autojump_clock: Any) -> None:
    async with victim_honest_evil("sun", 0) as (victim, honest, evil, inbox):
        forged = evil._factory.create("sun", "io", MessageType.REQUEST, "from sun, honest")
        await evil.links.link(victim.peer_id).send(encode_envelope(forged))
        # A HELLO carrying another peer's card is refused as well.
        sun_card = honest.local_agent("sun")
        await evil.links.link(victim.peer_id).send(encode_hello([sun_card], []))

        def mismatches() -> int:
            security = victim.events.recent(kind=EventKind.SECURITY)
            return [e.code for e in security].count(ErrorCode.SENDER_MISMATCH)

        # Both frames were handled once both are reported: the forged one was refused.
        await wait_until(lambda: mismatches() >= 2)
        assert inbox.received == []
        security = victim.events.recent(kind=EventKind.SECURITY)
        assert mismatches() == 2
        assert all(e.peer == str(evil.peer_id) for e in security)
        assert victim.registry.get("sun").peer_id == honest.peer_id


async def test_an_envelopes_frame_is_checked_envelope_by_envelope(autojump_clock: Any) -> None:
    async with victim_honest_evil("europa", 3) as (victim, _, evil, inbox):
        own = [evil.envelope("mallory", "io", MessageType.STREAM_DATA, i) for i in range(3)]
        forged = evil._factory.create("europa", "io", MessageType.STREAM_DATA, "forged")
        plain: list[object] = [e.to_dict() for e in own]
        plain.insert(1, forged.to_dict())
        plain.insert(3, {"schemaVersion": 1, "id": "broken"})
        await evil.links.link(victim.peer_id).send(pack([FrameKind.ENVELOPES, plain]))
        # The whole frame was handled: its last envelope arrived, both refusals reported.
        await wait_until(
            lambda: (
                len(inbox.received) >= 3 and len(victim.events.recent(kind=EventKind.SECURITY)) >= 2
            )
        )
        assert [e.payload for e in inbox.received] == [0, 1, 2]
        codes = {e.code for e in victim.events.recent(kind=EventKind.SECURITY)}
        assert codes == {ErrorCode.SENDER_MISMATCH, ErrorCode.INVALID_ENVELOPE}


async def test_ingress_policy_holds_when_a_peer_skips_egress_checks(autojump_clock: Any) -> None:
    async with swarm(2) as (_, (victim, rogue)):
        inbox = Inbox()
        await victim.add_agent("io", inbox, tier=3)
        await rogue.add_agent("mercury", Inbox(), tier=1)
        await rogue.connect(victim.listen_address)
        await wait_until(lambda: met(victim, rogue))
        envelope = rogue.envelope("mercury", "io", MessageType.REQUEST, None)
        before = len(victim.events.recent(kind=EventKind.SECURITY))
        await rogue.links.link(victim.peer_id).send(encode_envelope(envelope))
        await wait_until(lambda: len(victim.events.recent(kind=EventKind.SECURITY)) > before)
        assert inbox.received == []
        assert victim.events.recent(kind=EventKind.SECURITY)[-1].code is ErrorCode.TIER_VIOLATION


async def test_authority_swarm_rejects_unendorsed_tier_claims(autojump_clock: Any) -> None:
    authority = Identity(b"\xaa" * 32)
    config = dataclasses.replace(FAST_NODE, policy=PolicyConfig(authority_key=authority.public_key))
    async with swarm(3, config) as (_, (hub, member, pretender)):
        await hub.add_agent("earth", Inbox(), tier=1, authority=authority)
        await member.add_agent("venus", Inbox(), tier=2, authority=authority)
        await pretender.add_agent("sun", Inbox(), tier=0)  # claims L0, no endorsement
        await member.connect(hub.listen_address)
        await pretender.connect(hub.listen_address)

        def codes() -> list[ErrorCode | None]:
            return [e.code for e in hub.events.recent(kind=EventKind.SECURITY)]

        # Both HELLOs were handled: the member's card is in, the pretender's refused.
        await wait_until(
            lambda: "venus" in hub.registry and ErrorCode.INVALID_ENDORSEMENT in codes()
        )
        assert "sun" not in hub.registry
        assert ErrorCode.INVALID_ENDORSEMENT in codes()
        assert not hub.policy.is_open
        assert hub.status()["swarm"] == "authority"


async def test_garbage_frames_do_not_break_the_node(autojump_clock: Any) -> None:
    async with swarm(2) as (_, (victim, evil)):
        inbox = Inbox()
        await victim.add_agent("io", inbox, tier=3)
        await evil.add_agent("triton", Inbox(), tier=3)
        await evil.connect(victim.listen_address)
        await wait_until(lambda: met(victim, evil))
        link = evil.links.link(victim.peer_id)
        for junk in (b"\x00", b"\x92\x07\x80", b"\xc1" * 10, b"\x92\x01\x81\xa1x\x01"):
            await link.send(junk)
        await link.send(b"")  # an empty message is a keepalive, not a bad frame
        await wait_until(lambda: len(victim.events.recent(kind=EventKind.SECURITY)) >= 4)
        # The request comes after the keepalive on the same channel, which keeps order: once
        # it is answered the keepalive was handled too, and it must not have added a fifth.
        assert (await evil.request("triton", "io", "still fine")).payload == {"echo": "still fine"}
        assert len(victim.events.recent(kind=EventKind.SECURITY)) == 4


def test_node_config_is_validated() -> None:
    with pytest.raises(LocalError) as info:
        NodeConfig(request_timeout=0, card_ttl_seconds=1)
    assert len(info.value.details["problems"]) == 2
    with pytest.raises(LocalError):
        PolicyConfig(tier_rules=(TierRule(9, frozenset()),))


async def test_closing_a_node_stops_its_tasks(autojump_clock: Any) -> None:
    sim = SimNetwork(random.Random(3))
    host = sim.add_host()
    config = dataclasses.replace(FAST_NODE, listen=(host.host, 7000))
    async with Node(Identity.generate(), host, config) as node:
        await node.add_agent("io", Inbox(), tier=3)
    # The nursery exited: nothing is left running, and the node refuses new work.
    with pytest.raises(LocalError):
        await node.add_agent("x", Inbox())


def test_remote_error_type_of_policy_denials() -> None:
    from p2pnode.node.policy import Verdict

    verdict = Verdict(False, ErrorCode.TIER_VIOLATION, "no")
    assert isinstance(verdict.to_remote_error(), RemoteError)
    assert isinstance(verdict.to_local_error(), LocalError)


async def test_a_peer_that_stops_reading_cannot_hold_senders(autojump_clock: Any) -> None:
    from p2pnode.node.channels import PeerLink
    from p2pnode.transport.channel import SecureChannel, accept_secure, connect_secure
    from p2pnode.transport.secure import SecureIdentity

    client, server = SecureIdentity(Identity.generate()), SecureIdentity(Identity.generate())
    states: list[ChannelState] = []
    async with trio.open_nursery() as nursery:

        async def dial() -> SecureChannel:
            ours, theirs = trio.testing.lockstep_stream_pair()

            async def stalling_peer() -> None:
                await accept_secure(theirs, server)
                await trio.sleep_forever()  # handshakes, then never reads a byte

            nursery.start_soon(stalling_peer)
            return await connect_secure(ours, client, expected_peer_id=server.peer_id)

        async def on_frame(peer: object, data: bytes) -> None:
            raise AssertionError("the stalling peer sends nothing")

        retry = RetryPolicy(write_timeout=5.0, max_retries=1, first_delay=0.1)
        link = PeerLink(
            client.peer_id, server.peer_id, nursery, dial, on_frame,
            lambda _link, state: states.append(state), retry,
        )  # fmt: skip
        start = trio.current_time()
        with pytest.raises(LocalError) as info:
            await link.send(b"x" * 1000)
        assert info.value.code is ErrorCode.DELIVERY_FAILED
        assert 10.0 <= trio.current_time() - start < 30.0  # two writes timed out, then gave up
        assert ChannelState.RECONNECTING in states
        await link.aclose()
        nursery.cancel_scope.cancel()
