"""Routing policy: tiers and escalation (Property 16), sandboxes (Properties 29, 30),
card admission with endorsements, open swarms."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.card import AgentCard, Endorsement
from p2pnode.core.envelope import Envelope, MessageType, Metadata
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.identity import Identity, PeerId
from p2pnode.node.policy import (
    DEFAULT_TIER_ASSIGNMENTS,
    DEFAULT_TIER_RULES,
    Policy,
    PolicyConfig,
    PolicyError,
    TierRule,
    Verdict,
)
from tests.strategies import cards

OWNER = Identity(bytes(range(32)))
AUTHORITY = Identity(bytes(range(1, 33)))
OTHER_AUTHORITY = Identity(bytes(range(2, 34)))
OPEN = Policy(PolicyConfig(tier_assignments={}))


def card(agent_id: str, tier: int, sandbox: str | None = None) -> AgentCard:
    return AgentCard(
        id=agent_id,
        name=agent_id.upper(),
        version="1.0.0",
        public_key=OWNER.public_key,
        tier=tier,
        sandbox_id=sandbox,
        expires_at=10_000,
    ).signed(OWNER)


# -- the reference table (seed: Default Tier Assignments, R4.5, R11.2, R11.3) -----------------
#
# "ok": any message passes; "deny": every message is a TIER_VIOLATION;
# "justify": passes, except a task-proposal without a non-blank justification,
# which is ESCALATION_REQUIRED. A broadcast from L0 is "ok" to every tier.
TIER_TABLE = {
    (0, 0): "ok",      (0, 1): "ok",      (0, 2): "ok",   (0, 3): "ok",
    (1, 0): "ok",      (1, 1): "ok",      (1, 2): "deny", (1, 3): "deny",
    (2, 0): "justify", (2, 1): "justify", (2, 2): "ok",   (2, 3): "deny",
    (3, 0): "justify", (3, 1): "justify", (3, 2): "ok",   (3, 3): "ok",
}  # fmt: skip

TIER_CARDS = {t: card(f"agent-l{t}", t) for t in range(4)}


def expected_code(
    s: int, t: int, mtype: MessageType, justification: str | None, broadcast: bool
) -> ErrorCode | None:
    entry = "ok" if broadcast and s == 0 else TIER_TABLE[(s, t)]
    if entry == "deny":
        return ErrorCode.TIER_VIOLATION
    justified = justification is not None and justification.strip() != ""
    if entry == "justify" and mtype == MessageType.TASK_PROPOSAL and not justified:
        return ErrorCode.ESCALATION_REQUIRED
    return None


def assert_matches_table(
    s: int, t: int, mtype: MessageType, justification: str | None, broadcast: bool
) -> None:
    meta = None if justification is None else Metadata(escalation_justification=justification)
    v = OPEN.check_message(TIER_CARDS[s], TIER_CARDS[t], mtype, meta, broadcast=broadcast)
    want = expected_code(s, t, mtype, justification, broadcast)
    assert v.code == want, (s, t, mtype, justification, broadcast, v)
    assert v.allowed == (want is None)
    assert (v.source_tier, v.target_tier, v.cross_tier) == (s, t, s != t)


def test_every_tier_pair_type_justification_and_broadcast() -> None:
    for s, t, mtype, just, bcast in itertools.product(
        range(4), range(4), MessageType, (None, "", "  ", "urgent: prod down"), (False, True)
    ):
        assert_matches_table(s, t, mtype, just, bcast)


@settings(max_examples=300)
@given(
    st.integers(0, 3),
    st.integers(0, 3),
    st.sampled_from(list(MessageType)),
    st.none() | st.text(max_size=8),
    st.booleans(),
)
def test_check_message_matches_reference_table(
    s: int, t: int, mtype: MessageType, justification: str | None, broadcast: bool
) -> None:
    assert_matches_table(s, t, mtype, justification, broadcast)


@settings(max_examples=100)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(list(TIER_CARDS.values())),
            st.sampled_from(list(TIER_CARDS.values())),
            st.sampled_from(list(MessageType)),
            st.sampled_from([None, "", "  ", "why"]),
            st.booleans(),
        ),
        max_size=40,
    )
)
def test_remembered_verdicts_equal_fresh_ones(
    checks: list[tuple[AgentCard, AgentCard, MessageType, str | None, bool]],
) -> None:
    config = PolicyConfig(tier_assignments={})
    remembering = Policy(config)
    for source, target, mtype, justification, broadcast in checks:
        meta = None if justification is None else Metadata(escalation_justification=justification)
        fresh = Policy(config).check_message(source, target, mtype, meta, broadcast=broadcast)
        assert remembering.check_message(source, target, mtype, meta, broadcast=broadcast) == fresh


@settings(max_examples=50, deadline=None)
@given(cards(), cards())
def test_random_cards_without_sandboxes_follow_the_table(a: AgentCard, b: AgentCard) -> None:
    a = dataclasses.replace(a, sandbox_id=None)
    b = dataclasses.replace(b, sandbox_id=None)
    v = OPEN.check_message(a, b, MessageType.TASK_PROPOSAL, None)
    assert v.code == expected_code(a.tier, b.tier, MessageType.TASK_PROPOSAL, None, False)


def test_metadata_tier_claims_are_ignored() -> None:
    # An L1 agent claiming L0 in its metadata is still an L1 agent.
    v = OPEN.check_message(TIER_CARDS[1], TIER_CARDS[3], MessageType.REQUEST, Metadata(tier=0))
    assert v.code == ErrorCode.TIER_VIOLATION


def test_l0_broadcast_overrides_custom_tier_rules_but_direct_messages_do_not() -> None:
    rules = (TierRule(0, frozenset({0})), *DEFAULT_TIER_RULES[1:])
    policy = Policy(PolicyConfig(tier_rules=rules, tier_assignments={}))
    direct = policy.check_message(TIER_CARDS[0], TIER_CARDS[3], MessageType.NOTIFICATION, None)
    assert direct.code == ErrorCode.TIER_VIOLATION
    bcast = policy.check_message(
        TIER_CARDS[0], TIER_CARDS[3], MessageType.NOTIFICATION, None, broadcast=True
    )
    assert bcast.allowed and bcast.cross_tier


def test_missing_tier_rule_denies() -> None:
    policy = Policy(PolicyConfig(tier_rules=DEFAULT_TIER_RULES[:3], tier_assignments={}))
    v = policy.check_message(TIER_CARDS[3], TIER_CARDS[3], MessageType.REQUEST, None)
    assert v.code == ErrorCode.TIER_VIOLATION


# -- sandboxes (Properties 29, 30) -------------------------------------------------------------

BOXES = [None, "box-a", "box-b", "box-c"]
AGENT_IDS = ["alpha", "beta", "gamma", "delta"]


def sandbox_reference(src: AgentCard, dst: AgentCard, allow: dict[str, frozenset[str]]) -> bool:
    """Written from seed R10.1 plus isolation in both directions."""

    def box_lets(box: str | None, other: AgentCard) -> bool:
        if box is None or other.sandbox_id == box:
            return True
        names = allow.get(box, frozenset())
        return other.id in names or other.sandbox_id in names

    return box_lets(src.sandbox_id, dst) and box_lets(dst.sandbox_id, src)


allow_lists = st.dictionaries(
    st.sampled_from(BOXES[1:]),
    st.frozensets(st.sampled_from(BOXES[1:] + AGENT_IDS), max_size=3),
    max_size=3,
)


@settings(max_examples=300)
@given(
    st.sampled_from(AGENT_IDS),
    st.sampled_from(BOXES),
    st.sampled_from(AGENT_IDS),
    st.sampled_from(BOXES),
    allow_lists,
)
def test_sandbox_routing_matches_reference(
    src_id: str,
    src_box: str | None,
    dst_id: str,
    dst_box: str | None,
    allow: dict[str, frozenset[str]],
) -> None:
    policy = Policy(PolicyConfig(sandbox_allow=allow, tier_assignments={}))
    # L0 to L0: the tier rules allow everything, so only sandboxes can refuse.
    src, dst = card(src_id, 0, src_box), card(dst_id, 0, dst_box)
    v = policy.check_message(src, dst, MessageType.REQUEST, None)
    ok = sandbox_reference(src, dst, allow)
    assert v.allowed == ok
    assert v.code == (None if ok else ErrorCode.SANDBOX_VIOLATION)
    # Discovery (Property 30) follows the same boundary.
    assert policy.can_discover(src, dst) == (ok or src.id == dst.id)


@settings(max_examples=100)
@given(
    st.sampled_from(BOXES),
    st.lists(st.tuples(st.sampled_from(AGENT_IDS), st.sampled_from(BOXES)), max_size=8),
    allow_lists,
)
def test_filter_discoverable(
    viewer_box: str | None, others: list[tuple[str, str | None]], allow: dict[str, frozenset[str]]
) -> None:
    policy = Policy(PolicyConfig(sandbox_allow=allow, tier_assignments={}))
    viewer = card("viewer", 3, viewer_box)
    listed = [card(i, 3, b) for i, b in others]
    seen = policy.filter_discoverable(viewer, listed)
    assert seen == [c for c in listed if sandbox_reference(viewer, c, allow)]
    if viewer_box is not None and viewer_box not in allow:
        # No cross-sandbox grant: only the viewer's own sandbox is visible.
        assert all(c.sandbox_id == viewer_box for c in seen)


def test_sandbox_examples() -> None:
    policy = Policy(
        PolicyConfig(
            sandbox_allow={"ultra": frozenset({"gateway"}), "lab": frozenset({"ultra"})},
            tier_assignments={},
        )
    )
    inside, inside2 = card("worker", 3, "ultra"), card("worker2", 3, "ultra")
    gateway, stranger = card("gateway", 3), card("stranger", 3)
    lab = card("lab-agent", 3, "lab")
    assert policy.check_message(inside, inside2, MessageType.REQUEST, None).allowed
    assert policy.check_message(inside, gateway, MessageType.REQUEST, None).allowed
    # The reply path: the allow list of "ultra" is consulted in both directions.
    assert policy.check_message(gateway, inside, MessageType.RESPONSE, None).allowed
    out = policy.check_message(inside, stranger, MessageType.REQUEST, None)
    assert out.code == ErrorCode.SANDBOX_VIOLATION and "may not reach" in out.reason
    into = policy.check_message(stranger, inside, MessageType.REQUEST, None)
    assert into.code == ErrorCode.SANDBOX_VIOLATION and "does not accept" in into.reason
    # "lab" allows "ultra" but "ultra" does not allow "lab": crossing needs both.
    assert not policy.check_message(lab, inside, MessageType.REQUEST, None).allowed
    assert not policy.check_message(inside, lab, MessageType.REQUEST, None).allowed
    assert policy.filter_discoverable(inside, [inside, inside2, gateway, stranger, lab]) == [
        inside,
        inside2,
        gateway,
    ]


def test_sandbox_is_checked_before_tier() -> None:
    src, dst = card("a", 1, "box-a"), card("b", 3, "box-b")
    assert OPEN.check_message(src, dst, MessageType.REQUEST, None).code == (
        ErrorCode.SANDBOX_VIOLATION
    )


def test_l0_broadcast_does_not_cross_sandboxes() -> None:
    sun, boxed = card("orchestrator", 0), card("w", 3, "box-a")
    v = OPEN.check_message(sun, boxed, MessageType.NOTIFICATION, None, broadcast=True)
    assert v.code == ErrorCode.SANDBOX_VIOLATION


# -- admission and endorsements ----------------------------------------------------------------

CLOSED = Policy(PolicyConfig(authority_key=AUTHORITY.public_key, tier_assignments={}))


def test_open_swarm_uses_self_declared_claims() -> None:
    assert OPEN.is_open and not CLOSED.is_open
    unendorsed = card("agent", 0, "box-a")
    v = OPEN.admit_card(unendorsed)
    assert v.allowed and v.code is None and v.source_tier == 0
    assert OPEN.check_message(unendorsed, card("x", 3, "box-a"), MessageType.REQUEST, None).allowed


def test_endorsed_card_is_admitted() -> None:
    c = card("agent", 1, "box-a").with_endorsement(AUTHORITY)
    v = CLOSED.admit_card(c)
    assert v.allowed and v.code is None and v.source_tier == 1


@pytest.mark.parametrize("tier", [0, 1, 2, 3])
def test_unendorsed_card_is_rejected_in_closed_swarm(tier: int) -> None:
    for box in (None, "box-a"):
        v = CLOSED.admit_card(card("agent", tier, box))
        assert not v.allowed and v.code == ErrorCode.INVALID_ENDORSEMENT


def test_forged_endorsement_is_rejected() -> None:
    c = card("agent", 0)
    good = c.with_endorsement(AUTHORITY)
    assert good.endorsement is not None
    forged_sig = c.with_endorsement(OTHER_AUTHORITY).endorsement
    assert forged_sig is not None
    # Claims to be the authority, but the signature is someone else's.
    forged = dataclasses.replace(
        c, endorsement=Endorsement(AUTHORITY.public_key, forged_sig.signature)
    )
    assert CLOSED.admit_card(forged).code == ErrorCode.INVALID_ENDORSEMENT
    flipped = bytearray(good.endorsement.signature)
    flipped[0] ^= 1
    tampered = dataclasses.replace(c, endorsement=Endorsement(AUTHORITY.public_key, bytes(flipped)))
    assert CLOSED.admit_card(tampered).code == ErrorCode.INVALID_ENDORSEMENT


def test_endorsement_by_another_authority_is_rejected() -> None:
    c = card("agent", 2).with_endorsement(OTHER_AUTHORITY)
    assert CLOSED.admit_card(c).code == ErrorCode.INVALID_ENDORSEMENT
    # The cheap structural guard in check_message catches it even without admission.
    peer = card("peer", 2).with_endorsement(AUTHORITY)
    assert CLOSED.check_message(c, peer, MessageType.REQUEST, None).code == (
        ErrorCode.INVALID_ENDORSEMENT
    )
    assert CLOSED.check_message(peer, c, MessageType.REQUEST, None).code == (
        ErrorCode.INVALID_ENDORSEMENT
    )
    other = card("peer2", 2).with_endorsement(AUTHORITY)
    assert CLOSED.check_message(peer, other, MessageType.REQUEST, None).allowed


@pytest.mark.parametrize(
    "change", [{"tier": 0}, {"sandbox_id": None}, {"sandbox_id": "box-b"}, {"id": "other"}]
)
def test_claims_changed_after_endorsement_are_rejected(change: dict[str, Any]) -> None:
    endorsed = card("agent", 3, "box-a").with_endorsement(AUTHORITY)
    assert CLOSED.admit_card(endorsed).allowed
    # Even re-signed by its owner, the changed card no longer matches the endorsement.
    changed = dataclasses.replace(endorsed, **change).signed(OWNER)
    assert changed.is_signed_by_owner()
    assert CLOSED.admit_card(changed).code == ErrorCode.INVALID_ENDORSEMENT


def test_endorsement_moved_to_another_key_is_rejected() -> None:
    endorsed = card("agent", 0).with_endorsement(AUTHORITY)
    thief = Identity(bytes(range(5, 37)))
    stolen = dataclasses.replace(
        endorsed, public_key=thief.public_key, peer_id=PeerId.from_public_key(thief.public_key)
    ).signed(thief)
    assert CLOSED.admit_card(stolen).code == ErrorCode.INVALID_ENDORSEMENT


@settings(max_examples=25, deadline=None)
@given(cards())
def test_random_endorsed_cards_are_admitted_and_unendorsed_are_not(c: AgentCard) -> None:
    assert CLOSED.admit_card(c.with_endorsement(AUTHORITY)).allowed
    assert CLOSED.admit_card(c).code == ErrorCode.INVALID_ENDORSEMENT
    assert OPEN.admit_card(c).allowed


def test_planetary_names_must_claim_their_assigned_tier() -> None:
    policy = Policy()
    assert len(DEFAULT_TIER_ASSIGNMENTS) == 21
    assert policy.assigned_tier("SUN") == 0 and policy.assigned_tier("nobody") is None
    assert policy.admit_card(card("sun", 0)).allowed
    assert policy.admit_card(card("Mars", 2)).allowed
    v = policy.admit_card(card("mars", 0))
    assert v.code == ErrorCode.TIER_VIOLATION and "assigned L2" in v.reason
    assert policy.admit_card(card("not-a-planet", 0)).allowed


# -- verdicts, envelopes, configuration --------------------------------------------------------


def test_verdict_errors_split_blame() -> None:
    v = OPEN.check_message(TIER_CARDS[1], TIER_CARDS[3], MessageType.REQUEST, None)
    local = v.to_local_error()
    assert type(local) is LocalError and local.code == ErrorCode.TIER_VIOLATION
    assert local.details == {"source_tier": 1, "target_tier": 3}
    remote = v.to_remote_error()
    assert isinstance(remote, PolicyError) and isinstance(remote, RemoteError)
    assert remote.code == ErrorCode.TIER_VIOLATION and remote.message == v.reason
    ok = Verdict(True, None, "allowed")
    with pytest.raises(LocalError) as info:
        ok.to_local_error()
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    with pytest.raises(LocalError):
        ok.to_remote_error()


def test_check_envelope_requires_the_authenticated_sender() -> None:
    src, dst = TIER_CARDS[2], TIER_CARDS[0]
    env = Envelope("e1", src.id, dst.id, MessageType.TASK_PROPOSAL, 1)
    assert OPEN.check_envelope(src, dst, env).code == ErrorCode.ESCALATION_REQUIRED
    justified = dataclasses.replace(env, metadata=Metadata(escalation_justification="blocked"))
    assert OPEN.check_envelope(src, dst, justified).allowed
    spoofed = dataclasses.replace(justified, sender="agent-l0")
    assert OPEN.check_envelope(src, dst, spoofed).code == ErrorCode.SENDER_MISMATCH
    bcast = Envelope("e2", "agent-l0", "*", MessageType.NOTIFICATION, 1)
    assert OPEN.check_envelope(TIER_CARDS[0], TIER_CARDS[3], bcast).reason.startswith("L0")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tier_rules": (TierRule(0, frozenset({0})), TierRule(0, frozenset({1})))},
        {"tier_rules": (TierRule(7, frozenset({0})),)},
        {"tier_rules": (TierRule(1, frozenset({9})),)},
        {"authority_key": b"short"},
        {"tier_assignments": {"sun": 5}},
        {"sandbox_allow": {"a": {"b"}}},
        {"escalation_target_tiers": frozenset({4})},
    ],
)
def test_bad_config_is_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(LocalError) as info:
        PolicyConfig(**kwargs)
    assert info.value.code == ErrorCode.CONFIG_ERROR


def test_config_is_a_snapshot_of_the_callers_mappings() -> None:
    allow = {"box-a": frozenset({"box-b"})}
    policy = Policy(PolicyConfig(sandbox_allow=allow, tier_assignments={}))
    allow["box-a"] = frozenset()
    a, b = card("a", 0, "box-a"), card("b", 0, "box-b")
    # box-b does not allow box-a, so this stays denied; but box-a's grant survived.
    v = policy.check_message(a, b, MessageType.REQUEST, None)
    assert "does not accept" in v.reason
