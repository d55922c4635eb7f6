"""The NAT lab (tests/natlab.py) behaves as each kind claims, seen with plain sockets.

Mapping: the inner host sends from one port to two public observers, which report the
source they saw (same external port: endpoint-independent; two ports: symmetric).
Filtering: a third public host, never contacted, sends to that external port (it
reaches the inner host behind a full cone only); the observer the inner host did talk
to always gets through (so a "no" is the filter, not a broken lab)."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator

import pytest

from tests.natlab import LabError, NatKind, NatLab, nat_lab, require_lab, run_in

pytestmark = pytest.mark.slow

WAIT = 0.5  # seconds a packet that should arrive gets (same host, veths: it takes < 1 ms)
OBSERVED = 9000


@pytest.fixture(scope="module")
def lab() -> Iterator[NatLab]:
    require_lab()
    with nat_lab(publics=3) as built:
        yield built


def _sock(ns: str, kind: int, port: int = 0, *, reuse: bool = False) -> socket.socket:
    """A socket created inside ``ns``, bound to ``port`` on every address there."""

    def make() -> socket.socket:
        s = socket.socket(socket.AF_INET, kind)
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("0.0.0.0", port))
        s.settimeout(WAIT)
        return s

    return run_in(ns, make)


def _received(sock: socket.socket) -> tuple[bytes, tuple[str, int]] | None:
    try:
        data, source = sock.recvfrom(100)
    except TimeoutError:
        return None
    return data, source


def _udp(lab: NatLab, kind: NatKind) -> tuple[list[tuple[str, int]], bool, bool]:
    """The source each of two observers saw, whether observer 0 could answer from the
    port it was sent to, and whether the never-contacted host 2 got in."""
    site = lab.sites[kind]
    observers = [_sock(lab.public(i), socket.SOCK_DGRAM, OBSERVED) for i in range(3)]
    inner = _sock(site.inner, socket.SOCK_DGRAM)
    try:
        seen = []
        for i in (0, 1):
            inner.sendto(b"hello", (lab.public_ip(i), OBSERVED))
            got = _received(observers[i])
            assert got is not None, f"observer {i} heard nothing from the {kind.value} host"
            seen.append(got[1])
        observers[0].sendto(b"reply", seen[0])
        replied = _received(inner) == (b"reply", (lab.public_ip(0), OBSERVED))
        observers[2].sendto(b"unsolicited", seen[0])
        stranger = _received(inner) is not None
        return seen, replied, stranger
    finally:
        for s in (*observers, inner):
            s.close()


@pytest.mark.parametrize("kind", list(NatKind), ids=lambda k: k.value)
def test_udp_mapping_and_filtering_are_what_the_kind_claims(lab: NatLab, kind: NatKind) -> None:
    seen, replied, stranger = _udp(lab, kind)
    wan = lab.sites[kind].wan_ip
    assert [ip for ip, _ in seen] == [wan, wan]  # the private address never shows
    assert (seen[0][1] == seen[1][1]) is kind.endpoint_independent_mapping, seen
    assert replied  # the flow's own peer always gets back in
    assert stranger is kind.endpoint_independent_filtering


def test_a_port_restricted_nat_drops_the_observer_from_another_port(lab: NatLab) -> None:
    site = lab.sites[NatKind.PORT_RESTRICTED]
    observer = _sock(lab.public(0), socket.SOCK_DGRAM, OBSERVED)
    other_port = _sock(lab.public(0), socket.SOCK_DGRAM, OBSERVED + 1)
    inner = _sock(site.inner, socket.SOCK_DGRAM)
    try:
        inner.sendto(b"hello", (lab.public_ip(0), OBSERVED))
        got = _received(observer)
        assert got is not None
        other_port.sendto(b"same host, other port", got[1])
        assert _received(inner) is None
        observer.sendto(b"the flow's port", got[1])
        assert _received(inner) is not None
    finally:
        for s in (observer, other_port, inner):
            s.close()


def _tcp(lab: NatLab, kind: NatKind) -> tuple[list[tuple[str, int]], bool]:
    """Two connections from one inner port (SO_REUSEPORT) to two observers: the source
    each saw; then whether host 2 can connect to the first mapped address."""
    site = lab.sites[kind]
    listeners = [_sock(lab.public(i), socket.SOCK_STREAM, OBSERVED) for i in range(2)]
    for s in listeners:
        s.listen(4)
    inner_listener = _sock(site.inner, socket.SOCK_STREAM, reuse=True)
    port = inner_listener.getsockname()[1]
    inner_listener.listen(4)
    opened: list[socket.socket] = []
    try:
        seen = []
        for i in (0, 1):
            out = _sock(site.inner, socket.SOCK_STREAM, port, reuse=True)
            opened.append(out)
            out.connect((lab.public_ip(i), OBSERVED))
            accepted, source = listeners[i].accept()
            opened.append(accepted)
            seen.append(source)
        stranger = _sock(lab.public(2), socket.SOCK_STREAM)
        opened.append(stranger)
        try:
            stranger.connect(seen[0])
            inner_listener.accept()[0].close()
            got_in = True
        except (TimeoutError, ConnectionRefusedError):
            got_in = False
        return seen, got_in
    finally:
        for s in (*opened, *listeners, inner_listener):
            s.close()


@pytest.mark.parametrize("kind", list(NatKind), ids=lambda k: k.value)
def test_tcp_mapping_and_filtering_are_what_the_kind_claims(lab: NatLab, kind: NatKind) -> None:
    seen, got_in = _tcp(lab, kind)
    wan = lab.sites[kind].wan_ip
    assert [ip for ip, _ in seen] == [wan, wan]
    assert (seen[0][1] == seen[1][1]) is kind.endpoint_independent_mapping, seen
    assert got_in is kind.endpoint_independent_filtering


def test_a_public_host_cannot_reach_a_private_address(lab: NatLab) -> None:
    site = lab.sites[NatKind.FULL_CONE]
    probe = _sock(lab.public(0), socket.SOCK_DGRAM)
    try:
        with pytest.raises(OSError, match="unreachable"):
            probe.sendto(b"x", (site.inner_ip, OBSERVED))
    finally:
        probe.close()


def _listed() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def test_every_namespace_goes_on_exit_and_on_failure() -> None:
    require_lab()
    made: list[str] = []
    with pytest.raises(LabError, match="a step failed"), nat_lab(publics=1) as lab:  # noqa: PT012
        made = list(lab.namespaces)
        assert set(made) <= _listed()
        raise LabError("a step failed")
    assert len(made) == 1 + 1 + 2 * len(NatKind)
    assert not set(made) & _listed()
