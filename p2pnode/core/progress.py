"""A request's progress report: MCP's ``notifications/progress`` params without the token.

The rules of the notification that carries it are docs/protocol/node.md's
("Requests to an agent", Progress); the kernel's side is p2pnode.node.progress.
Here is only the value and its reading from a peer, which an attached
process's client needs too (without the kernel).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: ``metadata.capability`` of the progress notification (MCP's method name).
PROGRESS = "notifications/progress"
#: Longest ``message`` kept (a longer one is cut).
MAX_PROGRESS_MESSAGE = 1024


@dataclass(frozen=True, slots=True)
class Progress:
    """One progress report: ``progress`` so far, of ``total`` when known, and a short
    human ``message``."""

    progress: float
    total: float | None = None
    message: str | None = None

    def to_payload(self) -> dict[str, Any]:
        """The notification's payload (MCP's ``notifications/progress`` params, no token)."""
        out: dict[str, Any] = {"progress": self.progress}
        if self.total is not None:
            out["total"] = self.total
        if self.message is not None:
            out["message"] = self.message[:MAX_PROGRESS_MESSAGE]
        return out


def is_finite_number(value: Any) -> bool:
    """True for an int or a float that is finite (not a bool, not NaN)."""
    return type(value) in (int, float) and math.isfinite(value)


def progress_untrusted(payload: Any) -> Progress | None:
    """The progress a notification's payload reports; None when it is not a map with a
    finite number ``progress``, an optional finite number ``total`` and an optional
    string ``message`` (such a notification is dropped). Never raises."""
    if type(payload) is not dict:
        return None
    progress: Any = payload.get("progress")
    total, message = payload.get("total"), payload.get("message")
    if not is_finite_number(progress) or (total is not None and not is_finite_number(total)):
        return None
    if message is not None and type(message) is not str:
        return None
    return Progress(progress, total, None if message is None else message[:MAX_PROGRESS_MESSAGE])


#: What a requester is given for each progress of its request (sync: called on delivery).
ProgressCallback = Callable[[Progress], None]



__all__ = [
    "MAX_PROGRESS_MESSAGE",
    "PROGRESS",
    "Progress",
    "ProgressCallback",
    "is_finite_number",
    "progress_untrusted",
]
