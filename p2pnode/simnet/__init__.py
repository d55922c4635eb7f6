"""An in-memory network for simulating thousands of nodes in one process.

:mod:`p2pnode.simnet.network` holds the network, its hosts and datagrams (the
theory of operation is there); :mod:`p2pnode.simnet.streams` its TCP-like
streams; :mod:`p2pnode.simnet.nat` NATs of the three kinds in front of hosts.

May import: core, transport.
"""

from p2pnode.simnet.nat import Nat, NatKind, NatNetwork
from p2pnode.simnet.network import LinkConditions, SimHost, SimNetwork

__all__ = ["LinkConditions", "Nat", "NatKind", "NatNetwork", "SimHost", "SimNetwork"]
