"""The node's links to other peers: dialing, accepting, one PeerLink per peer.

:class:`LinkManager` owns every :class:`~p2pnode.node.channels.PeerLink` of a
node, the addresses and Noise static keys it knows for each peer, the
secure-channel listener loop, and dialing (IK when the peer's card gave its
static key, XX otherwise). Every new channel, dialed or accepted, starts with
this node's HELLO. Frames read on any link go to the node's frame handler.

Limits against floods (node/limits.py; defaults in KernelConfig, docs/SECURITY.md):

* An accepted connection takes a handshake slot (``max_handshakes`` in all,
  ``max_handshakes_per_host`` per source host) until its handshake ends.
  With no slot free the newest connection is closed at once, unread; the
  refusals are counted and reported once a minute per host.
* A peer's HELLO addresses are kept for dialing it only up to
  ``hello_addresses``, and every dial attempt to a peer (any address, any
  redial) that does not reach it spends its ``dials_per_minute`` budget. So a peer that announces
  16 addresses and hangs up costs a handful of connection attempts a minute,
  not one per address per redial; once they are spent, one probe per
  ``dial_probe_interval`` still goes to the first address that comes up (a
  link's redials span longer than that, so each round of them holds a
  probe). A peer that shows it is back (:meth:`LinkManager.peer_returned`:
  an inbound channel from it, its HELLO, a fresh card of it) has its budget
  reset and its link's backoff cut short. Addresses (and Noise static keys from
  cards) are kept for at most ``max_peers`` peers, those without a link
  forgotten first, and dropped with a peer's closed link: peers that come and
  go with fresh identities leave nothing behind.
* Each link gets the envelope rate limit and the queue bound of
  :class:`~p2pnode.node.channels.LinkLimits`; drops are reported once a minute
  per peer.

Presence and quiet logs: a link that was open and closes because its redials
failed is a *departure*: one INFO line ("peer X left: why, N agents
unreachable"), the registry told, and ``on_departed(peer, why)`` called (the
routing driver fails the requests pending on that peer). Channel states go to
DEBUG; failed dials to a peer with no link redialing are summarised, one line
per peer per minute with a count (:class:`~p2pnode.node.limits.FailureSummary`).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import trio

from p2pnode.core.errors import ErrorCode, LocalError, P2PError, RemoteError
from p2pnode.core.identity import PeerId
from p2pnode.core.lifetime import TaskOwner
from p2pnode.core.registry import Registry
from p2pnode.node.channels import (
    ChannelState,
    FrameHandler,
    LinkLimits,
    PeerLink,
    close_quietly,
    describe_loss,
    tick_on_grid,
    watch_interval,
)
from p2pnode.node.config import KernelConfig, parse_address
from p2pnode.node.limits import DialBudget, FailureSummary, HandshakeSlots, ReportGate
from p2pnode.node.observability import Observability
from p2pnode.transport.channel import SecureChannel, accept_secure, connect_secure
from p2pnode.transport.net import Address, Network, StreamListener
from p2pnode.transport.relay import RelayAddress, parse_relay_address
from p2pnode.transport.relayserve import RelayListener, connect_via_relay
from p2pnode.transport.secure import SecureIdentity

logger = logging.getLogger("p2pnode.node")

#: accept() failures that mean "no room right now", not "the listener is broken"
#: (the set trio's serve_listeners pauses on).
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
ACCEPT_PAUSE = 0.1
ACCEPT_PAUSE_MAX = 1.0

#: Told that a peer left (its link closed after failed redials), and why.
DepartureListener = Callable[[PeerId, str], object]


class LinkManager(TaskOwner):
    """Links by peer id (see the module docstring). Use ``async with``: every link's
    tasks and the accept loop run in the manager's nursery."""

    def __init__(
        self,
        secure_identity: SecureIdentity,
        network: Network,
        config: KernelConfig,
        registry: Registry,
        events: Observability,
        on_frame: FrameHandler,
        hello: Callable[[], bytes],
        on_departed: DepartureListener | None = None,
    ) -> None:
        self._secure = secure_identity
        self._network = network
        self._config = config
        self._registry = registry
        self._events = events
        self._on_frame = on_frame
        self._hello = hello
        self._on_departed = on_departed
        # Links enforce the idle timeout themselves (a watchdog, not a cancel scope per read).
        self._channel_config = dataclasses.replace(config.channel, idle_timeout=None)
        self._links: dict[PeerId, PeerLink] = {}
        self._addresses: dict[PeerId, list[Address]] = {}
        self._static: dict[PeerId, bytes] = {}
        self._closing = False
        self.handshakes = HandshakeSlots(
            config.max_handshakes,
            config.max_handshakes_per_host,
            limit_loopback=config.limit_loopback,
        )
        self.dials = DialBudget(
            config.dials_per_minute,
            60.0,
            probe_interval=config.dial_probe_interval,
            max_peers=config.max_peers,
        )
        self._dial_failures = FailureSummary(max_sources=config.max_peers)
        self._limits = LinkLimits(
            envelope_rate=config.envelope_rate,
            envelope_burst=config.envelope_burst,
            max_queue_bytes=config.max_link_queue_bytes,
        )
        self._reports = ReportGate()
        #: Envelopes dropped by the per-peer rate limit, in all.
        self.envelopes_dropped = 0
        #: The listeners of ``config.relays`` (their reservations), once serving, and of
        #: the relays started at run time (:meth:`start_relay`).
        self.relay_listeners: list[RelayListener] = []
        #: Relays started at run time, and the scopes that stop them.
        self._run_time_relays: dict[RelayAddress, tuple[RelayListener, trio.CancelScope]] = {}
        self._open_watchers: list[Callable[[PeerLink], object]] = []

    @property
    def local_peer_id(self) -> PeerId:
        return self._secure.peer_id

    def get(self, peer_id: PeerId) -> PeerLink | None:
        """The current link to ``peer_id``, if any."""
        return self._links.get(peer_id)

    def __iter__(self) -> Iterator[PeerLink]:
        return iter(list(self._links.values()))

    def link(self, peer_id: PeerId) -> PeerLink:
        """The link to ``peer_id``, made (not yet connected) when there is none open."""
        link = self._links.get(peer_id)
        if link is None or link.state is ChannelState.CLOSED:
            if self._closing:
                raise LocalError(ErrorCode.CHANNEL_CLOSED, "the node is closing")
            if len(self._links) >= self._config.max_peers:
                self._drop_closed()
            link = PeerLink(
                self.local_peer_id,
                peer_id,
                self.nursery,
                lambda: self._dial(peer_id),
                self._on_frame,
                self._on_state,
                self._config.retry,
                self._config.channel.idle_timeout,
                self._limits,
                self._on_drop,
                own_watchdog=False,  # _watch_links watches them all
            )
            self._links[peer_id] = link
        return link

    def learn_addresses(self, peer_id: PeerId, addresses: list[Address]) -> None:
        """Addresses a peer announced for itself (in its HELLO, which shows it is back)."""
        self.peer_returned(peer_id)
        if addresses:
            self._remember(peer_id, addresses)

    def peer_returned(self, peer_id: PeerId) -> None:
        """``peer_id`` showed it is (back) up: its dial budget is reset, and a link
        waiting out a redial backoff dials at once."""
        self.dials.reset(peer_id.raw)
        link = self._links.get(peer_id)
        if link is not None and link.state in (ChannelState.CONNECTING, ChannelState.RECONNECTING):
            link.redial_now()

    def peer_leaving(self, peer_id: PeerId) -> None:
        """``peer_id`` withdrew all its agents (it is stopping): when its channel closes,
        the link closes too, without redials or a "left" line (the withdrawal said it)."""
        link = self._links.get(peer_id)
        if link is not None:
            link.departing = True

    def watch_open(self, watcher: Callable[[PeerLink], object]) -> None:
        """Call ``watcher(link)`` each time a link opens, and when an open link takes an
        accepted or hole-punched channel in place of its current one (the hole punch
        watches relayed links open and turn direct); it must not block."""
        self._open_watchers.append(watcher)

    def _adopt(self, peer_id: PeerId, channel: SecureChannel, dialer: PeerId) -> None:
        link = self.link(peer_id)
        was_open = link.state is ChannelState.OPEN
        if link.adopt(channel, dialer) and was_open:
            for watcher in self._open_watchers:
                watcher(link)

    async def adopt_punched(
        self, stream: trio.abc.Stream, peer_id: PeerId, *, initiator: bool
    ) -> None:
        """Run the secure handshake on a hole-punched connection to ``peer_id`` (as the
        Noise initiator or responder, docs/protocol/holepunch.md) and give the channel
        to its link, where a direct channel replaces a relayed one.
        Raises what the handshake raises (RemoteError, OSError, trio.BrokenResourceError)."""
        if initiator:
            channel = await connect_secure(
                stream,
                self._secure,
                expected_peer_id=peer_id,
                remote_static=self._static.get(peer_id),
                config=self._channel_config,
            )
        else:
            channel = await accept_secure(stream, self._secure, config=self._channel_config)
            if channel.remote_peer_id != peer_id:
                await close_quietly(channel)
                raise RemoteError(ErrorCode.PEER_ID_MISMATCH, "punched through to another peer")
        await channel.send_message(self._hello())
        self._adopt(peer_id, channel, self.local_peer_id if initiator else peer_id)

    def _remember(self, peer_id: PeerId, addresses: list[Address]) -> None:
        """Keep ``addresses`` (first first, no repeats) for ``peer_id``: at most
        ``hello_addresses`` of them, for at most ``max_peers`` peers (those with no
        link are forgotten first, then the least recently told)."""
        kept = list(dict.fromkeys(addresses))[: self._config.hello_addresses]
        self._addresses.pop(peer_id, None)
        self._addresses[peer_id] = kept
        _bound(self._addresses, self._config.max_peers, self._links)

    def _on_state(self, link: PeerLink, state: ChannelState) -> None:
        logger.debug("channel to %s: %s", link.peer_id, state.value)
        # The registry's liveness of the peer's agent-id claims (registry.py, "Agent
        # ids and owners"): a link closes for good only once its redials failed.
        if state is ChannelState.OPEN:
            self._registry.note_reachable(link.peer_id)
            for watcher in self._open_watchers:
                watcher(link)
        elif state is ChannelState.CLOSED and not self._closing:
            self._registry.note_unreachable(link.peer_id)
            if link.departing:  # it said it is stopping: its withdrawal was the line
                self._tell_departed(link.peer_id, f"peer {link.peer_id} left: it stopped")
            elif link.gave_up and link.loss is not None:
                self._departed(link)

    def _departed(self, link: PeerLink) -> None:
        """The one line a neighbour logs when a peer leaves, and the routing driver told."""
        peer = link.peer_id
        self._dial_failures.hold(str(peer), trio.current_time())  # this line says it
        error = link.last_dial_error
        redials = f"redials failed ({error})" if error else "no redial succeeded"
        why = f"{link.loss}; {redials}"
        agents = self._registry.cards_of(peer)
        logger.info("peer %s left: %s; %d agents unreachable", peer, why, agents)
        self._tell_departed(peer, f"peer {peer} left: {why}")

    def _tell_departed(self, peer: PeerId, why: str) -> None:
        if self._on_departed is not None:
            self._on_departed(peer, why)

    def _on_drop(self, link: PeerLink, envelopes: int) -> None:
        self.envelopes_dropped += envelopes
        if self._reports.due(f"rate {link.peer_id}", trio.current_time()):
            self._events.security(
                ErrorCode.BUSY,
                f"over its envelope rate ({self._config.envelope_rate:g}/s): "
                f"{link.envelopes_dropped} envelopes dropped from this peer so far",
                str(link.peer_id),
                None,
            )

    async def close_all(self) -> None:
        """Close every link; from now on no link is made and accepted channels are closed."""
        self._closing = True
        for link in list(self._links.values()):
            await link.aclose()

    async def _start(self, nursery: trio.Nursery) -> None:
        nursery.start_soon(self._watch_links)

    async def _stop(self) -> None:
        await self.close_all()

    async def _watch_links(self) -> None:
        """Every link's watchdog check (PeerLink.watch), from one task for them all: a
        node wakes once per watch interval, however many links it holds."""
        interval = watch_interval(self._config.retry, self._config.channel.idle_timeout)

        def watch_all(now: float) -> None:
            for link in list(self._links.values()):
                link.watch(now)

        await tick_on_grid(self._network.move_on_at, interval, watch_all)

    def _drop_closed(self) -> None:
        for peer_id in [p for p, link in self._links.items() if link.state is ChannelState.CLOSED]:
            del self._links[peer_id]
            self._addresses.pop(peer_id, None)
            self._static.pop(peer_id, None)

    def _addresses_of(self, peer_id: PeerId) -> list[Address | RelayAddress]:
        """Where to dial ``peer_id``: its direct addresses, then the relays its cards
        name as endpoints (docs/protocol/relay.md; other endpoint forms are skipped)."""
        addresses: list[Address | RelayAddress] = list(self._addresses.get(peer_id, []))
        relayed: list[RelayAddress] = []
        for card in self._registry.owned_by(peer_id):  # rival claims too
            for text in card.addresses:
                address = parse_address(text)
                if address not in addresses:
                    addresses.append(address)
            for endpoint in card.endpoints:
                relay = parse_relay_address(endpoint.address)
                if relay is not None and relay not in relayed:
                    relayed.append(relay)
            if card.noise_static_key is not None and peer_id not in self._static:
                self._static[peer_id] = card.noise_static_key
                _bound(self._static, self._config.max_peers, self._links)
        return addresses + relayed

    async def _dial(self, peer_id: PeerId) -> SecureChannel:
        """One attempt per known address of ``peer_id`` while its budget allows.
        Raises LocalError(CHANNEL_CLOSED) saying why none reached it."""
        last: str | None = None
        addresses = self._addresses_of(peer_id)
        direct_limit = self._direct_limit(addresses)
        await self._wait_for_probe(peer_id)
        for address in addresses:
            now = trio.current_time()
            if not self.dials.allow(peer_id.raw, now):
                wait = self.dials.next_allowed(peer_id.raw, now) - now
                raise LocalError(
                    ErrorCode.CHANNEL_CLOSED,
                    f"cannot reach {peer_id}: its {self._config.dials_per_minute} connection "
                    f"attempts a minute are spent, next in {wait:.1f} s"
                    + (f" (last: {last})" if last else ""),
                )
            limit = math.inf if isinstance(address, RelayAddress) else direct_limit
            try:
                with trio.fail_after(limit):
                    channel = await self._dial_address(address, peer_id)
            except (P2PError, OSError, trio.BrokenResourceError, trio.TooSlowError) as exc:
                last = describe_loss(exc)
                self._dial_failed(peer_id, last)
            else:
                self.dials.refund(peer_id.raw)  # it was the peer's own address
                return channel
        why = last if last is not None else "no address known"
        raise LocalError(ErrorCode.CHANNEL_CLOSED, f"cannot reach {peer_id}: {why}")

    def _direct_limit(self, addresses: list[Address | RelayAddress]) -> float:
        """Seconds each direct address may take when relayed ones follow: together half
        the dial timeout, so a NAT that drops connection attempts leaves the relay time
        within the same dial (docs/protocol/relay.md). Unbounded otherwise."""
        direct = sum(not isinstance(a, RelayAddress) for a in addresses)
        if direct == len(addresses) or not direct:
            return math.inf
        return self._config.retry.dial_timeout / (2 * direct)

    async def _wait_for_probe(self, peer_id: PeerId) -> None:
        """A new link to a peer whose budget is spent waits for its next probe (at most
        ``dial_probe_interval``) instead of failing at once: what was sent to a peer
        that just came back reaches it within that, not a round of backoffs later."""
        link = self._links.get(peer_id)
        if link is None or link.state is not ChannelState.CONNECTING or link.dial_round != 1:
            return  # only a new link's first dial: later ones back off by themselves
        now = trio.current_time()
        wait = self.dials.next_allowed(peer_id.raw, now) - now
        if 0 < wait <= self._config.dial_probe_interval:
            await trio.sleep(wait)

    def _dial_failed(self, peer_id: PeerId, why: str) -> None:
        """Count a failed attempt; summarised once a minute per peer, except while a
        link that was open redials (its departure line says how that ended)."""
        link = self._links.get(peer_id)
        if link is not None and link.state is ChannelState.RECONNECTING:
            return
        count = self._dial_failures.note(str(peer_id), trio.current_time())
        if count == 1:
            logger.info("cannot reach %s: %s", peer_id, why)
        elif count:
            logger.info(
                "cannot reach %s: %d connection attempts failed in the last minute (last: %s)",
                peer_id,
                count,
                why,
            )

    async def _dial_address(
        self, address: Address | RelayAddress, peer_id: PeerId | None
    ) -> SecureChannel:
        if isinstance(address, RelayAddress):
            if peer_id is None:
                raise LocalError(ErrorCode.INVALID_ARGUMENT, "a relay is dialed for a known peer")
            stream: trio.abc.Stream = await connect_via_relay(self._network, address, peer_id)
        else:
            stream = await self._network.connect_stream(address)
        channel = await connect_secure(
            stream,
            self._secure,
            expected_peer_id=peer_id,
            remote_static=self._static.get(peer_id) if peer_id else None,
            config=self._channel_config,
        )
        await channel.send_message(self._hello())
        return channel

    async def connect(self, address: Address) -> PeerId:
        """Open a channel to the node at ``address``; returns its proven peer id."""
        channel = await self._dial_address(address, None)
        peer_id = channel.remote_peer_id
        self._remember(peer_id, [address, *self._addresses.get(peer_id, ())])
        self.link(peer_id).adopt(channel, self.local_peer_id)
        return peer_id

    async def accept_loop(
        self,
        listener: StreamListener,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept secure channels until cancelled; closes the listener on the way out.
        Channels through each relay of ``config.relays`` are accepted as well, by a loop
        of their own (:meth:`serve_relays`).

        Handshakes run in this loop's own nursery. When the process is out of file
        descriptors or buffers, accepting pauses (doubling from ACCEPT_PAUSE up to
        ACCEPT_PAUSE_MAX) and resumes by itself; each pause is reported once.
        """
        task_status.started()
        pause = ACCEPT_PAUSE
        try:
            async with trio.open_nursery() as nursery:
                if self._config.relays and not isinstance(listener, RelayListener):
                    nursery.start_soon(self.serve_relays)
                while True:
                    try:
                        stream = await listener.accept()
                    except OSError as exc:
                        if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                            raise
                        self._events.error(
                            ErrorCode.BUSY,
                            f"accepting paused for {pause:g} s: {os.strerror(exc.errno)}",
                        )
                        await trio.sleep(pause)
                        pause = min(pause * 2, ACCEPT_PAUSE_MAX)
                        continue
                    pause = ACCEPT_PAUSE
                    host = remote_host(stream)
                    if not self.handshakes.acquire(host):
                        await trio.aclose_forcefully(stream)
                        self._refused(host)
                        continue
                    nursery.start_soon(self._accept_one, stream, host)
        finally:
            with trio.CancelScope(shield=True):
                await listener.aclose()

    async def serve_relays(self) -> None:
        """Keep a reservation on each relay of ``config.relays`` and accept the channels
        that come through it, until cancelled (a lost reservation is made again)."""
        async with trio.open_nursery() as nursery:
            for text in self._config.relays:
                relay = parse_relay_address(text)
                if relay is None:  # KernelConfig validated them
                    continue
                listener = RelayListener(self._network, relay, self._secure.identity)
                self.relay_listeners.append(listener)
                nursery.start_soon(listener.keep)
                nursery.start_soon(self.accept_loop, listener)

    def start_relay(self, relay: RelayAddress) -> RelayListener:
        """Keep a reservation on ``relay`` and accept the channels through it, from now
        until :meth:`stop_relay` (the relays a node picks by itself, reachability.md §7);
        the listener at once (its ``reservation`` says when one is held)."""
        running = self._run_time_relays.get(relay)
        if running is not None:
            return running[0]
        listener = RelayListener(self._network, relay, self._secure.identity)
        scope = trio.CancelScope()
        self._run_time_relays[relay] = (listener, scope)
        self.relay_listeners.append(listener)
        self.nursery.start_soon(self._serve_relay, listener, scope)
        return listener

    def stop_relay(self, relay: RelayAddress) -> None:
        """End what :meth:`start_relay` started (channels already open stay)."""
        running = self._run_time_relays.pop(relay, None)
        if running is not None:
            running[1].cancel()
            if running[0] in self.relay_listeners:
                self.relay_listeners.remove(running[0])

    def started_at_run_time(self, listener: RelayListener) -> bool:
        """Whether ``listener`` is a relay :meth:`start_relay` started (not configured)."""
        running = self._run_time_relays.get(listener.relay)
        return running is not None and running[0] is listener

    async def _serve_relay(self, listener: RelayListener, scope: trio.CancelScope) -> None:
        with scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(listener.keep)
                nursery.start_soon(self.accept_loop, listener)

    def _refused(self, host: str | None) -> None:
        key = self.handshakes.key(host) or "all"
        if self._reports.due(f"handshakes {key}", trio.current_time()):
            self._events.security(
                ErrorCode.BUSY,
                f"connection from {host} refused: {self.handshakes.in_use} handshakes pending "
                f"(limits {self.handshakes.total}, {self.handshakes.per_host} per host); "
                f"{self.handshakes.refused} refused so far",
                None,
                None,
            )

    async def _accept_one(self, stream: trio.abc.Stream, host: str | None = None) -> None:
        try:
            try:
                channel = await accept_secure(stream, self._secure, config=self._channel_config)
            finally:
                self.handshakes.release(host)
            await channel.send_message(self._hello())
        except RemoteError as exc:
            if exc.code is ErrorCode.CHANNEL_CLOSED:  # the dialer went away: no attack
                logger.info("inbound handshake ended early: %s", exc.message)
            else:
                what = f"inbound handshake failed: {exc.message}"
                self._events.security(exc.code, what, None, None)
            return
        except (P2PError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            logger.info("inbound channel failed: %s", exc)
            return
        peer_id = channel.remote_peer_id
        if self._closing:
            # The node closed while this handshake ran: nobody will read the channel.
            await close_quietly(channel)
            return
        self.peer_returned(peer_id)
        self._adopt(peer_id, channel, peer_id)


def _bound(table: dict[PeerId, Any], limit: int, links: dict[PeerId, PeerLink]) -> None:
    """Forget entries of ``table`` until it holds ``limit``: peers without a link first
    (oldest first), then the oldest; never the newest (the one just added)."""
    while len(table) > limit:
        newest = next(reversed(table))
        stale = next((p for p in table if p not in links and p != newest), None)
        del table[stale if stale is not None else next(iter(table))]


def remote_host(stream: trio.abc.Stream) -> str | None:
    """The host a connection comes from (None when the stream cannot say)."""
    address = getattr(stream, "remote_address", None)  # TcpStream, simulated streams
    if address is None and isinstance(stream, trio.SocketStream):
        try:
            address = stream.socket.getpeername()
        except OSError:
            return None
    if isinstance(address, tuple) and address and isinstance(address[0], str):
        return address[0]
    return None
