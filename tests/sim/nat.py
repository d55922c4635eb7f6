"""A simulated network whose hosts are public unless the next one is asked to be behind
a NAT of a given kind (p2pnode.simnet.nat)."""

from __future__ import annotations

from p2pnode.simnet import NatKind, NatNetwork, SimHost


class LastBehindNat(NatNetwork):
    """Hosts are public, except the next one added after :attr:`next_kind` is set."""

    next_kind: NatKind | None = None

    def add_host(self, host: str | None = None) -> SimHost:
        kind, self.next_kind = self.next_kind, None
        if kind is not None and host is None:
            return self.add_nat_host(kind)
        return super().add_host(host)
