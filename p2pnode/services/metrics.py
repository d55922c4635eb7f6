"""Prometheus metrics of a running node (``p2pnode run --metrics HOST:PORT``).

Theory of operation
-------------------
Nothing on the message path is instrumented for Prometheus: the node already
folds every event into its metrics' counters (and the routing latency histogram's
buckets), and keeps per-document gossip counters. A scrape reads those, through the
protocols below (:class:`MetricsReader`, :class:`DocumentFigures`):

* :class:`MetricsExporter` (a node service) serves the page with
  ``prometheus_client.start_http_server``, which answers each request on a
  thread of its own. A scrape must not read the node's structures from that
  thread: the trio thread mutates them (a dict resized during iteration
  raises, and a half-updated set of counters is not a snapshot). So the
  collector asks the trio thread for a :class:`Scrape` with
  ``trio.from_thread.run_sync``: :func:`take_scrape` runs *on the trio
  thread*, between two trio tasks' steps, and builds fresh plain data
  (``node.status()``, ``events.metrics()``, the gossip counters); the HTTP
  thread only turns that immutable snapshot into metric families. The trio
  loop is never blocked by the HTTP server: it spends one short synchronous
  call per scrape, and a slow client holds only its own thread.
* :func:`families` is the pure mapping from a :class:`Scrape` to Prometheus
  metric families (names below), tested without a server.

Names (all prefixed ``p2pnode_``): ``messages_total{direction,type}``,
``routing_paths_total{path}``, ``routing_outcomes_total{outcome}``,
``routing_latency_seconds`` (histogram), ``security_events_total{code}``,
``errors_total{code}``, ``audit_events_total``, ``channels{state}``,
``peers``, ``known_agents``, ``dht_*`` (``dht_contacts`` and ``dht_records``
gauges, each other DHT counter as ``dht_<name>_total``, e.g.
``dht_rpcs_sent_total``), ``gossip_lag_operations{doc}``,
``gossip_peers{doc}``, ``gossip_deltas_total{doc,outcome}`` (``new``,
``duplicate``, ``forged``, ``malformed``), ``gossip_frames_dropped_total``,
``tool_calls_total{tool}``, ``tool_errors_total``, ``tool_duration_seconds``
(summary).

``prometheus_client`` is the optional extra ``p2pnode[metrics]``: this module
imports it only when used, and :func:`check_metrics_extra` (called by the
exporter, and by the command line before the node starts) raises one
``CONFIG_ERROR`` naming the extra when it is missing.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import trio

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.crdt.gossip import GossipStats

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.registry import Collector

logger = logging.getLogger("p2pnode.metrics")

#: DHT statistics that are levels, not counts since start.
_DHT_GAUGES = frozenset({"contacts", "records", "cards"})


#: The error without the library (the message names the extra).
MISSING_EXTRA = "--metrics needs the prometheus-client package: pip install 'p2pnode[metrics]'"


def check_metrics_extra() -> None:
    """Raise LocalError(CONFIG_ERROR) naming the extra when prometheus-client is missing."""
    if importlib.util.find_spec("prometheus_client") is None:
        raise LocalError(ErrorCode.CONFIG_ERROR, MISSING_EXTRA)


class MetricsFigures(Protocol):
    """The node's aggregate metrics, one snapshot (the figures a page shows of it)."""

    @property
    def sent_by_type(self) -> Mapping[str, int]: ...
    @property
    def received_by_type(self) -> Mapping[str, int]: ...
    @property
    def routing_by_path(self) -> Mapping[str, int]: ...
    @property
    def routing_by_outcome(self) -> Mapping[str, int]: ...
    @property
    def security_by_code(self) -> Mapping[str, int]: ...
    @property
    def errors_by_code(self) -> Mapping[str, int]: ...
    @property
    def tool_invocations_by_tool(self) -> Mapping[str, int]: ...
    @property
    def audit_events(self) -> int: ...
    @property
    def tool_errors(self) -> int: ...
    @property
    def tool_duration_count(self) -> int: ...
    @property
    def tool_duration_sum_ms(self) -> float: ...
    @property
    def routing_latency_sum_ms(self) -> float: ...
    @property
    def routing_latency_buckets(self) -> tuple[int, ...]:
        """Samples per latency bucket, not cumulative (one more than the bounds)."""


class MetricsReader(Protocol):
    """The node's aggregate metrics (its observability)."""

    @property
    def latency_bounds_ms(self) -> tuple[float, ...]:
        """The routing latency histogram's upper bucket bounds, in ms."""

    def metrics(self) -> MetricsFigures: ...


class DocumentFigures(Protocol):
    """What a scrape reads of the shared documents (the shared-state service)."""

    @property
    def frames_dropped(self) -> int: ...

    def statistics(self, doc: str) -> GossipStats: ...

    def lag(self, doc: str) -> int: ...

    def peers(self, doc: str) -> tuple[str, ...]: ...


class MetricsSource(Protocol):
    """What a scrape reads of a node (:class:`p2pnode.runtime.Node` is one): its
    metrics, its ``status``, and when ``status`` lists documents, ``shared``."""

    @property
    def events(self) -> MetricsReader: ...

    @property
    def shared(self) -> DocumentFigures: ...

    def status(self) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class DocumentScrape:
    """One shared document's gossip figures."""

    stats: GossipStats
    lag: int
    peers: int


@dataclass(frozen=True, slots=True)
class Scrape:
    """Plain data taken on the trio thread; read-only once made."""

    metrics: MetricsFigures
    status: dict[str, Any]
    documents: dict[str, DocumentScrape]
    frames_dropped: int
    #: The routing latency histogram's upper bucket bounds (ms).
    latency_bounds_ms: tuple[float, ...]


def take_scrape(node: MetricsSource) -> Scrape:
    """Everything one scrape shows, copied (call on the node's trio thread)."""
    status = node.status()
    documents: dict[str, DocumentScrape] = {}
    dropped = 0
    if status.get("documents"):
        shared = node.shared
        dropped = shared.frames_dropped
        for doc in status["documents"]:
            documents[doc] = DocumentScrape(
                shared.statistics(doc), shared.lag(doc), len(shared.peers(doc))
            )
    events = node.events
    return Scrape(events.metrics(), status, documents, dropped, events.latency_bounds_ms)


def families(scrape: Scrape) -> list[Metric]:
    """The metric families of one scrape (see the module docstring for the names)."""
    from prometheus_client.core import CounterMetricFamily, SummaryMetricFamily

    m = scrape.metrics
    out: list[Metric] = []
    messages = CounterMetricFamily(
        "p2pnode_messages", "Envelopes sent and received", labels=["direction", "type"]
    )
    for direction, by_type in (("sent", m.sent_by_type), ("received", m.received_by_type)):
        for kind, count in sorted(by_type.items()):
            messages.add_metric([direction, kind], count)
    out.append(messages)
    out.append(_labelled("p2pnode_routing_paths", "Routing decisions by path", "path",
                         m.routing_by_path))  # fmt: skip
    out.append(_labelled("p2pnode_routing_outcomes", "Routing decisions by outcome", "outcome",
                         m.routing_by_outcome))  # fmt: skip
    out.append(_latency(m, scrape.latency_bounds_ms))
    out.append(_labelled("p2pnode_security_events", "Security events by code", "code",
                         m.security_by_code))  # fmt: skip
    out.append(_labelled("p2pnode_errors", "Error events by code", "code", m.errors_by_code))
    out.append(CounterMetricFamily("p2pnode_audit_events", "Audit events", value=m.audit_events))
    out.extend(_node_families(scrape.status))
    out.extend(_gossip_families(scrape))
    out.append(_labelled("p2pnode_tool_calls", "Tool, resource and prompt uses by name",
                         "tool", m.tool_invocations_by_tool))  # fmt: skip
    out.append(CounterMetricFamily("p2pnode_tool_errors", "Failed or refused tool uses",
                                   value=m.tool_errors))  # fmt: skip
    out.append(
        SummaryMetricFamily(
            "p2pnode_tool_duration_seconds",
            "Time tool uses took on the owner",
            count_value=m.tool_duration_count,
            sum_value=m.tool_duration_sum_ms / 1000,
        )
    )
    return out


def _labelled(name: str, doc: str, label: str, counts: Iterable[Any]) -> Metric:
    from prometheus_client.core import CounterMetricFamily

    family = CounterMetricFamily(name, doc, labels=[label])
    for key, count in sorted(dict(counts).items()):
        family.add_metric([str(key)], count)
    return family


def _latency(m: MetricsFigures, bounds_ms: tuple[float, ...]) -> Metric:
    from prometheus_client.core import HistogramMetricFamily

    buckets: list[tuple[str, float]] = []
    cumulative = 0
    counts = m.routing_latency_buckets or (0,) * (len(bounds_ms) + 1)
    for bound, count in zip((*bounds_ms, None), counts, strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound is None else repr(bound / 1000), cumulative))
    return HistogramMetricFamily(
        "p2pnode_routing_latency_seconds",
        "Time from routing an envelope to its delivery or refusal",
        buckets=buckets,
        sum_value=m.routing_latency_sum_ms / 1000,
    )


def _node_families(status: dict[str, Any]) -> Iterator[Metric]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    channels = GaugeMetricFamily("p2pnode_channels", "Channels to peers by state",
                                 labels=["state"])  # fmt: skip
    states: dict[str, int] = {}
    for link in status.get("channels", []):
        states[link["state"]] = states.get(link["state"], 0) + 1
    for state, count in sorted(states.items()):
        channels.add_metric([state], count)
    yield channels
    yield GaugeMetricFamily("p2pnode_peers", "Peers whose agents are known",
                            value=len(status.get("peers", [])))  # fmt: skip
    yield GaugeMetricFamily("p2pnode_known_agents", "Agent cards in the registry",
                            value=status.get("knownAgents", 0))  # fmt: skip
    for key, value in sorted(status.get("discovery", {}).items()):
        if type(value) is not int:
            continue  # per-bucket lists and the like
        name = f"p2pnode_dht_{key}"
        if key in _DHT_GAUGES:
            yield GaugeMetricFamily(name, f"DHT {key}", value=value)
        else:
            yield CounterMetricFamily(name, f"DHT {key.replace('_', ' ')}", value=value)


def _gossip_families(scrape: Scrape) -> Iterator[Metric]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    lag = GaugeMetricFamily(
        "p2pnode_gossip_lag_operations",
        "Operations peers' digests show that this replica has not applied",
        labels=["doc"],
    )
    peers = GaugeMetricFamily("p2pnode_gossip_peers", "Gossip peers", labels=["doc"])
    deltas = CounterMetricFamily(
        "p2pnode_gossip_deltas", "Deltas received by outcome", labels=["doc", "outcome"]
    )
    for doc, d in sorted(scrape.documents.items()):
        lag.add_metric([doc], d.lag)
        peers.add_metric([doc], d.peers)
        s = d.stats
        outcomes = {"new": s.new_deltas, "duplicate": s.duplicates, "forged": s.forged,
                    "malformed": s.errors - s.forged}  # fmt: skip
        for outcome, count in outcomes.items():
            deltas.add_metric([doc, outcome], count)
    yield from (lag, peers, deltas)
    yield CounterMetricFamily("p2pnode_gossip_frames_dropped",
                              "Gossip frames dropped (full queues, suspended peers)",
                              value=scrape.frames_dropped)  # fmt: skip


class NodeCollector:
    """A Prometheus collector (``prometheus_client.registry.Collector``'s two methods)
    that shows the :class:`Scrape` ``scrape()`` returns (None: nothing, the node is
    gone)."""

    def __init__(self, scrape: Callable[[], Scrape | None]) -> None:
        self._scrape = scrape

    def describe(self) -> Iterable[Metric]:
        return []  # registering must not scrape (the families are dynamic)

    def collect(self) -> Iterable[Metric]:
        scrape = self._scrape()
        return families(scrape) if scrape is not None else []


class MetricsExporter:
    """A node service serving the node's metrics over HTTP at ``address``
    (``(host, port)``; port 0 picks one, see :attr:`address` once it runs).

    Raises LocalError(CONFIG_ERROR) from :meth:`run` when the address cannot be bound.
    """

    def __init__(self, node: MetricsSource, address: tuple[str, int]) -> None:
        """Raises LocalError(CONFIG_ERROR) without prometheus-client."""
        check_metrics_extra()
        self._node = node
        self._requested = address
        #: The address served, once :meth:`run` reported readiness.
        self.address: tuple[str, int] | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; the server thread is stopped and its socket closed."""
        token = trio.lowlevel.current_trio_token()
        node = self._node

        def scrape() -> Scrape | None:  # on the server's request thread
            try:
                return trio.from_thread.run_sync(take_scrape, node, trio_token=token)
            except trio.RunFinishedError:
                return None
            except Exception:  # a node closing under the scrape: an empty page, no 500
                logger.debug("scrape failed", exc_info=True)
                return None

        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=False)
        registry.register(cast("Collector", NodeCollector(scrape)))
        host, port = self._requested
        try:
            server, thread = await trio.to_thread.run_sync(
                lambda: start_http_server(port, host, registry)
            )
        except OSError as exc:
            raise LocalError(
                ErrorCode.CONFIG_ERROR,
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}",
            ) from None
        bound = server.server_address
        self.address = (str(bound[0]), int(bound[1]))
        try:
            task_status.started()
            await trio.sleep_forever()
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(server.shutdown)
                server.server_close()
                await trio.to_thread.run_sync(thread.join)


__all__ = [
    "MISSING_EXTRA",
    "DocumentFigures",
    "DocumentScrape",
    "MetricsExporter",
    "MetricsFigures",
    "MetricsReader",
    "MetricsSource",
    "NodeCollector",
    "Scrape",
    "check_metrics_extra",
    "families",
    "take_scrape",
]
