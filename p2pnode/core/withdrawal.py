"""Signed withdrawals: an owner's word that one of its agents has left.

When a node stops hosting an agent (the agent removed, the node stopping
gracefully) it signs a :class:`Withdrawal` of the agent's card and sends it to
every connected peer (in a HELLO, docs/protocol/node.md "Leaving") and to the
DHT (as the record that replaces the card's, docs/protocol/dht.md §4.5).
Holders drop the card at once instead of waiting for it to expire.

Rules (docs/protocol/data-model.md "Withdrawal"):

* Only the owner can withdraw: the signature is the card owner's Ed25519 key,
  over ``b"p2pnode-withdraw-v1\\x00" || canonical_pack([id, publicKey,
  revision, withdrawnAt, expiresAt])``.
* ``revision`` is the withdrawn card's revision + 1. A withdrawal ends that
  owner's cards of the id whose revision is *lower*; a card of the same owner
  with an equal or higher revision (the agent added again, the node restarted,
  whose new card's revision is its issue time in ms) is untouched, so a
  withdrawal replayed later cannot take down a later card.
* ``expiresAt`` is the withdrawn card's expiry: after it the card is void
  anyway, and holders forget the withdrawal. A withdrawal is remembered until
  then so that an older card met again (a stale DHT read, a late HELLO) is not
  taken back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from p2pnode.core.card import AgentCard
from p2pnode.core.card_rules import MAX_TEXT
from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.identity import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    Identity,
    PeerId,
    verify_signature,
)
from p2pnode.core.wire import WireError, WireLimits, canonical_pack, unpack_untrusted

WITHDRAWAL_DOMAIN = b"p2pnode-withdraw-v1\x00"
#: The keys of a withdrawal's plain form, all required.
WITHDRAWAL_KEYS = frozenset(
    {"id", "publicKey", "revision", "withdrawnAt", "expiresAt", "withdrawn", "signature"}
)
MAX_WITHDRAWAL_BYTES = 1024
_LIMITS = WireLimits(max_size=MAX_WITHDRAWAL_BYTES, max_array_len=8, max_map_len=8)
_UINT64 = 2**64


class WithdrawalError(RemoteError):
    """A withdrawal that is malformed or not signed by the card's owner."""


@dataclass(frozen=True, slots=True)
class Withdrawal:
    """The owner of ``public_key`` withdraws its agent ``agent_id`` (cards below ``revision``)."""

    agent_id: str
    public_key: bytes
    revision: int
    withdrawn_at: int
    expires_at: int
    signature: bytes = b""
    peer_id: PeerId = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "peer_id", PeerId.from_public_key(self.public_key))

    @classmethod
    def of(cls, card: AgentCard, identity: Identity, now_ms: int) -> Withdrawal:
        """The signed withdrawal of ``card`` by its owner ``identity`` at ``now_ms``.

        Raises LocalError(INVALID_SIGNATURE) when ``identity`` does not own the card.
        """
        if identity.public_key != card.public_key:
            raise LocalError(ErrorCode.INVALID_SIGNATURE, "only a card's owner withdraws it")
        unsigned = cls(card.id, card.public_key, card.revision + 1, now_ms, card.expires_at)
        return unsigned._with_signature(identity.sign(unsigned.signing_bytes()))

    def _with_signature(self, signature: bytes) -> Withdrawal:
        return Withdrawal(
            self.agent_id,
            self.public_key,
            self.revision,
            self.withdrawn_at,
            self.expires_at,
            signature,
        )

    def signing_bytes(self) -> bytes:
        """What the owner's signature covers (see the module docstring)."""
        return WITHDRAWAL_DOMAIN + canonical_pack(
            [self.agent_id, self.public_key, self.revision, self.withdrawn_at, self.expires_at]
        )

    def ends(self, card: AgentCard) -> bool:
        """True when this withdrawal ends ``card``: same owner and id, lower revision."""
        return (
            card.public_key == self.public_key
            and card.id == self.agent_id
            and card.revision < self.revision
        )

    def is_expired(self, now_ms: int) -> bool:
        return now_ms >= self.expires_at

    def to_dict(self) -> dict[str, Any]:
        """The plain form (msgpack map; ``withdrawn`` tells it from a card's)."""
        return {
            "id": self.agent_id,
            "publicKey": self.public_key,
            "revision": self.revision,
            "withdrawnAt": self.withdrawn_at,
            "expiresAt": self.expires_at,
            "withdrawn": True,
            "signature": self.signature,
        }

    def to_bytes(self) -> bytes:
        return canonical_pack(self.to_dict())

    @classmethod
    def from_bytes_untrusted(cls, data: bytes) -> Withdrawal:
        """Decode and verify a peer's withdrawal. Raises WithdrawalError
        (MALFORMED_MESSAGE for the shape, INVALID_SIGNATURE for the signature)."""
        try:
            plain = unpack_untrusted(data, _LIMITS)
        except WireError as exc:
            raise WithdrawalError(exc.code, f"withdrawal: {exc.message}") from None
        withdrawal = cls._from_plain_untrusted(plain)
        if not verify_signature(
            withdrawal.public_key, withdrawal.signing_bytes(), withdrawal.signature
        ):
            raise WithdrawalError(
                ErrorCode.INVALID_SIGNATURE,
                f"withdrawal of {withdrawal.agent_id!r} is not signed by its owner",
            )
        return withdrawal

    @classmethod
    def _from_plain_untrusted(cls, plain: object) -> Withdrawal:
        if not isinstance(plain, dict) or set(plain) != WITHDRAWAL_KEYS:
            raise WithdrawalError(ErrorCode.MALFORMED_MESSAGE, "withdrawal keys")
        agent_id, key, signature = plain["id"], plain["publicKey"], plain["signature"]
        numbers = (plain["revision"], plain["withdrawnAt"], plain["expiresAt"])
        if not isinstance(agent_id, str) or not 0 < len(agent_id) <= MAX_TEXT:
            raise WithdrawalError(ErrorCode.MALFORMED_MESSAGE, "withdrawal agent id")
        if not isinstance(key, bytes) or len(key) != PUBLIC_KEY_BYTES:
            raise WithdrawalError(ErrorCode.MALFORMED_MESSAGE, "withdrawal public key")
        if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
            raise WithdrawalError(ErrorCode.MALFORMED_MESSAGE, "withdrawal signature")
        if plain["withdrawn"] is not True or not all(
            type(n) is int and 0 <= n < _UINT64 for n in numbers
        ):
            raise WithdrawalError(ErrorCode.MALFORMED_MESSAGE, "withdrawal numbers")
        return cls(agent_id, key, *numbers, signature)


def is_withdrawal_untrusted(payload: bytes) -> bool:
    """Does ``payload`` (a card record's, from the DHT) hold a withdrawal rather than a
    card? Only the marker is read; :meth:`Withdrawal.from_bytes_untrusted` checks it."""
    try:
        plain = unpack_untrusted(payload, _LIMITS)
    except WireError:
        return False
    return isinstance(plain, dict) and plain.get("withdrawn") is True


__all__ = [
    "MAX_WITHDRAWAL_BYTES",
    "WITHDRAWAL_DOMAIN",
    "Withdrawal",
    "WithdrawalError",
    "is_withdrawal_untrusted",
]
