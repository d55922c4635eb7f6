"""An MCP server run as a child process and published as one agent while it lives.

:class:`ChildServer` is ``p2pnode mcp publish`` and ``p2pnode run
--mcp-server`` (docs/protocol/mcp.md §4): it starts a stdio MCP server (any
off-the-shelf one) with the SDK's ``stdio_client``, initializes a
``ClientSession``, builds the agent that mirrors it
(:func:`~p2pnode.bridges.mcp.mirror.mirror_agent`) and hands it to a
:data:`Host`, which publishes it until the child is gone:

* ``host_in_node`` hosts it in a node of this process (the daemon's
  ``--mcp-server``): ``node.add_agent``, then ``node.remove_agent``;
* ``host_attached`` attaches it to the node of a data directory over
  ``agent.sock`` (``mcp publish``); the node forwards the swarm's requests
  to this process, with the caller it authenticated.

Child states (an :class:`enum.Enum`, as the node's other state machines):

    STARTING ──listed──> PUBLISHED ──child gone / start failed──> BACKING_OFF ──> STARTING
                            │  └─ the server's lists changed: withdrawn, listed again ─┘
                            └────────── stop() / cancelled ──────────> STOPPED

The child's end is seen when its stdout closes (the read stream the session
reads ends), so a crash or a kill withdraws the agent at once: requests in
flight get ``AGENT_UNAVAILABLE``. It is started again after a delay that
doubles from ``backoff`` to at most ``max_backoff``, back to ``backoff``
once a child has lived ``healthy_after`` seconds. The child's stderr is
this process's stderr (its logs stay visible), and it inherits this
process's environment.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TextIO

import anyio
import mcp_types as types
from anyio.abc import TaskStatus
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.shared._stream_protocols import ReadStream
from mcp.shared.message import SessionMessage

from p2pnode import __version__
from p2pnode.agent.definition import Agent
from p2pnode.agent.tools import Access
from p2pnode.bridges.mcp.mirror import CALL_TIMEOUT, mirror_agent
from p2pnode.core.boundary import describe
from p2pnode.core.errors import ErrorCode, LocalError, P2PError
from p2pnode.core.identity import Identity
from p2pnode.node.service import ServiceHost

logger = logging.getLogger("p2pnode.mcp")

#: Hosts an agent while the child lives: ``host(agent, gone, hosted)`` publishes it,
#: calls ``hosted()`` once its node hosts it, returns once ``gone`` is set, having
#: withdrawn it; raises what makes hosting impossible.
Host = Callable[[Agent, anyio.Event, Callable[[], None]], Awaitable[None]]

#: Seconds the child gets to start and list what it offers.
START_TIMEOUT = 30.0
#: Seconds withdrawing an agent from a node may take.
WITHDRAW_TIMEOUT = 5.0


class ChildState(enum.Enum):
    """Where a :class:`ChildServer` is (see the module docstring)."""

    STARTING = "starting"
    PUBLISHED = "published"
    BACKING_OFF = "backing-off"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """What to run and how to publish it: agent ``agent_id`` (with ``tier``, ``sandbox``)
    offers what ``command`` (argv) serves over stdio, to callers ``access`` lets in."""

    agent_id: str
    command: tuple[str, ...]
    tier: int = 3
    sandbox: str | None = None
    access: Access | None = None
    cwd: Path | None = None
    env: dict[str, str] | None = None
    call_timeout: float = CALL_TIMEOUT
    #: Restart delays: from ``backoff`` doubling to ``max_backoff`` seconds.
    backoff: float = 0.5
    max_backoff: float = 30.0
    #: A child that lived this long starts the next delay from ``backoff`` again.
    healthy_after: float = 30.0
    #: Restarts after which the server is given up on (None: never).
    max_restarts: int | None = None


class _Watched:
    """The session's read stream, telling ``life`` when it ends (the child closed its
    stdout: it exited or was killed)."""

    def __init__(self, inner: ReadStream[SessionMessage | Exception], life: _Life) -> None:
        self._inner = inner
        self._life = life

    async def receive(self) -> SessionMessage | Exception:
        try:
            return await self._inner.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._life.end()
            raise

    async def aclose(self) -> None:
        await self._inner.aclose()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> SessionMessage | Exception:
        try:
            return await self.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
    ) -> bool | None:
        await self.aclose()
        return None

    @property
    def last_context(self) -> Any:
        return getattr(self._inner, "last_context", None)


class _HostFailed(Exception):
    """What the host raised: it ends the server (not the child's failure, not retried)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _leaf(exc: BaseException) -> BaseException:
    """The exception a task group's group stands for: a host's failure first, else the
    first leaf."""
    if not isinstance(exc, BaseExceptionGroup):
        return exc
    leaves = [_leaf(e) for e in exc.exceptions]
    return next((e for e in leaves if isinstance(e, _HostFailed)), leaves[0])


class ChildServer:
    """Runs ``spec``'s MCP server and keeps its agent published through ``host`` (see the
    module docstring). ``errlog`` takes the child's stderr."""

    def __init__(self, spec: ServerSpec, host: Host, *, errlog: TextIO | None = None) -> None:
        if not spec.command:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "an MCP server needs a command")
        self.spec = spec
        self.host = host
        self.errlog = errlog if errlog is not None else sys.stderr
        self.state = ChildState.STARTING
        #: Times the child was started, and the agent last published (None: none yet).
        self.starts = 0
        self.agent: Agent | None = None
        self._published = anyio.Event()

    async def wait_published(self) -> Agent:
        """Wait until the agent is published (the first time); it."""
        await self._published.wait()
        assert self.agent is not None
        return self.agent

    async def run(self) -> None:
        """Run, publish, watch and restart the child until cancelled.

        Raises LocalError(CONFIG_ERROR) when the first child cannot start or list what
        it offers (a command that cannot serve is a configuration error, not something
        to retry), LocalError(AGENT_UNAVAILABLE) once ``max_restarts`` are spent, and what
        the host raises (the node refused the agent, the daemon went away)."""
        delay = self.spec.backoff
        try:
            while True:
                self.state = ChildState.STARTING
                self.starts += 1
                started = anyio.current_time()
                try:
                    await self._run_once()
                    reason = "it exited"
                except Exception as exc:  # whatever ended the child: restarted below
                    leaf = _leaf(exc)
                    if isinstance(leaf, _HostFailed):
                        raise leaf.error from None
                    reason = describe(leaf)
                    logger.debug("MCP server %s failed", self.spec.agent_id, exc_info=exc)
                if not self._published.is_set():
                    raise LocalError(
                        ErrorCode.CONFIG_ERROR,
                        f"MCP server {self.spec.agent_id} ({self.spec.command[0]}) ended "
                        f"before it listed what it offers: {reason}",
                    )
                if anyio.current_time() - started >= self.spec.healthy_after:
                    delay = self.spec.backoff
                limit = self.spec.max_restarts
                if limit is not None and self.starts > limit:
                    raise LocalError(
                        ErrorCode.AGENT_UNAVAILABLE,
                        f"MCP server {self.spec.agent_id} ended ({reason}); given up after "
                        f"{limit} restarts",
                    )
                self.state = ChildState.BACKING_OFF
                logger.warning(
                    "MCP server %s ended (%s); withdrawn, starting it again in %.1f s",
                    self.spec.agent_id,
                    reason,
                    delay,
                )
                await anyio.sleep(delay)
                delay = min(delay * 2, self.spec.max_backoff)
        finally:
            self.state = ChildState.STOPPED

    async def _run_once(self) -> None:
        """One child's life: start it, publish its agent (again after each change of its
        lists), return when it is gone."""
        spec = self.spec
        params = StdioServerParameters(
            command=spec.command[0],
            args=list(spec.command[1:]),
            env=spec.env if spec.env is not None else dict(os.environ),
            cwd=spec.cwd,
        )
        life = _Life()

        async def on_message(message: Any) -> None:
            if isinstance(message, _LIST_CHANGED):
                life.change()

        info = types.Implementation(name="p2pnode", version=__version__)
        async with stdio_client(params, errlog=self.errlog) as (read_stream, write_stream):
            watched = _Watched(read_stream, life)
            async with ClientSession(
                watched, write_stream, message_handler=on_message, client_info=info
            ) as session:
                with anyio.fail_after(START_TIMEOUT):
                    await session.initialize()
                while not life.gone:
                    # Before listing: a change announced while listing withdraws this
                    # publication at once, and the next one lists again.
                    withdraw = life.next_publication()
                    with anyio.fail_after(START_TIMEOUT):
                        agent = await mirror_agent(
                            session,
                            spec.agent_id,
                            tier=spec.tier,
                            sandbox=spec.sandbox,
                            access=spec.access,
                            call_timeout=spec.call_timeout,
                        )
                    self.agent = agent
                    self.state = ChildState.PUBLISHED
                    logger.info(
                        "MCP server %s published: %d tools, %d resources, %d prompts",
                        agent.id,
                        len(agent.catalog.tools),
                        len(agent.catalog.resources),
                        len(agent.catalog.prompts),
                    )
                    try:
                        # Published once the node hosts it: a caller told so reaches it.
                        await self.host(agent, withdraw, self._published.set)
                    except Exception as exc:
                        raise _HostFailed(exc) from exc
                    if not life.gone:
                        logger.info("MCP server %s changed its lists: published again", agent.id)


_LIST_CHANGED = (
    types.ToolListChangedNotification,
    types.ResourceListChangedNotification,
    types.PromptListChangedNotification,
)


class _Life:
    """One child's life: whether it is gone, and the event that withdraws its current
    publication (set when it is gone or its lists changed)."""

    def __init__(self) -> None:
        self.gone = False
        self._withdraw = anyio.Event()

    def next_publication(self) -> anyio.Event:
        self._withdraw = anyio.Event()
        if self.gone:
            self._withdraw.set()
        return self._withdraw

    def end(self) -> None:
        self.gone = True
        self._withdraw.set()

    def change(self) -> None:
        self._withdraw.set()


def host_in_node(
    node: ServiceHost, *, authority: Identity | None = None, roles: tuple[str, ...] = ()
) -> Host:
    """A host that publishes the agent in ``node`` (a node of this process, through its
    service interface), endorsed by ``authority`` with ``roles`` as ``add_agent`` does."""

    async def host(agent: Agent, gone: anyio.Event, hosted: Callable[[], None]) -> None:
        await node.add_agent(agent, authority=authority, roles=roles)
        hosted()
        try:
            await gone.wait()
        finally:
            # Also when cancelled (the node is stopping); bounded, and an agent the node
            # no longer hosts is withdrawn already.
            with anyio.move_on_after(WITHDRAW_TIMEOUT, shield=True), suppress(P2PError):
                await node.remove_agent(agent.id)

    return host


class ChildServers:
    """The daemon's ``--mcp-server`` children as a node service (``node.start_service``):
    its ``run`` starts each child in its own task group and reports readiness once every
    one has published its agent; it raises what a child's ``run`` raises (a first start
    that failed: LocalError(CONFIG_ERROR))."""

    def __init__(self, children: list[ChildServer]) -> None:
        self.children = children

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tasks:
            for child in self.children:
                tasks.start_soon(child.run)
            for child in self.children:
                await child.wait_published()
            task_status.started()


def host_attached(data_dir: Path | str | None = None, *, path: Path | str | None = None) -> Host:
    """A host that attaches the agent to the node of ``data_dir`` (or its socket ``path``)
    over ``agent.sock``, and again after the node restarts
    (:func:`~p2pnode.hosting.client.stay_attached`)."""
    from p2pnode.hosting.client import stay_attached

    async def host(agent: Agent, gone: anyio.Event, hosted: Callable[[], None]) -> None:
        await stay_attached(agent, gone, data_dir=data_dir, path=path, hosted=hosted)

    return host


__all__ = [
    "START_TIMEOUT",
    "WITHDRAW_TIMEOUT",
    "ChildServer",
    "ChildServers",
    "ChildState",
    "Host",
    "ServerSpec",
    "host_attached",
    "host_in_node",
]
