"""An A2A server kept published as one agent while it answers (docs/protocol/a2a.md §9.5).

:class:`ServerPublisher` is ``p2pnode a2a publish``: it reads the server's card
(:class:`~p2pnode.bridges.a2a.publish.A2AServer`), builds the agent
(:func:`~p2pnode.bridges.a2a.publish.publisher_agent`) and hands it to a
:data:`Host`, which publishes it until told to withdraw it:

* ``host_attached`` attaches it to the node of a data directory over
  ``agent.sock`` (the command);
* ``host_in_aio_node`` hosts it in an asyncio program's node
  (:mod:`p2pnode.hosting.aio`): ``add_agent``, then the node's ``remove_agent``.
  That node passes its in-process agents no caller with a capability request,
  so a publisher with an access rule is given ``callers_in_aio_node`` to ask it.

States (an :class:`enum.Enum` with its transition table, as the node's other
state machines):

    READING ──card read──> PUBLISHED ──card changed: withdrawn, published again──┐
                              │   ^ └──────────────────────────────────────────────┘
      server gone (refused,   │   │ its card read again
      or MAX_FAILURES reads)  v   │
                           WITHDRAWN        (any) ──stop / cancelled──> STOPPED

While PUBLISHED the card is read every ``poll`` seconds (with the last ETag),
and at once when a call found the server unreachable. A read refused at the
connection withdraws the agent at once; other failed reads (a timeout, an
error status, a card that no longer parses) withdraw it after
``max_failures`` in a row. While WITHDRAWN the card is read every ``retry``
seconds; the first good read publishes the agent again. The first read must
succeed: a server that cannot be read at start is a configuration error,
not something to wait for.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Awaitable, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

import anyio
import httpx

from p2pnode.agent.definition import Agent
from p2pnode.agent.tools import Access, Caller
from p2pnode.bridges.a2a.publish import (
    CALL_TIMEOUT,
    CARD_TIMEOUT,
    A2AServer,
    CardRead,
    Forwarder,
    bounded_client,
    publisher_agent,
)
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError

if TYPE_CHECKING:
    from p2pnode.hosting.aio import AioNode

logger = logging.getLogger("p2pnode.a2a")

#: Hosts an agent until told: ``host(agent, withdraw, hosted)`` publishes it, calls
#: ``hosted()`` once its node hosts it, returns once ``withdraw`` is set, having
#: withdrawn it; raises what makes hosting impossible.
Host = Callable[[Agent, anyio.Event, Callable[[], None]], Awaitable[None]]

#: Seconds between card reads while published, and while withdrawn.
POLL: Final = 30.0
RETRY: Final = 5.0
#: Failed reads in a row (other than a refused connection) that withdraw the agent.
MAX_FAILURES: Final = 3
#: Seconds withdrawing an agent from a node may take.
WITHDRAW_TIMEOUT: Final = 5.0


class ServerState(enum.Enum):
    """Where a :class:`ServerPublisher` is (see the module docstring)."""

    READING = "reading"
    PUBLISHED = "published"
    WITHDRAWN = "withdrawn"
    STOPPED = "stopped"


#: The legal transitions; any other raises and leaves the state as it was.
TRANSITIONS: Final[Mapping[ServerState, frozenset[ServerState]]] = {
    ServerState.READING: frozenset({ServerState.PUBLISHED, ServerState.STOPPED}),
    ServerState.PUBLISHED: frozenset(
        {ServerState.PUBLISHED, ServerState.WITHDRAWN, ServerState.STOPPED}
    ),
    ServerState.WITHDRAWN: frozenset({ServerState.PUBLISHED, ServerState.STOPPED}),
    ServerState.STOPPED: frozenset(),
}


@dataclass(frozen=True, slots=True)
class PublishSpec:
    """What to publish and how: the A2A server at ``url`` as agent ``agent_id`` (with
    ``tier`` and ``sandbox``), used only by the callers ``access`` lets in (None: any
    agent the node's policy lets send it a request)."""

    url: str
    agent_id: str
    tier: int = 3
    sandbox: str | None = None
    access: Access | None = None
    call_timeout: float = CALL_TIMEOUT
    card_timeout: float = CARD_TIMEOUT
    poll: float = POLL
    retry: float = RETRY
    max_failures: int = MAX_FAILURES


class _HostFailed(Exception):
    """What the host raised: it ends the publisher."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _leaf(exc: BaseException) -> BaseException:
    """The exception a task group's group stands for: a host's failure first."""
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    leaves = [_leaf(e) for e in exc.exceptions]
    return next((e for e in leaves if isinstance(e, _HostFailed)), leaves[0])


class ServerPublisher:
    """Keeps ``spec``'s A2A server published through ``host`` (see the module
    docstring). ``transport`` is the HTTP transport under the bounds (tests give an
    in-process one); ``callers`` tells who sent a request the host's node passed no
    caller with (:func:`callers_in_aio_node` for :func:`host_in_aio_node`). Raises
    LocalError(INVALID_ARGUMENT) for intervals that are not positive."""

    def __init__(
        self,
        spec: PublishSpec,
        host: Host,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        callers: Callable[[str], Caller | None] | None = None,
    ) -> None:
        if not min(spec.poll, spec.retry, spec.call_timeout, spec.card_timeout) > 0:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "intervals and timeouts are positive")
        if spec.max_failures < 1:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "max_failures is at least 1")
        self.spec = spec
        self.host = host
        self.state = ServerState.READING
        #: The agent last published (None: none yet), and how many times one was.
        self.agent: Agent | None = None
        self.publications = 0
        self._transport = transport
        self._callers = callers
        self._published = anyio.Event()
        self._wake = anyio.Event()
        self._next: CardRead | None = None

    def _to(self, state: ServerState) -> None:
        if state not in TRANSITIONS[self.state]:
            raise LocalError(
                ErrorCode.ILLEGAL_TRANSITION, f"{self.state.value} -> {state.value}"
            )
        self.state = state

    async def wait_published(self) -> Agent:
        """Wait until the agent is published (the first time); it."""
        await self._published.wait()
        assert self.agent is not None
        return self.agent

    def nudge(self) -> None:
        """Read the card now (a call found the server unreachable)."""
        self._wake.set()

    async def run(self) -> None:
        """Read, publish, watch and publish again until cancelled.

        Raises LocalError with the read's code (INVALID_CARD, AGENT_UNAVAILABLE,
        TIMEOUT, MESSAGE_TOO_LARGE) when the first read fails, and what the host raises
        (the node refused the agent, the node went away)."""
        try:
            async with bounded_client(self._transport) as http:
                server = A2AServer(http, self.spec.url, timeout=self.spec.card_timeout)
                try:
                    read = await server.read_card()
                except RemoteError as exc:
                    raise LocalError(
                        exc.code, f"the A2A server at {self.spec.url}: {exc.message}"
                    ) from None
                assert read is not None
                while True:
                    try:
                        await self._publish(server, read)
                    except BaseException as exc:
                        leaf = _leaf(exc)
                        if isinstance(leaf, _HostFailed):
                            raise leaf.error from None
                        raise
                    if self._next is not None:
                        read = self._next
                    else:
                        self._to(ServerState.WITHDRAWN)
                        read = await self._wait_back(server)
        finally:
            self.state = ServerState.STOPPED

    async def _publish(self, server: A2AServer, read: CardRead) -> None:
        """Publish ``read``'s agent until its server is gone (``_next`` None) or its card
        changed (``_next`` the new read)."""
        spec = self.spec
        forwarder = Forwarder(
            read.client,
            call_timeout=spec.call_timeout,
            access=spec.access,
            callers=self._callers,
            unreachable=self.nudge,
        )
        agent = publisher_agent(
            spec.agent_id, read.facts, forwarder, tier=spec.tier, sandbox=spec.sandbox
        )
        withdraw = anyio.Event()
        self._next = None
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(self._watch, server, read, withdraw)
            self.agent = agent
            self.publications += 1
            self._to(ServerState.PUBLISHED)
            logger.info(
                "A2A server %s published as %s: %s",
                spec.url,
                agent.id,
                ", ".join(c.id for c in agent.capabilities),
            )
            try:
                # Published once the node hosts it: a caller told so can reach it.
                await self.host(agent, withdraw, self._published.set)
            except Exception as exc:
                raise _HostFailed(exc) from exc
            tasks.cancel_scope.cancel()

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or less when nudged."""
        with anyio.move_on_after(seconds):
            await self._wake.wait()
        if self._wake.is_set():
            self._wake = anyio.Event()

    async def _watch(self, server: A2AServer, read: CardRead, withdraw: anyio.Event) -> None:
        """Read the card every ``poll`` seconds; set ``withdraw`` and return when the
        server is gone or its card changed."""
        failures = 0
        while True:
            await self._pause(self.spec.poll)
            try:
                new = await server.read_card(read.etag)
            except RemoteError as exc:
                failures += 1
                gone = bool(exc.details.get("unreachable")) or failures >= self.spec.max_failures
                logger.warning(
                    "A2A server %s: card read failed (%d in a row): %s%s",
                    self.spec.url,
                    failures,
                    exc,
                    "; withdrawn" if gone else "",
                )
                if gone:
                    break
                continue
            failures = 0
            if new is not None and new.document != read.document:
                logger.info("A2A server %s: its card changed; published again", self.spec.url)
                self._next = new
                break
        withdraw.set()

    async def _wait_back(self, server: A2AServer) -> CardRead:
        """Read the card every ``retry`` seconds until a read succeeds."""
        while True:
            await self._pause(self.spec.retry)
            try:
                read = await server.read_card()
            except RemoteError as exc:
                logger.debug("A2A server %s still gone: %s", self.spec.url, exc)
                continue
            assert read is not None
            logger.info("A2A server %s is back", self.spec.url)
            return read


# -- hosts -------------------------------------------------------------------------------------


def host_in_aio_node(node: AioNode) -> Host:
    """A host that publishes the agent in ``node``, an asyncio program's node (its
    handlers run in the asyncio loop)."""

    async def host(agent: Agent, withdraw: anyio.Event, hosted: Callable[[], None]) -> None:
        await node.add_agent(agent)
        hosted()
        try:
            await withdraw.wait()
        finally:
            # Also when cancelled (the program is stopping); bounded, and an agent the
            # node no longer hosts is withdrawn already.
            with anyio.move_on_after(WITHDRAW_TIMEOUT, shield=True), suppress(P2PError):
                await node.run_trio(node.node.remove_agent, agent.id)

    return host


def callers_in_aio_node(node: AioNode) -> Callable[[str], Caller | None]:
    """Who sent a request to an agent ``node`` hosts, as the node authenticated it (the
    sender's card in its registry, the roles its swarm authority endorsed): the node
    passes its in-process agents no caller with a request for a capability."""
    return node.node.tool_audit.caller_of


def host_attached(data_dir: Path | str | None = None, *, path: Path | str | None = None) -> Host:
    """A host that attaches the agent to the node of ``data_dir`` (or its socket ``path``)
    over ``agent.sock``, and again after the node restarts; detaching withdraws it
    (:func:`~p2pnode.hosting.client.stay_attached`)."""
    from p2pnode.hosting.client import stay_attached

    async def host(agent: Agent, withdraw: anyio.Event, hosted: Callable[[], None]) -> None:
        await stay_attached(agent, withdraw, data_dir=data_dir, path=path, hosted=hosted)

    return host


__all__ = [
    "MAX_FAILURES",
    "POLL",
    "RETRY",
    "TRANSITIONS",
    "WITHDRAW_TIMEOUT",
    "Host",
    "PublishSpec",
    "ServerPublisher",
    "ServerState",
    "callers_in_aio_node",
    "host_attached",
    "host_in_aio_node",
]
