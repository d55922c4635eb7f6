"""Tools, resources and prompts an agent offers the swarm (MCP-style), with least privilege.

Theory of operation (the wire form is docs/protocol/tools.md):

* An agent declares them on its :class:`~p2pnode.agent.definition.Agent` (``@agent.tool()``,
  ``@agent.resource(uri)``, ``@agent.prompt()``, ``agent.add_prompt``); each
  lands in the agent's :class:`Catalog`. Across the swarm a tool is named
  ``<agent id>.<tool name>`` (seed R5.6); a second tool or prompt of one name,
  or a second resource of one URI, is refused with ``DUPLICATE_TOOL`` (R5.5).
* The agent's card lists the names and URIs only, which keeps a card well
  under the DHT's value limit; the descriptors (descriptions and schemas) are
  what the owner answers to ``tools/list``, ``resources/list`` and
  ``prompts/list``.
* Callers send requests to the owning agent whose ``metadata.capability`` is
  one of the MCP method names (:data:`MCP_METHODS`) and whose payload is the
  MCP ``params``. :meth:`Catalog.serve` answers them on the owner, in this
  order: parse the params, find the entry, check the caller's access, check
  the input, run the handler, check the output. Each failure is a typed
  :class:`~p2pnode.core.errors.P2PError` whose details name the owning agent.
* **Least privilege.** Each entry has an :class:`Access` rule, checked
  against a :class:`Caller` the owner's node built from the caller's
  *authenticated* card (and, for roles, the swarm authority's endorsement),
  never from anything the request claims. A list answer holds only what the
  caller may use.
"""

from __future__ import annotations

import inspect
import string
import types
import typing
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from p2pnode.agent.toolschema import Conversion, derived_arguments, derived_result, explicit
from p2pnode.agent.toolwire import (  # the method names, re-exported
    MCP_METHODS,
    PLAIN_RESULT,
    PROMPTS_GET,
    PROMPTS_LIST,
    RESOURCES_LIST,
    RESOURCES_READ,
    TOOLS_CALL,
    TOOLS_LIST,
    call_params,
    split_qualified,
    string_map,
    text_param,
)
from p2pnode.core.card import MAX_TEXT, MAX_URI_CHARS, NAME_PATTERN, URI_PATTERN, AgentCard
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.core.jsonutil import b64encode, dumps, is_json_value


# ---------------------------------------------------------------------- who may use an entry
# The Caller as the owner's node authenticated it, and the Access rule checked
# against it (docs/protocol/tools.md §4).
@dataclass(frozen=True, slots=True)
class Caller:
    """Who is calling, as the owner's node authenticated it: the caller's signed card,
    and the roles the swarm authority endorsed for it."""

    agent_id: str
    peer_id: str
    tier: int
    sandbox: str | None
    roles: frozenset[str] = frozenset()

    @classmethod
    def from_card(cls, card: AgentCard, authority_key: bytes | None) -> Caller:
        return cls(
            card.id,
            str(card.peer_id),
            int(card.tier),
            card.sandbox_id,
            card.endorsed_roles(authority_key),
        )


class Access:
    """Who may use a tool, resource or prompt. Each rule given must hold: the caller's
    tier is one of ``tiers``, its sandbox one of ``sandboxes``, its id one of
    ``agents``, its node one of ``peers`` (peer ids), and it holds one of ``roles``
    (endorsed by the swarm authority; an open swarm has no roles). No rule: anyone
    the node's policy lets send the owner a request."""

    __slots__ = ("agents", "peers", "roles", "sandboxes", "tiers")

    def __init__(
        self,
        *,
        tiers: Iterable[int] | None = None,
        sandboxes: Iterable[str] | None = None,
        agents: Iterable[str] | None = None,
        peers: Iterable[str] | None = None,
        roles: Iterable[str] | None = None,
    ) -> None:
        self.tiers = frozenset(int(t) for t in tiers) if tiers is not None else None
        self.sandboxes = frozenset(sandboxes) if sandboxes is not None else None
        self.agents = frozenset(agents) if agents is not None else None
        self.peers = frozenset(peers) if peers is not None else None
        self.roles = frozenset(roles) if roles is not None else None

    def refusal(self, caller: Caller | None) -> str | None:
        """Why ``caller`` may not use the entry (None: it may)."""
        if self.is_open():
            return None
        if caller is None:
            return "the caller is not authenticated"
        if self.tiers is not None and caller.tier not in self.tiers:
            return f"tier L{caller.tier} is not one of {_listed(f'L{t}' for t in self.tiers)}"
        if self.sandboxes is not None and caller.sandbox not in self.sandboxes:
            return f"sandbox {caller.sandbox!r} is not one of {_listed(self.sandboxes)}"
        if self.agents is not None and caller.agent_id not in self.agents:
            return f"agent {caller.agent_id!r} is not allowed"
        if self.peers is not None and caller.peer_id not in self.peers:
            return f"peer {caller.peer_id} is not allowed"
        if self.roles is not None and not caller.roles & self.roles:
            return f"no endorsed role among {_listed(self.roles)}"
        return None

    def is_open(self) -> bool:
        # Asked on every call of a tool: plain tests, no generator.
        return (
            self.tiers is None
            and self.sandboxes is None
            and self.agents is None
            and self.peers is None
            and self.roles is None
        )

    def __repr__(self) -> str:
        rules = ", ".join(f"{k}={sorted(v)}" for k in self.__slots__ if (v := getattr(self, k)))
        return f"Access({rules})"


def _listed(items: Iterable[str]) -> str:
    return ", ".join(sorted(items))


ANYONE = Access()


def _takes_caller(annotation: Any) -> bool:
    """A parameter so annotated receives the authenticated caller: ``Caller`` or
    ``Caller | None`` (None: the node could not authenticate it), ``Annotated`` or not.
    Anything else is an argument the peer sends, so ``Caller | None`` must be caught
    here: as an argument, a peer would fill in the Caller of its choice."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if annotation is Caller or annotation == "Caller":
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = set(typing.get_args(annotation))
        return Caller in members and members <= {Caller, type(None)}
    return False


async def _run(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    result = function(*args, **kwargs)
    # The exact type tests first: a plain result is the common case, and the general
    # awaitable check (an ABC isinstance) costs microseconds on every call.
    if type(result) in _PLAIN or not inspect.isawaitable(result):
        return result
    return await result


_PLAIN = frozenset({int, str, float, bool, dict, list, type(None)})


@dataclass(frozen=True, slots=True)
class ToolContent:
    """What a tool returns to answer with MCP content blocks (a bridged MCP server's):
    ``content`` the blocks as MCP's JSON (text, image, audio, resource_link, resource),
    ``structured`` its result, held to the output schema, or None. The answer is
    ``{"content": [...], "structuredContent"?: ...}`` (docs/protocol/tools.md §3)."""

    content: tuple[Any, ...]
    structured: Any = None


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A declared tool: its function, schemas (as conversions) and access rule."""

    name: str
    description: str
    function: Callable[..., Any]
    arguments: Conversion
    result: Conversion | None
    access: Access
    #: The function's parameter that receives the :class:`Caller`, if any.
    caller_parameter: str | None = None
    #: The function takes the arguments object itself (a tool with an explicit schema).
    takes_object: bool = False
    #: Anyone may use it (``access`` has no rule): decided once, asked on every call.
    open: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "open", self.access.is_open())

    def descriptor(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "description": self.description}
        out["inputSchema"] = self.arguments.schema or {"type": "object"}
        if self.result is not None and self.result.schema is not None:
            out["outputSchema"] = self.result.schema
        return out

    async def call(self, arguments: Any, caller: Caller | None) -> Any:
        """The checked result of the tool on ``arguments`` (a map or None) for ``caller``.
        Raises RemoteError (INVALID_INPUT, INVALID_OUTPUT) or what the function raises."""
        value = self.start(arguments, caller)
        if type(value) not in _PLAIN and inspect.isawaitable(value):
            value = await value
        return self.finish(value)

    def start(self, arguments: Any, caller: Caller | None) -> Any:
        """The function called on the checked ``arguments``: its value, or its awaitable
        for an async one (:meth:`call` in two steps, so a sync tool costs no coroutine)."""
        # MCP's tools/call may leave out "arguments": none is the empty object, whichever
        # way the tool's schema came (derived ones read it so already).
        converted, problem = self.arguments.convert({} if arguments is None else arguments)
        if problem is not None:
            raise RemoteError(ErrorCode.INVALID_INPUT, problem, tool=self.name)
        function = self.function
        if not self.caller_parameter:  # most tools: no keyword map to build
            return function(converted) if self.takes_object else function(**converted)
        if self.takes_object:
            return function(converted, **{self.caller_parameter: caller})
        return function(**converted, **{self.caller_parameter: caller})

    def finish(self, value: Any) -> Any:
        """The function's ``value`` checked against the output schema, as JSON data.
        Raises RemoteError(INVALID_OUTPUT)."""
        result = self.result
        if result is not None:
            kind = type(value)
            # A value exactly of the plain type declared is the declared result as is,
            # and JSON data once an int is in msgpack's range: nothing more to check.
            if kind is result.plain and (kind is not int or _MIN_INT <= value <= _MAX_INT):
                return value
            value, problem = result.convert(value)
            if problem is not None:
                raise RemoteError(ErrorCode.INVALID_OUTPUT, problem, tool=self.name)
        if not is_json_value(value):
            # Checked here, whatever the schemas say: a result the reply cannot carry
            # would otherwise fail on the owner's node, and the caller would wait for
            # nothing until its request timed out.
            raise RemoteError(
                ErrorCode.INVALID_OUTPUT,
                f"result: {type(value).__name__} is not JSON data",
                tool=self.name,
            )
        return value


def _content_answer(tool: ToolSpec, value: ToolContent) -> dict[str, Any]:
    """The ``tools/call`` answer of a tool that returned MCP content blocks."""
    content = list(value.content)
    if not all(isinstance(block, dict) for block in content) or not is_json_value(content):
        raise RemoteError(
            ErrorCode.INVALID_OUTPUT, "content: blocks must be JSON objects", tool=tool.name
        )
    if value.structured is None:
        return {"content": content}
    return {"content": content, "structuredContent": tool.finish(value.structured)}


_MIN_INT, _MAX_INT = -(2**63), 2**64 - 1  # what msgpack packs, and so JSON data here


@dataclass(frozen=True, slots=True)
class ResourceSpec:
    """A declared resource: its URI, name, MIME type and content loader."""

    uri: str
    name: str
    description: str
    mime_type: str
    load: Callable[..., Any]
    access: Access
    caller_parameter: str | None = None

    def descriptor(self) -> dict[str, Any]:
        return {
            "uri": self.uri,
            "name": self.name,
            "description": self.description,
            "mimeType": self.mime_type,
        }

    async def read(self, caller: Caller | None) -> dict[str, Any]:
        extra = {self.caller_parameter: caller} if self.caller_parameter else {}
        content = await _run(self.load, **extra)
        item: dict[str, Any] = {"uri": self.uri, "mimeType": self.mime_type}
        if isinstance(content, bytes | bytearray):
            item["blob"] = b64encode(bytes(content))
        elif isinstance(content, str):
            item["text"] = content
        elif is_json_value(content):
            item["text"] = dumps(content)
        else:
            raise RemoteError(
                ErrorCode.INVALID_OUTPUT,
                f"the loader of {self.uri} returned {type(content).__name__}, "
                "not text, bytes or JSON data",
                uri=self.uri,
            )
        return {"contents": [item]}


@dataclass(frozen=True, slots=True)
class PromptArgument:
    """One argument of a prompt."""

    name: str
    description: str = ""
    required: bool = True

    def descriptor(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description, "required": self.required}


@dataclass(frozen=True, slots=True)
class PromptSpec:
    """A declared prompt: a template body (``{name}`` placeholders) or a function
    returning the text or the messages."""

    name: str
    description: str
    arguments: tuple[PromptArgument, ...]
    render: Callable[..., Any]
    access: Access

    def descriptor(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "arguments": [a.descriptor() for a in self.arguments],
        }

    async def get(self, given: Mapping[str, str]) -> dict[str, Any]:
        declared = {a.name for a in self.arguments}
        unknown = sorted(set(given) - declared)
        if unknown:
            raise RemoteError(
                ErrorCode.INVALID_INPUT,
                f"arguments.{unknown[0]}: not an argument",
                prompt=self.name,
            )
        for argument in self.arguments:
            if argument.required and argument.name not in given:
                raise RemoteError(
                    ErrorCode.INVALID_INPUT,
                    f"arguments.{argument.name}: a required argument is missing",
                    prompt=self.name,
                )
        # An optional argument left out is not passed: a function's default applies (a
        # template renders it as nothing).
        values = {a.name: given[a.name] for a in self.arguments if a.name in given}
        rendered = await _run(self.render, **values)
        if isinstance(rendered, str):
            messages = [{"role": "user", "content": {"type": "text", "text": rendered}}]
        elif isinstance(rendered, list) and is_json_value(rendered):
            messages = rendered
        else:
            raise RemoteError(
                ErrorCode.INVALID_OUTPUT,
                f"prompt {self.name} rendered {type(rendered).__name__}, not text or messages",
                prompt=self.name,
            )
        return {"description": self.description, "messages": messages}


def template_fields(template: str) -> list[str]:
    """The placeholders of a template body, in order of first use.

    Raises LocalError(INVALID_ARGUMENT) for a placeholder that is not a plain name
    (``{a.b}``, ``{a[0]}``, ``{0}``, a format spec): a template only substitutes.
    """
    names: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, f"bad template: {exc}") from None
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise LocalError(
                ErrorCode.INVALID_ARGUMENT, f"bad placeholder {{{name}}}: use {{name}} only"
            )
        if name not in names:
            names.append(name)
    return names


def _template_renderer(template: str) -> Callable[..., str]:
    def render(**values: str) -> str:
        return template.format_map(defaultdict(str, values))

    return render


class Catalog:
    """An agent's tools, resources and prompts (see the module docstring)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.tools: dict[str, ToolSpec] = {}
        self.resources: dict[str, ResourceSpec] = {}
        self.prompts: dict[str, PromptSpec] = {}

    def __bool__(self) -> bool:
        return bool(self.tools or self.resources or self.prompts)

    # -- declaring ------------------------------------------------------------------------------

    def add_tool(
        self,
        function: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        input_schema: Any = None,
        output_schema: Any = None,
        access: Access | None = None,
    ) -> ToolSpec:
        """Declare ``function`` as a tool. With ``input_schema`` it takes the arguments
        object as its one parameter; without, its parameters are the arguments and the
        schema comes from their type hints (and the output schema from the return
        annotation, unless ``output_schema`` is given). A parameter annotated
        :class:`Caller` receives the authenticated caller.

        Raises LocalError(DUPLICATE_TOOL) for a name taken, LocalError(INVALID_ARGUMENT)
        for a bad name or schema.
        """
        tool_name = _check_name(name or function.__name__, "tool")
        if tool_name in self.tools:
            raise self._duplicate("tool", tool_name)
        caller_parameter = _caller_parameter(function)
        if input_schema is not None:
            arguments = explicit(input_schema, "arguments")
            takes_object = True
        else:
            arguments, _ = derived_arguments(function, skip=_takes_caller)
            takes_object = False
        result = (
            explicit(output_schema, "result")
            if output_schema is not None
            else derived_result(function)
        )
        spec = ToolSpec(
            tool_name,
            _summary(description, function),
            function,
            arguments,
            result,
            access or ANYONE,
            caller_parameter,
            takes_object,
        )
        self.tools[tool_name] = spec
        return spec

    def add_resource(
        self,
        load: Callable[..., Any],
        uri: str,
        *,
        name: str | None = None,
        description: str | None = None,
        mime_type: str = "text/plain",
        access: Access | None = None,
    ) -> ResourceSpec:
        """Declare a resource whose content ``load()`` returns (text, bytes or JSON data).

        Raises LocalError(DUPLICATE_TOOL) for a URI taken, LocalError(INVALID_ARGUMENT)
        for a bad URI.
        """
        if not isinstance(uri, str) or not URI_PATTERN.fullmatch(uri):
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"bad resource URI {uri!r}")
        if uri in self.resources:
            raise self._duplicate("resource", uri)
        spec = ResourceSpec(
            uri,
            name or str(getattr(load, "__name__", uri)),
            _summary(description, load),
            mime_type,
            load,
            access or ANYONE,
            _caller_parameter(load),
        )
        self.resources[uri] = spec
        return spec

    def add_prompt(
        self,
        body: str | Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        arguments: Iterable[PromptArgument | str] | None = None,
        access: Access | None = None,
    ) -> PromptSpec:
        """Declare a prompt. ``body`` is a template (``{topic}`` placeholders; its
        arguments are its placeholders unless ``arguments`` says more) or a function of
        the arguments returning the text or a list of MCP messages (its arguments are
        its parameters: required unless they have a default).

        Raises LocalError(DUPLICATE_TOOL) for a name taken, LocalError(INVALID_ARGUMENT)
        for a bad name, a bad placeholder, or a placeholder not among ``arguments``.
        """
        if isinstance(body, str):
            if name is None:
                raise LocalError(ErrorCode.INVALID_ARGUMENT, "a template prompt needs a name")
            fields = template_fields(body)
            render: Callable[..., Any] = _template_renderer(body)
            declared = _prompt_arguments(arguments, fields)
            missing = set(fields) - {a.name for a in declared}
            if missing:
                raise LocalError(
                    ErrorCode.INVALID_ARGUMENT,
                    f"prompt {name}: placeholders {sorted(missing)} are not arguments",
                )
            summary = description or ""
        else:
            render = body
            parameters = inspect.signature(body).parameters.values()
            derived = [PromptArgument(p.name, "", p.default is p.empty) for p in parameters]
            declared = _prompt_arguments(arguments, []) if arguments is not None else derived
            summary = _summary(description, body)
        prompt_name = _check_name(name or str(getattr(body, "__name__", "")), "prompt")
        if prompt_name in self.prompts:
            raise self._duplicate("prompt", prompt_name)
        spec = PromptSpec(prompt_name, summary, tuple(declared), render, access or ANYONE)
        self.prompts[prompt_name] = spec
        return spec

    def _duplicate(self, what: str, name: str) -> LocalError:
        qualified = f"{self.owner}.{name}" if what != "resource" else name
        return LocalError(
            ErrorCode.DUPLICATE_TOOL,
            f"{what} {qualified!r} is already registered",
            tool=qualified,
        )

    # -- serving --------------------------------------------------------------------------------

    async def serve(self, method: str, params: Any, caller: Caller | None) -> Any:
        """The answer to one MCP request from ``caller``. Raises P2PError (its details
        name this agent: ``agentId``)."""
        try:
            if method == TOOLS_CALL:  # most requests: no coroutine but this one
                name, arguments = call_params(params, "name")
                tool = self.tools.get(name)
                if tool is None or not tool.open:
                    tool = self._tool(name, tool, caller)
                value = tool.start(arguments, caller)
                if type(value) not in _PLAIN and inspect.isawaitable(value):
                    value = await value
                if type(value) is ToolContent:
                    return _content_answer(tool, value)
                value = tool.finish(value)
                # A result that is not a map goes as it is to a caller that asked so
                # (docs/protocol/tools.md §3.2): a map is always wrapped, so the two
                # forms cannot be taken for each other (and wrapping is never wrong).
                if type(value) is not dict and params.get(PLAIN_RESULT) is True:
                    return value
                return {"structuredContent": value}
            return await self._serve(method, params, caller)
        except P2PError as exc:
            exc.details.setdefault("agentId", self.owner)
            if not is_json_value(exc.details):
                # A handler's error travels to the caller: what is not JSON data in its
                # details is described, not sent (the reply could not carry it).
                exc.details = {
                    key: value if is_json_value(value) else repr(value)[:MAX_TEXT]
                    for key, value in exc.details.items()
                }
            raise

    def _tool(self, name: str, tool: ToolSpec | None, caller: Caller | None) -> ToolSpec:
        """``tool`` (the one named ``name``) if ``caller`` may use it: an open tool is
        not asked here."""
        if tool is None:
            raise RemoteError(ErrorCode.TOOL_NOT_FOUND, f"no tool {self.owner}.{name}", tool=name)
        self._check_access(tool.access, caller, f"tool {self.owner}.{name}")
        return tool

    async def _serve(self, method: str, params: Any, caller: Caller | None) -> Any:
        if method == RESOURCES_READ:
            uri = text_param(params, "uri", MAX_URI_CHARS)
            resource = self.resources.get(uri)
            if resource is None:
                raise RemoteError(ErrorCode.RESOURCE_NOT_FOUND, f"no resource {uri}", uri=uri)
            self._check_access(resource.access, caller, f"resource {uri}")
            return await resource.read(caller)
        if method == PROMPTS_GET:
            name, arguments = call_params(params, "name")
            prompt = self.prompts.get(name)
            if prompt is None:
                raise RemoteError(
                    ErrorCode.PROMPT_NOT_FOUND, f"no prompt {self.owner}.{name}", prompt=name
                )
            self._check_access(prompt.access, caller, f"prompt {self.owner}.{name}")
            return await prompt.get(string_map(arguments))
        listed: Mapping[str, ToolSpec | ResourceSpec | PromptSpec]
        if method == TOOLS_LIST:
            key, listed = "tools", self.tools
        elif method == RESOURCES_LIST:
            key, listed = "resources", self.resources
        elif method == PROMPTS_LIST:
            key, listed = "prompts", self.prompts
        else:
            raise RemoteError(ErrorCode.CAPABILITY_NOT_FOUND, f"no method {method!r}")
        return {key: [e.descriptor() for e in listed.values() if not e.access.refusal(caller)]}

    @staticmethod
    def _check_access(access: Access, caller: Caller | None, what: str) -> None:
        refusal = access.refusal(caller)
        if refusal is not None:
            who = caller.agent_id if caller is not None else "an unknown caller"
            raise RemoteError(
                ErrorCode.PERMISSION_DENIED, f"{who} may not use {what}: {refusal}", caller=who
            )


def _summary(description: str | None, function: Callable[..., Any]) -> str:
    if description is not None:
        return description[:MAX_TEXT]
    return (inspect.getdoc(function) or "").split("\n\n")[0][:MAX_TEXT]


def _check_name(name: str, what: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise LocalError(
            ErrorCode.INVALID_ARGUMENT, f"bad {what} name {name!r}: {NAME_PATTERN.pattern}"
        )
    return name


def _caller_parameter(function: Callable[..., Any]) -> str | None:
    try:
        parameters = inspect.signature(function, eval_str=True).parameters.values()
    except (TypeError, ValueError, NameError):
        return None
    for parameter in parameters:
        if _takes_caller(parameter.annotation):
            return parameter.name
    return None


def _prompt_arguments(
    given: Iterable[PromptArgument | str] | None, fields: list[str]
) -> list[PromptArgument]:
    if given is None:
        return [PromptArgument(f) for f in fields]
    out = [a if isinstance(a, PromptArgument) else PromptArgument(a) for a in given]
    for argument in out:
        if not argument.name.isidentifier():
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"bad argument name {argument.name!r}")
    return out


#: What a tool function may be: sync or async, any parameters.
ToolFunction = Callable[..., Any | Awaitable[Any]]

__all__ = [
    "ANYONE",
    "MCP_METHODS",
    "PLAIN_RESULT",
    "PROMPTS_GET",
    "PROMPTS_LIST",
    "RESOURCES_LIST",
    "RESOURCES_READ",
    "TOOLS_CALL",
    "TOOLS_LIST",
    "Access",
    "Caller",
    "Catalog",
    "PromptArgument",
    "PromptSpec",
    "ResourceSpec",
    "ToolContent",
    "ToolFunction",
    "ToolSpec",
    "split_qualified",
    "template_fields",
]
