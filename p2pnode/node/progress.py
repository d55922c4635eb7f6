"""Progress of a running request: the notification that keeps its requester waiting.

A request's deadline is an *idle* deadline (docs/protocol/node.md "Requests to
an agent"): a requester waits ``timeout`` seconds for the answer *or for the
next progress*, so a call that reports progress may run for many minutes
while one that goes silent fails at its deadline. The message is MCP's
``notifications/progress`` carried the way the cancel is
(p2pnode.node.callcancel): a ``notification`` envelope from the agent asked to
the requesting agent, ``metadata.capability`` the method, ``correlationId`` the
request's thread (as a reply's), and the payload MCP's params without the
token: ``{"progress": number, "total"?: number, "message"?: str}``.

* **Owner.** A handler reports with :func:`report_progress` (or the
  :class:`ProgressReporter` of :func:`current_progress`, which another task,
  an SDK's callback, may hold). Each report pushes the handler's own deadline
  out by its length again and sends the notification; a report outside a
  request's handler sends nothing.
* **Requester.** Its node takes the notification on delivery, before any
  inbox, like a reply: from an agent its pending request went to, it moves
  that request's deadline to now plus its timeout and hands the progress to
  the caller's callback; any other (no such request, another sender, a
  malformed payload) is dropped. It never reaches an agent's handler.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from contextvars import ContextVar, Token
from typing import Any

from p2pnode.core.envelope import Envelope, MessageType, Metadata
from p2pnode.core.progress import (  # re-exported: the value and its reading
    MAX_PROGRESS_MESSAGE,
    PROGRESS,
    Progress,
    ProgressCallback,
    is_finite_number,
    progress_untrusted,
)

logger = logging.getLogger("p2pnode.node")

#: The metadata every progress notification carries.
PROGRESS_METADATA = Metadata(capability=PROGRESS)


def is_progress(envelope: Envelope) -> bool:
    """True for a progress notification (whatever its payload holds)."""
    meta = envelope.metadata
    return (
        envelope.type is MessageType.NOTIFICATION
        and meta is not None
        and meta.capability == PROGRESS
    )


class ProgressReporter:
    """Reports the progress of one running request from its owner (see the module
    docstring); usable from any task while the request runs."""

    __slots__ = ("_extend", "_send", "request")

    def __init__(
        self,
        request: Envelope,
        extend: Callable[[], None],
        send: Callable[[Envelope, Progress], Awaitable[bool]],
    ) -> None:
        self.request = request
        self._extend = extend
        self._send = send

    async def report(
        self, progress: float, total: float | None = None, message: str | None = None
    ) -> bool:
        """Push the handler's deadline out and tell the requester; True when sent.
        Raises ValueError for a progress or total that is not a finite number."""
        if not is_finite_number(progress) or (total is not None and not is_finite_number(total)):
            raise ValueError("progress and total must be finite numbers")
        self._extend()
        return await self._send(self.request, Progress(progress, total, message))


#: The running request of this task: a factory of its reporter and the factory's
#: arguments, so that a request whose handler never reports costs one tuple.
_CURRENT: ContextVar[tuple[Any, ...] | None] = ContextVar("p2pnode_progress", default=None)


def current_progress() -> ProgressReporter | None:
    """The reporter of the request whose handler runs in this task, else None."""
    current = _CURRENT.get()
    if current is None:
        return None
    reporter: ProgressReporter = current[0](*current[1:])
    return reporter


async def report_progress(
    progress: float, total: float | None = None, message: str | None = None
) -> bool:
    """From a request's handler: report progress to its requester (module docstring).
    False, and nothing sent, outside a request's handler or when it could not be sent.
    Raises ValueError for a progress or total that is not a finite number."""
    reporter = current_progress()
    if reporter is None:
        return False
    return await reporter.report(progress, total, message)


def set_reporter(current: tuple[Any, ...] | None) -> Token[tuple[Any, ...] | None]:
    """Make ``current`` (a reporter factory, then its arguments) this task's running
    request; returns the token to reset it with."""
    return _CURRENT.set(current)


def reset_reporter(token: Token[tuple[Any, ...] | None]) -> None:
    """Undo :func:`set_reporter`."""
    _CURRENT.reset(token)


__all__ = [
    "MAX_PROGRESS_MESSAGE",
    "PROGRESS",
    "PROGRESS_METADATA",
    "Progress",
    "ProgressCallback",
    "ProgressReporter",
    "current_progress",
    "is_progress",
    "progress_untrusted",
    "report_progress",
    "reset_reporter",
    "set_reporter",
]
