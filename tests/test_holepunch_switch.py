"""Which channel a link keeps when a second one to the same peer arrives
(docs/protocol/holepunch.md §5): a direct channel replaces a relayed one, a relayed one
never replaces a direct one, and between two of one kind the channel dialed by the lower
peer id wins. The channel not kept is still read, then closed after the grace period."""

from __future__ import annotations

import itertools
from typing import Any, cast

import pytest
import trio

from p2pnode.core.identity import Identity, PeerId
from p2pnode.node.channels import ChannelState, PeerLink, RetryPolicy
from p2pnode.transport.channel import SecureChannel

LOW, HIGH = sorted((Identity.generate().peer_id for _ in range(2)), key=lambda p: p.raw)


class FakeChannel:
    """A secure channel that never receives and records whether it was closed."""

    def __init__(self, relayed: bool) -> None:
        self.relayed = relayed
        self.closed = False
        self.remote_address = None

    async def receive_message(self) -> bytes:
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        self.closed = True


async def _no_dial() -> SecureChannel:
    raise AssertionError("the test adopts channels; nothing dials")


async def _no_frames(peer: PeerId, frame: bytes) -> None:
    pass


def _expected_keep_first(first: tuple[bool, PeerId], second: tuple[bool, PeerId]) -> bool:
    (first_relayed, first_dialer), (second_relayed, second_dialer) = first, second
    if first_relayed != second_relayed:
        return not first_relayed  # the direct one
    return first_dialer.raw <= second_dialer.raw


CASES = list(itertools.product([False, True], [LOW, HIGH], [False, True], [LOW, HIGH]))


@pytest.mark.parametrize(
    ("first_relayed", "first_dialer", "second_relayed", "second_dialer"),
    CASES,
    ids=[
        f"{'relayed' if a else 'direct'}-by-{'low' if b is LOW else 'high'}"
        f"+{'relayed' if c else 'direct'}-by-{'low' if d is LOW else 'high'}"
        for a, b, c, d in CASES
    ],
)
async def test_which_channel_a_link_keeps(
    first_relayed: bool,
    first_dialer: PeerId,
    second_relayed: bool,
    second_dialer: PeerId,
    autojump_clock: Any,
) -> None:
    retry = RetryPolicy(retire_grace=1.0)
    states: list[ChannelState] = []
    async with trio.open_nursery() as nursery:
        link = PeerLink(LOW, HIGH, nursery, _no_dial, _no_frames,
                        lambda _, s: states.append(s), retry)  # fmt: skip
        first, second = FakeChannel(first_relayed), FakeChannel(second_relayed)
        assert link.adopt(cast(SecureChannel, first), first_dialer)
        assert link.relayed is first_relayed
        keep_first = _expected_keep_first(
            (first_relayed, first_dialer), (second_relayed, second_dialer)
        )
        assert link.adopt(cast(SecureChannel, second), second_dialer) is not keep_first
        kept, retired = (first, second) if keep_first else (second, first)
        assert link.relayed is kept.relayed
        assert states == [ChannelState.OPEN]  # the link stayed open throughout
        await trio.sleep(retry.retire_grace / 2)
        assert not retired.closed  # still read for a while: nothing in flight is lost
        await trio.sleep(retry.retire_grace)
        assert retired.closed and not kept.closed
        await link.aclose()
        nursery.cancel_scope.cancel()
