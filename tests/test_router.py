"""The pure routing decisions (node/router.py), checked without trio or a network."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.card import AgentCard, Capability, Origin
from p2pnode.core.envelope import BROADCAST, EnvelopeFactory, MessageType, Metadata
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.identity import Identity
from p2pnode.core.registry import Registry
from p2pnode.node.policy import Policy, PolicyConfig
from p2pnode.node.router import (
    REPLY_STREAM_TYPES,
    REPLY_TYPES,
    BoundedSet,
    BurstDecisions,
    Refusal,
    Router,
)

NOW = 1_700_000_000_000
LOCAL = Identity(b"\x01" * 32)
PEERS = [Identity(bytes([i]) * 32) for i in (2, 3, 4)]
SANDBOXES = [None, "lab", "prod"]


@dataclass
class Hosted:
    card: AgentCard


def make_card(owner: Identity, agent_id: str, tier: int, sandbox: str | None) -> AgentCard:
    # Every agent offers "plan": which ones a request may go to is a policy question.
    card = AgentCard(
        id=agent_id,
        capabilities=(Capability("plan", "Plan"),),
        name=agent_id.upper(),
        version="1.0.0",
        tier=tier,
        sandbox_id=sandbox,
        public_key=owner.public_key,
        issued_at=NOW,
        expires_at=NOW + 3_600_000,
    )
    return card.signed(owner)


# An agent: (owner index: 0 local, 1-3 a peer), tier, sandbox index.
agent_specs = st.lists(
    st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=8
)


@dataclass
class World:
    router: Router
    registry: Registry
    policy: Policy
    local: dict[str, Hosted]
    allowed: BoundedSet


def world(specs: list[tuple[int, int, int]]) -> World:
    registry = Registry(LOCAL)
    # "lab" may talk to "prod" (both ways must allow it); prod allows nobody.
    policy = Policy(PolicyConfig(sandbox_allow={"lab": frozenset({"prod"})}))
    local: dict[str, Hosted] = {}
    for i, (owner, tier, sandbox) in enumerate(specs):
        agent_id = f"a{i}"
        if owner == 0:
            card = registry.register(make_card(LOCAL, agent_id, tier, SANDBOXES[sandbox]), NOW)
            local[agent_id] = Hosted(card)
        else:
            remote = make_card(PEERS[owner - 1], agent_id, tier, SANDBOXES[sandbox])
            registry.merge_remote(remote, NOW)
    allowed = BoundedSet(64)
    return World(Router(registry, policy, local, allowed), registry, policy, local, allowed)


factory = EnvelopeFactory(lambda: NOW)


@settings(max_examples=200)
@given(agent_specs, st.sampled_from(list(MessageType)))
def test_fan_out_is_every_allowed_agent_grouped_by_host(
    specs: list[tuple[int, int, int]], type_: MessageType
) -> None:
    w = world([(0, specs[0][1], specs[0][2]), *specs])
    source = w.router.source("a0")
    envelope = factory.create("a0", BROADCAST, type_, None)
    fanout = w.router.fan_out(source, envelope)
    expected = {
        c.id
        for c in w.registry
        if c.id != source.id and w.policy.check_envelope(source, c, envelope).allowed
    }
    assert set(fanout.targets) == expected
    assert len(fanout.targets) == len(expected)
    assert all(w.registry.get(a).origin is Origin.LOCAL for a in fanout.local)
    for peer_id, ids in fanout.peers.items():
        assert all(w.registry.get(a).peer_id == peer_id for a in ids)
        assert all(w.registry.get(a).origin is Origin.REMOTE for a in ids)


@settings(max_examples=200)
@given(agent_specs)
def test_capability_candidates_are_discoverable_allowed_and_not_the_source(
    specs: list[tuple[int, int, int]],
) -> None:
    w = world([(0, specs[0][1], specs[0][2]), *specs])
    source = w.router.source("a0")
    got = w.router.candidates(source, "plan")
    offering = w.registry.find_by_capability("plan")
    expected = [
        c
        for c in offering
        if c.id != source.id
        and w.policy.can_discover(source, c)
        and w.policy.check_message(source, c, MessageType.REQUEST, None).allowed
    ]
    assert got == expected
    origins = [c.origin for c in got]
    assert origins == sorted(origins, key=lambda o: o is not Origin.LOCAL)  # local first


@settings(max_examples=200)
@given(agent_specs, st.integers(0, 7), st.integers(0, 7), st.booleans())
def test_authentication_accepts_only_the_peers_own_agents(
    specs: list[tuple[int, int, int]], sender_index: int, peer_index: int, known: bool
) -> None:
    w = world(specs)
    sender = f"a{sender_index}" if known else "stranger"
    peer = PEERS[peer_index % 3].peer_id
    envelope = factory.create(sender, "a0", MessageType.REQUEST, None)
    result = w.router.authenticate(peer, envelope)
    card = w.registry.find(sender)
    if card is not None and card.origin is Origin.REMOTE and card.peer_id == peer:
        assert result is card
    else:
        assert isinstance(result, Refusal) and result.code is ErrorCode.SENDER_MISMATCH


@settings(max_examples=200)
@given(agent_specs, st.integers(0, 9), st.sampled_from(list(MessageType)))
def test_ingress_gives_every_local_recipient_its_verdict(
    specs: list[tuple[int, int, int]], recipient_index: int, type_: MessageType
) -> None:
    w = world([(1, 3, 0), *specs])
    source = w.registry.get("a0")
    for recipient in (f"a{recipient_index}", BROADCAST):
        envelope = factory.create("a0", recipient, type_, None)
        decision = w.router.ingress(source, envelope)
        if recipient == BROADCAST:
            expected = list(w.local)
        elif recipient in w.local:
            expected = [recipient]
        else:
            assert decision.refusal is not None
            assert decision.refusal.code is ErrorCode.AGENT_NOT_FOUND
            assert decision.verdicts == ()
            continue
        assert decision.refusal is None
        assert [a for a, _ in decision.verdicts] == expected
        for agent_id, verdict in decision.verdicts:
            want = w.policy.check_envelope(source, w.local[agent_id].card, envelope)
            assert verdict == want
        assert decision.allowed == [a for a, v in decision.verdicts if v is not None and v.allowed]


@given(st.sampled_from(list(MessageType)), st.booleans(), st.integers(0, 3))
def test_replies_to_allowed_requests_skip_the_policy(
    type_: MessageType, allowed_before: bool, tier: int
) -> None:
    w = world([(0, 0, 0), (1, tier, 1)])
    source, target = w.router.source("a0"), w.registry.get("a1")
    request = factory.create("a1", "a0", MessageType.REQUEST, None)
    if allowed_before:
        w.router.note_request(request)
    reply = factory.reply(request, "a0", type_, None)
    verdict = w.router.check(source, target, reply)
    if (type_ in REPLY_TYPES or type_ in REPLY_STREAM_TYPES) and allowed_before:
        assert verdict is None
    else:
        assert verdict == w.policy.check_envelope(source, target, reply)


@given(
    st.sampled_from(list(MessageType)),
    st.sampled_from(["a", "b", "c"]),
    st.none() | st.lists(st.sampled_from(["a", "b"]), max_size=2).map(tuple),
)
def test_a_reply_answers_only_from_an_expected_agent(
    type_: MessageType, sender: str, targets: tuple[str, ...] | None
) -> None:
    envelope = factory.create(sender, "me", type_, None, metadata=Metadata())
    expected = type_ in REPLY_TYPES and (targets is None or sender in targets)
    assert Router.answers(envelope, targets) is expected


def test_only_a_local_agent_may_send() -> None:
    w = world([(0, 3, 0), (1, 3, 0)])
    assert w.router.source("a0").id == "a0"
    for sender in ("nobody", "a1"):  # unknown, and a remote agent
        with pytest.raises(LocalError) as info:
            w.router.source(sender)
        assert info.value.code is ErrorCode.AGENT_NOT_FOUND


#: Envelopes of a burst: sender, recipient, type, one of two equal metadata objects (or
#: none), in a thread or not.
burst_envelopes = st.lists(
    st.tuples(
        st.sampled_from(["a", "b"]),
        st.sampled_from(["x", "y"]),
        st.sampled_from([MessageType.NOTIFICATION, MessageType.REQUEST]),
        st.sampled_from([0, 1, None]),
        st.booleans(),
    ),
    max_size=30,
)


@given(burst_envelopes)
def test_a_burst_decision_is_reused_only_for_an_envelope_alike(
    specs: list[tuple[str, str, MessageType, int | None, bool]],
) -> None:
    # Equal but distinct metadata objects: identity decides (a miss costs a full check).
    metadatas = [Metadata(tier=1), Metadata(tier=1)]
    factory = EnvelopeFactory(lambda: NOW)
    memo: BurstDecisions[int] = BurstDecisions()
    model: dict[tuple[str, str, MessageType], tuple[Metadata | None, int]] = {}
    for number, (sender, recipient, type_, meta, in_thread) in enumerate(specs):
        metadata = None if meta is None else metadatas[meta]
        thread = "t" if in_thread else None
        envelope = factory.create(
            sender, recipient, type_, correlation_id=thread, metadata=metadata
        )
        key = (sender, recipient, type_)
        expected = None
        if thread is None and key in model and model[key][0] is metadata:
            expected = model[key][1]
        assert memo.get(envelope) == expected
        memo.put(envelope, number)
        if thread is None:
            model[key] = (metadata, number)
        if number % 7 == 6:
            memo.clear()
            model.clear()
