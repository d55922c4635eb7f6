"""Routing policy: tiers, escalation, sandboxes and card admission.

There is no central router: every node runs this policy on what it *sends*
(egress) and again on what it *receives* (ingress), with the same function.
A node never trusts another node to have filtered for it.

Theory of operation:

* **Decisions use authenticated cards.** ``source`` and ``target`` are the
  signed :class:`~p2pnode.core.card.AgentCard` objects of the agents involved: on
  ingress, the card of the peer proven by the Noise handshake. Tier and
  sandbox *claims* in envelope metadata are never consulted; only the
  escalation justification, which is content rather than a claim, is read.
* **Admission** (:meth:`Policy.admit_card`). A swarm configured with an
  ``authority_key`` is *closed*: a card's tier and sandbox count only when the
  authority endorsed them (:meth:`AgentCard.endorsed_by`; the endorsement
  covers agent id, owner key, tier and sandbox). An unendorsed card is
  rejected outright with ``INVALID_ENDORSEMENT``, whatever it claims: there is
  no least-privileged tier to downgrade it to (L3 reaches every tier, and "no
  sandbox" is the least confined state), so admitting it in any form would
  widen access. Without an authority the swarm is *open*: self-declared tiers
  and sandboxes are used as they are, which makes tiers and sandboxes
  cooperative conventions rather than security boundaries; ``status`` shows
  this through :attr:`Policy.is_open`. In both modes a card whose id is a
  planetary name in ``tier_assignments`` must claim the assigned tier
  (seed R11.1: the tier of a planetary agent is assigned, not chosen), else
  ``TIER_VIOLATION``. Checking the owner's signature is the registry's job
  (``Registry.merge_remote``); admission only decides what the card may do.
* **Message checks** (:meth:`Policy.check_message`), first failure wins:

  1. *Closed-swarm guard*: in a closed swarm, a card carrying no endorsement
     by the authority is refused (``INVALID_ENDORSEMENT``). This is a cheap
     structural check (no signature verification) that catches a caller who
     skipped :meth:`admit_card`; forged endorsements are caught by admission.
  2. *Sandbox* (seed R10.1-10.2, Property 29), ``SANDBOX_VIOLATION``.
     Isolation holds both ways: a sandboxed source may reach only its own
     sandbox or what its sandbox's allow list names, *and* a sandboxed target
     accepts only from its own sandbox or what its sandbox's allow list names.
     Allow lists hold sandbox ids and agent ids in one namespace. Crossing
     from one sandbox into another therefore needs both sandboxes to allow
     it, and a reply to an allowed agent passes because the same list is
     consulted in both directions. Sandboxes come first so that a sandboxed
     agent learns nothing about the tier of agents outside its boundary.
  3. *Tier* (seed R4.5, Property 16), ``TIER_VIOLATION``: the target's tier
     must be in the source tier's ``allowed_target_tiers``. Exception (seed
     R11.3): a broadcast from an L0 agent reaches every tier. It does not
     cross sandboxes; only tiers are waived.
  4. *Escalation* (seed R11.2), ``ESCALATION_REQUIRED``: when the source
     tier's rule has ``requires_escalation_justification``, a
     ``task-proposal`` to a tier in ``escalation_target_tiers`` (L0 and L1 by
     default) must carry a non-blank ``metadata.escalation_justification``.

  The verdict's ``cross_tier`` flag (source tier != target tier) is set
  whatever the outcome, so the node can write the audit record of seed R11.4.
* **Discovery** (seed R10.4, Property 30): a viewer can discover exactly the
  cards the sandbox rule of step 2 lets it exchange messages with, plus its
  own. Tiers do not hide cards.

Everything here is pure: no I/O, no clock, no randomness. That lets
:meth:`Policy.check_message` remember its verdicts per (source card, target
card, message type, broadcast, justified) in a bounded memo: the same pair
of card objects exchanging the same kind of message gets the same answer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from p2pnode.core.card import AgentCard, Tier
from p2pnode.core.envelope import BROADCAST, Envelope, MessageType, Metadata
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError

ALL_TIERS: frozenset[int] = frozenset(Tier)


@dataclass(frozen=True, slots=True)
class TierRule:
    """Which tiers agents of ``source_tier`` may send to, and whether their task
    proposals to the escalation tiers need a justification."""

    source_tier: int
    allowed_target_tiers: frozenset[int]
    requires_escalation_justification: bool = False


#: The seed's rules: L0 -> all; L1 -> L0, L1; L2 -> L0-L2 and L3 -> all, both
#: needing an escalation justification for task proposals to L0/L1.
DEFAULT_TIER_RULES: tuple[TierRule, ...] = (
    TierRule(Tier.L0, ALL_TIERS, False),
    TierRule(Tier.L1, frozenset({Tier.L0, Tier.L1}), False),
    TierRule(Tier.L2, frozenset({Tier.L0, Tier.L1, Tier.L2}), True),
    TierRule(Tier.L3, ALL_TIERS, True),
)

#: The seed's planetary agents and their tiers (seed R11.1).
DEFAULT_TIER_ASSIGNMENTS: Mapping[str, int] = MappingProxyType(
    {
        "sun": Tier.L0,
        **dict.fromkeys(("mercury", "earth", "jupiter"), Tier.L1),
        **dict.fromkeys(("venus", "mars", "pluto", "saturn", "titan"), Tier.L2),
        **dict.fromkeys(
            (
                "enceladus", "ganymede", "neptune", "charon", "uranus", "europa",
                "mimas", "io", "triton", "callisto", "atlas", "andromeda",
            ),
            Tier.L3,
        ),
    }
)  # fmt: skip

#: Tiers whose task proposals from escalating tiers need a justification (seed R11.2).
DEFAULT_ESCALATION_TARGET_TIERS: frozenset[int] = frozenset({Tier.L0, Tier.L1})


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """A node's policy. Validated on construction; raises LocalError(CONFIG_ERROR).

    ``sandbox_allow`` maps a sandbox id to the sandbox ids and agent ids its
    members may exchange messages with. ``authority_key`` (32-byte Ed25519
    public key) closes the swarm: only endorsed cards are admitted.
    """

    tier_rules: tuple[TierRule, ...] = DEFAULT_TIER_RULES
    sandbox_allow: Mapping[str, frozenset[str]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    authority_key: bytes | None = None
    tier_assignments: Mapping[str, int] = field(default_factory=lambda: DEFAULT_TIER_ASSIGNMENTS)
    escalation_target_tiers: frozenset[int] = DEFAULT_ESCALATION_TARGET_TIERS

    def __post_init__(self) -> None:
        problems: list[str] = []
        seen: set[int] = set()
        for rule in self.tier_rules:
            if rule.source_tier not in ALL_TIERS:
                problems.append(f"tier rule for unknown tier {rule.source_tier!r}")
            elif rule.source_tier in seen:
                problems.append(f"two tier rules for tier {rule.source_tier}")
            seen.add(rule.source_tier)
            if not rule.allowed_target_tiers <= ALL_TIERS:
                problems.append(f"tier rule {rule.source_tier}: unknown target tiers")
        if not self.escalation_target_tiers <= ALL_TIERS:
            problems.append("escalation_target_tiers: unknown tiers")
        if self.authority_key is not None and (
            not isinstance(self.authority_key, bytes) or len(self.authority_key) != 32
        ):
            problems.append("authority_key: must be a 32-byte Ed25519 public key")
        for name, tier in self.tier_assignments.items():
            if tier not in ALL_TIERS:
                problems.append(f"tier_assignments[{name!r}]: unknown tier {tier!r}")
        for sandbox, allowed in self.sandbox_allow.items():
            if not isinstance(allowed, frozenset):
                problems.append(f"sandbox_allow[{sandbox!r}]: must be a frozenset")
        if problems:
            raise LocalError(ErrorCode.CONFIG_ERROR, "; ".join(problems), problems=problems)
        # Freeze the caller's mappings so a config cannot change under a Policy.
        object.__setattr__(self, "sandbox_allow", MappingProxyType(dict(self.sandbox_allow)))
        object.__setattr__(
            self,
            "tier_assignments",
            MappingProxyType({k.lower(): v for k, v in self.tier_assignments.items()}),
        )


class PolicyError(RemoteError):
    """A peer's message or card was refused by this node's policy (ingress)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of one policy decision.

    ``code`` is None exactly when ``allowed``. ``cross_tier`` is true when the
    source and target tiers differ (it feeds the audit log, seed R11.4).
    ``target_tier`` is None for card admission.
    """

    allowed: bool
    code: ErrorCode | None
    reason: str
    cross_tier: bool = False
    source_tier: int | None = None
    target_tier: int | None = None

    @property
    def reported(self) -> bool:
        """True when the verdict leaves an event: a refusal, or a cross-tier allow."""
        return not self.allowed or self.cross_tier

    def _details(self) -> dict[str, object]:
        return {"source_tier": self.source_tier, "target_tier": self.target_tier}

    def _denial_code(self) -> ErrorCode:
        if self.allowed or self.code is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "the verdict allows; there is no error")
        return self.code

    def to_local_error(self) -> LocalError:
        """The denial as a LocalError, for refusing an outgoing message (egress).

        Raises LocalError(INVALID_ARGUMENT) if the verdict allows.
        """
        return LocalError(self._denial_code(), self.reason, **self._details())

    def to_remote_error(self) -> PolicyError:
        """The denial as a PolicyError (a RemoteError), for an incoming message (ingress).

        Raises LocalError(INVALID_ARGUMENT) if the verdict allows.
        """
        return PolicyError(self._denial_code(), self.reason, **self._details())


def _deny(code: ErrorCode, reason: str, source: int | None, target: int | None) -> Verdict:
    cross = source is not None and target is not None and source != target
    return Verdict(False, code, reason, cross, source, target)


def has_justification(metadata: Metadata | None) -> bool:
    """True when ``metadata`` carries a non-blank escalation justification."""
    text = metadata.escalation_justification if metadata is not None else None
    return isinstance(text, str) and text.strip() != ""


class Policy:
    """One node's routing policy; see the module docstring for the rules."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self._config = config if config is not None else PolicyConfig()
        self._rules: dict[int, TierRule] = {r.source_tier: r for r in self._config.tier_rules}
        # Keyed by the cards' ids; each entry holds the cards themselves, so the ids stay
        # theirs while the entry lives.
        self._memo: dict[tuple[int, int, str, bool, bool], _MemoEntry] = {}

    @property
    def config(self) -> PolicyConfig:
        return self._config

    @property
    def is_open(self) -> bool:
        """True when the swarm has no authority, so tiers and sandboxes are self-declared."""
        return self._config.authority_key is None

    def assigned_tier(self, agent_id: str) -> int | None:
        """The tier ``tier_assignments`` gives ``agent_id`` (case-insensitive), if any."""
        return self._config.tier_assignments.get(agent_id.lower())

    # -- admission --------------------------------------------------------------------------

    def admit_card(self, card: AgentCard) -> Verdict:
        """May ``card``'s tier and sandbox claims be used? Never raises.

        Denials: INVALID_ENDORSEMENT (closed swarm, missing, forged or foreign
        endorsement, or claims changed after endorsing) and TIER_VIOLATION (a
        planetary name claiming a tier other than its assigned one).
        """
        tier = int(card.tier)
        assigned = self.assigned_tier(card.id)
        if assigned is not None and assigned != tier:
            return _deny(
                ErrorCode.TIER_VIOLATION,
                f"agent {card.id!r} claims L{tier} but is assigned L{assigned}",
                tier,
                None,
            )
        authority = self._config.authority_key
        if authority is None:
            return Verdict(True, None, "open swarm: self-declared tier and sandbox", False, tier)
        if card.endorsement is None:
            return _deny(
                ErrorCode.INVALID_ENDORSEMENT,
                f"agent {card.id!r} has no endorsement in a swarm with an authority",
                tier,
                None,
            )
        if not card.endorsed_by(authority):
            return _deny(
                ErrorCode.INVALID_ENDORSEMENT,
                f"agent {card.id!r}: endorsement is not the authority's valid signature "
                "of this id, key, tier and sandbox",
                tier,
                None,
            )
        return Verdict(True, None, "endorsed by the swarm authority", False, tier)

    # -- messages ---------------------------------------------------------------------------

    def check_message(
        self,
        source: AgentCard,
        target: AgentCard,
        type: MessageType,
        metadata: Metadata | None,
        *,
        broadcast: bool = False,
    ) -> Verdict:
        """May ``source`` send a ``type`` message to ``target``? Never raises.

        ``source`` and ``target`` must be cards that passed :meth:`admit_card`
        (the registry holds only those). For a broadcast, call once per
        recipient with ``broadcast=True``. Used unchanged on egress and ingress.
        Rule order is in the module docstring.
        """
        justified = type == MessageType.TASK_PROPOSAL and has_justification(metadata)
        key = (id(source), id(target), type, broadcast, justified)
        entry = self._memo.get(key)
        if entry is not None and entry.source is source and entry.target is target:
            return entry.verdict
        verdict = self._decide(source, target, type, metadata, broadcast)
        if len(self._memo) >= MEMO_SIZE:
            self._memo.clear()
        self._memo[key] = _MemoEntry(source, target, verdict)
        return verdict

    def _decide(
        self,
        source: AgentCard,
        target: AgentCard,
        type: MessageType,
        metadata: Metadata | None,
        broadcast: bool,
    ) -> Verdict:
        s_tier, t_tier = int(source.tier), int(target.tier)
        authority = self._config.authority_key
        if authority is not None:
            for card in (source, target):
                e = card.endorsement
                if e is None or e.authority_key != authority:
                    return _deny(
                        ErrorCode.INVALID_ENDORSEMENT,
                        f"agent {card.id!r} is not endorsed by the swarm authority",
                        s_tier,
                        t_tier,
                    )
        reason = self._sandbox_denial(source, target)
        if reason is not None:
            return _deny(ErrorCode.SANDBOX_VIOLATION, reason, s_tier, t_tier)
        rule = self._rules.get(s_tier)
        if rule is None:
            return _deny(
                ErrorCode.TIER_VIOLATION, f"no tier rule for L{s_tier} senders", s_tier, t_tier
            )
        l0_broadcast = broadcast and s_tier == Tier.L0
        if t_tier not in rule.allowed_target_tiers and not l0_broadcast:
            return _deny(
                ErrorCode.TIER_VIOLATION,
                f"L{s_tier} agent {source.id!r} may not send {type} to L{t_tier} "
                f"agent {target.id!r}",
                s_tier,
                t_tier,
            )
        if (
            rule.requires_escalation_justification
            and type == MessageType.TASK_PROPOSAL
            and t_tier in self._config.escalation_target_tiers
            and not has_justification(metadata)
        ):
            return _deny(
                ErrorCode.ESCALATION_REQUIRED,
                f"task-proposal from L{s_tier} agent {source.id!r} to L{t_tier} agent "
                f"{target.id!r} needs metadata.escalationJustification",
                s_tier,
                t_tier,
            )
        why = "L0 broadcast reaches every tier" if l0_broadcast else "allowed"
        return Verdict(True, None, why, s_tier != t_tier, s_tier, t_tier)

    def check_envelope(self, source: AgentCard, target: AgentCard, envelope: Envelope) -> Verdict:
        """:meth:`check_message` for ``envelope``, after checking that its ``sender`` field
        names ``source`` (else SENDER_MISMATCH: the typed sender is not the authenticated
        one)."""
        if envelope.sender != source.id:
            return _deny(
                ErrorCode.SENDER_MISMATCH,
                f"envelope sender {envelope.sender!r} is not the authenticated agent {source.id!r}",
                int(source.tier),
                int(target.tier),
            )
        type_, broadcast = envelope.type, envelope.recipient == BROADCAST
        if type_ is not MessageType.TASK_PROPOSAL:
            # The memo of check_message, read here: this runs twice for every envelope.
            entry = self._memo.get((id(source), id(target), type_, broadcast, False))
            if entry is not None and entry.source is source and entry.target is target:
                return entry.verdict
        return self.check_message(source, target, type_, envelope.metadata, broadcast=broadcast)

    def _allows(self, sandbox: str, other: AgentCard) -> bool:
        """Does ``sandbox`` let its members talk with ``other``?"""
        if other.sandbox_id == sandbox:
            return True
        allowed = self._config.sandbox_allow.get(sandbox, frozenset())
        return other.id in allowed or (other.sandbox_id is not None and other.sandbox_id in allowed)

    def _sandbox_denial(self, source: AgentCard, target: AgentCard) -> str | None:
        s_box, t_box = source.sandbox_id, target.sandbox_id
        if s_box is not None and not self._allows(s_box, target):
            return (
                f"agent {source.id!r} in sandbox {s_box!r} may not reach agent "
                f"{target.id!r} ({_where(t_box)})"
            )
        if t_box is not None and not self._allows(t_box, source):
            return (
                f"agent {target.id!r} in sandbox {t_box!r} does not accept agent "
                f"{source.id!r} ({_where(s_box)})"
            )
        return None

    # -- discovery --------------------------------------------------------------------------

    def can_discover(self, viewer: AgentCard, card: AgentCard) -> bool:
        """May ``viewer`` see ``card`` in discovery results (seed R10.4, Property 30)?"""
        if viewer.id == card.id and viewer.public_key == card.public_key:
            return True
        return self._sandbox_denial(viewer, card) is None

    def filter_discoverable(self, viewer: AgentCard, cards: Iterable[AgentCard]) -> list[AgentCard]:
        """The cards of ``cards`` that ``viewer`` may discover, in their order."""
        return [c for c in cards if self.can_discover(viewer, c)]


MEMO_SIZE = 4096


@dataclass(frozen=True, slots=True)
class _MemoEntry:
    source: AgentCard
    target: AgentCard
    verdict: Verdict


def _where(sandbox: str | None) -> str:
    return "no sandbox" if sandbox is None else f"sandbox {sandbox!r}"
