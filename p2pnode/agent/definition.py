"""An agent's definition: who it is, what it offers, and its handlers.

An :class:`Agent` is plain data plus handlers declared by decorator, in the
style of FastAPI and FastMCP; it does no I/O and runs nowhere by itself. One
definition runs unchanged three ways: hosted by the daemon
(``p2pnode run --agent module:agent``), embedded in a trio program
(``await node.add_agent(agent)``), or embedded in an asyncio program
(:mod:`p2pnode.hosting.aio`).

Handlers take one :class:`Message` and may be sync or async:

* ``@agent.on_request("plan.strategy", input_schema={...})`` answers requests
  for that capability; the capability (with its schemas) is published in the
  agent's card. ``@agent.on_request()`` answers requests for no capability.
  The return value is sent as the ``response``.
* ``@agent.on_notification`` and ``@agent.on_message`` (any type not handled
  otherwise) see the other envelope types; what they return is ignored.
* ``@agent.tool()``, ``@agent.resource(uri)``, ``@agent.prompt()`` and
  ``agent.add_prompt(name, template)`` declare what the agent offers MCP-style
  (p2pnode.agent.tools; docs/protocol/tools.md): requests naming an MCP method in
  ``metadata.capability`` are answered from them.
* ``@agent.on_proposal`` decides on task proposals and ``@agent.on_task``
  does the tasks awarded (p2pnode.agent.task; docs/protocol/tasks.md);
  ``await agent.propose(target, task)`` proposes one, once a node hosts it.

What a handler raises decides the reply to a request: a
:class:`~p2pnode.core.errors.P2PError` is sent as a typed ``error`` envelope with
its code, message and details; anything else is logged with its traceback on
the owner's side only and answered with ``HANDLER_FAILED`` and no detail.
A request whose payload fails the capability's ``inputSchema`` is answered
with ``INVALID_INPUT`` naming the failing path, before the handler runs
(JSON Schema validation by the ``jsonschema`` package: the reference
implementation of every draft, with error paths; we do not write our own).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import CoroutineType
from typing import Any, TypeVar, cast, overload

from p2pnode.agent.task import Selection, Task
from p2pnode.agent.taskwork import TaskHandlers, TaskThread
from p2pnode.agent.tools import MCP_METHODS, TOOLS_CALL, Access, Caller, Catalog, PromptArgument
from p2pnode.agent.toolschema import Checker, schema_checker
from p2pnode.core.card import Capability
from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError

logger = logging.getLogger("p2pnode.agent.definition")

#: The longest deadline a tool may declare: one day, in seconds (NodeConfig's bound).
_MAX_DEADLINE = 86_400.0

#: A handler: ``handler(message)``, sync or async.
HandlerFunction = Callable[["Message"], Any]
F = TypeVar("F", bound=HandlerFunction)
T = TypeVar("T", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True)
class Message:
    """What a handler receives: one envelope addressed to the agent.

    ``sender`` is authenticated: the node checked that the sending agent's
    signed card belongs to the peer the envelope came from. ``caller`` is the
    sender as the hosting node authenticated it (its card's tier, sandbox and
    peer, its endorsed roles), when the node said: a request to an agent
    attached over ``agent.sock`` always carries it; None otherwise.
    """

    envelope: Envelope
    caller: Caller | None = None

    @property
    def payload(self) -> Any:
        return self.envelope.payload

    @property
    def sender(self) -> str:
        return self.envelope.sender

    @property
    def type(self) -> MessageType:
        return self.envelope.type

    @property
    def capability(self) -> str | None:
        """The capability a request is for (None: addressed to the agent itself)."""
        meta = self.envelope.metadata
        return meta.capability if meta is not None else None


@dataclass(frozen=True, slots=True)
class Reply:
    """What the agent answers to one request: a ``response`` or an ``error`` payload."""

    type: MessageType
    payload: Any


@dataclass(frozen=True, slots=True)
class _Route:
    handler: HandlerFunction
    validate: Checker | None


class Agent:
    """An agent's definition (see the module docstring)."""

    def __init__(
        self,
        id: str,
        *,
        name: str | None = None,
        description: str = "",
        tier: int = 3,
        sandbox: str | None = None,
        version: str = "1.0.0",
        capabilities: Iterable[Capability] = (),
    ) -> None:
        self.id = id
        self.name = name or id
        self.description = description
        self.tier = tier
        self.sandbox = sandbox
        self.version = version
        self._capabilities: dict[str, Capability] = {c.id: c for c in capabilities}
        self._requests: dict[str | None, _Route] = {}
        self._by_type: dict[MessageType, HandlerFunction] = {}
        self._fallback: HandlerFunction | None = None
        #: The fallback takes the envelope itself (an ``add_agent(id, handler)`` agent).
        self._fallback_takes_envelope = False
        self._fallback_cache: _Route | None = None
        #: Its tools, resources and prompts (p2pnode.agent.tools).
        self.catalog = Catalog(id)
        #: Its task handlers, and how it proposes once hosted (p2pnode.agent.task).
        self.tasks = TaskHandlers(id)
        #: Deadlines tools declared (seconds), by tool name.
        self._tool_deadlines: dict[str, float] = {}

    @property
    def capabilities(self) -> tuple[Capability, ...]:
        """What the agent's card offers: the declared capabilities and the request handlers'."""
        return tuple(self._capabilities.values())

    # -- declaring handlers -------------------------------------------------------------------

    def on_request(
        self,
        capability: str | None = None,
        *,
        name: str | None = None,
        description: str = "",
        input_schema: Any = None,
        output_schema: Any = None,
    ) -> Callable[[F], F]:
        """Declare the handler of requests for ``capability`` (None: requests addressed to
        the agent with no capability). Raises LocalError(INVALID_ARGUMENT) for a second
        handler of the same capability or an invalid schema."""

        def register(handler: F) -> F:
            if capability in MCP_METHODS:
                raise LocalError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"{capability!r} is answered by the agent's tools, resources and prompts",
                )
            if capability in self._requests:
                raise LocalError(
                    ErrorCode.INVALID_ARGUMENT, f"{self.id}: two handlers for {capability!r}"
                )
            schema = input_schema
            if capability is not None:
                declared = self._capabilities.get(capability)
                if declared is None:
                    doc = inspect.getdoc(handler) or ""
                    declared = Capability(
                        capability,
                        name or capability,
                        description or doc.split("\n\n")[0],
                        input_schema,
                        output_schema,
                    )
                    self._capabilities[capability] = declared
                elif schema is None:
                    schema = declared.input_schema
            try:
                check = schema_checker(schema)
            except LocalError as exc:
                problem = f"inputSchema of {capability!r}: {exc.message}"
                raise LocalError(exc.code, problem) from None
            self._requests[capability] = _Route(handler, check)
            return handler

        return register

    def on_notification(self, handler: F) -> F:
        """Declare the handler of ``notification`` envelopes."""
        return self.on_type(MessageType.NOTIFICATION)(handler)

    def on_type(self, *types: MessageType) -> Callable[[F], F]:
        """Declare the handler of envelopes of ``types`` (requests excepted)."""

        def register(handler: F) -> F:
            for type_ in types:
                if type_ is MessageType.REQUEST or type_ in self._by_type:
                    raise LocalError(
                        ErrorCode.INVALID_ARGUMENT, f"{self.id}: {type_.value} is already handled"
                    )
                self._by_type[type_] = handler
            return handler

        return register

    def on_message(self, handler: F) -> F:
        """Declare the handler of every envelope no other handler takes."""
        if self._fallback is not None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"{self.id}: on_message is declared")
        self._fallback = handler
        return handler

    # -- tasks (p2pnode.agent.task) ---------------------------------------------------------------

    def on_proposal(self, handler: T) -> T:
        """Declare what decides on task proposals: ``handler(proposal)`` returns an
        :class:`~p2pnode.agent.task.Accept` or :class:`~p2pnode.agent.task.Reject` (or a bool).
        Without it an agent with ``on_task`` accepts what it offers the capabilities for
        while it has room."""
        self.tasks.set_proposal(handler)
        return handler

    @overload
    def on_task(self, handler: T, *, capacity: int = 1) -> T: ...

    @overload
    def on_task(self, handler: None = None, *, capacity: int = 1) -> Callable[[T], T]: ...

    def on_task(self, handler: T | None = None, *, capacity: int = 1) -> Any:
        """Declare what does the tasks awarded to the agent: ``handler(work)`` gets a
        :class:`~p2pnode.agent.task.Work` and returns the result (JSON data). ``capacity``:
        tasks it runs at once. Use as ``@agent.on_task`` or ``@agent.on_task(capacity=4)``."""

        def register(function: T) -> T:
            self.tasks.set_work(function, capacity)
            return function

        return register if handler is None else register(handler)

    async def propose(
        self,
        target: str | Iterable[str],
        task: Task,
        *,
        deadline: float | None = None,
        capability: bool = False,
        selection: Selection = Selection.FIRST_ACCEPT,
        justification: str | None = None,
    ) -> TaskThread:
        """Propose ``task`` to an agent, to several (a call for proposals), or with
        ``capability`` to the agents offering one; returns the task once awarded (see
        ``TaskService.propose`` for what it raises). Raises LocalError(INVALID_ARGUMENT)
        when no node hosts the agent."""
        proposer = self.tasks.proposer
        if proposer is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"agent {self.id!r} is not hosted")
        return await proposer.propose(
            self.id,
            target,
            task,
            deadline=deadline,
            capability=capability,
            selection=selection,
            justification=justification,
        )

    # -- tools, resources and prompts (p2pnode.agent.tools) ---------------------------------------

    def tool(
        self,
        name: str | None = None,
        *,
        description: str | None = None,
        input_schema: Any = None,
        output_schema: Any = None,
        access: Access | None = None,
        deadline: float | None = None,
    ) -> Callable[[T], T]:
        """Declare a tool, named ``<agent id>.<name>`` in the swarm (``name`` defaults to
        the function's). Without ``input_schema`` the function's parameters are its
        arguments, their schema derived from the type hints; a parameter annotated
        :class:`~p2pnode.agent.tools.Caller` receives the authenticated caller. ``access``
        says who may call it (default: anyone policy lets send to this agent).
        ``deadline``: seconds one call may run before its owner's node cancels it and
        answers TIMEOUT (default: the node's ``tool_deadline``, 30 s).

        Raises LocalError(DUPLICATE_TOOL) for a name taken, LocalError(INVALID_ARGUMENT)
        for a deadline that is not more than 0 and at most a day."""
        if deadline is not None and not 0 < deadline <= _MAX_DEADLINE:
            raise LocalError(
                ErrorCode.INVALID_ARGUMENT,
                f"a tool's deadline is more than 0 and at most {_MAX_DEADLINE:g} s",
            )

        def register(function: T) -> T:
            spec = self.catalog.add_tool(
                function,
                name=name,
                description=description,
                input_schema=input_schema,
                output_schema=output_schema,
                access=access,
            )
            if deadline is not None:
                self._tool_deadlines[spec.name] = deadline
            return function

        return register

    def resource(
        self,
        uri: str,
        *,
        name: str | None = None,
        description: str | None = None,
        mime_type: str = "text/plain",
        access: Access | None = None,
    ) -> Callable[[T], T]:
        """Declare the content loader of resource ``uri``: it returns text, bytes or JSON
        data (sent as JSON text). Raises LocalError(DUPLICATE_TOOL) for a URI taken."""

        def register(load: T) -> T:
            self.catalog.add_resource(
                load, uri, name=name, description=description, mime_type=mime_type, access=access
            )
            return load

        return register

    def prompt(
        self,
        name: str | None = None,
        *,
        description: str | None = None,
        arguments: Iterable[PromptArgument | str] | None = None,
        access: Access | None = None,
    ) -> Callable[[T], T]:
        """Declare a prompt rendered by the function: its parameters are the prompt's
        arguments (required unless they have a default); it returns the text, or a list
        of MCP messages. For a template body use :meth:`add_prompt`."""

        def register(render: T) -> T:
            self.catalog.add_prompt(
                render, name=name, description=description, arguments=arguments, access=access
            )
            return render

        return register

    def add_prompt(
        self,
        name: str,
        template: str,
        *,
        description: str = "",
        arguments: Iterable[PromptArgument | str] | None = None,
        access: Access | None = None,
    ) -> None:
        """Declare a prompt with a template body: ``{topic}`` placeholders are its
        arguments (all required unless ``arguments`` declares them otherwise)."""
        self.catalog.add_prompt(
            template, name=name, description=description, arguments=arguments, access=access
        )

    # -- dispatch (the node calls this) -------------------------------------------------------

    async def handle(self, envelope: Envelope, caller: Caller | None = None) -> Reply | None:
        """Run the handler ``envelope`` is for; for a request, the reply to send.

        ``caller`` is who sent it as the hosting node authenticated it: what the access
        rules of tools, resources and prompts are checked against."""
        if envelope.type is not MessageType.REQUEST:
            # Every notification and stream message passes here: the handler is called
            # inline (no coroutine of our own), and an add_agent(id, handler) function
            # gets the envelope with no Message made for it.
            handler = self._by_type.get(envelope.type)
            argument: Any
            if handler is not None:
                argument = Message(envelope)
            elif self._fallback is not None:
                handler = self._fallback
                argument = envelope if self._fallback_takes_envelope else Message(envelope)
            else:
                return None
            try:
                result = handler(argument)
                if _awaitable(result):
                    await result
            except Exception:
                logger.exception("%s: %s handler failed", self.id, envelope.type.value)
            return None
        meta = envelope.metadata
        asked = meta.capability if meta is not None else None
        if asked in MCP_METHODS and (self._fallback is None or self.catalog):
            # An agent with no catalog but one handler of everything (a bridge, or an
            # agent being withdrawn) answers MCP methods itself.
            return await self._serve_catalog(asked, envelope.payload, caller)
        message = Message(envelope, caller)
        route = self._requests.get(asked) or self._fallback_route()
        if route is None:
            what = f"does not offer {asked!r}" if asked else "takes requests for a capability"
            error = RemoteError(
                ErrorCode.CAPABILITY_NOT_FOUND, f"agent {self.id!r} {what}", capability=asked
            )
            return Reply(MessageType.ERROR, error.to_dict())
        if route.validate is not None:
            problem = route.validate(envelope.payload)
            if problem is not None:
                error = RemoteError(ErrorCode.INVALID_INPUT, problem)
                return Reply(MessageType.ERROR, error.to_dict())
        try:
            result = route.handler(message)
            if _awaitable(result):
                result = await result
            return Reply(MessageType.RESPONSE, result)
        except P2PError as exc:
            return Reply(MessageType.ERROR, exc.to_dict())
        except Exception:
            logger.exception("%s: handler of %r failed", self.id, message.capability)
            failed = f"the handler of agent {self.id!r} failed"
            error = RemoteError(ErrorCode.HANDLER_FAILED, failed)
            return Reply(MessageType.ERROR, error.to_dict())

    async def _serve_catalog(self, method: str, params: Any, caller: Caller | None) -> Reply:
        try:
            return Reply(MessageType.RESPONSE, await self.catalog.serve(method, params, caller))
        except P2PError as exc:
            return Reply(MessageType.ERROR, exc.to_dict())
        except Exception:
            logger.exception("%s: %s failed", self.id, method)
            failed = f"the handler of {method} on agent {self.id!r} failed"
            error = RemoteError(ErrorCode.HANDLER_FAILED, failed, agentId=self.id)
            return Reply(MessageType.ERROR, error.to_dict())

    def tool_deadline(self, envelope: Envelope) -> float | None:
        """The deadline (seconds) the tool a ``tools/call`` request names declared; None
        when it declared none, or for any other request."""
        if not self._tool_deadlines:
            return None
        meta, params = envelope.metadata, envelope.payload
        if meta is None or meta.capability != TOOLS_CALL or type(params) is not dict:
            return None
        name = params.get("name")
        return self._tool_deadlines.get(name) if type(name) is str else None

    def card_offers(self) -> dict[str, tuple[str, ...]]:
        """What the agent's card lists of its catalog: ``tools``, ``resources`` and
        ``prompts`` (keyword arguments of :class:`~p2pnode.core.card.AgentCard`)."""
        return {
            "tools": tuple(self.catalog.tools),
            "resources": tuple(self.catalog.resources),
            "prompts": tuple(self.catalog.prompts),
        }

    def _fallback_route(self) -> _Route | None:
        """The route of requests no capability handler takes (None: no fallback); made
        once, on the first such request."""
        route = self._fallback_cache
        if route is None and self._fallback is not None:
            fallback = self._fallback
            handler = fallback
            if self._fallback_takes_envelope:

                def handler(message: Message) -> Any:
                    return fallback(message.envelope)  # type: ignore[arg-type]

            route = self._fallback_cache = _Route(handler, None)
        return route


def _awaitable(result: Any) -> bool:
    # The exact type test first: it is what async handlers return, and it is far cheaper
    # than the general awaitable check (an ABC isinstance) on every envelope.
    return type(result) is CoroutineType or (result is not None and inspect.isawaitable(result))


def agent_for_handler(
    agent_id: str,
    handler: Callable[[Envelope], Any],
    *,
    name: str | None = None,
    tier: int = 3,
    capabilities: Iterable[Capability] = (),
    sandbox: str | None = None,
    description: str = "",
    version: str = "1.0.0",
) -> Agent:
    """An agent whose one ``handler`` takes every envelope (a request's answer is what it
    returns): the shape of ``node.add_agent(agent_id, handler)``."""
    agent = Agent(
        agent_id,
        name=name,
        tier=tier,
        capabilities=capabilities,
        sandbox=sandbox,
        description=description,
        version=version,
    )
    # The one handler takes envelopes, not Messages (see Agent.handle).
    agent.on_message(cast(HandlerFunction, handler))
    agent._fallback_takes_envelope = True
    return agent


def as_agent(
    agent: Agent | str,
    handler: Callable[[Envelope], Any] | None = None,
    *,
    name: str | None = None,
    tier: int = 3,
    capabilities: Iterable[Capability] = (),
    sandbox: str | None = None,
    description: str = "",
    version: str = "1.0.0",
) -> Agent:
    """``agent`` itself, or for an agent id the agent of one ``handler`` (see
    :func:`agent_for_handler`; its name defaults to the id in capitals): what every
    ``add_agent(agent_or_id, handler, ...)`` of the package accepts.

    Raises LocalError(INVALID_ARGUMENT) for an agent id without a handler.
    """
    if isinstance(agent, Agent):
        return agent
    if handler is None:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "an agent id needs a handler")
    return agent_for_handler(
        agent,
        handler,
        name=name or agent.upper(),
        tier=tier,
        capabilities=capabilities,
        sandbox=sandbox,
        description=description,
        version=version,
    )


__all__ = ["Agent", "HandlerFunction", "Message", "Reply", "agent_for_handler", "as_agent"]
