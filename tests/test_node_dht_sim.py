"""Nodes with their DHT in the simulator: discovery by capability and by agent id
reaches agents the asking node never met (seed R1.7, R4.3-4.4)."""

from __future__ import annotations

from typing import Any

import pytest

from p2pnode.core.card import Capability
from p2pnode.core.envelope import Envelope
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.runtime import NodeConfig
from tests.sim import met, open_swarm, wait_until


async def echo(envelope: Envelope) -> Any:
    return {"from": envelope.recipient}


async def test_discovery_through_the_dht(autojump_clock: Any) -> None:
    # Default timings, each node opened with its DHT as a daemon opens it.
    async with open_swarm(12, NodeConfig(), seed=7, dht=True) as sw:
        nodes = sw.nodes
        # The last node hosts two agents: both must be findable, neither hides the other.
        await nodes[-1].add_agent("io", echo, tier=3, capabilities=(Capability("test.unit", "T"),))
        await nodes[-1].add_agent(
            "europa", echo, tier=3, capabilities=(Capability("docs.write", "D"),)
        )
        await nodes[1].add_agent("callisto", echo, tier=3)
        for node in nodes:
            await node.join()  # returns once its cards are provided to the DHT
        # Every node has met the bootstrap node, which so knows every agent: it is not
        # the bootstrap node that tells the asker about "io" below.
        await wait_until(lambda: all(met(nodes[0], node) for node in nodes[1:]))
        asker = nodes[1]
        assert "io" not in asker.registry  # never met: only the bootstrap node
        found = await asker.find("docs.write")
        assert [c.id for c in found] == ["europa"]
        reply = await asker.request("callisto", "test.unit", None, capability=True)
        assert reply.sender == "io"
        # By agent id, through the DHT's agent record.
        other = nodes[2]
        await other.add_agent("ganymede", echo, tier=3)
        assert (await other.request("ganymede", "europa", None)).payload == {"from": "europa"}
        with pytest.raises(LocalError) as info:
            await other.request("ganymede", "no-such-agent", None)
        assert info.value.code is ErrorCode.AGENT_NOT_FOUND
