"""The interface between a node and its protocol services.

A protocol service (shared state today; agents attached from other processes,
tools, tasks next) is built on :class:`ServiceHost`: the narrow set of things
a service may use of the node that runs it, and nothing else.

* Send and request as one of the node's local agents (egress policy applies).
* Intercept inbound envelopes, after sender authentication and ingress
  policy: ``stream-data`` envelopes whose payload map holds a marker key, or
  every envelope of some message types. Interceptors run on the channel's
  reader task, behind the frame's failure boundary: they must not block.
* Read the registry, ask the policy, emit events, contain a failure.
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
docs/DESIGN.md ("Services") has a short example.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import trio

from p2pnode.agent.definition import Agent
from p2pnode.core.boundary import FailureBoundary
from p2pnode.core.card import AgentCard, Capability
from p2pnode.core.envelope import Envelope, MessageType, Metadata
from p2pnode.core.identity import Identity, PeerId
from p2pnode.node.observability import Observability
from p2pnode.node.policy import Verdict
from p2pnode.node.router import Interceptor, RoutingResult


class RegistryReader(Protocol):
    """The registry, read-only."""

    def find(self, agent_id: str) -> AgentCard | None: ...

    def find_by_capability(self, capability_id: str) -> list[AgentCard]: ...

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
    def events(self) -> Observability: ...

    @property
    def boundary(self) -> FailureBoundary: ...

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


class Service(Protocol):
    """A protocol service: runs until cancelled, in a nursery of its own."""

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the service's nursery, start its tasks, report readiness, run."""


__all__ = ["Interceptor", "PolicyChecks", "RegistryReader", "Service", "ServiceHost"]
