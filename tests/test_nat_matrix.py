"""Real daemons behind real NATs (tests/natlab.py) reach each other: the NAT matrix.

One lab for the whole file: a public bootstrap that also relays (``p2pnode run --relay``),
a plain public daemon, and two daemons behind each kind of NAT router (one per private
segment), started with the bootstrap and ``--use-relay``, all as OS processes in their
namespaces (``ip netns exec``) and started in parallel.

For every pair of kinds (both behind NAT, and one side public) the first node asks the
second's agent by id: the routing finds the card through the DHT, dials, and the request
is answered. A node behind NAT advertises its private listen address, so a direct dial to
it fails (no route from outside its segment) and the dialer goes through the relay; the
relayed channel is the ordinary Noise handshake end to end, expecting the card's peer id
(docs/protocol/relay.md), so an answered request on a relayed channel proves that.

Each pair's row: how the channel goes (direct or relayed), seconds from the request
(which looks the agent up and dials) to its answer, and, when the nodes hole-punch
(docs/protocol/holepunch.md), seconds until the channel is direct. The table is printed
(``pytest -s``) and each row checked against what the NAT kinds allow.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from p2pnode.cli.process import NodeProcess
from tests.natlab import LabError, NatKind, NatLab, NatSite, unavailable

pytestmark = pytest.mark.slow

PORT = 7000
RELAY_PORT = 7001
STEP = 30.0  # seconds any one wait may take before the test fails naming it
PUBLIC = "public"


@dataclass
class _MatrixLab(NatLab):
    """A lab that keeps every NAT site, also two of one kind (``sites`` keeps the last)."""

    all_sites: list[NatSite] = field(default_factory=list)

    def _add_site(self, j: int, kind: NatKind) -> None:
        NatLab._add_site(self, j, kind)
        self.all_sites.append(self.sites[kind])


@pytest.fixture(scope="module")
def lab() -> Iterator[_MatrixLab]:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"NAT MATRIX NOT RUN: {reason}")
    built = _MatrixLab(2, tuple(NatKind) * 2)
    built.create()
    try:
        yield built
    finally:
        left = built.destroy()
        if left:
            raise LabError(f"namespaces left behind: {left}")


@dataclass(frozen=True, slots=True)
class _Member:
    """One daemon of the matrix: its name (also its agent id), namespace and listen IP."""

    name: str
    kind: str  # a NatKind value, or PUBLIC
    ns: str
    ip: str


def _members(lab: _MatrixLab) -> list[_Member]:
    seen: dict[NatKind, int] = {}
    out = [_Member("pub", PUBLIC, lab.public(1), lab.public_ip(1))]
    for site in lab.all_sites:
        n = seen[site.kind] = seen.get(site.kind, -1) + 1
        out.append(_Member(f"{site.kind.value}-{n}", site.kind.value, site.inner, site.inner_ip))
    return out


def _pairs(members: list[_Member]) -> list[tuple[_Member, _Member]]:
    """Every unordered pair of kinds once: the first node of each kind, or its two
    nodes when both sides are of the same kind (public with public is not a NAT case)."""
    firsts = {m.kind: m for m in reversed(members)}
    seconds = {m.kind: m for m in members if m is not firsts[m.kind]}
    kinds = [k.value for k in NatKind]
    out = [(firsts[PUBLIC], firsts[k]) for k in kinds]
    for i, a in enumerate(kinds):
        out.append((firsts[a], seconds[a]))
        out += [(firsts[a], firsts[b]) for b in kinds[i + 1 :]]
    return out


@dataclass
class _Row:
    pair: str
    path: str = "none"
    first_answer: float | None = None
    direct_after: float | None = None
    direct_dial: str = "-"  # why the first direct dial failed, from the dialer's log
    error: str | None = None


async def _until(process: NodeProcess, check: Any, what: str) -> dict[str, Any]:
    """``process``'s status once ``check(status)`` holds (polled every 0.1 s, bounded)."""
    status: dict[str, Any] = {}
    for _ in range(int(STEP / 0.1)):
        status = await process.call({"op": "status"})
        if check(status):
            return status
        await trio.sleep(0.1)
    raise AssertionError(f"{what}: never; last status {status}")


def _channel(status: dict[str, Any], peer: str) -> dict[str, Any] | None:
    return next((c for c in status["channels"] if c["peer"] == peer and c["state"] == "open"), None)


async def _ask(a: NodeProcess, b: NodeProcess, a_name: str, b_name: str, row: _Row) -> None:
    """``a`` asks ``b``'s agent; fills ``row`` (time to the answer, then the path)."""
    started = trio.current_time()
    ask = {"op": "send", "from": a_name, "to": b_name, "type": "request", "payload": {"n": 1}}
    try:
        reply = await a.call(ask)
    except Exception as exc:
        row.error = f"{type(exc).__name__}: {exc}"
        return
    row.first_answer = trio.current_time() - started
    assert reply["payload"]["echo"] == {"n": 1}, reply
    b_id = (await b.call({"op": "status"}))["peerId"]
    status = await _until(a, lambda s: _channel(s, b_id) is not None, f"{a_name} -> {b_name}")
    channel = _channel(status, b_id)
    assert channel is not None
    row.path = "relayed" if channel["relayed"] else "direct"
    said = [line for line in a.log if f"cannot reach {b_id}: " in line]
    if said:
        row.direct_dial = said[0].split(f"cannot reach {b_id}: ", 1)[1][-48:]


async def _start(
    nursery: trio.Nursery, root: Path, member: _Member, bootstrap: str, relay: str
) -> NodeProcess:
    process = NodeProcess(root / member.name, prefix=["ip", "netns", "exec", member.ns])
    process.prepare(member.name, 3)
    args = ["--log-level", "INFO"]
    if member.kind != PUBLIC:
        args += ["--use-relay", relay]
    await process.start(nursery, bootstrap, listen=f"{member.ip}:{PORT}", run_args=args)
    return process


async def _start_all(
    nursery: trio.Nursery, root: Path, lab: _MatrixLab, started: list[NodeProcess]
) -> tuple[NodeProcess, dict[str, NodeProcess]]:
    """The relaying bootstrap, then every member in parallel; each holds its reservation."""
    relay = NodeProcess(root / "relay", prefix=["ip", "netns", "exec", lab.public(0)])
    relay.prepare("relay", 3)
    started.append(relay)
    ip = lab.public_ip(0)
    await relay.start(
        nursery, None, listen=f"{ip}:{PORT}", run_args=["--relay", f"{ip}:{RELAY_PORT}"]
    )
    relay_address = (await relay.call({"op": "status"}))["relay"]["address"]
    members = _members(lab)
    daemons: dict[str, NodeProcess] = {}

    async def one(member: _Member) -> None:
        daemons[member.name] = await _start(nursery, root, member, relay.address, relay_address)
        started.append(daemons[member.name])

    async with trio.open_nursery() as starting:
        for member in members:
            starting.start_soon(one, member)
    for member in members:
        if member.kind != PUBLIC:
            await _until(
                daemons[member.name],
                lambda s: bool(s["relays"]) and s["relays"][0]["reserved"],
                f"{member.name} holds a reservation",
            )
    return relay, daemons


def _table(rows: list[_Row]) -> str:
    def secs(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [f"{'pair':40} {'path':8} {'answer s':>8} {'direct s':>8}  first direct dial"]
    for row in rows:
        lines.append(
            f"{row.pair:40} {row.path:8} {secs(row.first_answer):>8} "
            f"{secs(row.direct_after):>8}  {row.direct_dial}"
            + (f"  ERROR {row.error}" if row.error else "")
        )
    return "\n".join(lines)


async def test_nat_matrix(lab: _MatrixLab, tmp_path: Path) -> None:
    started: list[NodeProcess] = []
    rows: list[_Row] = []
    with trio.fail_after(3 * STEP):
        async with trio.open_nursery() as nursery:
            try:
                relay, daemons = await _start_all(nursery, tmp_path, lab, started)
                pairs = _pairs(_members(lab))
                async with trio.open_nursery() as asking:
                    for a, b in pairs:
                        row = _Row(f"{a.name} -> {b.name}")
                        rows.append(row)
                        asking.start_soon(
                            _ask, daemons[a.name], daemons[b.name], a.name, b.name, row
                        )
                relayed = (await relay.call({"op": "status"}))["relay"]
            finally:
                with trio.CancelScope(shield=True):
                    async with trio.open_nursery() as stopping:
                        for process in started:
                            stopping.start_soon(process.kill)
                nursery.cancel_scope.cancel()
    print("\nNAT matrix\n" + _table(rows))
    failed = [row for row in rows if row.error is not None]
    assert not failed, _table(failed)
    # A node behind NAT is never dialed directly at the private address it advertises:
    # every pair with a NAT side went through the relay, end to end (an answer proves the
    # Noise handshake with the card's peer id completed through it).
    assert all(row.path == "relayed" for row in rows), _table(rows)
    assert all(row.direct_dial != "-" for row in rows), _table(rows)  # tried, and failed
    assert relayed["circuitsOpened"] >= len(rows), relayed
    assert relayed["bytesRelayed"] > 0, relayed
