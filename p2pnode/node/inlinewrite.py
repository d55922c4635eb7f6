"""A bound on the replies agent tasks write themselves, without a timer per reply.

An agent's task writes a small reply itself when it can leave at once
(p2pnode.node.agents). A peer that stopped reading can still block that write
once its socket buffer is full, and the agent must not wait on it for long.
A cancel scope with a deadline per reply would bound it, but registering and
clearing a deadline costs about a twentieth of a whole request's round trip.
So each agent task runs in one long-lived cancel scope (a :class:`Writer`),
and numbers each write it starts; one watcher task per node looks at the
writers every ``wait / 2`` seconds while writes are happening, and cancels a
writer found in the same write at two looks in a row: that write has been
stuck for between ``wait / 2`` and ``wait`` seconds. Cancelling a write cuts
the channel (its stream state is unknown: p2pnode.transport.channel) and loses the
reply; the agent's task then opens a new scope and goes on with its inbox.

The watcher sleeps on an event while no write happens (a node at rest, or a
simulated swarm on the virtual clock, wakes for nothing) and goes back to it
after a look that finds no write started or running since the one before. A
write costs two attribute stores and a flag test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import trio

from p2pnode.core.lifetime import TaskOwner


@dataclass(slots=True)
class Writer:
    """One agent task's scope, and the number of the write it is in (0: none)."""

    scope: trio.CancelScope
    writing: int = 0


class InlineWatch:
    """Cancels writers stuck in one write for ``wait`` seconds (the module docstring);
    ``on_cut`` is told the key of each writer cut. The watcher runs in ``owner``'s
    nursery, started with the first write."""

    def __init__(self, owner: TaskOwner, wait: float, on_cut: Callable[[str], None]) -> None:
        self._owner = owner
        self._wait = wait
        self._on_cut = on_cut
        self._writers: dict[str, Writer] = {}
        self._started = 0  # writes started, ever: a look tells whether any came since
        self._watching = False
        self._wake = trio.Event()
        self._running = False

    def open(self, key: str, scope: trio.CancelScope) -> Writer:
        """Register the task ``key`` (an agent id) running in ``scope``."""
        writer = self._writers[key] = Writer(scope)
        return writer

    def close(self, key: str, writer: Writer) -> None:
        """The task ``key`` left ``writer``'s scope."""
        if self._writers.get(key) is writer:
            del self._writers[key]

    def begin(self, writer: Writer) -> None:
        """``writer``'s task starts a write (end it with :meth:`end`)."""
        started = self._started = self._started + 1
        writer.writing = started
        if not self._watching:
            self._watching = True
            if self._running:
                self._wake.set()
            elif self._owner.is_open:
                self._running = True
                self._owner.nursery.start_soon(self._watch)

    @staticmethod
    def end(writer: Writer) -> None:
        writer.writing = 0

    async def _watch(self) -> None:
        try:
            while True:
                await self._look_while_writing()
                self._watching = False
                self._wake = trio.Event()
                await self._wake.wait()
        finally:
            self._running = False
            self._watching = False

    async def _look_while_writing(self) -> None:
        seen: dict[str, int] = {}
        started = -1
        while seen or started != self._started:
            started = self._started
            await trio.sleep(self._wait / 2)
            for key, writer in list(self._writers.items()):
                if writer.writing and seen.get(key) == writer.writing:
                    writer.scope.cancel()  # its task is parked in that write: see above
                    self._on_cut(key)
            seen = {k: w.writing for k, w in self._writers.items() if w.writing}


__all__ = ["InlineWatch", "Writer"]
