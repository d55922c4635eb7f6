"""The caller's side of tools, resources and prompts: list what the swarm offers, use it.

``node.tools`` is a :class:`ToolClient`. Every call is made as one of the
node's local agents (``caller``, default: the first), so the owner checks its
access rules against that agent's authenticated card.

* **Listing** asks each owner it can reach for what this caller may use: the
  registry's cards that list tools (resources, prompts) and that the caller
  may discover (sandbox rules), each asked ``tools/list`` (...) at once, at
  most :data:`LIST_CONCURRENCY` at a time. An owner that does not answer is
  reported in :attr:`Listing.unreachable` with the error code, not hidden.
  Each answer is a peer's input: an entry that is not well formed is dropped
  and counted, at most the card limits are kept per owner, and names are
  qualified with the owner's id, so no owner can list a tool as another's.
* **Using** sends one request to the owning agent (named in ``agent.tool``,
  or for a resource the agent whose card lists the URI). A failure raises
  :class:`~p2pnode.core.errors.RemoteError` with the owner's code, message and
  details (``agentId`` names the source agent).
"""

from __future__ import annotations

from collections.abc import Coroutine, Mapping
from typing import Any

import trio

from p2pnode.agent.surface import Listing
from p2pnode.agent.tools import (
    PLAIN_RESULT,
    PROMPTS_GET,
    PROMPTS_LIST,
    RESOURCES_LIST,
    RESOURCES_READ,
    TOOLS_CALL,
    TOOLS_LIST,
    split_qualified,
)
from p2pnode.core.card import (
    MAX_PROMPTS,
    MAX_RESOURCES,
    MAX_TEXT,
    MAX_TOOLS,
    NAME_PATTERN,
    AgentCard,
)
from p2pnode.core.envelope import Envelope, MessageType, Metadata
from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.core.jsonutil import is_flat_json_map, is_json_value
from p2pnode.core.wire import DEFAULT_LIMITS
from p2pnode.node.service import ProgressCallback, ServiceHost

#: Owners asked at once while listing.
LIST_CONCURRENCY = 16
#: How deep tool arguments may nest (the arguments object is 1): what a frame carries
#: below its own levels of envelope and payload, with a margin.
MAX_ARGUMENT_DEPTH = 24
#: Entries a listing keeps in all (the rest are counted in ``dropped``).
MAX_LISTED = 4096
_KINDS = {
    "tools": (TOOLS_LIST, MAX_TOOLS),
    "resources": (RESOURCES_LIST, MAX_RESOURCES),
    "prompts": (PROMPTS_LIST, MAX_PROMPTS),
}


class ToolClient:
    """Lists and uses the swarm's tools, resources and prompts (see the module docstring)."""

    def __init__(self, host: ServiceHost, default_caller: Any) -> None:
        self._host = host
        self._default_caller = default_caller
        #: The metadata of each (caller, method): the card's claims and the method.
        self._metadata: dict[tuple[str, str], tuple[AgentCard, Metadata]] = {}

    # -- listing --------------------------------------------------------------------------------

    async def list_tools(self, caller: str | None = None) -> Listing:
        """Every tool ``caller`` may use in the swarm, as far as this node can reach."""
        return await self._list("tools", caller)

    async def list_resources(self, caller: str | None = None) -> Listing:
        """Every resource ``caller`` may read in the swarm, as far as this node can reach."""
        return await self._list("resources", caller)

    async def list_prompts(self, caller: str | None = None) -> Listing:
        """Every prompt ``caller`` may get in the swarm, as far as this node can reach."""
        return await self._list("prompts", caller)

    async def _list(self, kind: str, caller: str | None) -> Listing:
        sender = caller or self._default_caller()
        viewer = self._host.local_agent(sender)
        method, per_owner = _KINDS[kind]
        owners = [card for card in self._owners(viewer) if getattr(card, kind)]
        listing = Listing()
        answers: dict[str, list[Any]] = {}
        limiter = trio.CapacityLimiter(LIST_CONCURRENCY)

        async def ask(owner: AgentCard) -> None:
            async with limiter:
                try:
                    answer = (await self._ask(sender, owner.id, method, {})).payload
                except P2PError as exc:
                    listing.unreachable[owner.id] = str(exc.code)
                    return
            entries = answer.get(kind) if isinstance(answer, dict) else None
            if not isinstance(entries, list):
                listing.unreachable[owner.id] = str(ErrorCode.MALFORMED_MESSAGE)
                return
            answers[owner.id] = entries

        async with trio.open_nursery() as nursery:
            for owner in owners:
                nursery.start_soon(ask, owner)
        for owner in owners:  # in registry order, whatever order answers came in
            entries = answers.get(owner.id, [])
            kept = [e for e in map(_entry_checker(kind, owner.id), entries[:per_owner]) if e]
            listing.dropped += len(entries) - len(kept)
            room = MAX_LISTED - len(listing.items)
            listing.dropped += max(0, len(kept) - room)
            listing.items.extend(kept[:room])
        return listing

    def _owners(self, viewer: AgentCard) -> list[AgentCard]:
        """The agents ``viewer`` may discover and send a request to (sandboxes, tiers)."""
        now = self._host.now_ms()
        policy = self._host.policy
        # Owners known unreachable are left out: their listing would only fail.
        live = [card for card in self._host.registry if self._host.registry.is_live(card, now)]
        return [
            card
            for card in policy.filter_discoverable(viewer, live)
            if card.id == viewer.id
            or policy.check_message(viewer, card, MessageType.REQUEST, None).allowed
        ]

    # -- using ----------------------------------------------------------------------------------

    async def call_tool(
        self,
        name: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        caller: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (it travels to the owner)
        on_progress: ProgressCallback | None = None,
    ) -> Any:
        """Call tool ``name`` (``agent.tool``) with ``arguments``; returns its result.

        ``timeout`` is the caller's idle deadline (seconds; each progress the tool reports
        to ``on_progress`` starts it again), sent to the owner, which bounds the call by
        min(it, the tool's deadline); default: the node's ``request_timeout``.

        Raises LocalError(INVALID_ARGUMENT) for a name that is not qualified or arguments
        that are not JSON data, RemoteError with the owner's code otherwise.
        """
        answer = await self.call_tool_result(
            name, arguments, caller=caller, timeout=timeout, on_progress=on_progress, plain=True
        )
        if type(answer) is not dict:
            return answer  # a plain result (or a bare answer of an agent serving itself)
        if "structuredContent" in answer:
            return answer["structuredContent"]
        return answer.get("content")

    async def call_tool_result(
        self,
        name: str,
        arguments: Mapping[str, Any] | None = None,
        *,
        caller: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (it travels to the owner)
        on_progress: ProgressCallback | None = None,
        plain: bool = False,
    ) -> Any:
        """The owner's whole ``tools/call`` answer (tools.md §3: ``structuredContent``
        and, from a tool that returns MCP content, ``content``), as :meth:`call_tool`
        sends it; with ``plain`` a result that is not a map may come as it is (§3.2)."""
        owner, tool = split_qualified(name)
        # A plain result is asked for: an owner that knows the key answers a result that
        # is not a map as it is, one that does not wraps it as every result.
        limits = DEFAULT_LIMITS
        if type(arguments) is dict and is_flat_json_map(
            arguments, limits.max_str_len // 4, limits.max_array_len
        ):
            value = arguments  # what _json_object checks first, without its call
        else:
            value = _json_object(arguments)
        params: dict[str, Any] = {"name": tool, "arguments": value}
        if plain:
            params[PLAIN_RESULT] = True
        sender = caller or self._default_caller()
        return (await self._ask(sender, owner, TOOLS_CALL, params, timeout, on_progress)).payload

    async def read_resource(
        self,
        uri: str,
        *,
        caller: str | None = None,
        agent: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (it travels to the owner)
        on_progress: ProgressCallback | None = None,
    ) -> dict[str, Any]:
        """Read resource ``uri`` from ``agent`` (default: the first agent ``caller`` may
        discover whose card lists it): the MCP result, ``{"contents": [...]}``.

        Raises LocalError(RESOURCE_NOT_FOUND) naming the URI when no such agent is known.
        """
        sender = caller or self._default_caller()
        owner = agent
        if owner is None:
            viewer = self._host.local_agent(sender)
            listing = [c for c in self._owners(viewer) if uri in c.resources]
            if not listing:
                raise LocalError(
                    ErrorCode.RESOURCE_NOT_FOUND, f"no reachable agent offers {uri}", uri=uri
                )
            owner = listing[0].id
        asked = self._ask(sender, owner, RESOURCES_READ, {"uri": uri}, timeout, on_progress)
        answer = (await asked).payload
        return _checked(answer, "contents", _is_content, owner)

    async def get_prompt(
        self,
        name: str,
        arguments: Mapping[str, str] | None = None,
        *,
        caller: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (it travels to the owner)
        on_progress: ProgressCallback | None = None,
    ) -> dict[str, Any]:
        """Get prompt ``name`` (``agent.prompt``) rendered with ``arguments``: the MCP
        result, ``{"description": ..., "messages": [...]}``."""
        owner, prompt = split_qualified(name)
        params = {"name": prompt, "arguments": _json_object(arguments)}
        sender = caller or self._default_caller()
        answer = (await self._ask(sender, owner, PROMPTS_GET, params, timeout, on_progress)).payload
        return _checked(answer, "messages", _is_message, owner)

    def _ask(
        self,
        sender: str,
        owner: str,
        method: str,
        params: Any,
        timeout: float | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> Coroutine[Any, Any, Envelope]:
        # The request's own coroutine, handed back rather than awaited in one of ours.
        card = self._host.local_agent(sender)
        key = (sender, method)
        cached = self._metadata.get(key)
        if cached is None or cached[0] is not card:
            if len(self._metadata) >= 1024:
                self._metadata.clear()
            claims = Metadata(int(card.tier), card.sandbox_id, capability=method)
            cached = self._metadata[key] = (card, claims)
        if timeout is None and on_progress is None:
            return self._host.request(sender, owner, params, metadata=cached[1])
        return self._host.request(
            sender, owner, params, metadata=cached[1], timeout=timeout, on_progress=on_progress
        )


def _is_content(item: Any) -> bool:
    return (
        isinstance(item, dict)
        and isinstance(item.get("uri"), str)
        and isinstance(item.get("mimeType", ""), str)
        and (isinstance(item.get("text"), str) or isinstance(item.get("blob"), str))
    )


def _is_message(item: Any) -> bool:
    return (
        isinstance(item, dict)
        and isinstance(item.get("role"), str)
        and isinstance(item.get("content"), dict)
    )


def _checked(answer: Any, key: str, is_item: Any, owner: str) -> dict[str, Any]:
    """An owner's ``resources/read`` or ``prompts/get`` answer, its ``key`` a list of
    well-formed items. Raises RemoteError(MALFORMED_MESSAGE) naming the owner."""
    items = answer.get(key) if isinstance(answer, dict) else None
    if not isinstance(items, list) or not all(is_item(item) for item in items):
        raise RemoteError(
            ErrorCode.MALFORMED_MESSAGE,
            f"the answer of {owner} has no well-formed {key!r}",
            agentId=owner,
        )
    return dict(answer)


def _json_object(arguments: Mapping[str, Any] | None) -> dict[str, Any]:
    """``arguments`` as a dict a peer can decode. Raises LocalError(INVALID_ARGUMENT) for
    what is not JSON data, LocalError(MESSAGE_TOO_LARGE) past the frame limits."""
    if arguments is None:
        return {}
    value = arguments if type(arguments) is dict else dict(arguments)
    limits = DEFAULT_LIMITS
    if is_flat_json_map(value, limits.max_str_len // 4, limits.max_array_len):
        return value  # within both checks below by construction: no walk
    if not is_json_value(value):
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "arguments must be JSON data")
    problem = _past_frame_limits(value)
    if problem is not None:
        raise LocalError(ErrorCode.MESSAGE_TOO_LARGE, f"arguments: {problem}")
    return value


def _past_frame_limits(value: Any) -> str | None:
    """What in ``value`` a peer's frame decoder refuses (docs/protocol/tools.md §5), or
    None. Iterative, so a deep value cannot exhaust the stack."""
    limits = DEFAULT_LIMITS
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if len(item) > limits.max_str_len // 4 and len(item.encode()) > limits.max_str_len:
                return f"a string over {limits.max_str_len} bytes"
        elif isinstance(item, dict | list):
            if depth > MAX_ARGUMENT_DEPTH:
                return f"nested deeper than {MAX_ARGUMENT_DEPTH}"
            if len(item) > limits.max_array_len:
                return f"more than {limits.max_array_len} items in one array or map"
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return None


def _entry_checker(kind: str, owner: str) -> Any:
    """A function turning one listed entry from ``owner`` into what the listing keeps
    (None when it is not well formed)."""

    def check(entry: Any) -> dict[str, Any] | None:
        if not isinstance(entry, dict) or not is_json_value(entry):
            return None
        description = entry.get("description", "")
        if not isinstance(description, str):
            return None
        kept: dict[str, Any] = {"agentId": owner, "description": description[:MAX_TEXT]}
        if kind == "resources":
            uri, name = entry.get("uri"), entry.get("name", "")
            mime = entry.get("mimeType", "text/plain")
            if not all(isinstance(v, str) and len(v) <= 256 for v in (uri, name, mime)):
                return None
            return kept | {"uri": uri, "name": name, "mimeType": mime}
        name = entry.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            return None
        kept["name"] = f"{owner}.{name}"
        if kind == "tools":
            kept["inputSchema"] = entry.get("inputSchema", {"type": "object"})
            if "outputSchema" in entry:
                kept["outputSchema"] = entry["outputSchema"]
        else:
            arguments = entry.get("arguments", [])
            if not isinstance(arguments, list) or len(arguments) > 64:
                return None
            kept["arguments"] = arguments
        return kept

    return check


__all__ = ["LIST_CONCURRENCY", "MAX_ARGUMENT_DEPTH", "MAX_LISTED", "Listing", "ToolClient"]
