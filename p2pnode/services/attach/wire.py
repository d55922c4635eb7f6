"""The agent protocol's wire form: lines, replies, and the fields of ops (sans-IO).

Shared by the node's session core (:mod:`p2pnode.services.attach.session`) and by clients
(:mod:`p2pnode.hosting.client`). docs/protocol/agents.md is the specification: JSON
lines of at most :data:`MAX_LINE` bytes, one object each; a reply is
``{"op", "ok": true, "id"?, "result"}`` or ``{"op", "ok": false, "id"?,
"error": {"code", "message", "details"}, "fatal"?}``. Functions ending in
``_untrusted`` read the other side's data and raise only :class:`AttachError`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final

from p2pnode.agent.tools import Caller
from p2pnode.core.card import (
    MAX_CAPABILITIES,
    MAX_PROMPTS,
    MAX_RESOURCES,
    MAX_TOOLS,
    NAME_PATTERN,
    URI_PATTERN,
    Capability,
)
from p2pnode.core.card_rules import names_problems
from p2pnode.core.envelope import MAX_ID_LENGTH, MessageType
from p2pnode.core.errors import ErrorCode, P2PError, RemoteError
from p2pnode.core.jsonutil import MAX_PARSE_DEPTH, is_json_value, loads_untrusted

PROTOCOL_VERSION: Final = 1
AGENT_SOCKET_NAME: Final = "agent.sock"
#: The longest line either side may send, newline excluded.
MAX_LINE: Final = 1024 * 1024
MAX_TEXT: Final = 4096
#: Message types by their wire name.
TYPES: Final = {t.value: t for t in MessageType}


class AttachError(RemoteError):
    """A line of the agent process (or of the node, read by a client) is wrong."""


@dataclass(frozen=True, slots=True)
class Ref:
    """Which op a reply answers: its name (None: the line named none) and the process's
    ``id`` (None when it gave none)."""

    op: str | None
    id: int | str | None = None


@dataclass(frozen=True, slots=True)
class CardTemplate:
    """The descriptive fields of the agent's card; the node fills in and signs the rest."""

    id: str
    name: str
    description: str
    version: str
    tier: int
    sandbox_id: str | None
    capabilities: tuple[Capability, ...]
    #: What the process's agent offers (docs/protocol/tools.md); its MCP requests are
    #: forwarded to the process when any is listed.
    tools: tuple[str, ...] = ()
    resources: tuple[str, ...] = ()
    prompts: tuple[str, ...] = ()

    def offers(self) -> dict[str, tuple[str, ...]]:
        return {"tools": self.tools, "resources": self.resources, "prompts": self.prompts}


class LineBuffer:
    """Splits a byte stream into lines of at most ``max_line`` bytes (newline excluded)."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer known to hold no newline
        self._max = max_line

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def next_line(self) -> bytes | None:
        """The next complete line, or None. Raises AttachError(MESSAGE_TOO_LARGE)."""
        end = self._buffer.find(b"\n", self._scanned)
        if end < 0:
            self._scanned = len(self._buffer)
            if self._scanned > self._max:
                raise AttachError(ErrorCode.MESSAGE_TOO_LARGE, f"a line exceeds {self._max} bytes")
            return None
        if end > self._max:
            raise AttachError(ErrorCode.MESSAGE_TOO_LARGE, f"a line exceeds {self._max} bytes")
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        self._scanned = 0
        return line

    def __len__(self) -> int:
        return len(self._buffer)


def encode_line(obj: Any) -> bytes:
    """One JSON line (strict JSON: no NaN). Raises ValueError or TypeError when ``obj`` has
    no JSON form."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def error_line(
    ref: Ref | None, error: P2PError, *, fatal: bool = False, remote: bool = False, **extra: Any
) -> bytes:
    """The error reply to ``ref`` (None: the line had no readable op). ``remote``: the error
    is a peer's or a responder's (``"remote": true`` in the error object, so a client raises
    it as the in-process node does, a RemoteError)."""
    reply: dict[str, Any] = {"op": ref.op if ref else None, "ok": False}
    if ref is not None and ref.id is not None:
        reply["id"] = ref.id
    reply.update(extra)
    reply["error"] = error.to_dict()
    if remote:
        reply["error"]["remote"] = True
    if fatal:
        reply["fatal"] = True
    try:
        return encode_line(reply)
    except (TypeError, ValueError):  # details a peer's error carried that JSON cannot
        reply["error"] = {"code": str(error.code), "message": error.message, "details": {}}
        return encode_line(reply)


# -- parsing one op (the process's bytes: raises only AttachError) ----------------------------


def invalid(
    message: str, code: ErrorCode = ErrorCode.INVALID_ARGUMENT, **details: Any
) -> AttachError:
    return AttachError(code, message, **details)


def text(obj: dict[str, Any], key: str, default: str | None, limit: int = MAX_TEXT) -> str:
    value = obj.get(key, default)
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        raise invalid(f"{key}: must be a string of 1..{limit} characters")
    return value


def optional_text(obj: dict[str, Any], key: str, limit: int = MAX_ID_LENGTH) -> str | None:
    if obj.get(key) is None:
        return None
    return text(obj, key, None, limit)


def flag(obj: dict[str, Any], key: str) -> bool:
    value = obj.get(key, False)
    if not isinstance(value, bool):
        raise invalid(f"{key}: must be true or false")
    return value


def payload_untrusted(obj: dict[str, Any]) -> Any:
    value = obj.get("payload")
    if not is_json_value(value):
        raise invalid("payload: must be JSON data nested at most 32 deep (64-bit integers)")
    return value


def only_keys(obj: dict[str, Any], allowed: frozenset[str]) -> None:
    unknown = set(obj) - allowed
    if unknown:
        raise invalid(f"unknown keys {sorted(unknown)}")


_CARD_KEYS = frozenset(
    {"id", "name", "description", "version", "tier", "sandboxId", "capabilities"}
    | {"tools", "resources", "prompts"}
)
_CAPABILITY_KEYS = frozenset({"id", "name", "description", "inputSchema", "outputSchema"})


def parse_card_template_untrusted(card: object) -> CardTemplate:
    """The card template of an ``attach``. Raises AttachError(INVALID_CARD) listing problems."""
    if not isinstance(card, dict):
        raise invalid("card: must be an object", ErrorCode.INVALID_CARD)
    problems: list[str] = []
    unknown = set(card) - _CARD_KEYS
    if unknown:
        problems.append(f"card: unknown keys {sorted(unknown)}")
    agent_id = card.get("id")
    if not isinstance(agent_id, str) or not 0 < len(agent_id) <= MAX_ID_LENGTH:
        problems.append(f"card.id: required, a string of 1..{MAX_ID_LENGTH} characters")
        agent_id = "?"
    texts = {}
    for key, default in (("name", agent_id), ("description", ""), ("version", "1.0.0")):
        value = card.get(key, default)
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            problems.append(f"card.{key}: must be a string of at most {MAX_TEXT} characters")
            value = default
        texts[key] = value
    tier = card.get("tier", 3)
    if type(tier) is not int or not 0 <= tier <= 3:
        problems.append("card.tier: must be 0, 1, 2 or 3")
        tier = 3
    sandbox = card.get("sandboxId")
    if sandbox is not None and (not isinstance(sandbox, str) or len(sandbox) > MAX_ID_LENGTH):
        problems.append("card.sandboxId: must be null or a short string")
        sandbox = None
    capabilities = _capabilities(card.get("capabilities", []), problems)
    for key, limit, pattern in _OFFERS:
        problems.extend(f"card.{p}" for p in names_problems(card, key, limit, pattern))
    if problems:
        raise invalid("; ".join(problems), ErrorCode.INVALID_CARD, problems=problems)
    return CardTemplate(
        agent_id,
        texts["name"] or agent_id,
        texts["description"],
        texts["version"],
        tier,
        sandbox,
        capabilities,
        *(tuple(card.get(key, ())) for key, _, _ in _OFFERS),
    )


def caller_to_plain(caller: Caller) -> dict[str, Any]:
    """The ``caller`` of an ``envelope`` event carrying a request."""
    return {
        "agentId": caller.agent_id,
        "peerId": caller.peer_id,
        "tier": caller.tier,
        "sandboxId": caller.sandbox,
        "roles": sorted(caller.roles),
    }


def caller_from_plain(data: object) -> Caller | None:
    """The caller of an ``envelope`` event, or None when there is none or it is malformed."""
    if not isinstance(data, dict):
        return None
    agent_id, peer_id, tier = data.get("agentId"), data.get("peerId"), data.get("tier")
    sandbox, roles = data.get("sandboxId"), data.get("roles", [])
    if not (isinstance(agent_id, str) and isinstance(peer_id, str) and type(tier) is int):
        return None
    if not (sandbox is None or isinstance(sandbox, str)) or not isinstance(roles, list):
        return None
    return Caller(
        agent_id, peer_id, tier, sandbox, frozenset(r for r in roles if isinstance(r, str))
    )


_OFFERS = (
    ("tools", MAX_TOOLS, NAME_PATTERN),
    ("resources", MAX_RESOURCES, URI_PATTERN),
    ("prompts", MAX_PROMPTS, NAME_PATTERN),
)


def _capabilities(value: object, problems: list[str]) -> tuple[Capability, ...]:
    if not isinstance(value, list) or len(value) > MAX_CAPABILITIES:
        problems.append(f"card.capabilities: must be a list of at most {MAX_CAPABILITIES}")
        return ()
    out = []
    for i, cap in enumerate(value):
        where = f"card.capabilities[{i}]"
        if not isinstance(cap, dict):
            problems.append(f"{where}: must be an object")
            continue
        if set(cap) - _CAPABILITY_KEYS:
            problems.append(f"{where}: unknown keys {sorted(set(cap) - _CAPABILITY_KEYS)}")
        cap_id = cap.get("id")
        if not isinstance(cap_id, str) or not 0 < len(cap_id) <= MAX_ID_LENGTH:
            problems.append(f"{where}.id: required, a string of 1..{MAX_ID_LENGTH} characters")
            continue
        name, description = cap.get("name", cap_id), cap.get("description", "")
        if not isinstance(name, str) or not isinstance(description, str):
            problems.append(f"{where}: name and description must be strings")
            continue
        schemas = (cap.get("inputSchema"), cap.get("outputSchema"))
        if not all(is_json_value(s) for s in schemas):
            problems.append(f"{where}: inputSchema and outputSchema must be JSON data")
            continue
        out.append(Capability(cap_id, name or cap_id, description, *schemas))
    return tuple(out)


def object_untrusted(line: bytes) -> dict[str, Any]:
    """The JSON object of a line. Raises AttachError(MALFORMED_MESSAGE, fatal)."""
    try:
        if len(line) <= MAX_LINE and line.count(b"{") + line.count(b"[") <= MAX_PARSE_DEPTH:
            # A line cannot nest deeper than it has brackets: the same limit as
            # loads_untrusted without walking the parsed value (half the cost of a line).
            obj = json.loads(line)
        else:
            obj = loads_untrusted(line, MAX_LINE)
    except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        message = str(exc) if not isinstance(exc, json.JSONDecodeError) else f"invalid JSON: {exc}"
        raise AttachError(ErrorCode.MALFORMED_MESSAGE, message[:240]) from None
    if not isinstance(obj, dict):
        raise AttachError(ErrorCode.MALFORMED_MESSAGE, "a line is a JSON object")
    return obj


def ok_line(ref: Ref, result: Any) -> bytes:
    reply: dict[str, Any] = {"op": ref.op, "ok": True}
    if ref.id is not None:
        reply["id"] = ref.id
    reply["result"] = result
    return encode_line(reply)


def is_error_body(payload: Any) -> bool:
    return (
        isinstance(payload, dict)
        and set(payload) <= {"code", "message", "details"}
        and isinstance(payload.get("code"), str)
        and 0 < len(payload["code"]) <= MAX_ID_LENGTH
        and isinstance(payload.get("message"), str)
        and isinstance(payload.get("details", {}), dict)
    )


__all__ = [
    "AGENT_SOCKET_NAME",
    "MAX_LINE",
    "MAX_TEXT",
    "PROTOCOL_VERSION",
    "TYPES",
    "AttachError",
    "CardTemplate",
    "LineBuffer",
    "Ref",
    "encode_line",
    "error_line",
    "flag",
    "invalid",
    "is_error_body",
    "object_untrusted",
    "ok_line",
    "only_keys",
    "optional_text",
    "parse_card_template_untrusted",
    "payload_untrusted",
    "text",
]
