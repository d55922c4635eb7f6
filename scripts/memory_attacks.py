"""Memory attacks against a real ``p2pnode run`` daemon, measured as its RSS.

The node's memory bounds (inbox and thread-store byte budgets, reply queues,
handshake reads) are tested in the simulator through the structures' own byte
counts. This script measures what the operating system sees instead: it
starts a *victim* daemon and an *honest* one that joined through it, records
the victim's resident memory (VmRSS) once it has served some honest traffic,
then runs each attack in turn:

* ``notifications``: an authenticated peer sends ``--notifications`` (617)
  notifications of 3.8 MiB, each with its own correlation id;
* ``requests``: an authenticated peer sends ``--requests`` (120) requests of
  3.8 MiB in a loop, reading the 3.8 MiB echoes the victim's agent sends back;
* ``records``: ``--record-peers`` (200) authenticated peers each announce a
  4 MiB record on their channel and send its first 196 bytes, then wait;
* ``junk``: 300 TCP connections each write 64 KB of junk, 4 rounds;
* ``proposals``: an authenticated peer sends ``--proposals`` (100,000) task
  proposals, as fast as it can, to a task-taking agent the victim hosts
  (examples/squarer.py, which accepts them all and is never awarded), reading
  the answers; the victim's task counters are printed after it (accepted,
  refused ``BUSY``, open threads). When ``proposals`` is among the attacks the
  victim hosts that agent from the start.

During each attack the honest daemon sends the victim a request every
``--probe-every`` seconds; every one must be answered (``honest ok``/``failed``
and the slowest answer are printed). When the attacker has left, the victim's
RSS must come back within ``--slack`` (50) MB of the baseline within
``--settle`` seconds. Each attack prints one row: the RSS before, at its
peak, and after; exit status 1 if any attack left the victim above the
baseline plus the slack or an honest request failed. Linux only (/proc).

Usage: python scripts/memory_attacks.py [--attacks notifications,requests,records,junk]
"""

from __future__ import annotations

import argparse
import math
import os
import struct
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from p2pnode.agent.task import Task, proposal_payload
from p2pnode.cli.process import NodeProcess
from p2pnode.core.card import AgentCard, Capability
from p2pnode.core.cardfile import CARD_FILE_NAME
from p2pnode.core.envelope import EnvelopeFactory, MessageType, Metadata, wall_clock_ms
from p2pnode.core.errors import P2PError
from p2pnode.core.identity import Identity
from p2pnode.node.config import parse_address
from p2pnode.node.frames import encode_envelope, encode_hello
from p2pnode.transport.channel import SecureChannel, connect_secure
from p2pnode.transport.framing import DEFAULT_MAX_MESSAGE_SIZE, FRAME_HEADER, RECORD_HEADER
from p2pnode.transport.noise import TAGLEN
from p2pnode.transport.secure import SecureIdentity

MIB = 1024 * 1024
BIG = int(3.8 * MIB)  # fits one 4 MiB node frame with the envelope around it
ATTACKER = "mallory"


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


@dataclass
class Row:
    """What one attack did to the victim."""

    name: str
    sent: int = 0
    before: float = 0.0
    peak: float = 0.0
    after: float = 0.0
    settled_in: float = math.inf
    honest_ok: int = 0
    honest_failed: int = 0
    slowest: float = 0.0
    errors: list[str] = field(default_factory=list)


#: The task-taking agent of the proposal flood: examples/squarer.py, hosted by the victim.
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TASKER = "squarer"


def victim_options(
    attacks: list[str], data_dir: Path
) -> tuple[dict[str, str] | None, list[str]]:
    """The victim's environment and ``run`` options: with the proposal flood, it hosts
    :data:`TASKER` beside its card file's agent."""
    if "proposals" not in attacks:
        return None, []
    path = os.pathsep.join(p for p in (str(EXAMPLES), os.environ.get("PYTHONPATH")) if p)
    card = str(data_dir / CARD_FILE_NAME)
    return dict(os.environ, PYTHONPATH=path), ["--agent", f"{TASKER}:agent", "--card", card]


class Bench:
    """The victim, the honest daemon and the measurements."""

    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.root = root
        env, self.victim_args = victim_options(args.attacks, root / "victim")
        self.victim = NodeProcess(root / "victim", env, log_lines=200)
        self.honest = NodeProcess(root / "honest", log_lines=200)
        self.baseline = 0.0
        self.nonce = 0

    def rss(self) -> float:
        assert self.victim.process is not None
        return rss_mb(self.victim.process.pid)

    async def start(self, nursery: trio.Nursery) -> None:
        for node, name in ((self.victim, "victim"), (self.honest, "honest")):
            node.prepare(name, 3, [{"id": f"{name}.echo", "name": "Echo", "description": "echo"}])
        await self.victim.start(nursery, None, run_args=self.victim_args)
        await self.honest.start(nursery, self.victim.address)
        for _ in range(20):  # warm the paths an honest request takes
            await self.ask()
        self.baseline = self.rss()

    async def ask(self) -> float:
        """One honest request to the victim; seconds it took. Raises on failure."""
        self.nonce += 1
        started = trio.current_time()
        ask = {"op": "send", "from": "honest", "to": "victim", "type": "request"}
        reply = await self.honest.call({**ask, "payload": {"nonce": self.nonce}})
        if reply.get("payload", {}).get("echo") != {"nonce": self.nonce}:
            raise AssertionError(f"wrong answer {reply!r}")
        return trio.current_time() - started

    async def probe(self, row: Row, done: trio.Event) -> None:
        """An honest request every probe_every seconds until ``done``; sample the RSS."""
        while not done.is_set():
            row.peak = max(row.peak, self.rss())
            try:
                with trio.fail_after(self.args.honest_timeout):
                    row.slowest = max(row.slowest, await self.ask())
                row.honest_ok += 1
            except (
                P2PError,
                OSError,
                trio.TooSlowError,
                trio.BrokenResourceError,
                AssertionError,
            ) as exc:
                row.honest_failed += 1
                row.errors.append(repr(exc))
            with trio.move_on_after(self.args.probe_every):
                await done.wait()

    async def run(self, name: str, attack: Callable[[Row], Awaitable[None]]) -> Row:
        row = Row(name, before=self.rss())
        row.peak = row.before
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.probe, row, done)
            try:
                await attack(row)
            finally:
                done.set()
        # The attacker has left: wait (bounded) for the victim to give the memory back.
        started = trio.current_time()
        while True:
            row.after = self.rss()
            if row.after <= self.baseline + self.args.slack:
                row.settled_in = trio.current_time() - started
                break
            if trio.current_time() - started > self.args.settle:
                break
            await trio.sleep(0.5)
        with trio.fail_after(self.args.honest_timeout):  # and it still serves
            await self.ask()
        row.honest_ok += 1
        return row

    # -- attackers ----------------------------------------------------------------------------

    async def attacker(self) -> tuple[SecureChannel, Identity]:
        """An authenticated peer whose agent ``mallory`` the victim knows."""
        identity = Identity.generate()
        now = wall_clock_ms()
        card = AgentCard(
            id=ATTACKER,
            name="Mallory",
            version="1.0.0",
            public_key=identity.public_key,
            capabilities=(Capability(f"{ATTACKER}.echo", "echo"),),
            issued_at=now,
            expires_at=now + 3_600_000,
            revision=now,
        ).signed(identity)
        host, port = parse_address(self.victim.address)
        stream = await trio.open_tcp_stream(host, port)
        channel = await connect_secure(stream, SecureIdentity(identity))
        await channel.send_message(encode_hello([card], []))
        peer = str(identity.peer_id)
        for _ in range(100):  # bounded: 10 s
            if peer in (await self.victim.call({"op": "status"}))["peers"]:
                break
            await trio.sleep(0.1)
        return channel, identity

    async def envelopes(self, row: Row, kind: MessageType, count: int) -> None:
        channel, _ = await self.attacker()
        factory = EnvelopeFactory(wall_clock_ms)
        payload = "x" * BIG
        async with channel, trio.open_nursery() as nursery:
            nursery.start_soon(_drain, channel)  # read what the victim answers
            for n in range(count):
                envelope = factory.create(
                    ATTACKER,
                    "victim",
                    kind,
                    payload,
                    correlation_id=f"note-{n}" if kind is MessageType.NOTIFICATION else None,
                    metadata=Metadata(tier=3),
                )
                await channel.send_message(encode_envelope(envelope))
                row.sent += 1
            await trio.sleep(self.args.linger)  # the victim works through what it read
            nursery.cancel_scope.cancel()

    async def notifications(self, row: Row) -> None:
        await self.envelopes(row, MessageType.NOTIFICATION, self.args.notifications)

    async def requests(self, row: Row) -> None:
        await self.envelopes(row, MessageType.REQUEST, self.args.requests)

    async def records(self, row: Row) -> None:
        # One transport frame whose record header announces 4 MiB, with 196 bytes of
        # the record: a receiver that allocated the announced size would hold 800 MiB.
        host, port = parse_address(self.victim.address)

        async def one(opened: list[SecureChannel]) -> None:
            stream = await trio.open_tcp_stream(host, port)
            channel = await connect_secure(stream, SecureIdentity(Identity.generate()))
            opened.append(channel)
            await channel._stream.send_all(_announce(channel, DEFAULT_MAX_MESSAGE_SIZE, 196))
            row.sent += 1

        opened: list[SecureChannel] = []
        try:
            async with trio.open_nursery() as nursery:
                for _ in range(self.args.record_peers):
                    nursery.start_soon(one, opened)
            await trio.sleep(self.args.linger)
            row.peak = max(row.peak, self.rss())
        finally:
            for channel in opened:
                await trio.aclose_forcefully(channel._stream)

    async def proposals(self, row: Row) -> None:
        channel, _ = await self.attacker()
        factory = EnvelopeFactory(wall_clock_ms)
        task = Task("square 7", ("square",), 1.0, 7)
        deadline = wall_clock_ms() + 3_600_000  # accepted, then held until the award timeout
        async with channel, trio.open_nursery() as nursery:
            nursery.start_soon(_drain, channel)  # read the accepts and the BUSY refusals
            for n in range(self.args.proposals):
                task_id = f"flood-{n:08d}"
                envelope = factory.create(
                    ATTACKER,
                    TASKER,
                    MessageType.TASK_PROPOSAL,
                    proposal_payload(task_id, task, deadline),
                    correlation_id=task_id,
                    metadata=Metadata(tier=3),
                )
                await channel.send_message(encode_envelope(envelope))
                row.sent += 1
                if n % 2000 == 0:
                    row.peak = max(row.peak, self.rss())
            await trio.sleep(self.args.linger)
            row.peak = max(row.peak, self.rss())
            nursery.cancel_scope.cancel()
        tasks = (await self.victim.call({"op": "status"}))["tasks"]
        keys = ("proposalsReceived", "proposalsRefused", "open")
        print("  victim tasks: " + ", ".join(f"{k} {tasks.get(k)}" for k in keys), flush=True)

    async def junk(self, row: Row) -> None:
        address = parse_address(self.victim.address)
        for _ in range(4):
            row.sent += await junk_round(address)
            row.peak = max(row.peak, self.rss())


#: 64 KiB that fail a Noise handshake's first read.
JUNK = bytes(range(256)) * 256


async def junk_round(address: tuple[str, int], connections: int = 300) -> int:
    """One round of the junk-connection flood: ``connections`` TCP connections at once,
    each sending :data:`JUNK` and reading until the victim closes it (3 s at most).
    Returns the connections made."""

    async def one() -> None:
        try:
            stream = await trio.open_tcp_stream(*address)
        except OSError:
            return
        try:
            await stream.send_all(JUNK)
            with trio.move_on_after(3):
                while await stream.receive_some(65536):
                    pass
        except trio.BrokenResourceError:
            pass
        finally:
            await trio.aclose_forcefully(stream)

    async with trio.open_nursery() as flood:
        for _ in range(connections):
            flood.start_soon(one)
    return connections


def _announce(channel: SecureChannel, announced: int, sent: int) -> bytes:
    """One sealed transport frame carrying a record header of ``announced`` bytes and
    the first ``sent`` bytes of it (noise.md, "Transport"); uses the channel's own codec
    so that its nonce counts on."""
    codec = channel._codec
    out = bytearray(FRAME_HEADER + RECORD_HEADER + sent + TAGLEN)
    struct.pack_into(">I", out, FRAME_HEADER, announced)  # sealing writes the frame length
    out[FRAME_HEADER + RECORD_HEADER : FRAME_HEADER + RECORD_HEADER + sent] = b"x" * sent
    codec._seal(struct.pack("<4xQ", codec._nonces(1)), out, 0, RECORD_HEADER + sent)
    return bytes(out)


async def _drain(channel: SecureChannel) -> None:
    try:
        while True:
            await channel.receive_message()
    except (P2PError, trio.BrokenResourceError, trio.ClosedResourceError, EOFError):
        return


def print_row(row: Row, baseline: float) -> None:
    print(
        f"{row.name:<14} sent {row.sent:>5}  RSS before {row.before:6.1f} peak {row.peak:6.1f} "
        f"after {row.after:6.1f} MB (baseline {baseline:.1f}, back in "
        f"{row.settled_in:.1f} s)  honest {row.honest_ok} ok {row.honest_failed} failed, "
        f"slowest {row.slowest:.2f} s",
        flush=True,
    )
    for error in row.errors[:3]:
        print(f"  honest request failed: {error}")


async def main_async(args: argparse.Namespace, root: Path) -> int:
    bench = Bench(args, root)
    rows: list[Row] = []
    async with trio.open_nursery() as nursery:
        await bench.start(nursery)
        print(f"victim up, baseline RSS {bench.baseline:.1f} MB", flush=True)
        for name in args.attacks:
            row = await bench.run(name, getattr(bench, name))
            print_row(row, bench.baseline)
            rows.append(row)
        for node in (bench.honest, bench.victim):
            await node.stop()
        nursery.cancel_scope.cancel()
    bad = [r for r in rows if r.after > bench.baseline + args.slack or r.honest_failed]
    print(f"{'OK' if not bad else 'FAILED: ' + ', '.join(r.name for r in bad)}")
    return 1 if bad else 0


ATTACKS = ("notifications", "requests", "records", "junk", "proposals")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attacks", default=",".join(ATTACKS), help="comma-separated, in order")
    parser.add_argument("--notifications", type=int, default=617)
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--record-peers", type=int, default=200)
    parser.add_argument("--proposals", type=int, default=100_000)
    parser.add_argument("--slack", type=float, default=50.0, help="MB above the baseline")
    parser.add_argument("--settle", type=float, default=30.0, help="seconds to give it back")
    parser.add_argument("--linger", type=float, default=2.0, help="attacker stays after sending")
    parser.add_argument("--probe-every", type=float, default=0.5)
    parser.add_argument("--honest-timeout", type=float, default=15.0)
    args = parser.parse_args(argv)
    args.attacks = [a for a in args.attacks.split(",") if a]
    unknown = set(args.attacks) - set(ATTACKS)
    if unknown:
        parser.error(f"unknown attacks {sorted(unknown)}; known: {', '.join(ATTACKS)}")
    return args


def main() -> int:
    args = parse_args()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="p2pnode-memory-") as root:
        code = trio.run(main_async, args, Path(root))
    print(f"done in {time.monotonic() - started:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
