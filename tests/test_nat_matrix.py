"""Real daemons behind real NATs (tests/natlab.py) reach each other: the NAT matrix.

One lab for the whole file: a public bootstrap that also relays (``p2pnode run --relay``),
a plain public daemon, and two daemons behind each kind of NAT router (one per private
segment), started with the bootstrap and ``--use-relay``, all as OS processes in their
namespaces (``ip netns exec``) and started in parallel. The routers drop unsolicited
SYNs to their own address (RFC 5382 REQ-4, :func:`~tests.natlab.quiet_wan`) unless
NAT_MATRIX_RST=1 keeps the reset they answer with as built.

For every pair of kinds (both behind NAT, and one side public) the first node asks the
second's agent by id: the routing finds the card through the DHT, dials, and the request
is answered. The asks start once every daemon's reachability check (docs/protocol/
reachability.md §6) reached a verdict: a node behind NAT then lists no direct address,
only its relayed one, and is found through the DHT all the same (dht.md §4.5); a dialer
still holding its earlier card tries its private address first, which fails (no route
from outside its segment), and goes through the relay. The relayed channel is the
ordinary Noise handshake end to end, expecting the card's peer id (docs/protocol/
relay.md), so an answered request on a relayed channel proves that. The pairs ask one
after another, so that a circuit the relay opened during an ask is that ask's.

Each pair's row: how the channel came to be (relayed; existing: opened before the ask,
by a reachability check or an earlier pair; direct would be a fault), seconds from the request
(which looks the agent up and dials) to its answer, and, when the nodes hole-punch
(docs/protocol/holepunch.md), seconds until the channel is direct; then one request each
way over the channel as it is. The table is printed (``pytest -s``) and each row checked
against what the NAT kinds allow (:func:`punchable`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio

from p2pnode.cli.process import NodeProcess
from tests.natlab import LabError, NatKind, NatLab, NatSite, quiet_wan, unavailable

pytestmark = pytest.mark.slow

PORT = 7000
RELAY_PORT = 7001
UPGRADE_WAIT = 15.0  # seconds a hole punch has (three attempts, each a few seconds)
STEP = 30.0  # seconds any one wait may take before the test fails naming it
PUBLIC = "public"
#: NAT_MATRIX_RST=1 leaves the routers answering unsolicited SYNs with a reset (as
#: natlab builds them) instead of dropping them as RFC 5382 asks (:func:`quiet_wan`).
RST_ROUTERS = os.environ.get("NAT_MATRIX_RST") == "1"


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
        if not RST_ROUTERS:
            for site in built.all_sites:
                quiet_wan(site)
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
    started: float = 0.0  # when the first request went out (trio's clock)


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


async def _first(
    a: NodeProcess, b: NodeProcess, a_name: str, b_name: str, relay: NodeProcess, row: _Row
) -> str:
    """``a`` asks ``b``'s agent; fills ``row`` (time to the answer, and how the channel
    came to be); returns ``b``'s peer id. Run one pair at a time: a circuit the relay
    opened during the ask is this ask's."""
    b_id = str((await b.call({"op": "status"}))["peerId"])
    existing = _channel(await a.call({"op": "status"}), b_id)
    circuits = (await relay.call({"op": "status"}))["relay"]["circuitsOpened"]
    started = trio.current_time()
    ask = {"op": "send", "from": a_name, "to": b_name, "type": "request", "payload": {"n": 1}}
    try:
        reply = await a.call(ask)
    except Exception as exc:
        row.error = f"{type(exc).__name__}: {exc}"
        return b_id
    row.first_answer = trio.current_time() - started
    row.started = started
    assert reply["payload"]["echo"] == {"n": 1}, reply
    status = await _until(a, lambda s: _channel(s, b_id) is not None, f"{a_name} -> {b_name}")
    # The channel may have been opened meanwhile by the other side, through the relay
    # (its reachability check asking this node): a circuit accepted before the count
    # above was read, but a channel still relayed now, is a relayed one all the same.
    relayed_now = bool((_channel(status, b_id) or {}).get("relayed"))
    # A direct dial at a card's private address (before the node's reachability check
    # took it off its card) fails first, which the dialer logs.
    said = [line for line in a.log if f"cannot reach {b_id}: " in line]
    if said:
        row.direct_dial = said[0].split(f"cannot reach {b_id}: ", 1)[1][-48:]
    if existing is not None:  # opened earlier (a reachability check, an earlier pair)
        row.path = "existing"
    else:
        opened = (await relay.call({"op": "status"}))["relay"]["circuitsOpened"] > circuits
        row.path = "relayed" if opened or said or relayed_now else "direct"
    return b_id


async def _rest(
    a: NodeProcess, b: NodeProcess, b_id: str, a_name: str, b_name: str, row: _Row
) -> None:
    """Wait for the hole punch (if the kinds allow one), then one request each way over
    the channel as it is."""
    if row.error is not None:
        return
    await _wait_direct(a, b_id, row.started, row)
    for x, x_name, y_name in ((a, a_name, b_name), (b, b_name, a_name)):
        again = {"op": "send", "from": x_name, "to": y_name, "type": "request", "payload": 2}
        assert (await x.call(again))["payload"]["echo"] == 2  # over the channel as it is now


async def _wait_direct(a: NodeProcess, b_id: str, started: float, row: _Row) -> None:
    """Poll ``a``'s channel to ``b_id`` until it is direct (the hole punch), up to
    UPGRADE_WAIT seconds after the first answer; records when."""
    until = trio.current_time() + UPGRADE_WAIT
    while trio.current_time() < until:
        channel = _channel(await a.call({"op": "status"}), b_id)
        if channel is not None and channel["relayed"] is False:
            row.direct_after = trio.current_time() - started
            return
        await trio.sleep(0.1)


async def _start(
    nursery: trio.Nursery, root: Path, member: _Member, bootstrap: str, relay: str
) -> NodeProcess:
    process = NodeProcess(root / member.name, prefix=["ip", "netns", "exec", member.ns])
    process.prepare(member.name, 3)
    args = ["--log-level", os.environ.get("NAT_MATRIX_LOG_LEVEL", "INFO")]
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
    for member in members:  # no check runs during the asks, opening channels of its own
        await _until(daemons[member.name], _decided, f"{member.name} checked its reachability")
    return relay, daemons


def _decided(status: dict[str, Any]) -> bool:
    """Whether the node's reachability check ran and none runs now. A decisive verdict
    makes its cards list the confirmed TCP addresses and relayed endpoints only; after
    ``unknown`` (too few checkers answered) the next check is 30 s or more away."""
    reach = status["reachability"]
    return reach.get("verdict") is not None and reach["auto"]["phase"] != "checking"


def punchable(a: str, b: str) -> bool:
    """Whether a TCP hole punch between these kinds can succeed in this lab: one side's
    SYN must meet the other's mapping at the port it was told. A public node or a full
    cone accepts a SYN from any source port, so a symmetric NAT's fresh port does not
    matter; two port-restricted cones meet at their predicted ports (the listening
    port, kept by the NAT) when their SYNs cross, which needs routers that drop
    unsolicited SYNs (RFC 5382 REQ-4, :func:`~tests.natlab.quiet_wan`) rather than
    answer them with a reset. A symmetric NAT's port for the new flow cannot be
    predicted, so with a port-restricted or symmetric peer the channel stays relayed."""
    kinds = {a, b}
    if kinds & {PUBLIC, NatKind.FULL_CONE.value}:
        return True
    return kinds == {NatKind.PORT_RESTRICTED.value} and not RST_ROUTERS


def _keep_logs(processes: list[NodeProcess]) -> None:
    """NAT_MATRIX_LOGS=<dir> writes each daemon's kept log lines there (<name>.log);
    NAT_MATRIX_LOG_LEVEL sets the daemons' level (INFO by default)."""
    where = os.environ.get("NAT_MATRIX_LOGS")
    if not where:
        return
    Path(where).mkdir(parents=True, exist_ok=True)
    for process in processes:
        (Path(where) / f"{process.data_dir.name}.log").write_text("\n".join(process.log))


def _table(rows: list[_Row]) -> str:
    def secs(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [f"{'pair':40} {'first':8} {'answer s':>8} {'direct s':>8}  first direct dial"]
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
    pairs = _pairs(_members(lab))
    with trio.fail_after(3 * STEP):
        async with trio.open_nursery() as nursery:
            try:
                relay, daemons = await _start_all(nursery, tmp_path, lab, started)
                ids = []
                for a, b in pairs:
                    rows.append(_Row(f"{a.name} -> {b.name}"))
                    ids.append(
                        await _first(
                            daemons[a.name], daemons[b.name], a.name, b.name, relay, rows[-1]
                        )
                    )
                async with trio.open_nursery() as waiting:
                    for (a, b), b_id, row in zip(pairs, ids, rows, strict=True):
                        waiting.start_soon(
                            _rest, daemons[a.name], daemons[b.name], b_id, a.name, b.name, row
                        )
                relayed = (await relay.call({"op": "status"}))["relay"]
            finally:
                with trio.CancelScope(shield=True):
                    async with trio.open_nursery() as stopping:
                        for process in started:
                            stopping.start_soon(process.kill)
                nursery.cancel_scope.cancel()
    print("\nNAT matrix\n" + _table(rows))
    _keep_logs(started)
    failed = [row for row in rows if row.error is not None]
    assert not failed, _table(failed)
    # No node behind NAT is reached by a direct dial from outside: every pair with a NAT
    # side went through the relay, end to end (an answer proves the Noise handshake with
    # the card's peer id completed through it), or over a channel opened before.
    assert all(row.path in ("relayed", "existing") for row in rows), _table(rows)
    assert any(row.path == "relayed" for row in rows), _table(rows)
    # Then the hole punch made the channel direct where the NAT kinds allow it.
    wrong = [
        row for row, (a, b) in zip(rows, pairs, strict=True)
        if (row.direct_after is not None) != punchable(a.kind, b.kind)
    ]  # fmt: skip
    assert not wrong, _table(wrong)
    # Each relayed row's channel (a pair of its own) went through a circuit of its own.
    assert relayed["circuitsOpened"] >= sum(row.path == "relayed" for row in rows), relayed
    assert relayed["bytesRelayed"] > 0, relayed
