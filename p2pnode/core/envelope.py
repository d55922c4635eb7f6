"""Envelopes: the typed messages agents exchange.

Correlation threads (envelopes grouped by correlation id) are kept by
:class:`p2pnode.core.threadstore.ThreadStore`.

Every message between agents is an :class:`Envelope`: a unique id, the schema
version, sender and recipient agent ids (``"*"`` for broadcast), an optional
correlation id that threads a conversation, one of ten message types, a
millisecond timestamp, a payload and routing metadata.

The plain form is a dict with the seed's camelCase keys; JSON and msgpack
carry that same dict. Decoders check the schema version *first*: an unknown
version raises ``SCHEMA_VERSION_MISMATCH`` naming the expected and actual
versions, so a newer peer's message is never misread as a malformed one.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.jsonutil import dumps, is_json_value, loads_untrusted
from p2pnode.core.wire import DEFAULT_LIMITS, LIMIT_CODES, WireLimits, pack, unpack_untrusted

SCHEMA_VERSION = 1
BROADCAST = "*"
MAX_ENVELOPE_BYTES = 4 * 1024 * 1024
MAX_ID_LENGTH = 128
MAX_JUSTIFICATION_LENGTH = 4096
_ENVELOPE_LIMITS = WireLimits(max_size=MAX_ENVELOPE_BYTES)
#: How deep a payload may nest (a scalar 0, a flat array or map 1) for every node frame
#: to carry its envelope within the decoder's 32 levels: the frame's array, an ENVELOPES
#: frame's array and the envelope's map take three (docs/protocol/node.md, "Limits").
MAX_PAYLOAD_DEPTH = DEFAULT_LIMITS.max_depth - 3


class MessageType(enum.StrEnum):
    """The ten envelope types."""

    REQUEST = "request"
    RESPONSE = "response"
    NOTIFICATION = "notification"
    TASK_PROPOSAL = "task-proposal"
    TASK_ACCEPT = "task-accept"
    TASK_REJECT = "task-reject"
    STREAM_START = "stream-start"
    STREAM_DATA = "stream-data"
    STREAM_END = "stream-end"
    ERROR = "error"


_TYPES = {t.value: t for t in MessageType}
ROUTING_HINT_CAPABILITY = "capability"


class EnvelopeError(RemoteError):
    """An envelope from a peer is malformed, of an unknown type or schema version."""


@dataclass(frozen=True, slots=True)
class Metadata:
    """Routing metadata. ``tier`` and ``sandbox_id`` are the sender's *claims*; policy
    decides on the authenticated peer's signed card, never on these fields."""

    tier: int | None = None
    sandbox_id: str | None = None
    routing_hint: str | None = None
    escalation_justification: str | None = None
    #: The capability a request is for, set by the sender's node when it resolved a
    #: capability to an agent (or by a sender addressing one capability of an agent).
    capability: str | None = None
    #: How long the requester waits for an answer, in milliseconds, when it asked for
    #: its own timeout: the owner bounds the handler by min(this, its own maximum)
    #: (docs/protocol/node.md "Requests to an agent").
    deadline_ms: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.tier is not None:
            out["tier"] = self.tier
        if self.sandbox_id is not None:
            out["sandboxId"] = self.sandbox_id
        if self.routing_hint is not None:
            out["routingHint"] = self.routing_hint
        if self.escalation_justification is not None:
            out["escalationJustification"] = self.escalation_justification
        if self.capability is not None:
            out["capability"] = self.capability
        if self.deadline_ms is not None:
            out["deadlineMs"] = self.deadline_ms
        return out


_set = object.__setattr__


@dataclass(frozen=True, slots=True)
class Envelope:
    """One message between agents."""

    id: str
    sender: str
    recipient: str
    type: MessageType
    timestamp: int
    payload: Any = None
    correlation_id: str | None = None
    metadata: Metadata | None = None
    schema_version: int = SCHEMA_VERSION

    def __init__(
        self,
        id: str,
        sender: str,
        recipient: str,
        type: MessageType,
        timestamp: int,
        payload: Any = None,
        correlation_id: str | None = None,
        metadata: Metadata | None = None,
        schema_version: int = SCHEMA_VERSION,
    ) -> None:
        # The generated __init__ of a frozen dataclass, with object.__setattr__ looked up
        # once for the module instead of once per field: an envelope is made at least
        # twice on its way (by the sender, and decoded by the receiver), and this takes
        # a quarter off each.
        _set(self, "id", id)
        _set(self, "sender", sender)
        _set(self, "recipient", recipient)
        _set(self, "type", type)
        _set(self, "timestamp", timestamp)
        _set(self, "payload", payload)
        _set(self, "correlation_id", correlation_id)
        _set(self, "metadata", metadata)
        _set(self, "schema_version", schema_version)

    @property
    def is_broadcast(self) -> bool:
        return self.recipient == BROADCAST

    def to_dict(self) -> dict[str, Any]:
        """The plain form with the seed's camelCase keys."""
        out: dict[str, Any] = {
            "id": self.id,
            "schemaVersion": self.schema_version,
            "sender": self.sender,
            "recipient": self.recipient,
            "type": self.type.value,
            "timestamp": self.timestamp,
            "payload": self.payload,
        }
        if self.correlation_id is not None:
            out["correlationId"] = self.correlation_id
        if self.metadata is not None:
            out["metadata"] = self.metadata.to_dict()
        return out

    @classmethod
    def from_dict_untrusted(cls, data: object) -> Envelope:
        """Validate a peer's plain form. Raises EnvelopeError (SCHEMA_VERSION_MISMATCH or
        INVALID_ENVELOPE listing every problem)."""
        if type(data) is dict:  # the common case first: one pass, then the full report
            version = data.get("schemaVersion")
            if type(version) is int and version == SCHEMA_VERSION:
                envelope = _well_formed_envelope(data)
                if envelope is not None:
                    return envelope
        if not isinstance(data, Mapping):
            raise EnvelopeError(ErrorCode.INVALID_ENVELOPE, "envelope must be a map")
        version = data.get("schemaVersion")
        if version != SCHEMA_VERSION or isinstance(version, bool):
            raise EnvelopeError(
                ErrorCode.SCHEMA_VERSION_MISMATCH,
                f"expected schemaVersion {SCHEMA_VERSION}, got {version!r}",
                expected=SCHEMA_VERSION,
                actual=version,
            )
        problems = envelope_problems(data)
        if problems:
            raise EnvelopeError(ErrorCode.INVALID_ENVELOPE, "; ".join(problems), problems=problems)
        meta = data.get("metadata")
        return cls(
            id=data["id"],
            sender=data["sender"],
            recipient=data["recipient"],
            type=_TYPES[data["type"]],
            timestamp=data["timestamp"],
            payload=data["payload"],
            correlation_id=data.get("correlationId"),
            metadata=(
                Metadata(
                    tier=meta.get("tier"),
                    sandbox_id=meta.get("sandboxId"),
                    routing_hint=meta.get("routingHint"),
                    escalation_justification=meta.get("escalationJustification"),
                    capability=meta.get("capability"),
                    deadline_ms=meta.get("deadlineMs"),
                )
                if meta is not None
                else None
            ),
        )

    def to_json(self) -> str:
        """JSON text. Raises LocalError(INVALID_ARGUMENT) if the payload is not JSON data."""
        if not is_json_value(self.payload):
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "payload is not JSON data")
        return dumps(self.to_dict())

    @classmethod
    def from_json_untrusted(cls, text: str | bytes) -> Envelope:
        """Parse JSON text. Raises EnvelopeError (MALFORMED_MESSAGE, SCHEMA_VERSION_MISMATCH,
        INVALID_ENVELOPE)."""
        try:
            data = loads_untrusted(text, MAX_ENVELOPE_BYTES)
        except ValueError as exc:
            raise EnvelopeError(ErrorCode.MALFORMED_MESSAGE, str(exc)) from None
        envelope = cls.from_dict_untrusted(data)
        # JSON text can hold what no envelope may carry (NaN, integers past 64 bits): an
        # envelope accepted here must encode again, as JSON and as msgpack.
        if not is_json_value(envelope.payload):
            raise EnvelopeError(
                ErrorCode.INVALID_ENVELOPE,
                "payload: must be JSON data (finite numbers, 64-bit integers)",
                problems=["payload: must be JSON data"],
            )
        return envelope

    def to_msgpack(self) -> bytes:
        return pack(self.to_dict())

    @classmethod
    def from_msgpack_untrusted(cls, data: bytes) -> Envelope:
        return cls.from_dict_untrusted(unpack_untrusted(data, _ENVELOPE_LIMITS))


def _id_ok(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_LENGTH


_METADATA_KEYS = frozenset(
    {"tier", "sandboxId", "routingHint", "escalationJustification", "capability", "deadlineMs"}
)
#: Longest ``metadata.deadlineMs``: a day.
MAX_DEADLINE_MS = 86_400_000
_ENVELOPE_KEYS = frozenset(
    {"id", "schemaVersion", "sender", "recipient", "correlationId", "type", "timestamp"}
    | {"payload", "metadata"}
)


def envelope_problems(data: Mapping[str, Any]) -> list[str]:
    """Every problem with an envelope's plain form (schema version aside)."""
    problems: list[str] = []
    for key in ("id", "sender", "recipient", "type", "timestamp", "payload"):
        if key not in data:
            problems.append(f"{key}: required")
    for key in ("id", "sender", "recipient"):
        if key in data and not _id_ok(data[key]):
            problems.append(f"{key}: must be a string of 1..{MAX_ID_LENGTH} characters")
    if "correlationId" in data and not _id_ok(data["correlationId"]):
        problems.append(f"correlationId: must be a string of 1..{MAX_ID_LENGTH} characters")
    if "type" in data and (not isinstance(data["type"], str) or data["type"] not in _TYPES):
        problems.append(f"type: unknown message type {data['type']!r}")
    ts = data.get("timestamp")
    if "timestamp" in data and (
        not isinstance(ts, int) or isinstance(ts, bool) or not 0 < ts < 2**63
    ):
        problems.append("timestamp: must be a positive integer of milliseconds")
    unknown = set(data) - _ENVELOPE_KEYS
    if unknown:
        problems.append(f"unknown fields {sorted(map(str, unknown))}")
    meta = data.get("metadata")
    if meta is not None:
        if not isinstance(meta, Mapping):
            problems.append("metadata: must be a map")
        else:
            problems.extend(_metadata_problems(meta))
    return problems


def _metadata_problems(meta: Mapping[str, Any]) -> list[str]:
    problems: list[str] = []
    tier = meta.get("tier")
    if tier is not None and (
        not isinstance(tier, int) or isinstance(tier, bool) or not 0 <= tier <= 3
    ):
        problems.append("metadata.tier: must be 0..3")
    if meta.get("sandboxId") is not None and not _id_ok(meta["sandboxId"]):
        problems.append("metadata.sandboxId: must be a short string")
    hint = meta.get("routingHint")
    if hint is not None and hint != ROUTING_HINT_CAPABILITY:
        problems.append(f"metadata.routingHint: only {ROUTING_HINT_CAPABILITY!r} is defined")
    just = meta.get("escalationJustification")
    if just is not None and (not isinstance(just, str) or len(just) > MAX_JUSTIFICATION_LENGTH):
        problems.append(
            f"metadata.escalationJustification: at most {MAX_JUSTIFICATION_LENGTH} characters"
        )
    if meta.get("capability") is not None and not _id_ok(meta["capability"]):
        problems.append(f"metadata.capability: must be a string of 1..{MAX_ID_LENGTH} characters")
    if meta.get("deadlineMs") is not None and not _deadline_ok(meta["deadlineMs"]):
        problems.append(f"metadata.deadlineMs: must be an integer of 1..{MAX_DEADLINE_MS}")
    unknown = set(meta) - _METADATA_KEYS
    if unknown:
        problems.append(f"metadata: unknown fields {sorted(map(str, unknown))}")
    return problems


# Nearly every envelope of an agent carries the same metadata (its tier and sandbox):
# share one immutable Metadata per distinct value instead of building one per envelope.
_METADATA: dict[tuple[int | None, str | None, str | None, str | None], Metadata] = {}
_METADATA_LIMIT = 1024


def _interned_metadata(
    tier: int | None,
    sandbox_id: str | None,
    hint: str | None,
    justification: str | None,
    capability: str | None,
) -> Metadata:
    if justification is not None:
        return Metadata(tier, sandbox_id, hint, justification, capability)
    key = (tier, sandbox_id, hint, capability)
    metadata = _METADATA.get(key)
    if metadata is None:
        metadata = Metadata(tier, sandbox_id, hint, None, capability)
        if len(_METADATA) < _METADATA_LIMIT:
            _METADATA[key] = metadata
    return metadata


def _justification_ok(value: object) -> bool:
    return type(value) is str and len(value) <= MAX_JUSTIFICATION_LENGTH


def _deadline_ok(value: object) -> bool:
    return type(value) is int and 0 < value <= MAX_DEADLINE_MS


def _short_str(value: object) -> bool:
    return type(value) is str and 0 < len(value) <= MAX_ID_LENGTH


def _well_formed_envelope(data: dict[str, Any]) -> Envelope | None:
    """The envelope of a plain form that is valid in the common way, else None.

    One pass over the fields, for the receive path; None sends the caller to
    :func:`envelope_problems`, which reports every problem (a property test
    checks that this never accepts what that function rejects).
    """
    if not data.keys() <= _ENVELOPE_KEYS:
        return None
    # Any: every value is checked below before it is used.
    id_: Any = data.get("id")
    sender: Any = data.get("sender")
    recipient: Any = data.get("recipient")
    timestamp: Any = data.get("timestamp")
    correlation_id: Any = data.get("correlationId")
    type_text: Any = data.get("type")
    message_type = _TYPES.get(type_text) if type(type_text) is str else None
    if (
        message_type is None
        or "payload" not in data
        # The three ids, tested inline: this runs for every envelope received.
        or type(id_) is not str
        or type(sender) is not str
        or type(recipient) is not str
        or not (0 < len(id_) <= MAX_ID_LENGTH)
        or not (0 < len(sender) <= MAX_ID_LENGTH)
        or not (0 < len(recipient) <= MAX_ID_LENGTH)
        or type(timestamp) is not int
        or not 0 < timestamp < 2**63
        or (correlation_id is not None and not _short_str(correlation_id))
        or (correlation_id is None and "correlationId" in data)
    ):
        return None
    meta = data.get("metadata")
    metadata = None
    if meta is not None:
        if type(meta) is not dict or not meta.keys() <= _METADATA_KEYS:
            return None
        tier, sandbox_id = meta.get("tier"), meta.get("sandboxId")
        hint, justification = meta.get("routingHint"), meta.get("escalationJustification")
        capability = meta.get("capability")
        deadline = meta.get("deadlineMs")
        if (
            (tier is not None and (type(tier) is not int or not 0 <= tier <= 3))
            or (sandbox_id is not None and not _short_str(sandbox_id))
            or (hint is not None and hint != ROUTING_HINT_CAPABILITY)
            or (justification is not None and not _justification_ok(justification))
            or (capability is not None and not _short_str(capability))
            or (deadline is not None and not _deadline_ok(deadline))
        ):
            return None
        metadata = _interned_metadata(tier, sandbox_id, hint, justification, capability)
        if deadline is not None:  # a per-request value: not interned
            metadata = dataclasses.replace(metadata, deadline_ms=deadline)
    return Envelope(
        id_, sender, recipient, message_type, timestamp, data["payload"], correlation_id, metadata
    )


def wall_clock_ms() -> int:
    """Milliseconds since the Unix epoch."""
    return time.time_ns() // 1_000_000


class EnvelopeFactory:
    """Makes envelopes with unique ids and millisecond timestamps.

    Ids are a random 64-bit prefix chosen per factory plus a counter: unique
    within the factory without a syscall per envelope, and unique across
    factories with overwhelming probability. Clock and randomness are injected.
    """

    def __init__(
        self,
        clock_ms: Callable[[], int] = wall_clock_ms,
        random_bytes: Callable[[int], bytes] = os.urandom,
    ) -> None:
        self._clock_ms = clock_ms
        self._prefix = random_bytes(8).hex()
        self._counter = 0

    def new_id(self) -> str:
        self._counter += 1
        return f"{self._prefix}-{self._counter:x}"

    def create(
        self,
        sender: str,
        recipient: str,
        type: MessageType,
        payload: Any = None,
        *,
        correlation_id: str | None = None,
        metadata: Metadata | None = None,
    ) -> Envelope:
        """A new envelope stamped with a fresh id and the current time."""
        return Envelope(
            id=self.new_id(),
            sender=sender,
            recipient=recipient,
            type=type if type.__class__ is MessageType else MessageType(type),
            timestamp=max(1, self._clock_ms()),
            payload=payload,
            correlation_id=correlation_id,
            metadata=metadata,
        )

    def reply(self, to: Envelope, sender: str, type: MessageType, payload: Any = None) -> Envelope:
        """An envelope answering ``to``: same thread (its correlation id, else its id)."""
        return self.create(
            sender, to.sender, type, payload, correlation_id=to.correlation_id or to.id
        )


#: Bytes an envelope is charged beyond its payload: ids, names, metadata (about what
#: the msgpack form takes, rounded up).
ENVELOPE_OVERHEAD = 256


def envelope_size(envelope: Envelope) -> int:
    """About how many bytes ``envelope`` holds: its payload's strings and bytes, 16 per
    other value, plus :data:`ENVELOPE_OVERHEAD`. What memory budgets are charged; one
    pass over the payload (whose depth the wire limits already bound)."""
    return payload_envelope_size(envelope.payload)


def payload_envelope_size(payload: Any) -> int:
    """:func:`envelope_size` of an envelope carrying ``payload``."""
    kind = type(payload)
    if kind is str or kind is bytes:  # most payloads: no walk
        return ENVELOPE_OVERHEAD + len(payload)
    if payload is None or kind in (int, float, bool):
        return ENVELOPE_OVERHEAD + 16
    return ENVELOPE_OVERHEAD + _value_size(payload)


#: Exact types sized by their length, and scalars sized 16: no isinstance needed for them.
_SIZED_BY_LENGTH = (str, bytes, bytearray)
_SCALARS = (int, float, bool, type(None))


def _value_size(value: Any) -> int:
    # Exact type tests first, and the members of a map or list sized in this frame when
    # they are strings or scalars: tool arguments and results are maps of those, and this
    # runs for every envelope. Subclasses take the isinstance tests at the end.
    kind = type(value)
    if kind in _SIZED_BY_LENGTH:
        return len(value)
    if kind in _SCALARS:
        return 16
    if kind is dict or isinstance(value, dict):
        total = 0
        for key, item in value.items():
            total += len(key) if type(key) is str else _value_size(key)
            total += _member_size(item)
        return total
    if kind is list or kind is tuple or isinstance(value, list | tuple):
        total = 16
        for item in value:
            total += _member_size(item)
        return total
    if isinstance(value, str | bytes | bytearray):
        return len(value)
    return 16


def _member_size(item: Any) -> int:
    kind = type(item)
    if kind is str or kind is bytes:
        return len(item)
    if kind in _SCALARS:
        return 16
    return _value_size(item)


# -- the decoder's limits, on the sending side and in a refusal -------------------------------


def payload_limit_error(payload: Any, limits: WireLimits = DEFAULT_LIMITS) -> LocalError | None:
    """Why a peer's decoder would refuse an envelope carrying ``payload`` (a string or
    binary over its limit: MESSAGE_TOO_LARGE; an array or map of more items:
    TOO_MANY_ITEMS; nesting past :data:`MAX_PAYLOAD_DEPTH`: NESTING_TOO_DEEP; the details
    name the ``bound`` and its ``limit``), or None. What a node checks before an envelope
    leaves, so its sender fails at once instead of waiting for a reply that cannot come.
    A string payload, most of them, costs one comparison; others one bounded walk."""
    kind = type(payload)
    if kind is str and len(payload) <= limits.max_str_len // 4:
        return None
    if payload is None or kind is int or kind is float or kind is bool:
        return None
    return _walk_limits(payload, limits)


def _walk_limits(value: Any, limits: WireLimits) -> LocalError | None:
    # Iterative, so a deep value cannot exhaust the stack; stops at the first violation.
    # Exact type tests, and the members of a container checked in its own turn when they
    # are strings or scalars: tool arguments are maps of those, and this runs per envelope.
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        kind = type(item)
        if kind is dict or isinstance(item, dict):
            if len(item) > limits.max_map_len:
                return _limit_error("map", limits.max_map_len, "a map's items")
            children: Any = [*item, *item.values()]
        elif kind is list or kind is tuple or isinstance(item, list | tuple):
            if len(item) > limits.max_array_len:
                return _limit_error("array", limits.max_array_len, "an array's items")
            children = item
        else:
            problem = _scalar_problem(item, limits)
            if problem is not None:
                return problem
            continue
        if depth >= MAX_PAYLOAD_DEPTH:
            return _limit_error("depth", MAX_PAYLOAD_DEPTH, "the payload's nesting")
        for child in children:
            child_kind = type(child)
            if child_kind is str:
                if len(child) > limits.max_str_len // 4:
                    stack.append((child, depth + 1))
            elif child_kind not in _SCALARS:
                stack.append((child, depth + 1))
    return None


def _scalar_problem(item: Any, limits: WireLimits) -> LocalError | None:
    if isinstance(item, str):
        if len(item) > limits.max_str_len // 4 and _utf8_len(item) > limits.max_str_len:
            return _limit_error("string", limits.max_str_len, "a string")
    elif isinstance(item, bytes | bytearray) and len(item) > limits.max_bin_len:
        return _limit_error("binary", limits.max_bin_len, "a binary")
    return None


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _limit_error(bound: str, limit: int, what: str) -> LocalError:
    return LocalError(
        LIMIT_CODES[bound],
        f"{what} exceeds the decoder's limit of {limit}: a peer would refuse the envelope",
        bound=bound,
        limit=limit,
    )


# The header fields of a refused envelope are short: ids of at most 128 characters (four
# bytes each at most), a type name, integers. Anything longer is not attributable.
_HEADER_STR_BYTES = 4 * MAX_ID_LENGTH
_SKIPPED_FIELDS = frozenset({"payload", "metadata"})


def envelope_header_untrusted(data: bytes | memoryview) -> Envelope | None:
    """The envelope whose plain form ``data`` (one msgpack map) encodes, read without its
    payload and metadata, which are skipped unread (the result carries neither): what
    identifies an envelope whose payload a decoding limit refused, so its sender can be
    answered. None when the rest is not a valid envelope's header; never raises."""
    unpacker = msgpack.Unpacker(
        raw=False,
        strict_map_key=True,
        max_buffer_size=max(len(data), 1),
        max_str_len=_HEADER_STR_BYTES,
        max_bin_len=0,
        max_array_len=0,
        max_map_len=0,
        max_ext_len=0,
    )
    header: dict[str, Any] = {"payload": None}
    try:
        unpacker.feed(data)
        count = unpacker.read_map_header()
        if count > len(_ENVELOPE_KEYS):
            return None
        for _ in range(count):
            key = unpacker.unpack()
            if key in _SKIPPED_FIELDS:
                unpacker.skip()  # unread: skipping builds nothing, whatever it holds
            elif type(key) is not str or key in header or key not in _ENVELOPE_KEYS:
                return None
            else:
                header[key] = unpacker.unpack()  # scalars only: containers exceed the limits
        if unpacker.tell() != len(data):
            return None
        return Envelope.from_dict_untrusted(header)
    except Exception:  # msgpack's errors and EnvelopeError alike: not attributable
        return None
