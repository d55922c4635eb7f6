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
"""

from __future__ import annotations

import base64
import binascii
import enum
import json
from collections.abc import Mapping
from typing import Any, Final

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


__all__ = [
    "MAX_PARTS",
    "MAX_RAW_BYTES",
    "OUTCOMES",
    "PARTS_KEY",
    "SKILL_KEY",
    "Outcome",
    "check_parts_untrusted",
    "error_data",
    "json_numbers",
    "outcome_of",
    "parts_of_payload",
    "payload_of_parts_untrusted",
    "skill_for_untrusted",
]
