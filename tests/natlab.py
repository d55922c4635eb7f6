"""A lab of real NATs: Linux network namespaces, nftables, and threads placed in them.

Topology (all addresses are test-net or private, all inside namespaces of the lab;
the root namespace is never changed)::

    inet namespace: bridge br0 (the "internet", 203.0.113.0/24)
      ├── public host i   namespace, eth0 203.0.113.(10+i)/24
      └── NAT router j    namespace, wan 203.0.113.(100+j)/24, lan 10.0.(j+1).1/24
                └── inner host j namespace, eth0 10.0.(j+1).2/24, default via the router

Public hosts have no route to the private networks: the only way in is through a
router's WAN address. Each router forwards (``net.ipv4.ip_forward=1`` in its namespace)
and holds one nftables table ``natlab`` for its :class:`NatKind`:

``FULL_CONE`` (endpoint-independent mapping, endpoint-independent filtering)::

    set mapped { type inet_proto . inet_service; flags dynamic,timeout; timeout 2m; }
    chain postrouting { type nat hook postrouting priority srcnat;
                        oifname "wan" masquerade }
    chain record { type filter hook postrouting priority srcnat + 10;
                   oifname "wan" meta l4proto { tcp, udp }
                   update @mapped { meta l4proto . th sport } }
    chain prerouting { type nat hook prerouting priority dstnat;
                       iifname "wan" meta l4proto . th dport @mapped dnat to INNER }
    chain forward { type filter hook forward priority filter; policy drop;
                    ct state established,related accept; iifname "lan" accept;
                    iifname "wan" ct status dnat accept }

  ``masquerade`` keeps the inner source port when the resulting tuple is free (one
  inner host: always), so every destination sees the same external port: the mapping
  is endpoint-independent. The ``record`` chain runs after source NAT and remembers each
  external (protocol, port) in use; a new inbound flow from ANY public host to such a
  port is DNATed back to the inner host (same port), which is endpoint-independent
  filtering. Ports never used outbound stay closed.

``PORT_RESTRICTED`` (endpoint-independent mapping, address-and-port-dependent
filtering): the same ``masquerade`` and ``forward`` chains, without ``mapped``,
``record`` or ``prerouting``. Conntrack lets in only replies of a flow the inner host
opened, i.e. from the exact public address and port it sent to.

``SYMMETRIC`` (endpoint-dependent mapping): ``oifname "wan" masquerade random`` and
the port-restricted ``forward`` chain. ``random`` never keeps the source port: each
new flow (each destination) gets its own external port, so two destinations see two
ports; filtering is conntrack's (address-and-port-dependent).

Everything the lab creates lives in its namespaces; :meth:`NatLab.destroy` deletes
them all (their veths, bridge and rulesets go with them), also when building fails.
Names carry the pid and a random tag, so parallel xdist workers never collide.

Code runs "inside" a namespace on a thread of its own (:func:`run_in`): the thread
calls ``setns(2)`` for its network namespace only, so sockets it creates (and a trio
loop it runs) belong to that namespace, while the rest of the process stays put.
"""

from __future__ import annotations

import ctypes
import enum
import os
import random
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import pytest

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
PUBLIC_NET = "203.0.113"


class LabError(Exception):
    """Building or using the lab failed; the message names the step."""


class NatKind(enum.Enum):
    """The NAT behaviours the lab builds (RFC 4787 terms)."""

    FULL_CONE = "full-cone"
    PORT_RESTRICTED = "port-restricted"
    SYMMETRIC = "symmetric"

    @property
    def endpoint_independent_mapping(self) -> bool:
        return self is not NatKind.SYMMETRIC

    @property
    def endpoint_independent_filtering(self) -> bool:
        return self is NatKind.FULL_CONE


def require_lab() -> None:
    """Skip the calling test, saying loudly why, when the lab cannot be built here
    (.ci/run installs iproute2 and nftables and runs as root, so on CI it is built)."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"NAT LAB NOT RUN: {reason}")


def unavailable() -> str | None:
    """Why the lab cannot be built here (a sentence for pytest.skip), or None."""
    if sys.platform != "linux":
        return "the NAT lab needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the NAT lab needs root (it creates namespaces and nftables rules)"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"the NAT lab needs `{tool}` ({package}), which is not installed"
    probe = f"nlprobe{os.getpid()}r{random.randrange(10**6)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        ruleset = "table ip t {\n chain c {\n type nat hook postrouting priority srcnat;\n }\n}\n"
        tried = subprocess.run(
            ["ip", "netns", "exec", probe, "nft", "-f", "-"],
            input=ruleset,
            capture_output=True,
            text=True,
        )
        if tried.returncode != 0:
            return f"nftables NAT does not work in a namespace: {tried.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(args: list[str], stdin: str | None = None) -> None:
    done = subprocess.run(args, input=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        raise LabError(f"{' '.join(args)}: {done.stderr.strip()}")


def ruleset(kind: NatKind, inner: str) -> str:
    """The nftables ruleset of a router of ``kind`` whose inner host is ``inner``."""
    masquerade = "masquerade random" if kind is NatKind.SYMMETRIC else "masquerade"
    cone = kind is NatKind.FULL_CONE
    chains: list[tuple[str, list[str]]] = []
    if cone:
        chains.append(("record", [
            "type filter hook postrouting priority srcnat + 10;",
            'oifname "wan" meta l4proto { tcp, udp } update @mapped { meta l4proto . th sport }',
        ]))  # fmt: skip
        chains.append(("prerouting", [
            "type nat hook prerouting priority dstnat;",
            f'iifname "wan" meta l4proto . th dport @mapped dnat to {inner}',
        ]))  # fmt: skip
    chains.append(("postrouting", [
        "type nat hook postrouting priority srcnat;", f'oifname "wan" {masquerade}'
    ]))  # fmt: skip
    forward = [
        "type filter hook forward priority filter; policy drop;",
        "ct state established,related accept",
        'iifname "lan" accept',
    ]
    if cone:
        forward.append('iifname "wan" ct status dnat accept')
    chains.append(("forward", forward))
    lines = ["table ip natlab {"]
    if cone:
        lines += [
            "  set mapped {",
            "    type inet_proto . inet_service; flags dynamic,timeout; timeout 2m;",
            "  }",
        ]
    for name, body in chains:
        lines += [f"  chain {name} {{", *(f"    {line}" for line in body), "  }"]
    return "\n".join([*lines, "}", ""])


@dataclass(frozen=True, slots=True)
class NatSite:
    """A NAT router and the one host behind it."""

    kind: NatKind
    router: str  # namespace
    inner: str  # namespace
    wan_ip: str  # the router's public address: what the world sees
    inner_ip: str  # the inner host's private address


@dataclass
class NatLab:
    """The namespaces of one lab; build with :func:`nat_lab`."""

    publics: int
    kinds: tuple[NatKind, ...]
    tag: str = field(default_factory=lambda: f"nl{os.getpid() % 100000}r{random.randrange(1000)}")
    namespaces: list[str] = field(default_factory=list)
    sites: dict[NatKind, NatSite] = field(default_factory=dict)

    @property
    def inet(self) -> str:
        return f"{self.tag}-inet"

    def public(self, i: int) -> str:
        """The namespace of public host ``i``."""
        return f"{self.tag}-p{i}"

    @staticmethod
    def public_ip(i: int) -> str:
        return f"{PUBLIC_NET}.{10 + i}"

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self.namespaces.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _wire(self, hub: str, hub_end: str, ns: str, ns_end: str, address: str) -> None:
        """A veth from ``hub`` (its end ``hub_end``) to ``ns`` (``ns_end`` = ``address``)."""
        veth = ["type", "veth", "peer", "name", ns_end, "netns", ns]
        _run(["ip", "-n", hub, "link", "add", hub_end, *veth])
        _run(["ip", "-n", ns, "addr", "add", address, "dev", ns_end])
        _run(["ip", "-n", ns, "link", "set", ns_end, "up"])

    def create(self) -> None:
        """Build it all; on any failure what was built is removed and LabError raised."""
        try:
            self._add_ns(self.inet)
            _run(["ip", "-n", self.inet, "link", "add", "br0", "type", "bridge"])
            _run(["ip", "-n", self.inet, "link", "set", "br0", "up"])
            for i in range(self.publics):
                self._add_ns(self.public(i))
                self._wire(self.inet, f"p{i}", self.public(i), "eth0", f"{self.public_ip(i)}/24")
                _run(["ip", "-n", self.inet, "link", "set", f"p{i}", "master", "br0", "up"])
            for j, kind in enumerate(self.kinds):
                self._add_site(j, kind)
        except BaseException:
            self.destroy()
            raise

    def _add_site(self, j: int, kind: NatKind) -> None:
        router, inner = f"{self.tag}-r{j}", f"{self.tag}-h{j}"
        wan_ip, lan = f"{PUBLIC_NET}.{100 + j}", f"10.0.{j + 1}"
        self._add_ns(router)
        self._add_ns(inner)
        self._wire(self.inet, f"r{j}", router, "wan", f"{wan_ip}/24")
        _run(["ip", "-n", self.inet, "link", "set", f"r{j}", "master", "br0", "up"])
        self._wire(router, "lan", inner, "eth0", f"{lan}.2/24")
        _run(["ip", "-n", router, "addr", "add", f"{lan}.1/24", "dev", "lan"])
        _run(["ip", "-n", router, "link", "set", "lan", "up"])
        _run(["ip", "-n", inner, "route", "add", "default", "via", f"{lan}.1"])
        _run(["ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        _run(["ip", "netns", "exec", router, "nft", "-f", "-"], ruleset(kind, f"{lan}.2"))
        self.sites[kind] = NatSite(kind, router, inner, wan_ip, f"{lan}.2")

    def destroy(self) -> list[str]:
        """Delete every namespace made; returns the names still listed (empty when all went)."""
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        names = {line.split()[0] for line in listed.splitlines() if line.strip()}
        self.namespaces = [ns for ns in self.namespaces if ns in names]
        return self.namespaces


#: Drops new TCP connections to the router's own WAN address instead of answering RST.
QUIET_WAN = """table ip natlab_quiet {
  chain input {
    type filter hook input priority filter; policy accept;
    iifname "wan" meta l4proto tcp ct state new,invalid drop
  }
}
"""


def quiet_wan(site: NatSite) -> None:
    """Make ``site``'s router drop unsolicited inbound TCP SYNs silently, as RFC 5382
    REQ-4 asks of a NAT ("MUST NOT respond to an unsolicited inbound SYN for at least 6
    seconds"), so a TCP simultaneous open survives one side's SYN arriving first. As
    built, a router is a Linux host with no socket on that port: it answers RST, and
    the RST closes the other side's fresh mapping on its way back."""
    _run(["ip", "netns", "exec", site.router, "nft", "-f", "-"], QUIET_WAN)


@contextmanager
def nat_lab(publics: int = 3, kinds: tuple[NatKind, ...] = tuple(NatKind)) -> Iterator[NatLab]:
    """A lab with ``publics`` public hosts and one NAT site per kind, removed on exit."""
    lab = NatLab(publics, kinds)
    lab.create()
    try:
        yield lab
    finally:
        left = lab.destroy()
        if left:
            raise LabError(f"namespaces left behind: {left}")


def _setns(ns: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise LabError(f"setns({ns}): {os.strerror(err)}")
    finally:
        os.close(fd)


def run_in(ns: str, fn: Callable[[], T], *, timeout: float = 60.0) -> T:
    """``fn()`` on a new thread inside namespace ``ns``; its result, or what it raised.
    Raises LabError when it does not finish within ``timeout`` seconds."""
    box: dict[str, object] = {}

    def body() -> None:
        try:
            _setns(ns)
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=body, name=f"netns {ns}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise LabError(f"not within {timeout:g} s: a call in namespace {ns}")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def start_in(ns: str, fn: Callable[[], object]) -> threading.Thread:
    """Run ``fn()`` on a thread inside ``ns`` in the background (the caller joins it)."""

    def body() -> None:
        _setns(ns)
        fn()

    thread = threading.Thread(target=body, name=f"netns {ns}", daemon=True)
    thread.start()
    return thread


__all__ = [
    "PUBLIC_NET",
    "LabError",
    "NatKind",
    "NatLab",
    "NatSite",
    "nat_lab",
    "quiet_wan",
    "require_lab",
    "ruleset",
    "run_in",
    "start_in",
    "unavailable",
]
