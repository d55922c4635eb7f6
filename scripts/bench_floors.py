"""Floors of the envelope path: the least work an envelope or a send() can cost here.

bench_node.py prints them beside its node rows, in the same run. The node's rows can
never beat them, so they show how much of the node's time is its own checks and
plumbing, and how much the language and the scheduler take on this machine.

- The envelope alone: made as the node makes it, encoded BATCH to a frame, decoded
  with the receiving node's limits, validated, checked against a map of ids seen and
  handed to a function. One process, no trio, no channel, no policy, no events, no
  inbox: the part of the pipelined rows that no node design can drop.
- A task switch: BATCH trio tasks each yielding to the scheduler in turn, the least a
  send() from one of many concurrent tasks costs before any work is done.
"""

from __future__ import annotations

import time
from typing import Any

import trio

from p2pnode.core.envelope import Envelope, EnvelopeFactory, MessageType
from p2pnode.core.wire import pack, unpack_untrusted

BATCH = 64


def envelope_rate(count: int, payload: Any) -> float:
    """Envelopes per second through the envelope alone (see the module docstring)."""
    factory = EnvelopeFactory()
    seen: dict[str, Envelope] = {}
    handled = 0

    def handler(envelope: Envelope) -> None:
        nonlocal handled
        handled += 1

    rounds = max(1, count // BATCH)
    start = time.perf_counter()
    for _ in range(rounds):
        frame = pack(
            [
                factory.create("client", "sink", MessageType.NOTIFICATION, payload).to_dict()
                for _ in range(BATCH)
            ]
        )
        for plain in unpack_untrusted(frame):
            envelope = Envelope.from_dict_untrusted(plain)
            if envelope.id not in seen:
                seen[envelope.id] = envelope
                handler(envelope)
    elapsed = time.perf_counter() - start
    assert handled == rounds * BATCH
    return handled / elapsed


async def _switches(count: int) -> float:
    rounds = max(1, count // BATCH)

    async def task() -> None:
        for _ in range(rounds):
            await trio.lowlevel.checkpoint()

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(BATCH):
            nursery.start_soon(task)
    return rounds * BATCH / (time.perf_counter() - start)


def task_switch_rate(count: int) -> float:
    """Trio task switches per second among BATCH tasks that each yield in turn."""
    return trio.run(_switches, count)
