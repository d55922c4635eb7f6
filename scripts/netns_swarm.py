"""A p2pnode swarm across Linux network namespaces: real, distinct addresses on a bridge.

What it does (as root, with iproute2's ``ip``):

1. creates a hub namespace holding a bridge, and one namespace per node, each
   with a veth into the bridge and its own address ``10.<a>.<b>.<i>/24``;
2. ``p2pnode init --data-dir`` for each node (card ``node<i>`` offering
   ``cap.node<i>``), then ``ip netns exec NS p2pnode run --listen ADDR:7400
   --bootstrap <node 1>`` in each namespace, waiting for each one's ready line;
3. discovery (``p2pnode find``), requests (``p2pnode send``), a broadcast and a
   shared document (``p2pnode doc subscribe/update/read``) across the addresses;
4. a partition: the last node's veth goes down in the hub; both sides update the
   document, and a node that joins meanwhile is one the cut node never met;
5. the heal: the link comes back; DHT lookups across it recover (the cut node
   and the newcomer find each other) and the document converges with every
   update of both sides.

The commands of steps 2-5 other than ``run`` (``init``, ``find``, ``send``, ``doc``,
``status``) only read files or talk to a daemon over its control socket, a file in its
data directory that any namespace reaches: they run ``p2pnode``'s ``main(argv)`` in this
process, not a new interpreter each (a second or more apiece on a busy 2-core machine,
most of the run's time). The daemons are real processes inside their namespaces.

Every wait polls for its condition until a deadline. Namespace names are unique
per run; every namespace (and so every veth and the bridge inside them) is
deleted on exit, on failure and on SIGINT/SIGTERM; the root namespace is never
changed.

Usage: sudo python scripts/netns_swarm.py [--nodes 5] [--keep-logs]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from p2pnode.cli.main import main as p2pnode_main

PORT = 7400
#: Seconds a step may take before the run fails naming it.
STEP = 60.0

T = TypeVar("T")


class NetnsError(Exception):
    """A step of the run failed; the message names it."""


def unavailable() -> str | None:
    """Why namespaces cannot be used here, or None if they can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"p2n-probe-{os.getpid()}-{random.randrange(10**6)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def poll(what: str, probe: Callable[[], T | None], deadline: float = STEP) -> T:
    """``probe()`` every half second until it returns something other than None or
    False; raises NetnsError naming ``what`` after ``deadline`` seconds."""
    end = time.monotonic() + deadline
    while True:
        value = probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() > end:
            raise NetnsError(f"not within {deadline:g} s: {what}")
        time.sleep(0.5)


@dataclass
class Topology:
    """The hub namespace with its bridge, and ``n`` node namespaces wired to it."""

    n: int
    tag: str = field(default_factory=lambda: f"{os.getpid() % 10000}{random.randrange(1000)}")
    namespaces: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # A /24 per run, so two runs at once do not share addresses.
        self.subnet = f"10.{random.randrange(64, 250)}.{random.randrange(1, 250)}"

    @property
    def hub(self) -> str:
        return f"p2n{self.tag}-hub"

    def ns(self, i: int) -> str:
        return f"p2n{self.tag}-n{i}"

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def veth(self, i: int) -> str:
        return f"v{i}"  # the hub's end; names are per namespace

    def create(self) -> None:
        """Build it all; on any failure what was built is removed and NetnsError raised."""
        try:
            _ip("netns", "add", self.hub)
            self.namespaces.append(self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i in range(self.n):
                ns = self.ns(i)
                _ip("netns", "add", ns)
                self.namespaces.append(ns)
                _ip(
                    "-n",
                    self.hub,
                    "link",
                    "add",
                    self.veth(i),
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    ns,
                )
                _ip("-n", self.hub, "link", "set", self.veth(i), "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.destroy()
            raise

    def cut(self, i: int) -> None:
        """Partition node ``i``: its veth goes down at the bridge."""
        _ip("-n", self.hub, "link", "set", self.veth(i), "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.hub, "link", "set", self.veth(i), "up")

    def destroy(self) -> list[str]:
        """Delete every namespace made (their veths and the bridge go with them);
        returns the names still listed afterwards (empty when all went)."""
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        left = [ns for ns in self.namespaces if ns in listed.split()]
        self.namespaces = left
        return left


@dataclass
class Daemon:
    """One ``p2pnode run`` inside a namespace, and the CLI run beside it."""

    name: str
    ns: str
    address: str
    data_dir: Path
    proc: subprocess.Popen[bytes] | None = None

    def cli(self, *args: str) -> tuple[int, str]:
        """``p2pnode --data-dir D ARGS``, through the daemon's control socket: exit code
        and stdout (the command bounds its wait for the daemon itself)."""
        return cli_in_process("--data-dir", str(self.data_dir), *args)

    def json(self, *args: str) -> Any:
        """The JSON a CLI command printed, or None if it failed."""
        code, out = self.cli(*args)
        if code != 0:
            return None
        try:
            return json.loads(out)
        except ValueError:
            return None

    def start(self, bootstrap: str | None) -> None:
        """Start the daemon and wait for its ready line."""
        argv = [
            "ip",
            "netns",
            "exec",
            self.ns,
            sys.executable,
            "-m",
            "p2pnode",
            "run",
            "--data-dir",
            str(self.data_dir),
            "--listen",
            f"{self.address}:{PORT}",
        ]
        if bootstrap is not None:
            argv += ["--bootstrap", f"{bootstrap}:{PORT}"]
        log = (self.data_dir / "daemon.log").open("wb")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log)
        log.close()
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)
        buf = bytearray()

        def ready() -> bool | None:
            assert self.proc is not None and self.proc.stdout is not None
            chunk = self.proc.stdout.read()
            if chunk:
                buf.extend(chunk)
            if b'"ready"' in buf:
                return True
            if self.proc.poll() is not None:
                raise NetnsError(f"{self.name} exited ({self.proc.returncode}): {self.log_tail()}")
            return None

        poll(f"{self.name} ready", ready)

    def terminate(self) -> None:
        """SIGTERM, without waiting: daemons stopping together leave together."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 15 s; waits for the process either way."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        if proc.stdout is not None:
            proc.stdout.close()

    def log_tail(self) -> str:
        path = self.data_dir / "daemon.log"
        return path.read_text(errors="replace")[-800:] if path.exists() else ""


def cli_in_process(*argv: str) -> tuple[int, str]:
    """``p2pnode ARGV`` run in this process: its exit code and stdout (stderr is dropped,
    as the command's output was when it ran in a process of its own)."""
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(io.StringIO()):
        try:
            code = p2pnode_main(list(argv))
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else 1
    return code, out.getvalue()


def _init(daemon: Daemon) -> None:
    code, _ = cli_in_process("init", "--data-dir", str(daemon.data_dir), "--agent-id", daemon.name)
    if code != 0:
        raise NetnsError(f"p2pnode init {daemon.name}: exit {code}")
    card_path = daemon.data_dir / "card.json"
    card = json.loads(card_path.read_text())
    card["capabilities"].append({"id": f"cap.{daemon.name}", "name": f"{daemon.name}'s"})
    card_path.write_text(json.dumps(card, indent=2))


class Report:
    """Prints each step with the seconds since the start, and keeps the results."""

    def __init__(self, out: Callable[[str], None]) -> None:
        self.out = out
        self.t0 = time.monotonic()
        self.results: dict[str, Any] = {}

    def line(self, text: str) -> None:
        self.out(f"[{time.monotonic() - self.t0:6.1f}s] {text}")


def _finds(asker: Daemon, target: Daemon) -> bool:
    found = asker.json("find", f"cap.{target.name}", "--json")
    return bool(found) and any(
        c["id"] == target.name and any(target.address in a for a in c["addresses"]) for c in found
    )


def _doc(d: Daemon) -> dict[str, Any] | None:
    value = d.json("doc", "read", "plan")
    return value if isinstance(value, dict) else None


def _doc_value(d: Daemon) -> tuple[int, set[str]] | None:
    doc = _doc(d)
    if doc is None:
        return None
    value = doc.get("value", doc)
    hits = value.get("hits", 0)
    seen = value.get("seen", [])
    return (hits if isinstance(hits, int) else 0), set(seen if isinstance(seen, list) else [])


def scenario(topo: Topology, daemons: list[Daemon], extra: Daemon, report: Report) -> None:
    """Steps 2-5 of the module docstring on a created topology."""
    line, results = report.line, report.results
    first, *rest = daemons
    first.start(None)
    line(f"{first.name} ready at {first.address}:{PORT} in {first.ns}")
    for d in rest:
        d.start(first.address)
        line(f"{d.name} ready at {d.address}:{PORT} in {d.ns} (bootstrap {first.address})")

    # Discovery: each node finds the next-but-one by capability, through the DHT.
    for i, asker in enumerate(daemons):
        target = daemons[(i + 2) % len(daemons)]
        poll(f"{asker.name} finds cap.{target.name}", partial(_finds, asker, target))
        line(f"find      {asker.name} -> cap.{target.name} at {target.address}")
    results["discovery"] = len(daemons)

    # Requests across addresses: each node asks the next one's echo agent.
    for i, asker in enumerate(daemons):
        target = daemons[(i + 1) % len(daemons)]
        payload = json.dumps({"from": asker.name})

        def answered(a: Daemon = asker, t: Daemon = target, p: str = payload) -> Any:
            reply = a.json("send", t.name, "--payload", p)
            ok = reply and reply.get("sender") == t.name
            return reply if ok and reply["payload"]["echo"] == json.loads(p) else None

        reply = poll(f"{asker.name} -> {target.name} request", answered)
        line(f"send      {asker.name} -> {target.name}: {reply['type']} {reply['payload']}")
    results["requests"] = len(daemons)

    # A broadcast reaches every other node's agent.
    others = sorted(d.name for d in rest)
    sent = poll(
        "broadcast to every other node",
        lambda: (
            (r := first.json("send", "*", "--type", "notification", "--payload", "{}"))
            and sorted(r.get("targets", [])) == others
            and r
        ),
    )
    line(f"broadcast {first.name} -> {sorted(sent['targets'])}")
    results["broadcast"] = len(sent["targets"])

    # A shared document: every node adds 1 and its name; all converge.
    for d in daemons:
        poll(f"{d.name} subscribes", partial(_subscribed, d))
    for d in daemons:
        _update(d, {"op": "counter.add", "path": "hits", "amount": 1})
        _update(d, {"op": "set.add", "path": "seen", "element": d.name})
    names = {d.name for d in daemons}
    for d in daemons:
        poll(f"{d.name} converges", partial(_doc_is, d, (len(daemons), names)))
    line(f"doc       plan converged on {len(daemons)} nodes: hits={len(daemons)}")

    # Partition: the last node's link goes down at the bridge.
    cut = daemons[-1]
    topo.cut(len(daemons) - 1)
    veth = topo.veth(len(daemons) - 1)
    line(f"partition {cut.name} ({cut.address}): `ip -n {topo.hub} link set {veth} down`")
    _update(cut, {"op": "counter.add", "path": "hits", "amount": 10})
    _update(cut, {"op": "set.add", "path": "seen", "element": f"{cut.name}-while-cut"})
    _update(first, {"op": "counter.add", "path": "hits", "amount": 100})
    _update(first, {"op": "set.add", "path": "seen", "element": f"{first.name}-while-cut"})
    majority = daemons[:-1]
    for d in majority:
        poll(f"{d.name} has {first.name}'s update", partial(_has, d, f"{first.name}-while-cut"))
    leaked = [d.name for d in majority if _has(d, f"{cut.name}-while-cut")]
    if leaked:
        raise NetnsError(f"the cut node's update reached {leaked}: the link was not cut")
    # A newcomer joins the majority side: the cut node has never met it.
    extra.start(first.address)
    line(f"{extra.name} joins at {extra.address} while {cut.name} is cut off")
    poll(f"{extra.name} finds cap.{first.name}", lambda: _finds(extra, first))
    line(f"during    both sides updated plan; {cut.name}'s update reached nobody")
    # The cut node's DHT lookups fail (its contacts time out), as do requests to it.
    for _ in range(2):
        if _finds(cut, extra):
            raise NetnsError(f"{cut.name} found {extra.name} while cut off")
    status = cut.json("status", "--json") or {}
    line(
        f"during    {cut.name} finds no cap.{extra.name}; its DHT contacts: "
        f"{status.get('discovery', {}).get('contacts')}"
    )
    t = time.monotonic()
    code, _ = first.cli("send", cut.name, "--payload", "{}")
    if code == 0:
        raise NetnsError(f"{first.name} reached {cut.name} while it was cut off")
    line(
        f"during    {first.name} -> {cut.name} request fails (exit {code}, "
        f"{time.monotonic() - t:.1f} s)"
    )

    topo.heal(len(daemons) - 1)
    healed = time.monotonic()
    line(f"heal      {cut.name}'s link is up again")
    # DHT lookups across the healed link: the cut node and the newcomer never met.
    poll(f"{cut.name} finds cap.{extra.name} (DHT)", lambda: _finds(cut, extra), 120)
    line(
        f"find      {cut.name} -> cap.{extra.name} at {extra.address} "
        f"({time.monotonic() - healed:.1f} s after the heal)"
    )
    poll(f"{extra.name} finds cap.{cut.name} (DHT)", lambda: _finds(extra, cut), 120)
    line(f"find      {extra.name} -> cap.{cut.name} at {cut.address}")
    reply = poll(
        f"{first.name} -> {cut.name} request after the heal",
        lambda: (r := first.json("send", cut.name, "--payload", "{}")) and r,
        120,
    )
    line(f"send      {first.name} -> {cut.name}: {reply['type']} after the heal")
    want = (len(daemons) + 110, names | {f"{cut.name}-while-cut", f"{first.name}-while-cut"})
    for d in daemons:
        poll(f"{d.name} converges after the heal", partial(_doc_is, d, want), 120)
    line(
        f"doc       plan converged on {len(daemons)} nodes after the heal: hits={want[0]} "
        f"seen={sorted(want[1])} ({time.monotonic() - healed:.1f} s after the heal)"
    )
    results["healed_in"] = round(time.monotonic() - healed, 1)
    results["document"] = {"hits": want[0], "seen": sorted(want[1])}
    status = cut.json("status", "--json") or {}
    dht = status.get("discovery", {})
    line(
        f"status    {cut.name}: dht contacts {dht.get('contacts')} buckets {dht.get('buckets')} "
        f"peers {len(status.get('peers', []))}"
    )
    results["ok"] = True


def _subscribed(d: Daemon) -> bool:
    return d.cli("doc", "subscribe", "plan")[0] == 0


def _doc_is(d: Daemon, want: tuple[int, set[str]]) -> bool:
    return _doc_value(d) == want


def _update(d: Daemon, op: dict[str, Any]) -> None:
    # Once, not polled: a retry after an update that did apply would count it twice.
    code, out = d.cli("doc", "update", "plan", json.dumps(op))
    if code != 0:
        raise NetnsError(f"{d.name} doc update {op} failed ({code}): {out.strip()}")


def _has(d: Daemon, element: str) -> bool:
    value = _doc_value(d)
    return value is not None and element in value[1]


@contextmanager
def swarm(n: int, work: Path) -> Iterator[tuple[Topology, list[Daemon], Daemon]]:
    """``n`` namespaces with daemons (not started) and one spare namespace for a
    newcomer; everything is stopped and deleted on exit, whatever happens."""
    topo = Topology(n + 1)
    topo.create()
    daemons = [
        Daemon(f"node{i + 1}", topo.ns(i), topo.address(i), work / f"node{i + 1}")
        for i in range(n + 1)
    ]
    # The newcomer's namespace is the last, so the node cut off is daemons[n - 1].
    try:
        for d in daemons:
            _init(d)
        yield topo, daemons[:n], daemons[n]
    finally:
        for d in daemons:
            try:
                d.terminate()
            except Exception as exc:  # keep cleaning up
                print(f"stopping {d.name}: {exc}", file=sys.stderr)
        for d in daemons:
            try:
                d.stop()
            except Exception as exc:  # keep cleaning up
                print(f"stopping {d.name}: {exc}", file=sys.stderr)
        left = topo.destroy()
        if left:
            print(f"namespaces not deleted: {left}", file=sys.stderr)


def run(
    n: int = 5, *, out: Callable[[str], None] = print, keep: Path | None = None
) -> dict[str, Any]:
    """Run the whole scenario on ``n`` nodes (plus a newcomer); the results.

    Raises NetnsError naming the step that failed (daemon logs are printed first).
    """
    if n < 5:
        raise NetnsError("use at least 5 nodes")
    reason = unavailable()
    if reason is not None:
        raise NetnsError(reason)
    report = Report(out)
    work = Path(tempfile.mkdtemp(prefix="p2pnode-netns-")) if keep is None else keep
    try:
        with swarm(n, work) as (topo, daemons, extra):
            report.line(
                f"{len(topo.namespaces)} namespaces on bridge br0 in {topo.hub}, "
                f"subnet {topo.subnet}.0/24"
            )
            try:
                scenario(topo, daemons, extra, report)
            except BaseException:
                for d in [*daemons, extra]:
                    out(f"--- {d.name} log tail ---\n{d.log_tail()}")
                raise
        report.line("stopped every daemon and deleted every namespace")
    finally:
        if keep is None:
            shutil.rmtree(work, ignore_errors=True)
    return report.results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=5)
    ap.add_argument("--keep-logs", type=Path, default=None, help="data dirs and logs here")
    args = ap.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the namespaces are deleted either way.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        results = run(args.nodes, keep=args.keep_logs)
    except NetnsError as exc:
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
