"""The interface between a node and its protocol services.

A protocol service (shared state today; agents attached from other processes,
tools, tasks next) is built on :class:`ServiceHost`: the narrow set of things
a service may use of the node that runs it, and nothing else.

* Send and request as one of the node's local agents (egress policy applies).
* Intercept inbound envelopes, after sender authentication and ingress
  policy: ``stream-data`` envelopes whose payload map holds a marker key, or
  every envelope of some message types. Interceptors run on the channel's
  reader task, behind the frame's failure boundary: they must not block.
* Read the registry and the node's clock (:meth:`ServiceHost.now_ms`), ask
  the policy, report events (:class:`EventSink`), contain a failure
  (:class:`FailureContainment`).
* Be told of each agent hosted and removed (:meth:`ServiceHost.watch_agents`).
* Serve request methods in place of the agents' handlers
  (:meth:`ServiceHost.serve_methods`: the tools service serves the MCP
  methods); the kernel dispatches a request to whoever serves its method.
* Sign as the node (:attr:`ServiceHost.identity`: shared state signs deltas).
* Add a capability to a local agent's card (re-signed and re-published).
* Host an agent definition as a local agent, and stop hosting one (its card
  withdrawn, what was queued for it answered ``AGENT_UNAVAILABLE``).
* Find agents by capability (registry, refreshed through discovery).
* Hand an inbound envelope it intercepted but does not take to the local
  agent's handler after all (its inbox).

A service's lifetime is its :meth:`Service.run`: the node starts it in its
own nursery (``await node.start_service(service)``); ``run`` opens the
service's nursery with ``async with``, reports readiness with
``task_status.started()`` and runs until cancelled when the node closes.
Services that use each other get protocols from the composition root
(:mod:`p2pnode.runtime`), never each other's attributes. docs/DESIGN.md
("Services") has a short example.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import trio

from p2pnode.agent.definition import Agent, Reply
from p2pnode.core.card import AgentCard, Capability
from p2pnode.core.envelope import Envelope, MessageType, Metadata
from p2pnode.core.errors import ErrorCode
from p2pnode.core.identity import Identity, PeerId
from p2pnode.node.policy import Verdict
from p2pnode.node.progress import (  # re-exported: the progress API of services and bridges
    Progress,
    ProgressCallback,
    ProgressReporter,
    current_progress,
    progress_untrusted,
    report_progress,
)
from p2pnode.node.router import Interceptor, RoutingResult


class RegistryReader(Protocol):
    """The registry, read-only."""

    def find(self, agent_id: str) -> AgentCard | None: ...

    def find_by_capability(self, capability_id: str) -> list[AgentCard]: ...

    def is_live(self, card: AgentCard, now_ms: int | None) -> bool:
        """Not expired at ``now_ms`` (None: not checked) and its owner not known
        unreachable (its channel closed and redials failed)."""
        ...

    def __iter__(self) -> Iterator[AgentCard]: ...

    def __len__(self) -> int: ...


class PolicyChecks(Protocol):
    """The policy questions a service may ask (never raise; see node/policy.py)."""

    def check_message(
        self,
        source: AgentCard,
        target: AgentCard,
        type: MessageType,
        metadata: Metadata | None,
        *,
        broadcast: bool = False,
    ) -> Verdict: ...

    def check_envelope(
        self, source: AgentCard, target: AgentCard, envelope: Envelope
    ) -> Verdict: ...

    def can_discover(self, viewer: AgentCard, card: AgentCard) -> bool: ...

    def filter_discoverable(
        self, viewer: AgentCard, cards: Iterable[AgentCard]
    ) -> list[AgentCard]: ...


class EventSink(Protocol):
    """Where a service reports what happened (the node's observability: events,
    counters, logs). What the methods return is the kernel's business."""

    def security(
        self,
        code: ErrorCode,
        reason: str,
        peer: str | None = None,
        envelope: Envelope | None = None,
    ) -> object:
        """A refused or forged input (a security event, counted in ``status``)."""

    def error(
        self,
        code: ErrorCode,
        detail: str,
        peer: str | None = None,
        envelope: Envelope | None = None,
    ) -> object:
        """A failure that is not a security matter."""

    def tool_invocation(
        self,
        tool: str,
        agent: str | None,
        duration_ms: float,
        success: bool,
        *,
        code: ErrorCode | None = None,
        detail: str = "",
        owner: str | None = None,
        arguments_digest: str | Callable[[], str] | None = None,
    ) -> int:
        """One use of a tool, resource or prompt (the audit event); returns its
        timestamp (ms)."""


class FailureContainment(Protocol):
    """Contains what one input raised (see :mod:`p2pnode.core.boundary`)."""

    def contain(self, source: str, what: str, exc: Exception) -> None: ...


class Signer(Protocol):
    """The node's identity as a service may use it: its public key, and signing."""

    @property
    def public_key(self) -> bytes: ...

    def sign(self, message: bytes) -> bytes: ...


class MethodServer(Protocol):
    """Answers requests for the methods a service serves (:meth:`ServiceHost.serve_methods`)
    to local agents, in the agent's inbox task, instead of the agent's handler."""

    def serve(
        self, agent: Agent, envelope: Envelope, method: str, sender: AgentCard
    ) -> Coroutine[Any, Any, Reply | None]:
        """``agent``'s answer to request ``envelope`` for ``method``; None when the
        answer goes another way (an attached agent's process sends it). ``sender`` is
        the card of the agent that sent it, of the peer it came from: an id two owners
        claim names either, so the registry's card of ``envelope.sender`` may be the
        other owner's."""

    def deadline(self, agent: Agent, envelope: Envelope) -> float:
        """Seconds :meth:`serve` may run for ``envelope`` before it is cancelled and
        answered TIMEOUT (at most a day)."""


class ServiceHost(Protocol):
    """What a protocol service may use of the node that runs it."""

    @property
    def peer_id(self) -> PeerId: ...

    @property
    def data_dir(self) -> Path | None:
        """Where the service may keep durable state (None: in memory only)."""

    @property
    def registry(self) -> RegistryReader: ...

    @property
    def policy(self) -> PolicyChecks: ...

    @property
    def identity(self) -> Signer: ...

    @property
    def events(self) -> EventSink: ...

    @property
    def boundary(self) -> FailureContainment: ...

    def now_ms(self) -> int:
        """The node's wall clock, ms since the epoch (virtual in simulations)."""

    def local_agent(self, agent_id: str) -> AgentCard: ...

    def envelope(
        self,
        sender: str,
        recipient: str,
        type: MessageType,
        payload: Any = None,
        *,
        correlation_id: str | None = None,
        metadata: Metadata | None = None,
    ) -> Envelope: ...

    async def send(self, envelope: Envelope) -> RoutingResult: ...

    async def request(
        self,
        sender: str,
        recipient: str,
        payload: Any = None,
        *,
        capability: bool = False,
        metadata: Metadata | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (it travels to the owner)
        on_progress: ProgressCallback | None = None,
    ) -> Envelope: ...

    def intercept_stream(self, marker: str, interceptor: Interceptor | None) -> None: ...

    def intercept_types(
        self, types: Iterable[MessageType], interceptor: Interceptor | None
    ) -> None: ...

    async def add_capability(self, agent_id: str, capability: Capability) -> AgentCard: ...

    async def add_agent(
        self, agent: Agent, *, authority: Identity | None = None, roles: tuple[str, ...] = ()
    ) -> AgentCard: ...

    async def remove_agent(self, agent_id: str) -> None: ...

    async def find(self, capability: str) -> list[AgentCard]: ...

    async def deliver(self, agent_id: str, envelope: Envelope) -> None: ...

    def watch_agents(
        self,
        *,
        added: Callable[[Agent], None] | None = None,
        removed: Callable[[str], None] | None = None,
    ) -> Callable[[], None]:
        """Be told of agents hosted and removed; returns what stops it (see
        :meth:`p2pnode.node.kernel.Kernel.watch_agents`)."""

    def serve_methods(
        self, methods: Iterable[str], server: MethodServer | None, *, streamed: bool = False
    ) -> None:
        """Serve request ``methods`` with ``server`` (see
        :meth:`p2pnode.node.kernel.Kernel.serve_methods`)."""


class Service(Protocol):
    """A protocol service: runs until cancelled, in a nursery of its own."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the service's nursery, start its tasks, report readiness, run."""


__all__ = [
    "EventSink",
    "FailureContainment",
    "Interceptor",
    "MethodServer",
    "PolicyChecks",
    "Progress",
    "ProgressCallback",
    "ProgressReporter",
    "RegistryReader",
    "Service",
    "ServiceHost",
    "Signer",
    "current_progress",
    "progress_untrusted",
    "report_progress",
]
