"""Agent names cannot be denied by a squatter (docs/protocol/node.md "Agent ids and
owners"): the rule a bare id resolves by, held against a model over any sequence of
claims, departures, returns, withdrawals, expiries and endorsements; the router and the
card intake that apply it; and, in the simulator on trio's virtual clock, a squatter
that comes and goes while honest traffic to the name continues."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.card import AgentCard, Capability
from p2pnode.core.envelope import Envelope, EnvelopeFactory, MessageType
from p2pnode.core.errors import ErrorCode
from p2pnode.core.identity import Identity
from p2pnode.core.registry import Registry
from p2pnode.node.cardintake import CardIntake
from p2pnode.node.channels import ChannelState, PeerLink
from p2pnode.node.observability import EventKind, Observability
from p2pnode.node.policy import Policy, PolicyConfig
from p2pnode.node.router import AmbiguousAgentError, BoundedSet, Router, pinned_address
from tests.sim import Inbox, open_swarm, wait_until

NOW = 1_000_000
NAME = "carol"
OWNERS = [Identity(bytes([n + 1]) * 32) for n in range(3)]
AUTHORITY = Identity(b"\x61" * 32)


def claim(
    owner: Identity,
    *,
    ttl: int = 60_000,
    revision: int = 0,
    now: int = NOW,
    endorsed: bool = False,
    agent_id: str = NAME,
) -> AgentCard:
    card = AgentCard(
        id=agent_id,
        name=agent_id,
        version="1.0",
        public_key=owner.public_key,
        capabilities=(Capability("chat.talk", "talk"),),
        revision=revision,
        issued_at=now,
        expires_at=now + ttl,
    ).signed(owner)
    return card.with_endorsement(AUTHORITY) if endorsed else card


# -- the rule, against a model ----------------------------------------------------------------


@dataclasses.dataclass
class Model:
    """The rule as docs/protocol/node.md states it, for one agent id."""

    claims: list[int] = dataclasses.field(default_factory=list)  # learned order, holder first
    pinned: bool = True
    unreachable: set[int] = dataclasses.field(default_factory=set)
    endorsed: set[int] = dataclasses.field(default_factory=set)
    expiry: dict[int, int] = dataclasses.field(default_factory=dict)
    first: int | None = None  # whose current claim began with no other claim standing

    def live(self) -> list[int]:
        return [c for c in self.claims if c not in self.unreachable]

    def learn(self, owner: int, endorsed: bool, expires: int) -> None:
        if owner not in self.claims:
            if not self.claims:
                self.first = owner
            self.claims.append(owner)
        self.expiry[owner] = expires
        (self.endorsed.add if endorsed else self.endorsed.discard)(owner)

    def end(self, owner: int) -> None:
        if owner == self.first:
            self.first = None
        if self.claims[0] == owner:
            self.claims.pop(0)
            live = self.live()
            if self.claims:
                heir = live[0] if live else self.claims[0]
                self.claims.remove(heir)
                self.claims.insert(0, heir)
                self.pinned = len(live) <= 1
        else:
            self.claims.remove(owner)
        if len(self.claims) <= 1:
            self.pinned = True

    def resolve(self, authority: bool) -> list[int]:
        live = self.live()
        if authority and len(live) > 1:
            live = [c for c in live if c in self.endorsed] or live
        if len(live) <= 1:
            return live
        if live[0] == self.claims[0] and self.pinned:
            return [live[0]]
        return live


Op = tuple[str, int, int]
ops = st.lists(
    st.tuples(
        st.sampled_from(["claim", "claim", "leave", "return", "withdraw", "tick"]),
        st.integers(0, len(OWNERS) - 1),
        st.sampled_from([0, 1, 2]),  # claim: ttl choice and endorsement; tick: step
    ),
    max_size=24,
)
TTLS = [3_000, 20_000, 90_000]


def apply(op: Op, registry: Registry, model: Model, now: int, revision: int) -> int:
    """Run one operation on the registry and the model; returns the new time."""
    kind, owner, arg = op
    peer = OWNERS[owner].peer_id
    if kind == "claim":  # a HELLO: the owner is reachable, its card merged
        card = claim(OWNERS[owner], ttl=TTLS[arg], revision=revision, now=now, endorsed=arg == 1)
        registry.note_reachable(peer)
        model.unreachable.discard(owner)
        if registry.merge_remote(card, now):
            model.learn(owner, arg == 1, card.expires_at)
    elif kind == "leave":  # the link closed and its redials failed
        registry.note_unreachable(peer)
        if owner in model.claims:
            model.unreachable.add(owner)
    elif kind == "return":
        registry.note_reachable(peer)
        model.unreachable.discard(owner)
    elif kind == "withdraw":  # a HELLO that no longer lists the agent
        contested = len(model.claims) > 1
        ended = registry.withdraw_missing(peer, set(), now)
        assert ended == ([NAME] if contested and owner in model.claims else [])
        if ended:
            model.end(owner)
    else:
        now += [1_000, 10_000, 40_000][arg]
        registry.prune_expired(now)
        expired = [c for c in model.claims if model.expiry[c] <= now]
        for c in [c for c in expired if c != model.claims[0]]:  # rivals first, as pruning
            model.end(c)
        for c in expired:
            if c in model.claims:
                model.end(c)
    return now


@settings(max_examples=300, deadline=None)
@given(ops, st.booleans())
def test_a_bare_name_resolves_by_the_rule(steps: list[Op], authority: bool) -> None:
    registry, model, now = Registry(), Model(), NOW
    key = AUTHORITY.public_key if authority else None
    for revision, op in enumerate(steps, start=1):
        now = apply(op, registry, model, now, revision)
        got = [OWNERS.index(_owner(c)) for c in registry.resolve(NAME, now, authority_key=key)]
        assert got == model.resolve(authority), (op, model)
        live = model.live()
        # Only live owners are ever an answer; one live owner is always the answer.
        assert set(got) <= set(live) and bool(got) == bool(live)
        if len(live) == 1:
            assert got == live
        # A live owner met first (and not outranked by an endorsement) keeps the name.
        first = model.first
        endorsed_live = [c for c in live if c in model.endorsed]
        outranked = authority and endorsed_live and first not in model.endorsed
        if first is not None and first in live and not outranked:
            assert got == [first]
        if authority and len(endorsed_live) == 1:
            assert got == endorsed_live
        # Ambiguity only among two or more live owners, none of them pinned.
        if len(got) > 1:
            assert len(live) >= 2 and (first is None or first not in live or outranked)


def _owner(card: AgentCard) -> Identity:
    return next(o for o in OWNERS if o.peer_id == card.peer_id)


# -- the router and the card intake -----------------------------------------------------------


def router_over(registry: Registry, authority: bytes | None = None) -> Router:
    policy = Policy(PolicyConfig(authority_key=authority))
    return Router(registry, policy, {}, BoundedSet(16))


def test_a_squatter_never_takes_the_name_of_a_live_first_owner() -> None:
    real, squatter = OWNERS[0], OWNERS[1]
    registry = Registry()
    registry.merge_remote(claim(real), NOW)
    registry.merge_remote(claim(squatter, ttl=30 * 86400_000), NOW + 1)
    router = router_over(registry)
    assert router.known_target(NAME, NOW + 2).peer_id == real.peer_id  # type: ignore[union-attr]
    # The squatter is still reached when named, and only then.
    named = router.known_target(pinned_address(NAME, squatter.peer_id), NOW + 2)
    assert named is not None and named.peer_id == squatter.peer_id
    # The squatter leaves, comes back: the name never moves.
    registry.note_unreachable(squatter.peer_id)
    registry.note_reachable(squatter.peer_id)
    assert router.known_target(NAME, NOW + 3).peer_id == real.peer_id  # type: ignore[union-attr]


def test_the_newcomer_takes_the_name_while_the_first_owner_is_gone() -> None:
    old, new = OWNERS[0], OWNERS[1]  # one owner, restarted under a new key
    registry = Registry()
    router = router_over(registry)
    registry.merge_remote(claim(old, ttl=10_000), NOW)
    registry.merge_remote(claim(new, ttl=60_000), NOW + 1)
    assert router.known_target(NAME, NOW + 2).peer_id == old.peer_id  # type: ignore[union-attr]
    registry.note_unreachable(old.peer_id)  # its channel closed and redials failed
    assert router.known_target(NAME, NOW + 2).peer_id == new.peer_id  # type: ignore[union-attr]
    # The old card expires: the newcomer holds the name, pinned, whoever comes next.
    registry.prune_expired(NOW + 10_000)
    registry.merge_remote(claim(OWNERS[2], now=NOW + 10_001), NOW + 10_001)
    found = router.known_target(NAME, NOW + 10_002)
    assert found is not None and found.peer_id == new.peer_id


def test_claims_of_one_discovery_answer_are_ambiguous_until_one_is_unreachable() -> None:
    a, b = OWNERS[0], OWNERS[1]
    registry = Registry()
    events = Observability(lambda: NOW)
    intake = CardIntake(OWNERS[2].peer_id, registry, Policy(), events, lambda: NOW)
    intake.learn_all([claim(a), claim(b)])
    router = router_over(registry)
    with pytest.raises(AmbiguousAgentError) as info:
        router.known_target(NAME, NOW)
    assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert "claimed by 2 owners" in info.value.message
    assert info.value.details["owners"] == [
        pinned_address(NAME, a.peer_id),
        pinned_address(NAME, b.peer_id),
    ]
    # The ambiguity lasts only as long as both claimants can be reached.
    registry.note_unreachable(a.peer_id)
    assert router.known_target(NAME, NOW).peer_id == b.peer_id  # type: ignore[union-attr]
    registry.note_reachable(a.peer_id)
    with pytest.raises(AmbiguousAgentError):
        router.known_target(NAME, NOW)
    # Naming one owner chooses it for the bare name too.
    router.pin(_request_to(pinned_address(NAME, a.peer_id)))
    assert router.known_target(NAME, NOW).peer_id == a.peer_id  # type: ignore[union-attr]
    assert [e.code for e in events.recent(kind=EventKind.SECURITY)] == [ErrorCode.INVALID_CARD]


def test_a_claim_its_owners_hello_leaves_out_is_withdrawn() -> None:
    real, squatter = OWNERS[0], OWNERS[1]
    registry = Registry()
    events = Observability(lambda: NOW)
    intake = CardIntake(OWNERS[2].peer_id, registry, Policy(), events, lambda: NOW)
    intake.learn_from(real.peer_id, (claim(real),))
    other = claim(squatter, agent_id="other")
    intake.learn_from(squatter.peer_id, (claim(squatter), other))
    [squat] = events.recent(kind=EventKind.SECURITY)
    assert str(squatter.peer_id) in squat.detail and "stays with peer" in squat.detail
    assert registry.is_contested(NAME)
    intake.learn_from(squatter.peer_id, (other,))  # its "carol" was withdrawn
    assert not registry.is_contested(NAME)
    assert registry.find_owned(NAME, squatter.peer_id) is None
    assert registry.find("other") is not None  # an uncontested card stays to its expiry
    assert registry.cards_of(squatter.peer_id) == 1


def test_the_endorsed_owner_takes_the_name() -> None:
    squatter, real = OWNERS[0], OWNERS[1]
    registry = Registry()
    registry.merge_remote(claim(squatter), NOW)  # met first, but not endorsed
    registry.merge_remote(claim(real, endorsed=True), NOW)
    router = router_over(registry, AUTHORITY.public_key)
    assert router.known_target(NAME, NOW).peer_id == real.peer_id  # type: ignore[union-attr]
    assert router_over(registry).known_target(NAME, NOW).peer_id == squatter.peer_id  # type: ignore[union-attr]


def _closed(link: PeerLink | None) -> bool:
    return link is not None and link.state is ChannelState.CLOSED


def _request_to(recipient: str) -> Envelope:
    return EnvelopeFactory(lambda: NOW).create("alice", recipient, MessageType.REQUEST)


# -- in the simulator: a squatter that comes and goes -----------------------------------------


async def test_a_squatter_that_comes_and_goes_never_denies_the_name(autojump_clock: Any) -> None:
    async with open_swarm(3) as sw:
        alice, carol, squatter = sw.nodes
        carol_inbox, squatter_inbox = Inbox(), Inbox()
        await alice.add_agent("alice", Inbox(), tier=3)
        await carol.add_agent(NAME, carol_inbox, tier=3)
        await squatter.add_agent(NAME, squatter_inbox, tier=3)
        await carol.connect(alice.listen_address)
        await wait_until(lambda: alice.registry.find(NAME) is not None)
        sent = answered = 0

        async def honest_traffic() -> None:
            nonlocal sent, answered
            for n in range(300):  # one request every 100 ms of virtual time
                sent += 1
                reply = await alice.request("alice", NAME, n)
                answered += reply.payload == {"echo": n}
                await trio.sleep(0.1)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(honest_traffic)
            for _ in range(3):  # the squatter comes, claims the name, and leaves
                await trio.sleep(2.0)
                sw.sim.revive(sw.members[2].host)
                await squatter.connect(alice.listen_address)
                await wait_until(lambda: alice.registry.is_contested(NAME))
                await trio.sleep(2.0)
                sw.sim.kill(sw.members[2].host)
                await wait_until(lambda: _closed(alice.links.get(squatter.peer_id)))
                rival = alice.registry.find_owned(NAME, squatter.peer_id)
                assert rival is not None and not alice.registry.is_live(rival, None)
        assert (sent, answered) == (300, 300)
        assert [e.payload for e in carol_inbox.received] == list(range(300))
        assert squatter_inbox.received == []
        squats = [
            e
            for e in alice.events.recent(kind=EventKind.SECURITY)
            if str(squatter.peer_id) in e.detail
        ]
        assert squats and all(e.code is ErrorCode.INVALID_CARD for e in squats)
