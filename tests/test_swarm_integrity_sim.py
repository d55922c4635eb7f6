"""A hostile member in a swarm of real nodes in the simulator (docs/protocol/tasks.md
§4.6), on trio's virtual clock: uninvited results, an early-sorting forged journal record,
a forged coordinator epoch, a squatted worker id and replayed records each leave the
outcome the honest one, every sub-task done by the honest worker, and the forged entries
counted as security events."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from p2pnode.agent.definition import Agent
from p2pnode.core.card import Capability
from p2pnode.core.jsonutil import dumps
from p2pnode.crdt.ops import RegisterSet
from p2pnode.services.swarms.document import (
    COMPLETED,
    CoordLease,
    lease_stamp,
    log_key,
    member_address,
)
from p2pnode.services.swarms.service import SwarmHandle, SwarmService
from tests.sim import wait_until
from tests.test_swarms_sim import World, plan_of, settled, world

N = 10
HONEST = sum(i * i for i in range(N))
EVIL = 2  # the hostile node's index


async def hostile(w: World, name: str, caps: tuple[str, ...]) -> SwarmService:
    """The hostile node's agent ``name`` (offering ``caps``: not the plan's, so never
    invited), with the swarm service its node runs."""
    agent = Agent(name, capabilities=tuple(Capability(c, c) for c in caps))

    @agent.on_task
    async def refuse(work: Any) -> int:
        return -1

    await w.sw.nodes[EVIL].add_agent(agent)
    return w.services[EVIL]


async def write(service: SwarmService, agent: str, doc: str, path: tuple[str, ...], text: Any,
                stamp: int) -> None:  # fmt: skip
    if agent not in service.shared.subscriptions().get(doc, []):
        await service.shared.subscribe(agent, doc)
    await service.shared.update(agent, doc, RegisterSet(path, text, stamp))


def lies(who: str) -> str:
    return dumps({"d": [[i, 1, who, -10_000] for i in range(N)], "s": COMPLETED, "o": -10_045})


async def uninvited(w: World, handle: SwarmHandle, evil: SwarmService) -> None:
    """Beats to the coordinator, then reports made-up results for every sub-task."""
    boss = member_address("boss", str(w.sw.nodes[0].peer_id))
    for target in ("boss", boss):
        await evil.members.send("x", target, handle.swarm, {"op": "beat", "caps": ["sq"],
                                                            "capacity": 8, "load": 0})  # fmt: skip
        await evil.members.send("x", target, handle.swarm, {
            "op": "done", "results": [[i, a, -10_000] for i in range(N) for a in (1, 2)]})


async def early_journal(w: World, handle: SwarmHandle, evil: SwarmService) -> None:
    """A journal record at epoch 0 (it sorts first), and one in the opener's own term."""
    me = member_address("x", str(w.sw.nodes[EVIL].peer_id))
    boss = member_address("boss", str(w.sw.nodes[0].peer_id))
    now = w.sw.nodes[EVIL].events.now_ms()
    await write(evil, "x", handle.doc, ("log", log_key(0, me), "0000000001"), lies(me), now)
    await write(evil, "x", handle.doc, ("log", log_key(1, boss), "0000000000"), lies(me), now)


async def forged_epoch(w: World, handle: SwarmHandle, evil: SwarmService) -> None:
    """A coordinator claim at epoch 50, renewed every half second for 20 s, with a record."""
    me = member_address("x", str(w.sw.nodes[EVIL].peer_id))
    events = w.sw.nodes[EVIL].events
    await write(evil, "x", handle.doc, ("log", log_key(50, me), "0000000001"), lies(me),
                events.now_ms())  # fmt: skip
    for beat in range(40):
        text = CoordLease(me, 50, beat).to_json()
        await write(evil, "x", handle.doc, ("coord",), text, lease_stamp(50, events.now_ms()))
        await trio.sleep(0.5)


async def squatter(w: World, handle: SwarmHandle, evil: SwarmService) -> None:
    """The worker's own agent id on the hostile node: beats, fails every sub-task, and
    reports made-up results, all as ``w1``."""
    boss = member_address("boss", str(w.sw.nodes[0].peer_id))
    for attempt in (1, 2, 3):
        body = {"op": "done", "failed": [[i, attempt, "HANDLER_FAILED"] for i in range(N)],
                "results": [[i, attempt, -10_000] for i in range(N)]}  # fmt: skip
        await evil.members.send("w1", boss, handle.swarm, {"op": "beat", "caps": ["sq"],
                                                           "capacity": 8, "load": 0})  # fmt: skip
        await evil.members.send("w1", boss, handle.swarm, body)
        await trio.sleep(0.3)


async def replay(w: World, handle: SwarmHandle, evil: SwarmService) -> None:
    """The honest journal's records copied under keys of the hostile peer's choosing."""
    me = member_address("x", str(w.sw.nodes[EVIL].peer_id))
    boss = member_address("boss", str(w.sw.nodes[0].peer_id))
    await write(evil, "x", handle.doc, ("note",), "hello", 1)
    await wait_until(lambda: bool(evil.shared.read(handle.doc).get("log")), 30)
    log = evil.shared.read(handle.doc)["log"]
    now = w.sw.nodes[EVIL].events.now_ms()
    for n, (term, entries) in enumerate(sorted(log.items())):
        for seq, text in sorted(entries.items()):
            await write(evil, "x", handle.doc, ("log", log_key(1, me), f"{n}{seq}"), text, now)
            await write(evil, "x", handle.doc, ("log", term, seq + ".9999"), text, now)
    await write(evil, "x", handle.doc, ("log", log_key(1, boss), "0000000000"), lies(me), now)


ATTACKS = {
    "uninvited": uninvited,
    "early-journal": early_journal,
    "forged-epoch": forged_epoch,
    "squatter": squatter,
    "replay": replay,
}


@pytest.mark.parametrize("kind", sorted(ATTACKS))
async def test_a_hostile_member_never_changes_the_outcome(autojump_clock: Any, kind: str) -> None:
    async with world(3, [(1, "w1", ("sq",))]) as w:
        handle = await w.services[0].open("boss", plan_of(N, kinds=("sq",)))
        await wait_until(lambda: handle.progress[0] >= 1, 30)
        # Mid-run, as a member of an open swarm would: the squatter claims the worker's id.
        evil = await hostile(w, "w1" if kind == "squatter" else "x", ("other",))
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ATTACKS[kind], w, handle, evil)
            assert await handle.result() == HONEST
        took = trio.current_time() - start
        honest_worker = member_address("w1", str(w.sw.nodes[1].peer_id))
        for member in (0, 1):

            def ended(m: int = member) -> bool:
                return settled(w.view(handle.swarm, m))

            await wait_until(ended, 30)
            view = w.view(handle.swarm, member)
            assert view is not None and view.outcome == HONEST
            assert {s.assignee for s in view.subtasks} == {honest_worker}
        stats = [s.statistics() for s in w.services[:2]]
        assert sum(s["takeovers"] for s in stats) == 0
        assert all(s["escalations"] == 0 for s in stats)
        assert took < 30  # no stall while the attack lasted
        await wait_until(lambda: sum(s.statistics()["forgedEntries"] for s in w.services[:2]) > 0,
                         30)  # fmt: skip
