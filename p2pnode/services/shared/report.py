"""How shared state reports the CRDT deltas its gossip core skipped (gossip.md §6, §9).

A delta its claimed origin did not sign (``PEER_ID_MISMATCH``, ``INVALID_SIGNATURE``)
is a security event naming the peer that sent the frame: an honest node verifies
before it forwards, so that peer forged it or passed on what it did not check. A
malformed delta is an error event, one per frame, naming the source agent.
"""

from __future__ import annotations

from p2pnode.core.card import AgentCard
from p2pnode.core.envelope import Envelope
from p2pnode.core.errors import ErrorCode
from p2pnode.crdt.clock import CRDTError
from p2pnode.crdt.signing import ForgedDeltaError
from p2pnode.node.service import EventSink


def report_rejected(
    events: EventSink,
    doc: str,
    source: AgentCard,
    envelope: Envelope,
    rejected: tuple[CRDTError, ...],
) -> int:
    """Report the deltas of one frame from ``source`` that the core rejected; returns
    how many of them were forged."""
    peer = source.id
    forged = [exc for exc in rejected if isinstance(exc, ForgedDeltaError)]
    malformed = [exc for exc in rejected if not isinstance(exc, ForgedDeltaError)]
    for exc in forged:
        events.security(
            exc.code,
            f"forged CRDT update of {doc!r} from agent {peer} dropped: {exc.message}",
            str(source.peer_id),
            envelope,
        )
    if malformed:
        events.error(
            ErrorCode.CRDT_DESERIALIZATION_FAILED,
            f"skipped {len(malformed)} bad CRDT update(s) of {doc!r} from agent {peer}: "
            f"{malformed[-1].message}",
            str(source.peer_id),
            envelope,
        )
    return len(forged)


__all__ = ["report_rejected"]
