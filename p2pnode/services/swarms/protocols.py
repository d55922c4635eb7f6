"""What the swarm service uses of the other services, as protocols it declares itself.

The composition root (:mod:`p2pnode.runtime`) passes the node's task service as
:class:`Tasks` and its shared-state service as :class:`Documents`; the swarm service
never imports their classes, and reads only what these protocols name. In the other
direction, the task service runs an accepted invitation with the swarm service's
:data:`Joiner`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

from p2pnode.agent.task import Accepted, Proposal, SwarmInvite, Task
from p2pnode.agent.taskwork import TaskHandlers, Work
from p2pnode.crdt.ops import Op
from p2pnode.crdt.types import ORMap

#: What runs an accepted invitation to a swarm: called with the local agent, the
#: proposal and the participation's Work; returns its result when the swarm ended.
Joiner = Callable[[str, Proposal, Work], Awaitable[Any]]


class Invitation(Protocol):
    """A proposed task once awarded, as the swarm reads it: who accepted, on what terms."""

    def acceptance(self, agent: str) -> Accepted | None:
        """The ``task-accept`` of ``agent`` (as proposed to: an id or ``agent@peer``)."""


class Tasks(Protocol):
    """The task service: invitations are task proposals; a participant's capacity and
    load are its task handlers' and its running tasks'."""

    async def propose(
        self,
        sender: str,
        target: str,
        task: Task,
        *,
        deadline: float | None = None,
        swarm: SwarmInvite | None = None,
    ) -> Invitation: ...

    def handlers(self, agent_id: str) -> TaskHandlers | None: ...

    def load(self, agent_id: str) -> int: ...


class Documents(Protocol):
    """The shared-state service: the swarm's document is a shared document."""

    async def subscribe(self, agent_id: str, doc: str) -> None: ...

    async def update(self, agent_id: str, doc: str, op: Op) -> object: ...

    def read(self, doc: str) -> dict[str, Any]:
        """The current value of ``doc`` as plain data (``{}`` if unknown)."""

    def subscriptions(self) -> Mapping[str, Sequence[str]]: ...

    def root(self, doc: str) -> ORMap:
        """This replica's state of ``doc``, its registers with their writers. Raises
        LocalError when the document is not held."""


__all__ = ["Documents", "Invitation", "Joiner", "Tasks"]
