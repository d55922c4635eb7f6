"""Probing owners: is a peer this node has no channel to alive?

An agent id claimed by two owners is ambiguous only while both are alive
(docs/protocol/node.md "Agent ids and owners"). An owner restarted under a new
key leaves its old card behind in the DHT and in registries; a node that never
had a channel to the old owner cannot tell it is dead. Before refusing a bare id
as ambiguous, the node dials each owner it has no open channel to: one that
answers is live; one whose dials all fail is marked unreachable by its link
(node/links.py), and the id resolves to the owner left.
"""

from __future__ import annotations

from collections.abc import Iterable

import trio

from p2pnode.core.errors import LocalError
from p2pnode.core.identity import PeerId
from p2pnode.node.channels import ChannelState
from p2pnode.node.links import LinkManager

#: The longest a probe waits for a verdict (the link's redials of a dead peer take about
#: 1.6 s: 6 attempts from 0.05 s doubling, each refused at once or timed out).
PROBE_WINDOW = 5.0


async def probe(links: LinkManager, peers: Iterable[PeerId], window: float = PROBE_WINDOW) -> None:
    """Dial each of ``peers`` that has no open link, at once, and wait until each link is
    open or closed for good (its redials failed), at most ``window`` seconds."""
    waiting = [p for p in dict.fromkeys(peers) if _needs_probe(links, p)]
    if not waiting:
        return
    with trio.move_on_after(window):
        async with trio.open_nursery() as nursery:
            for peer_id in waiting:
                nursery.start_soon(_settle, links, peer_id)


def _needs_probe(links: LinkManager, peer_id: PeerId) -> bool:
    link = links.get(peer_id)
    return link is None or link.state is not ChannelState.OPEN


async def _settle(links: LinkManager, peer_id: PeerId) -> None:
    """Dial ``peer_id``; back when its link opens, closes (redials failed: the link marks
    the peer unreachable) or the dial timeout passes."""
    try:
        await links.link(peer_id).wait_open()
    except LocalError:
        pass  # closed, or the node is closing: the registry heard from the link


__all__ = ["PROBE_WINDOW", "probe"]
