"""The kernel's configuration: one validated, immutable object.

:class:`p2pnode.runtime.NodeConfig` (``p2pnode.NodeConfig``) extends it with the
services' settings; the kernel reads only the fields here.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.node.channels import RetryPolicy
from p2pnode.node.policy import PolicyConfig
from p2pnode.transport.channel import ChannelConfig
from p2pnode.transport.net import Address
from p2pnode.transport.relay import parse_relay_address

#: The longest deadline a call may have (a tool's own included): one day, in seconds.
MAX_DEADLINE = 86_400.0


def parse_address(text: str) -> Address:
    """``host:port`` or ``[v6]:port`` as an address. Raises LocalError(CONFIG_ERROR)."""
    host, sep, port_text = text.strip().rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise LocalError(ErrorCode.CONFIG_ERROR, f"not a host:port address: {text!r}")
    return (host.strip("[]"), int(port_text))


def format_address(address: Address) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


#: A DNS host name (RFC 1123 labels; ``_`` is tolerated, as resolvers do).
_HOST_NAME = re.compile(r"(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
                        r"(?:\.[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?")  # fmt: skip


def bootstrap_problem(address: Address) -> str | None:
    """Why ``address`` cannot be a bootstrap peer (None: it can): the host must be an
    IP literal or a host name, the port 1-65535 (docs/protocol/node.md "Joining")."""
    host, port = address[0], address[1]
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port <= 65535:
        return "the port must be 1-65535"
    if not isinstance(host, str) or not host:
        return "no host"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if _HOST_NAME.fullmatch(host) is None:
            return f"{host!r} is not a host name or an IP address"
    return None


def parse_bootstrap(text: str) -> Address:
    """A bootstrap address: ``host:port``, ``[v6]:port`` or ``name:port`` (a host name,
    resolved when joining). Raises LocalError(CONFIG_ERROR) naming ``text`` and why."""
    stripped = text.strip()
    scheme, sep, rest = stripped.partition("://")
    if sep:
        hint = f"; write HOST:PORT ({rest.split('/', 1)[0]})" if rest else ""
        raise _bootstrap_error(text, f"a URL ({scheme}://) is not a bootstrap address{hint}")
    host, sep, port_text = stripped.rpartition(":")
    if not sep or not host or "]" in port_text:
        raise _bootstrap_error(text, "no port; write HOST:PORT")
    if not port_text.isdigit():
        raise _bootstrap_error(text, "the port must be 1-65535")
    if host.startswith("[") != host.endswith("]"):
        raise _bootstrap_error(text, "unbalanced brackets around an IPv6 address")
    address = (host[1:-1] if host.startswith("[") else host, int(port_text))
    problem = bootstrap_problem(address)
    if problem is not None:
        raise _bootstrap_error(text, problem)
    return address


def _bootstrap_error(text: str, why: str) -> LocalError:
    return LocalError(ErrorCode.CONFIG_ERROR, f"bootstrap address {text!r}: {why}", address=text)


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Everything the kernel needs besides its network and identity.

    ``listen`` is the TCP address for secure channels; the DHT binds UDP on
    ``dht_listen`` (port 0 picks a free one). ``advertise`` replaces the
    listening host in the node's cards when it listens on a wildcard address.
    """

    data_dir: Path | None = None
    listen: Address = ("127.0.0.1", 0)
    dht_listen: Address = ("127.0.0.1", 0)
    advertise_host: str | None = None
    bootstrap: tuple[Address, ...] = ()
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    channel: ChannelConfig = field(default_factory=ChannelConfig)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    request_timeout: float = 10.0
    #: A card's lifetime: renewed at half of it, so a node that died without a word
    #: leaves every holder's ``find`` within it (docs/protocol/data-model.md "Lifetime").
    card_ttl_seconds: int = 600
    #: Seconds a stopping node spends telling peers and the DHT its agents left.
    leave_timeout: float = 2.0
    inbox_size: int = 256
    #: Request handlers of one local agent that may wait at once; past it a request waits
    #: in the inbox, and finding the inbox full it is refused BUSY (docs/protocol/node.md
    #: "Requests to an agent").
    agent_concurrency: int = 64
    #: Seconds a use of a tool, resource or prompt may run at its owner, unless the tool
    #: declares its own (``@agent.tool(deadline=...)``); other requests get
    #: ``request_timeout``. Then the handler is cancelled and answered TIMEOUT. (The
    #: tools service applies it; it is validated here with the kernel's deadlines.)
    tool_deadline: float = 30.0
    dedup_window: int = 65_536
    max_peers: int = 4096
    #: Connections still in the Noise handshake, in all and per source host (an IPv4
    #: address or IPv6 /64; loopback hosts only with ``limit_loopback``). The newest
    #: connection beyond either is closed at once (docs/SECURITY.md).
    max_handshakes: int = 256
    max_handshakes_per_host: int = 8
    limit_loopback: bool = False
    #: Addresses of a peer's HELLO kept for dialing it.
    hello_addresses: int = 4
    #: Failed connection attempts to one peer a minute (dials and redials, any address;
    #: an attempt that reaches the peer is not counted).
    dials_per_minute: int = 8
    #: Once a peer's dials_per_minute are spent, one probe attempt still passes per this
    #: many seconds without any attempt, so a peer that restarts is reached about this
    #: soon after its return (docs/protocol/node.md "Channels").
    dial_probe_interval: float = 1.0
    #: Envelopes one peer may send a second, and in a burst (None: no limit). The
    #: default admits what one link carries at full speed (pipelined send_many), so the
    #: cap bounds a flood's cost without throttling honest bulk traffic.
    envelope_rate: float | None = 100_000.0
    envelope_burst: int = 200_000
    #: Bytes of frames queued for one peer that it has not read yet (None: no limit).
    max_link_queue_bytes: int | None = 16 * 1024 * 1024
    #: Relays to keep a reservation on, as relayed addresses
    #: (``relay:<host>:<port>/<relay peer id>``, docs/protocol/relay.md): channels
    #: come in through them, and the node's cards list them as endpoints.
    relays: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        problems = []
        if self.request_timeout <= 0 or self.leave_timeout <= 0:
            problems.append("request_timeout and leave_timeout must be positive")
        if not 60 <= self.card_ttl_seconds <= 30 * 86400:
            problems.append("card_ttl_seconds must be from 60 to 2592000")
        if self.inbox_size < 1 or self.dedup_window < 1 or self.max_peers < 1:
            problems.append("inbox_size, dedup_window and max_peers must be positive")
        if self.agent_concurrency < 1:
            problems.append("agent_concurrency must be positive")
        if not 0 < self.dial_probe_interval <= 60:
            problems.append("dial_probe_interval must be more than 0 and at most 60")
        if not 0 < self.tool_deadline <= MAX_DEADLINE:
            problems.append(f"tool_deadline must be more than 0 and at most {MAX_DEADLINE:g}")
        problems.extend(
            f"relay {text!r}: not a relayed address (relay:<host>:<port>/<relay peer id>)"
            for text in self.relays
            if parse_relay_address(text) is None
        )
        for address in self.bootstrap:
            problem = bootstrap_problem(address)
            if problem is not None:
                problems.append(f"bootstrap address {address!r}: {problem}")
        if problems:
            raise LocalError(ErrorCode.CONFIG_ERROR, "; ".join(problems), problems=problems)
