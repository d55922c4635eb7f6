"""Prometheus metrics (``p2pnode run --metrics``): a scrape of real nodes in the simulator
parsed with prometheus-client's own parser shows what happened (messages, routing latency,
channels, gossip, a forged delta's security event, tool calls); an address in use is a
CONFIG_ERROR. tests/test_metrics_daemon.py scrapes a daemon over HTTP."""

from __future__ import annotations

import socket
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from p2pnode.agent.definition import Agent
from p2pnode.core.envelope import MessageType
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.crdt.gossip import DeltaPush
from p2pnode.crdt.ops import CounterAdd, SetAdd
from p2pnode.crdt.replica import Replica
from p2pnode.node.frames import encode_envelope
from p2pnode.node.observability import LATENCY_BUCKETS_MS
from p2pnode.services.metrics import MetricsExporter, NodeCollector, Scrape, take_scrape
from p2pnode.services.shared.docops import gossip_payload
from tests.sim import FAST_SHARED, converged, knows, open_swarm, wait_until

DOC = "ledger"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of a page, parsed by prometheus-client: (name, sorted labels) -> value."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def page(scrape: Scrape) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(cast(Collector, NodeCollector(lambda: scrape)))
    return generate_latest(registry).decode()


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def histogram_is_sound(samples: Samples, name: str) -> float:
    """The histogram's buckets are cumulative and end at its count; returns the count."""
    bounds = [repr(b / 1000) for b in LATENCY_BUCKETS_MS] + ["+Inf"]
    counts = [value(samples, f"{name}_bucket", le=le) for le in bounds]
    assert counts == sorted(counts)
    assert counts[-1] == value(samples, f"{name}_count")
    return counts[-1]


async def test_a_scrape_shows_what_the_nodes_did(autojump_clock: Any) -> None:
    async with open_swarm(seed=5, discovery=True, shared=FAST_SHARED) as sw:
        a, b = await sw.add(agent="alpha"), await sw.add(agent="beta")
        assert a.node is not None and b.node is not None
        toolbox = Agent("toolbox")

        @toolbox.tool()
        def double(x: int) -> int:
            """Twice x."""
            return 2 * x

        await b.node.add_agent(toolbox)
        for m in (a, b):
            await m.shared.subscribe(m.agent, DOC)
        node_a, node_b = a.node, b.node
        await wait_until(
            lambda: a.shared.peers(DOC) and b.shared.peers(DOC) and knows(node_a, node_b)
        )
        reply = await a.node.request("alpha", "beta", {"x": 1})
        assert reply.payload == {"echo": {"x": 1}}
        assert await a.node.tools.call_tool("toolbox.double", {"x": 21}, caller="alpha") == 42
        for i in range(3):
            await a.shared.update(a.agent, DOC, SetAdd(("s",), i))
        await wait_until(lambda: converged([a, b], DOC))
        # A forged delta from a (beta's operation, signed with a's key) reaches b.
        forged = Replica(b.shared.replica_id).update(DOC, CounterAdd(("n",), 5))
        frame = gossip_payload(DOC, DeltaPush.of(forged.sign(a.node.identity)).encode())
        env = a.node.envelope(a.agent, b.agent, MessageType.STREAM_DATA, frame)
        await a.node.links.link(b.node.peer_id).send(encode_envelope(env))
        await wait_until(lambda: b.shared.forged_deltas == 1)

        sa, sb = parse(page(take_scrape(a.node))), parse(page(take_scrape(b.node)))
        assert value(sa, "p2pnode_messages_total", direction="sent", type="request") >= 2
        assert value(sb, "p2pnode_messages_total", direction="received", type="request") >= 2
        assert value(sb, "p2pnode_messages_total", direction="sent", type="response") >= 2
        assert value(sb, "p2pnode_messages_total", direction="received", type="stream-data") >= 3
        assert histogram_is_sound(sa, "p2pnode_routing_latency_seconds") >= 2
        # (the virtual clock makes every latency 0 s: the real one is in the daemon's test)
        assert value(sa, "p2pnode_routing_outcomes_total", outcome="delivered") >= 2
        assert value(sa, "p2pnode_channels", state="open") == 1
        assert value(sa, "p2pnode_peers") == 1 and value(sa, "p2pnode_known_agents") >= 3
        assert value(sa, "p2pnode_dht_cards") >= 3  # the swarm's in-memory directory
        # Gossip: b learned a's three updates, is not behind, and counted the forgery.
        assert value(sb, "p2pnode_gossip_deltas_total", doc=DOC, outcome="new") >= 3
        assert value(sb, "p2pnode_gossip_deltas_total", doc=DOC, outcome="forged") == 1
        assert value(sb, "p2pnode_gossip_lag_operations", doc=DOC) == 0
        assert value(sb, "p2pnode_gossip_peers", doc=DOC) == 1
        assert value(sb, "p2pnode_security_events_total", code="PEER_ID_MISMATCH") == 1
        # The tool's owner counts its use and how long it took.
        assert value(sb, "p2pnode_tool_calls_total", tool="toolbox.double") == 1
        assert value(sb, "p2pnode_tool_errors_total") == 0
        assert value(sb, "p2pnode_tool_duration_seconds_count") == 1


@pytest.mark.slow
async def test_an_address_in_use_is_a_config_error(autojump_clock: Any) -> None:
    async with open_swarm(1) as sw:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = int(taken.getsockname()[1])
            exporter = MetricsExporter(sw.nodes[0], ("127.0.0.1", port))
            with pytest.raises(LocalError) as info:
                await sw.nodes[0].start_service(exporter)
            assert info.value.code is ErrorCode.CONFIG_ERROR and str(port) in info.value.message
