"""What an A2A message means to the swarm, and back: the SDK-free half of the gateway.

docs/protocol/a2a.md is the contract; this module is its rules as functions on
A2A's JSON forms (the protobuf JSON mapping of A2A 1.0: a ``Part`` is
``{"text" | "raw" | "url" | "data": ..., "filename"?, "mediaType"?, "metadata"?}``):

* **Parts -> payload** (§3): one bare text part is the string; one bare data
  part is its value, unless that is a string (which would read back as text);
  anything else (several parts, a file, a part with a file
  name, a media type or metadata) is ``{"a2a/parts": [part, ...]}`` with each
  part in its JSON form (``raw`` as base64), so nothing is lost. A data part
  whose value is itself such a wrapper is wrapped too, so the reverse is exact.
* **Payload -> parts**: a string is one text part, a wrapper is its parts,
  any other JSON value one data part.
* **Errors** (§5): each p2pnode error code becomes an A2A outcome: the task
  ``rejected`` (the owner's access rules refused the gateway's agent), a
  JSON-RPC ``InvalidParams`` error (the input was refused before any work), the
  task ``canceled``, or the task ``failed`` (everything else).

The inverse, for ``a2a publish`` (§9), reads what an A2A server sent:

* **Card -> capabilities**: each skill of an AgentCard is a capability of the
  same id (an id the swarm cannot carry is renamed), with the JSON Schemas the
  gateway's skill-schemas extension lists, so a card the gateway serves gives
  back the capabilities it was made from.
* **Parts -> payload** of an answer, as above, its refusals blamed on the
  server (``INVALID_OUTPUT``).
* **A task that ended badly -> error**: the p2pnode error its status message
  carries (as the gateway writes it), else a code by its state.
"""

from __future__ import annotations

import base64
import binascii
import enum
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from p2pnode.core.card import MAX_CAPABILITIES, MAX_TEXT, Capability
from p2pnode.core.errors import ErrorCode, P2PError, RemoteError

#: The key of the payload that carries parts as they are.
PARTS_KEY: Final = "a2a/parts"
#: Most parts one message may carry.
MAX_PARTS: Final = 64
#: Most bytes of files (``raw`` parts, decoded) one message may carry: their base64 text
#: must fit in the node's 4 MiB envelope.
MAX_RAW_BYTES: Final = 3 * 1024 * 1024
#: Longest ``url``, ``filename`` and ``mediaType``.
MAX_URL: Final = 2048
MAX_NAME: Final = 256
#: The metadata key of a message naming the skill (capability) it asks for.
SKILL_KEY: Final = "skillId"

_CONTENT = ("text", "raw", "url", "data")
_EXTRAS = ("filename", "mediaType", "metadata")


class Outcome(enum.Enum):
    """What a p2pnode error becomes in A2A."""

    REJECTED = "rejected"  # the task ends TASK_STATE_REJECTED
    INVALID_PARAMS = "invalid-params"  # JSON-RPC -32602, no task
    CANCELED = "canceled"  # the task ends TASK_STATE_CANCELED
    FAILED = "failed"  # the task ends TASK_STATE_FAILED


#: Codes that are not FAILED (docs/protocol/a2a.md §5).
OUTCOMES: Final[Mapping[ErrorCode, Outcome]] = {
    ErrorCode.PERMISSION_DENIED: Outcome.REJECTED,
    ErrorCode.TIER_VIOLATION: Outcome.REJECTED,
    ErrorCode.SANDBOX_VIOLATION: Outcome.REJECTED,
    ErrorCode.ESCALATION_REQUIRED: Outcome.REJECTED,
    ErrorCode.INVALID_ENDORSEMENT: Outcome.REJECTED,
    ErrorCode.TASK_REJECTED: Outcome.REJECTED,
    ErrorCode.INVALID_INPUT: Outcome.INVALID_PARAMS,
    ErrorCode.INVALID_ARGUMENT: Outcome.INVALID_PARAMS,
    ErrorCode.MALFORMED_MESSAGE: Outcome.INVALID_PARAMS,
    ErrorCode.MESSAGE_TOO_LARGE: Outcome.INVALID_PARAMS,
    ErrorCode.NESTING_TOO_DEEP: Outcome.INVALID_PARAMS,
    ErrorCode.TOO_MANY_ITEMS: Outcome.INVALID_PARAMS,
    ErrorCode.CAPABILITY_NOT_FOUND: Outcome.INVALID_PARAMS,
    ErrorCode.TASK_CANCELED: Outcome.CANCELED,
}


def outcome_of(code: ErrorCode) -> Outcome:
    """The A2A outcome of an error with ``code``."""
    return OUTCOMES.get(code, Outcome.FAILED)


def error_data(exc: P2PError) -> dict[str, Any]:
    """The error as A2A carries it (a JSON-RPC error's ``data``, a status message's data
    part): ``{"code", "message", "details"}``, as JSON (a detail JSON cannot hold, such
    as bytes, as its text)."""
    data: dict[str, Any] = json.loads(json.dumps(exc.to_dict(), default=str))
    return data


def _invalid(message: str, **details: Any) -> RemoteError:
    return RemoteError(ErrorCode.INVALID_INPUT, message, **details)


def _check_part_untrusted(part: Any, index: int) -> int:
    """Check one part's JSON form; the bytes of its file (0 for others). Raises
    RemoteError(INVALID_INPUT)."""
    if not isinstance(part, dict):
        raise _invalid(f"part {index} is not an object")
    content = [k for k in _CONTENT if k in part]
    unknown = sorted(set(part) - set(_CONTENT) - set(_EXTRAS))
    if len(content) != 1 or unknown:
        raise _invalid(f"part {index}: exactly one of text, raw, url, data", unknown=unknown)
    for key, limit in (("filename", MAX_NAME), ("mediaType", MAX_NAME), ("url", MAX_URL)):
        value = part.get(key)
        if value is not None and (not isinstance(value, str) or len(value) > limit):
            raise _invalid(f"part {index}: {key} is text of at most {limit} characters")
    if "metadata" in part and not isinstance(part["metadata"], dict):
        raise _invalid(f"part {index}: metadata is an object")
    if "text" in part and not isinstance(part["text"], str):
        raise _invalid(f"part {index}: text is a string")
    if "raw" not in part:
        return 0
    raw = part["raw"]
    if not isinstance(raw, str):
        raise _invalid(f"part {index}: raw is base64 text")
    try:
        return len(base64.b64decode(raw, validate=True))
    except (binascii.Error, ValueError):
        raise _invalid(f"part {index}: raw is not base64") from None


def check_parts_untrusted(parts: Any) -> list[dict[str, Any]]:
    """``parts`` checked as a message's parts: a list of 1-MAX_PARTS part objects whose
    files total at most MAX_RAW_BYTES. Raises RemoteError(INVALID_INPUT), or
    RemoteError(MESSAGE_TOO_LARGE) for too many or too large parts."""
    if not isinstance(parts, list) or not parts:
        raise _invalid("a message has at least one part")
    if len(parts) > MAX_PARTS:
        raise RemoteError(ErrorCode.MESSAGE_TOO_LARGE, f"at most {MAX_PARTS} parts")
    total = sum(_check_part_untrusted(part, i) for i, part in enumerate(parts))
    if total > MAX_RAW_BYTES:
        raise RemoteError(
            ErrorCode.MESSAGE_TOO_LARGE, f"files total {total} bytes, at most {MAX_RAW_BYTES}"
        )
    return parts


def _is_wrapper(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {PARTS_KEY}


def payload_of_parts_untrusted(parts: Any) -> Any:
    """The request payload of a message's ``parts`` (see the module docstring). Raises
    what :func:`check_parts_untrusted` raises."""
    checked = check_parts_untrusted(parts)
    if len(checked) == 1:
        (part,) = checked
        if set(part) == {"text"}:
            return part["text"]
        data = part.get("data")
        if set(part) == {"data"} and not _is_wrapper(data) and not isinstance(data, str):
            return data  # a string would read back as a text part: wrapped below
    return {PARTS_KEY: checked}


def parts_of_payload(value: Any) -> list[dict[str, Any]]:
    """The parts of a response ``value`` (see the module docstring)."""
    if isinstance(value, str):
        return [{"text": value}]
    if _is_wrapper(value):
        try:
            return check_parts_untrusted(value[PARTS_KEY])
        except RemoteError:
            pass  # not parts after all: the value as data
    return [{"data": value}]


def skill_for_untrusted(metadata: Any, skills: tuple[str, ...]) -> str | None:
    """The capability a message asks for: its ``metadata.skillId`` when given (one of
    ``skills``), else the only skill when there is one, else None (the agent's request
    handler without a capability). Raises RemoteError(CAPABILITY_NOT_FOUND)."""
    asked = metadata.get(SKILL_KEY) if isinstance(metadata, dict) else None
    if asked is None:
        return skills[0] if len(skills) == 1 else None
    if not isinstance(asked, str) or asked not in skills:
        raise RemoteError(
            ErrorCode.CAPABILITY_NOT_FOUND,
            f"metadata.{SKILL_KEY} names no skill of this agent",
            skills=list(skills),
        )
    return asked


def json_numbers(value: Any) -> Any:
    """``value`` with integral floats of at most 2**53 as ints: A2A's data parts hold
    numbers as doubles (protobuf ``Value``), so the JSON ``1`` a client sent arrives as
    ``1.0``."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= 2**53:
        return int(value)
    if isinstance(value, list):
        return [json_numbers(v) for v in value]
    if isinstance(value, dict):
        return {k: json_numbers(v) for k, v in value.items()}
    return value


# -- the inverse: what an A2A server sent, for a2a publish (§9) ---------------------------------

#: The card extension listing each skill's JSON Schemas (A2A's AgentSkill has no field).
SCHEMAS_EXTENSION: Final = "urn:p2pnode:a2a:skill-schemas:1"
#: Most skills of a card read (those past it are left out).
MAX_SKILLS: Final = MAX_CAPABILITIES
_CAPABILITY_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
_NOT_IN_ID = re.compile(r"[^A-Za-z0-9._:/-]")

#: The A2A task states (their protobuf JSON names) that end a task, and those that stop
#: it for a client's next turn.
TERMINAL_STATES: Final = frozenset(
    {"TASK_STATE_COMPLETED", "TASK_STATE_FAILED", "TASK_STATE_CANCELED", "TASK_STATE_REJECTED"}
)
INTERRUPTED_STATES: Final = frozenset({"TASK_STATE_INPUT_REQUIRED", "TASK_STATE_AUTH_REQUIRED"})

#: The code of a task that ended in a state without a p2pnode error in its status.
STATE_CODES: Final[Mapping[str, ErrorCode]] = {
    "TASK_STATE_FAILED": ErrorCode.HANDLER_FAILED,
    "TASK_STATE_REJECTED": ErrorCode.TASK_REJECTED,
    "TASK_STATE_CANCELED": ErrorCode.TASK_CANCELED,
    "TASK_STATE_INPUT_REQUIRED": ErrorCode.HANDLER_FAILED,
    "TASK_STATE_AUTH_REQUIRED": ErrorCode.PERMISSION_DENIED,
}

#: The code of an A2A error, by its reason (google.rpc.ErrorInfo ``reason``; the A2A SDK's
#: error classes): the server refused the input, the method or version, or failed.
REASON_CODES: Final[Mapping[str, ErrorCode]] = {
    "INVALID_PARAMS": ErrorCode.INVALID_INPUT,
    "INVALID_REQUEST": ErrorCode.INVALID_INPUT,
    "CONTENT_TYPE_NOT_SUPPORTED": ErrorCode.INVALID_INPUT,
    "VERSION_NOT_SUPPORTED": ErrorCode.PROTOCOL_VERSION_MISMATCH,
    "METHOD_NOT_FOUND": ErrorCode.CAPABILITY_NOT_FOUND,
    "UNSUPPORTED_OPERATION": ErrorCode.CAPABILITY_NOT_FOUND,
    "PUSH_NOTIFICATION_NOT_SUPPORTED": ErrorCode.CAPABILITY_NOT_FOUND,
    "EXTENSION_SUPPORT_REQUIRED": ErrorCode.CAPABILITY_NOT_FOUND,
    "EXTENDED_AGENT_CARD_NOT_CONFIGURED": ErrorCode.CAPABILITY_NOT_FOUND,
    "TASK_NOT_FOUND": ErrorCode.HANDLER_FAILED,
    "TASK_NOT_CANCELABLE": ErrorCode.ILLEGAL_TRANSITION,
    "INVALID_AGENT_RESPONSE": ErrorCode.HANDLER_FAILED,
    "INTERNAL_ERROR": ErrorCode.HANDLER_FAILED,
}


@dataclass(frozen=True, slots=True)
class Skill:
    """One skill of an A2A card as the swarm sees it: ``skill_id`` as the server names it
    (sent back as ``metadata.skillId``) and the capability it is published as."""

    skill_id: str
    capability: Capability


@dataclass(frozen=True, slots=True)
class CardFacts:
    """What ``a2a publish`` takes of an A2A AgentCard."""

    name: str
    description: str
    version: str
    skills: tuple[Skill, ...]
    #: The card says the server streams (``capabilities.streaming``).
    streaming: bool


def _invalid_card(message: str, **details: Any) -> RemoteError:
    return RemoteError(ErrorCode.INVALID_CARD, message, **details)


def capability_id_of(skill_id: str) -> str | None:
    """The capability id of skill ``skill_id``: itself when the swarm can carry it, else
    its characters outside ``[A-Za-z0-9._:/-]`` as ``_`` (``s`` before a first character
    that is not a letter or digit), cut to 128; None for an empty id."""
    if _CAPABILITY_ID.fullmatch(skill_id):
        return skill_id
    renamed = _NOT_IN_ID.sub("_", skill_id)
    if not renamed:
        return None
    if not renamed[0].isascii() or not renamed[0].isalnum():
        renamed = "s" + renamed
    return renamed[:128]


def _text(value: Any, fallback: str) -> str:
    text = value.strip() if isinstance(value, str) else ""
    return (text or fallback)[:MAX_TEXT]


def _schemas_untrusted(document: Mapping[str, Any]) -> Mapping[str, Any]:
    """The skill-schemas extension's ``params.skills`` of a card ({} when absent)."""
    capabilities = document.get("capabilities")
    extensions = capabilities.get("extensions") if isinstance(capabilities, dict) else None
    for extension in extensions if isinstance(extensions, list) else ():
        if isinstance(extension, dict) and extension.get("uri") == SCHEMAS_EXTENSION:
            params = extension.get("params")
            skills = params.get("skills") if isinstance(params, dict) else None
            return skills if isinstance(skills, dict) else {}
    return {}


def _skill_untrusted(skill: Any, schemas: Mapping[str, Any]) -> Skill | None:
    if not isinstance(skill, dict) or not isinstance(skill.get("id"), str):
        return None
    skill_id: str = skill["id"]
    capability_id = capability_id_of(skill_id)
    if capability_id is None:
        return None
    schema = schemas.get(skill_id)
    schema = schema if isinstance(schema, dict) else {}
    capability = Capability(
        capability_id,
        _text(skill.get("name"), capability_id),
        _text(skill.get("description"), ""),
        json_numbers(schema.get("inputSchema")),
        json_numbers(schema.get("outputSchema")),
    )
    return Skill(skill_id, capability)


def card_facts_untrusted(document: Any) -> CardFacts:
    """What ``a2a publish`` takes of an AgentCard's JSON form (the inverse of the card the
    gateway serves): its name, description, version, each skill as a capability (see
    :func:`capability_id_of`; a skill without a string id, a second skill of one
    capability id and skills past MAX_SKILLS are left out) and whether it streams.

    Raises RemoteError(INVALID_CARD) for a card that is no object or has no skill the
    swarm can carry."""
    if not isinstance(document, dict):
        raise _invalid_card("the agent card is not a JSON object")
    listed = document.get("skills")
    if not isinstance(listed, list):
        raise _invalid_card("the agent card lists no skills")
    schemas = _schemas_untrusted(document)
    skills: dict[str, Skill] = {}
    for entry in listed:
        skill = _skill_untrusted(entry, schemas)
        if skill is not None and len(skills) < MAX_SKILLS:
            skills.setdefault(skill.capability.id, skill)
    if not skills:
        raise _invalid_card("the agent card has no skill the swarm can carry", skills=len(listed))
    name = _text(document.get("name"), "A2A agent")
    capabilities = document.get("capabilities")
    streaming = isinstance(capabilities, dict) and capabilities.get("streaming") is True
    return CardFacts(
        name=name,
        description=_text(document.get("description"), name),
        version=_text(document.get("version"), "1.0.0")[:64],
        skills=tuple(skills.values()),
        streaming=streaming,
    )


def payload_of_answer_untrusted(parts: Any) -> Any:
    """The response payload of an A2A server's answer ``parts`` (JSON forms): as
    :func:`payload_of_parts_untrusted`, its data's integral doubles as integers. Raises
    RemoteError(INVALID_OUTPUT), or RemoteError(MESSAGE_TOO_LARGE)."""
    if isinstance(parts, list):
        parts = [
            {k: json_numbers(v) if k in ("data", "metadata") else v for k, v in part.items()}
            if isinstance(part, dict)
            else part
            for part in parts
        ]
    try:
        return payload_of_parts_untrusted(parts)
    except RemoteError as exc:
        if exc.code is ErrorCode.MESSAGE_TOO_LARGE:
            raise
        raise RemoteError(
            ErrorCode.INVALID_OUTPUT, f"the A2A server's answer: {exc.message}", **exc.details
        ) from None


def carried_error_untrusted(value: Any) -> RemoteError | None:
    """The p2pnode error ``value`` carries as the gateway writes it (``{"code", "message",
    "details"}``, the code one of ours); None for anything else."""
    if not isinstance(value, dict) or not isinstance(value.get("message"), str):
        return None
    code = value.get("code")
    if not isinstance(code, str) or code not in ErrorCode.__members__:
        return None
    details = value.get("details")
    error = RemoteError(ErrorCode(code), value["message"][:MAX_TEXT])
    # Set, not passed as keywords: a peer's keys may be any text ("code" among them).
    error.details = {str(k): v for k, v in details.items()} if isinstance(details, dict) else {}
    return error


def error_of_task_untrusted(state: str, parts: Any) -> RemoteError:
    """The error of an A2A task that ended (or stopped) in ``state`` without an answer,
    its status message's ``parts`` (JSON forms): the p2pnode error a data part carries,
    else the state's code (STATE_CODES) with the message's text."""
    listed = parts if isinstance(parts, list) else []
    for part in listed:
        if isinstance(part, dict):
            carried = carried_error_untrusted(json_numbers(part.get("data")))
            if carried is not None:
                return carried
    texts = [p["text"] for p in listed if isinstance(p, dict) and isinstance(p.get("text"), str)]
    what = state.removeprefix("TASK_STATE_").lower().replace("_", "-")
    text = " ".join(texts).strip() or f"the A2A task ended {what}"
    code = STATE_CODES.get(state, ErrorCode.HANDLER_FAILED)
    return RemoteError(code, text[:MAX_TEXT], state=what)


def error_of_a2a_untrusted(reason: str, message: str, data: Any) -> RemoteError:
    """The error of an A2A error answer: the p2pnode error its ``data`` carries, else the
    code of its ``reason`` (REASON_CODES; HANDLER_FAILED for any other)."""
    carried = carried_error_untrusted(data)
    if carried is not None:
        return carried
    code = REASON_CODES.get(reason, ErrorCode.HANDLER_FAILED)
    return RemoteError(code, f"the A2A server answered {reason}: {message}"[:MAX_TEXT])


__all__ = [
    "INTERRUPTED_STATES",
    "MAX_PARTS",
    "MAX_RAW_BYTES",
    "MAX_SKILLS",
    "OUTCOMES",
    "PARTS_KEY",
    "REASON_CODES",
    "SCHEMAS_EXTENSION",
    "SKILL_KEY",
    "STATE_CODES",
    "TERMINAL_STATES",
    "CardFacts",
    "Outcome",
    "Skill",
    "capability_id_of",
    "card_facts_untrusted",
    "carried_error_untrusted",
    "check_parts_untrusted",
    "error_data",
    "error_of_a2a_untrusted",
    "error_of_task_untrusted",
    "json_numbers",
    "outcome_of",
    "parts_of_payload",
    "payload_of_answer_untrusted",
    "payload_of_parts_untrusted",
    "skill_for_untrusted",
]
