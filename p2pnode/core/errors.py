"""The project's error types.

Every error raised by p2pnode is a :class:`P2PError` carrying a stable
:class:`ErrorCode`. Blame is split by type: :class:`LocalError` means the
caller misused an API or local state is bad (a corrupt key file, an invalid
card we were asked to sign); :class:`RemoteError` means a peer sent something
wrong. Functions whose names end in ``_untrusted`` parse peer bytes and raise
only :class:`RemoteError` (or a subclass). Low-level exceptions from msgpack,
PyNaCl or struct are translated at the boundary and never leak.
"""

from __future__ import annotations

import enum
from typing import Any


class ErrorCode(enum.StrEnum):
    """Stable machine-readable error codes (the seed table plus per-layer codes)."""

    # The seed's table.
    AGENT_NOT_FOUND = "AGENT_NOT_FOUND"
    CAPABILITY_NOT_FOUND = "CAPABILITY_NOT_FOUND"
    TIER_VIOLATION = "TIER_VIOLATION"
    SANDBOX_VIOLATION = "SANDBOX_VIOLATION"
    ESCALATION_REQUIRED = "ESCALATION_REQUIRED"
    CHANNEL_CLOSED = "CHANNEL_CLOSED"
    DELIVERY_FAILED = "DELIVERY_FAILED"
    DUPLICATE_TOOL = "DUPLICATE_TOOL"
    INVALID_CARD = "INVALID_CARD"
    SCHEMA_VERSION_MISMATCH = "SCHEMA_VERSION_MISMATCH"
    PROPOSAL_TIMEOUT = "PROPOSAL_TIMEOUT"
    CRDT_DESERIALIZATION_FAILED = "CRDT_DESERIALIZATION_FAILED"
    # Wire and data model.
    MALFORMED_MESSAGE = "MALFORMED_MESSAGE"
    MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"
    #: A message nests deeper than its decoder takes (details: ``limit``, ``max``).
    NESTING_TOO_DEEP = "NESTING_TOO_DEEP"
    #: An array or map holds more items than its decoder takes (details: ``limit``, ``max``).
    TOO_MANY_ITEMS = "TOO_MANY_ITEMS"
    INVALID_ENVELOPE = "INVALID_ENVELOPE"
    INVALID_SIGNATURE = "INVALID_SIGNATURE"
    INVALID_PEER_ID = "INVALID_PEER_ID"
    INVALID_ENDORSEMENT = "INVALID_ENDORSEMENT"
    SENDER_MISMATCH = "SENDER_MISMATCH"
    # Identity and local state.
    KEY_FILE_ERROR = "KEY_FILE_ERROR"
    CONFIG_ERROR = "CONFIG_ERROR"
    # Channels and transport.
    HANDSHAKE_FAILED = "HANDSHAKE_FAILED"
    PEER_ID_MISMATCH = "PEER_ID_MISMATCH"
    PROTOCOL_VERSION_MISMATCH = "PROTOCOL_VERSION_MISMATCH"
    DECRYPT_FAILED = "DECRYPT_FAILED"
    TIMEOUT = "TIMEOUT"
    BUSY = "BUSY"
    ILLEGAL_TRANSITION = "ILLEGAL_TRANSITION"
    #: A circuit relay refused a reservation, a connection or an accept (the details
    #: carry ``reason``, docs/protocol/relay.md).
    RELAY_REFUSED = "RELAY_REFUSED"
    # DHT.
    INVALID_RECORD = "INVALID_RECORD"
    LOOKUP_FAILED = "LOOKUP_FAILED"
    # Agents.
    #: A handler raised something that is not a P2PError (the owner logs the traceback).
    HANDLER_FAILED = "HANDLER_FAILED"
    #: A request's payload does not match the capability's inputSchema.
    INVALID_INPUT = "INVALID_INPUT"
    #: The agent went away (its process detached or died) before answering.
    AGENT_UNAVAILABLE = "AGENT_UNAVAILABLE"
    # Tasks and swarms.
    #: Every agent a task was proposed to rejected it (the details carry the reasons).
    TASK_REJECTED = "TASK_REJECTED"
    #: The task was canceled by its proposer.
    TASK_CANCELED = "TASK_CANCELED"
    # Tools, resources and prompts.
    #: The owner has no tool (or prompt) of that name.
    TOOL_NOT_FOUND = "TOOL_NOT_FOUND"
    PROMPT_NOT_FOUND = "PROMPT_NOT_FOUND"
    #: The owner has no resource of that URI (the details carry ``uri``).
    RESOURCE_NOT_FOUND = "RESOURCE_NOT_FOUND"
    #: The entry's access rule does not admit the authenticated caller.
    PERMISSION_DENIED = "PERMISSION_DENIED"
    #: A tool's result does not match its output schema (the owner's defect).
    INVALID_OUTPUT = "INVALID_OUTPUT"
    # Generic.
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    INTERNAL = "INTERNAL"
    #: Processing one input raised an exception that is not a P2PError (a defect,
    #: contained by the input's failure boundary and logged with a traceback).
    INPUT_FAILED = "INPUT_FAILED"


class P2PError(Exception):
    """Base of every p2pnode error.

    ``code`` is stable across releases; ``details`` holds structured context
    (for example the expected and actual schema version, or every problem
    found in a card) for logs and for error envelopes.
    """

    def __init__(self, code: ErrorCode, message: str, **details: Any) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details: dict[str, Any] = details

    def to_dict(self) -> dict[str, Any]:
        """The error as plain data, for an ``error`` envelope or a JSON log line."""
        return {"code": str(self.code), "message": self.message, "details": self.details}


class LocalError(P2PError):
    """The caller or local state is at fault (bad argument, corrupt key file, ...)."""


class RemoteError(P2PError):
    """A peer sent something malformed, forged, oversized or out of protocol."""
