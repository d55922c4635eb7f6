"""The events of an agent session (p2pnode.services.attach.session): what the process asked for,
each for the trio driver (p2pnode.services.attach.service) to perform."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.services.attach.wire import CardTemplate, Ref


class Event:
    """Base of what :meth:`AgentSession.next_event` returns."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Attach(Event):
    """Host an agent with this card (answer with ``attach_succeeded`` / ``attach_failed``)."""

    ref: Ref
    card: CardTemplate


@dataclass(frozen=True, slots=True)
class Send(Event):
    """Send an envelope from the agent; the result is ``{"envelope","path","targets"}``."""

    ref: Ref
    to: str
    type: MessageType
    payload: Any
    capability: bool
    correlation_id: str | None


@dataclass(frozen=True, slots=True)
class Request(Event):
    """Send a request from the agent and wait for its reply (the result: its envelope)."""

    ref: Ref
    to: str
    payload: Any
    capability: bool
    timeout: float | None


@dataclass(frozen=True, slots=True)
class Answer(Event):
    """Answer ``request`` (forwarded to the process) with a ``response`` or ``error``."""

    ref: Ref
    request: Envelope
    type: MessageType
    payload: Any


@dataclass(frozen=True, slots=True)
class DocOp(Event):
    """``doc.subscribe``, ``doc.update`` (``update`` is the operation's JSON) or ``doc.read``."""

    ref: Ref
    doc: str
    update: Any = None


@dataclass(frozen=True, slots=True)
class Detach(Event):
    """Withdraw the agent, answer, close (the session is CLOSED already)."""

    ref: Ref


@dataclass(frozen=True, slots=True)
class Closed(Event):
    """The session is over: ``reason`` is ``disconnected``, ``detached`` or ``error``."""

    reason: str


@dataclass(frozen=True, slots=True)
class ToolOp(Event):
    """Use the swarm's tools, resources and prompts as the agent (``tools.list``,
    ``tools.call``, ``resources.list``, ``resources.read``, ``prompts.list``,
    ``prompts.get``): ``params`` holds the op's checked keys."""

    ref: Ref
    params: dict[str, Any]


@dataclass(frozen=True, slots=True)
class FindOp(Event):
    """``find``: the cards of agents offering ``capability`` that the agent may discover."""

    ref: Ref
    capability: str


@dataclass(frozen=True, slots=True)
class TaskOp(Event):
    """``tasks.propose`` (``params``: ``to``, ``task``, ``capability``, ``deadline``,
    ``justification``, checked) or ``tasks.cancel`` (``taskId``, ``reason``)."""

    ref: Ref
    params: dict[str, Any]


__all__ = [
    "Answer",
    "Attach",
    "Closed",
    "Detach",
    "DocOp",
    "Event",
    "FindOp",
    "Request",
    "Send",
    "TaskOp",
    "ToolOp",
]
