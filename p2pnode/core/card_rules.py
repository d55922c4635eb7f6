"""The rules a card's plain form must follow: limits, patterns and :func:`card_problems`.

Kept apart from :mod:`p2pnode.core.card` (the card object, its encodings and
signatures) so each stays readable; :mod:`p2pnode.core.card` re-exports the names.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from p2pnode.core.errors import P2PError
from p2pnode.core.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, PeerId
from p2pnode.core.jsonutil import b64decode, is_json_value

MAX_CARD_BYTES = 64 * 1024
MAX_CAPABILITIES = 64
MAX_ADDRESSES = 16
MAX_LIST_ITEMS = 32
MAX_TEXT = 4096
#: What a card may list of its agent's tools, resources and prompts (names and URIs
#: only: descriptors come from the owner, see docs/protocol/tools.md §2).
MAX_TOOLS = 64
MAX_RESOURCES = 16
MAX_PROMPTS = 16
MAX_ROLES = 16
MAX_URI_CHARS = 128
#: Tool and prompt names: what MCP clients accept, and no dot (``agent.tool`` splits
#: on the last one).
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
#: A resource URI: a scheme, a colon, no white space, MAX_URI_CHARS in all.
URI_PATTERN = re.compile(r"^(?=.{1,128}$)[A-Za-z][A-Za-z0-9+.-]*:\S+$")
DEFAULT_CARD_TTL_MS = 10 * 60 * 1000  # renewed at half: a dead agent leaves within it
_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
_ADDRESS_PATTERN = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$")
ENDPOINT_TRANSPORTS = frozenset({"local", "tcp+noise", "websocket"})
_ORIGINS = frozenset({"local", "remote"})


def _check_text(
    problems: list[str], data: Mapping[str, Any], key: str, *, required: bool, allow_empty: bool
) -> None:
    if key not in data:
        if required:
            problems.append(f"{key}: required")
        return
    value = data[key]
    if not isinstance(value, str):
        problems.append(f"{key}: must be a string")
    elif not allow_empty and not value.strip():
        problems.append(f"{key}: must not be empty")
    elif len(value) > MAX_TEXT:
        problems.append(f"{key}: longer than {MAX_TEXT} characters")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_text_in(value: object, allowed: frozenset[str]) -> bool:
    # A membership test hashes its operand: a peer's list or map must not reach it.
    return isinstance(value, str) and value in allowed


def _check_bytes(
    problems: list[str], data: Mapping[str, Any], key: str, sizes: tuple[int, ...]
) -> None:
    raw = b64decode(data.get(key))
    if raw is None:
        problems.append(f"{key}: must be base64")
    elif len(raw) not in sizes:
        problems.append(f"{key}: must be {' or '.join(map(str, sizes))} bytes, not {len(raw)}")


def _capability_problems(caps: object) -> list[str]:
    if not isinstance(caps, list):
        return ["capabilities: must be a list"]
    if len(caps) > MAX_CAPABILITIES:
        return [f"capabilities: more than {MAX_CAPABILITIES}"]
    problems: list[str] = []
    seen: set[str] = set()
    for i, cap in enumerate(caps):
        where = f"capabilities[{i}]"
        if not isinstance(cap, Mapping):
            problems.append(f"{where}: must be an object")
            continue
        cap_id = cap.get("id")
        if not isinstance(cap_id, str) or not _ID_PATTERN.fullmatch(cap_id):
            problems.append(f"{where}.id: must match {_ID_PATTERN.pattern}")
        elif cap_id in seen:
            problems.append(f"{where}.id: duplicate {cap_id!r}")
        else:
            seen.add(cap_id)
        for key, required in (("name", True), ("description", False)):
            sub: list[str] = []
            _check_text(sub, cap, key, required=required, allow_empty=not required)
            problems.extend(f"{where}.{p}" for p in sub)
        for key in ("inputSchema", "outputSchema"):
            if not is_json_value(cap.get(key)):
                problems.append(f"{where}.{key}: must be JSON data")
        unknown = set(cap) - {"id", "name", "description", "inputSchema", "outputSchema"}
        if unknown:
            # Peer keys may mix bytes and str, which do not compare: sort their text.
            problems.append(f"{where}: unknown fields {sorted(map(str, unknown))}")
    return problems


def is_address(text: object) -> bool:
    """True when ``text`` is ``host:port`` or ``[v6]:port`` with a port of 0-65535: what a
    node can dial (:func:`p2pnode.node.config.parse_address` accepts every such text)."""
    return (
        isinstance(text, str)
        and _ADDRESS_PATTERN.fullmatch(text) is not None
        and int(text.rpartition(":")[2]) <= 65535
    )


def _bounded_list(data: Mapping[str, Any], key: str, limit: int) -> list[Any] | str:
    """The list under ``key`` (empty when absent), or the problem with it."""
    value = data.get(key, [])
    if not isinstance(value, list):
        return f"{key}: must be a list"
    if len(value) > limit:
        return f"{key}: more than {limit} entries"
    return value


def _list_problems(
    data: Mapping[str, Any], key: str, check: Callable[[str], bool] | None, limit: int
) -> list[str]:
    value = _bounded_list(data, key, limit)
    if isinstance(value, str):
        return [value]
    problems = []
    for i, item in enumerate(value):
        if not isinstance(item, str) or len(item) > 256:
            problems.append(f"{key}[{i}]: must be a string of at most 256 characters")
        elif check is not None and not check(item):
            problems.append(f"{key}[{i}]: {item!r} must look like host:port")
    return problems


def names_problems(
    data: Mapping[str, Any], key: str, limit: int, pattern: re.Pattern[str]
) -> list[str]:
    """Problems of an optional list of distinct names, each matching ``pattern``."""
    value = _bounded_list(data, key, limit)
    if isinstance(value, str):
        return [value]
    problems = []
    seen: set[str] = set()
    for i, item in enumerate(value):
        if not isinstance(item, str) or not pattern.fullmatch(item):
            problems.append(f"{key}[{i}]: must match {pattern.pattern}")
        elif item in seen:
            problems.append(f"{key}[{i}]: duplicate {item!r}")
        else:
            seen.add(item)
    return problems


def _endpoint_problems(value: object) -> list[str]:
    if not isinstance(value, list) or len(value) > MAX_LIST_ITEMS:
        return [f"endpoints: must be a list of at most {MAX_LIST_ITEMS}"]
    problems = []
    for i, ep in enumerate(value):
        if not isinstance(ep, Mapping):
            problems.append(f"endpoints[{i}]: must be an object")
        elif not _is_text_in(ep.get("transport"), ENDPOINT_TRANSPORTS):
            problems.append(f"endpoints[{i}].transport: one of {sorted(ENDPOINT_TRANSPORTS)}")
        elif not (ep.get("address") is None or isinstance(ep.get("address"), str)):
            problems.append(f"endpoints[{i}].address: must be a string")
    return problems


_KNOWN_FIELDS = frozenset(
    {
        "id", "name", "version", "description", "tier", "protocols", "endpoints", "capabilities",
        "revision", "sandboxId", "origin", "lastSeenAt", "publicKey", "peerId", "addresses",
        "noiseStaticKey", "issuedAt", "expiresAt", "endorsement", "signature",
        "tools", "resources", "prompts",
    }
)  # fmt: skip


def card_problems(data: object) -> list[str]:
    """Every problem with the plain form of a card; empty when it is valid."""
    if not isinstance(data, Mapping):
        return ["card: must be an object"]
    problems: list[str] = []
    unknown = set(data) - _KNOWN_FIELDS
    if unknown:
        problems.append(f"unknown fields {sorted(map(str, unknown))}")
    problems.extend(_offer_problems(data))
    problems.extend(_time_problems(data))
    sandbox = data.get("sandboxId")
    if sandbox is not None and (not isinstance(sandbox, str) or not _ID_PATTERN.fullmatch(sandbox)):
        problems.append(f"sandboxId: must match {_ID_PATTERN.pattern}")
    if not _is_text_in(data.get("origin", "local"), _ORIGINS):
        problems.append("origin: must be 'local' or 'remote'")
    problems.extend(_key_problems(data))
    problems.extend(_endorsement_problems(data.get("endorsement")))
    problems.extend(names_problems(data, "tools", MAX_TOOLS, NAME_PATTERN))
    problems.extend(names_problems(data, "prompts", MAX_PROMPTS, NAME_PATTERN))
    problems.extend(names_problems(data, "resources", MAX_RESOURCES, URI_PATTERN))
    agent_id = data.get("id")
    return [f"card {agent_id!r}: {p}" if isinstance(agent_id, str) else p for p in problems]


def _offer_problems(data: Mapping[str, Any]) -> list[str]:
    """Who the agent is, what it offers and where it is reached: id to endpoints."""
    problems: list[str] = []
    agent_id = data.get("id")
    if "id" not in data:
        problems.append("id: required")
    elif not isinstance(agent_id, str) or not _ID_PATTERN.fullmatch(agent_id):
        problems.append(f"id: must match {_ID_PATTERN.pattern}")
    _check_text(problems, data, "name", required=True, allow_empty=False)
    _check_text(problems, data, "version", required=True, allow_empty=False)
    _check_text(problems, data, "description", required=False, allow_empty=True)
    if "tier" not in data:
        problems.append("tier: required")
    elif not _is_int(data["tier"]) or not 0 <= data["tier"] <= 3:
        problems.append("tier: must be 0, 1, 2 or 3")
    if "capabilities" not in data:
        problems.append("capabilities: required")
    else:
        problems.extend(_capability_problems(data["capabilities"]))
    problems.extend(_list_problems(data, "protocols", None, MAX_LIST_ITEMS))
    problems.extend(_list_problems(data, "addresses", is_address, MAX_ADDRESSES))
    problems.extend(_endpoint_problems(data.get("endpoints", [])))
    return problems


def _time_problems(data: Mapping[str, Any]) -> list[str]:
    """The card's counters and times: revision, lastSeenAt, issuedAt, expiresAt."""
    problems: list[str] = []
    for key in ("revision", "lastSeenAt", "issuedAt"):
        if key in data and (not _is_int(data[key]) or not 0 <= data[key] < 2**63):
            problems.append(f"{key}: must be a non-negative integer")
    expires: Any = data.get("expiresAt")
    issued: Any = data.get("issuedAt", 0)
    if "expiresAt" not in data:
        problems.append("expiresAt: required")
    elif not _is_int(expires) or not 0 <= expires < 2**63:
        problems.append("expiresAt: must be a non-negative integer")
    elif _is_int(issued) and expires <= issued:
        problems.append("expiresAt: must be after issuedAt")
    return problems


def _key_problems(data: Mapping[str, Any]) -> list[str]:
    """The keys and the signature: publicKey, noiseStaticKey, signature, peerId."""
    problems: list[str] = []
    if "publicKey" not in data:
        problems.append("publicKey: required")
    else:
        _check_bytes(problems, data, "publicKey", (PUBLIC_KEY_BYTES,))
    if data.get("noiseStaticKey") is not None:
        _check_bytes(problems, data, "noiseStaticKey", (32,))
    if "signature" in data:
        _check_bytes(problems, data, "signature", (0, SIGNATURE_BYTES))
    problems.extend(_peer_id_problems(data))
    return problems


def _endorsement_problems(endorsement: object) -> list[str]:
    """The swarm authority's endorsement of the card's roles, if it has one."""
    if endorsement is None:
        return []
    if not isinstance(endorsement, Mapping):
        return ["endorsement: must be an object"]
    problems: list[str] = []
    _check_bytes(problems, endorsement, "authorityKey", (PUBLIC_KEY_BYTES,))
    _check_bytes(problems, endorsement, "signature", (SIGNATURE_BYTES,))
    problems.extend(
        f"endorsement.{p}" for p in names_problems(endorsement, "roles", MAX_ROLES, _ID_PATTERN)
    )
    return problems


def _peer_id_problems(data: Mapping[str, Any]) -> list[str]:
    text = data.get("peerId")
    if text is None:
        return []
    try:
        peer_id = PeerId.parse(text)
    except P2PError:
        return ["peerId: not a peer id"]
    key = b64decode(data.get("publicKey"))
    if key is not None and len(key) == PUBLIC_KEY_BYTES and PeerId.from_public_key(key) != peer_id:
        return ["peerId: does not match publicKey"]
    return []
