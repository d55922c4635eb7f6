"""Shared state on a running node: the trio driver of the CRDT gossip core.

Theory of operation (seed R9; docs/protocol/gossip.md §8 and §9):

* One :class:`~p2pnode.crdt.replica.Replica` per node, its id the node's
  peer id text and its deltas signed with the node's identity key
  (gossip.md §3.1), loaded from ``data_dir/crdt.sqlite3`` when the node has a
  data directory (else in memory). Each subscribed document has its own
  sans-IO :class:`~p2pnode.crdt.gossip.GossipNode` over that replica, so its
  peer set, fanout and anti-entropy timer are the document's own.
* **Members and peers.** Local agents *subscribe* to a document; the node's
  replica of it is shared by those agents, so they must be allowed to
  exchange messages both ways (policy, else the policy's error). Subscribing
  adds the capability ``crdt:<doc>`` to the agent's card (new revision: a
  HELLO to connected peers and a discovery ``provide``). A remote agent
  offering ``crdt:<doc>`` (registry, refreshed by ``node.find`` through
  discovery) is a gossip peer when policy lets a local member and it
  exchange ``stream-data`` both ways and its card has not expired; one agent
  per remote node, so ``fanout`` counts distinct replicas. Replicas that
  policy forbids are listed by :meth:`SharedState.refused`, and a document
  left without any peer because of them says so
  (:meth:`SharedState.convergence_warning`, shown by ``doc read`` and
  ``status``); the selection is in :mod:`p2pnode.services.shared.peers`. The
  peer set is rescanned every ``refresh_interval``; discovery runs every
  ``discovery_interval``. A peer that fails a delivery is left out for
  ``suspend`` seconds (anti-entropy repairs what it missed). Subscriptions
  are saved in ``data_dir/crdt-subscriptions.json`` (:class:`SubscriptionFile`).
* **Frames.** Each gossip frame travels in a ``stream-data`` envelope from
  the member to the peer agent, payload ``{"crdt": doc, "frame": bin}``, sent
  with :meth:`Node.send` so egress policy, and on the receiver sender
  authentication and ingress policy, apply. The receiver's node hands such
  envelopes to :meth:`SharedState._on_gossip` (``Node.intercept_stream``),
  never to the agent's handler. One bounded queue and one writer task per
  peer agent; a full queue drops the frame (anti-entropy repairs it).
* **Timers.** One task per document sleeps until the core's
  ``next_deadline()`` and calls ``handle_timer(trio.current_time())``.
* **Durability.** ``update`` applies the operation, commits it to SQLite and
  only then returns (acknowledges) and pushes it to ``fanout`` peers. Remote
  changes are committed by a background task. No frame leaves the node while
  a local operation it might carry is not yet durable (frames are tagged
  with the local-operation count and wait for it), so a crash can never
  have shown peers an operation id that the restarted node would reuse.
* **Bad input.** A malformed payload or frame is a ``GossipError``: logged
  with the source agent, reported as a security event, dropped. A bad delta
  inside a good frame is skipped by the core (logged and recorded,
  ``CRDT_DESERIALIZATION_FAILED``) and reported as an error event; sync goes
  on (R9.5). A delta its claimed origin did not sign (or one writing in
  another replica's name) is never applied nor forwarded, and is reported as
  a security event (``INVALID_SIGNATURE`` or ``PEER_ID_MISMATCH``) naming the
  peer that sent it: an honest node verifies before it forwards, so that
  peer forged it or passed on what it did not check.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from p2pnode.core.card import AgentCard, Capability, Origin
from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode, LocalError, P2PError
from p2pnode.core.identity import write_private_file
from p2pnode.core.lifetime import TaskOwner
from p2pnode.crdt.clock import CRDTError, VectorClock
from p2pnode.crdt.delta import Delta
from p2pnode.crdt.gossip import GossipConfig, GossipError, GossipNode, GossipStats, decode_untrusted
from p2pnode.crdt.ops import Op
from p2pnode.crdt.replica import Replica
from p2pnode.crdt.signing import ForgedDeltaError
from p2pnode.crdt.store import AsyncCRDTStore
from p2pnode.crdt.types import ORMap
from p2pnode.node.service import EventSink, ServiceHost
from p2pnode.services.shared.docops import (
    CAPABILITY_PREFIX,
    GOSSIP_MARKER,
    decode_gossip_payload_untrusted,
    doc_capability,
    gossip_payload,
)
from p2pnode.services.shared.peers import (
    check_mutual,
    convergence_warning,
    eligible_peers,
    mutual,
    refused_replicas,
)

logger = logging.getLogger("p2pnode.shared")

STORE_FILE_NAME = "crdt.sqlite3"
SUBSCRIPTIONS_FILE_NAME = "crdt-subscriptions.json"
#: Subscriptions read back from the file at most (a longer file is cut).
_MAX_SUBSCRIPTIONS = 1024


@dataclass(frozen=True, slots=True)
class SharedConfig:
    """Tuning of the shared-state service."""

    gossip: GossipConfig = field(default_factory=GossipConfig)
    #: Seconds between rescans of the registry for peers.
    refresh_interval: float = 2.0
    #: Seconds between discovery lookups (``node.find``) per document.
    discovery_interval: float = 30.0
    discovery_timeout: float = 10.0
    #: Seconds a peer is left out after a failed delivery.
    suspend: float = 5.0
    #: Frames queued per peer agent before new ones are dropped.
    send_queue: int = 256
    #: Deltas logged per document (see Replica).
    max_log: int = 1024
    #: SQLite ``synchronous`` (FULL: survives power loss; NORMAL: survives kill -9).
    synchronous: str = "FULL"

    def __post_init__(self) -> None:
        if min(self.refresh_interval, self.discovery_interval, self.discovery_timeout) <= 0:
            raise LocalError(ErrorCode.CONFIG_ERROR, "intervals and timeouts must be positive")
        if self.suspend < 0 or self.send_queue < 1 or self.max_log < 1:
            raise LocalError(ErrorCode.CONFIG_ERROR, "bad suspend, send_queue or max_log")


@dataclass(frozen=True, slots=True)
class _Outgoing:
    doc: str
    via: str  # local member agent sending it
    payload: dict[str, Any]
    gen: int  # local operations applied when queued; sent once that many are durable


# -- change notifications --------------------------------------------------------------


class Watch:
    """Change notifications for one document: ``async for value in watch`` yields the
    document's value after each change. Coalescing (bounded): a slow reader gets the
    latest value, never a backlog. Close it (``with`` block) to stop.

    Made by :meth:`SharedState.watch`, which passes how to read the document and what
    to call when the watch closes.
    """

    def __init__(
        self,
        doc: str,
        read: Callable[[str], dict[str, Any]],
        on_close: Callable[[Watch], None],
    ) -> None:
        self.doc = doc
        self._read = read
        self._on_close = on_close
        self._event = trio.Event()
        self._closed = False

    def notify(self) -> None:
        """Mark the document changed (called by the shared-state service)."""
        self._event.set()

    def close(self) -> None:
        """Stop: a pending or later ``__anext__`` ends the iteration."""
        self._closed = True
        self._event.set()
        self._on_close(self)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if not self._closed:
            await self._event.wait()
        if self._closed:
            raise StopAsyncIteration
        self._event = trio.Event()
        return self._read(self.doc)


# -- subscriptions saved across restarts -----------------------------------------------


class SubscriptionFile:
    """The (agent, document) subscriptions of a node's agents, saved across restarts in
    ``data_dir`` (nothing is saved without one)."""

    def __init__(self, data_dir: Path | None) -> None:
        self._data_dir = data_dir
        self._lock = trio.Lock()

    def load(self) -> list[tuple[str, str]]:
        """The saved pairs; none when the file is missing or unreadable (logged)."""
        if self._data_dir is None:
            return []
        path = self._data_dir / SUBSCRIPTIONS_FILE_NAME
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            logger.warning("ignoring unreadable %s: %s", path, exc)
            return []
        items = data.get("subscriptions") if isinstance(data, dict) else None
        out = []
        for item in items[:_MAX_SUBSCRIPTIONS] if isinstance(items, list) else []:
            if isinstance(item, list) and len(item) == 2 and all(isinstance(s, str) for s in item):
                out.append((item[0], item[1]))
        return out

    async def save(self, pairs: set[tuple[str, str]]) -> None:
        """Save ``pairs`` and the saved ones (those of agents not hosted now are kept)."""
        if self._data_dir is None:
            return
        pairs = pairs | set(self.load())
        text = json.dumps({"subscriptions": sorted([list(p) for p in pairs])}, indent=1)
        async with self._lock:
            path = self._data_dir / SUBSCRIPTIONS_FILE_NAME
            await trio.to_thread.run_sync(write_private_file, path, text.encode())


# -- reporting the deltas the gossip core skipped --------------------------------------


def report_rejected(
    events: EventSink,
    doc: str,
    source: AgentCard,
    envelope: Envelope,
    rejected: tuple[CRDTError, ...],
) -> int:
    """Report the deltas of one frame from ``source`` that the core skipped (gossip.md
    §6, §9); returns how many of them were forged. A forged one (``PEER_ID_MISMATCH``,
    ``INVALID_SIGNATURE``) is a security event naming the peer that sent the frame (the
    module docstring says why); the malformed ones are one error event per frame,
    naming the source agent."""
    peer = source.id
    forged = [exc for exc in rejected if isinstance(exc, ForgedDeltaError)]
    malformed = [exc for exc in rejected if not isinstance(exc, ForgedDeltaError)]
    for exc in forged:
        events.security(
            exc.code,
            f"forged CRDT update of {doc!r} from agent {peer} dropped: {exc.message}",
            str(source.peer_id),
            envelope,
        )
    if malformed:
        events.error(
            ErrorCode.CRDT_DESERIALIZATION_FAILED,
            f"skipped {len(malformed)} bad CRDT update(s) of {doc!r} from agent {peer}: "
            f"{malformed[-1].message}",
            str(source.peer_id),
            envelope,
        )
    return len(forged)


@dataclass(slots=True)
class _Doc:
    name: str
    core: GossipNode
    members: set[str] = field(default_factory=set)
    #: remote agent id -> local member agent that talks to it
    routes: dict[str, str] = field(default_factory=dict)
    watchers: set[Watch] = field(default_factory=set)
    #: Set when the core's deadline may have moved earlier (a frame queued an
    #: announcement or announced a missing delta): wakes the timer task.
    wake: trio.Event = field(default_factory=trio.Event)


class SharedState(TaskOwner):
    """Replicated CRDT documents of one node (see the module docstring): a protocol
    service on the node's :class:`~p2pnode.node.service.ServiceHost`.

    Run it with ``await node.open_shared()`` (the node runs it) or
    ``async with SharedState(node) as shared``.
    """

    def __init__(
        self,
        host: ServiceHost,
        config: SharedConfig | None = None,
        *,
        rng: random.Random | None = None,
    ) -> None:
        self.host = host
        self.config = config or SharedConfig()
        self._rng = rng or random.Random()
        self.replica_id = str(host.peer_id)
        self._replica: Replica | None = None
        self._store: AsyncCRDTStore | None = None
        self._docs: dict[str, _Doc] = {}
        self._queues: dict[str, trio.MemorySendChannel[_Outgoing]] = {}
        self._suspended: dict[str, float] = {}
        self._nursery: trio.Nursery | None = None
        self._dirty = trio.Event()
        self._subscription_file = SubscriptionFile(host.data_dir)
        self._local_gen = 0
        self._durable_gen = 0
        self._durable_changed = trio.Event()
        self.frames_dropped = 0
        self.bad_frames = 0
        #: Deltas dropped because their claimed origin did not sign them.
        self.forged_deltas = 0

    # -- lifecycle --------------------------------------------------------------------------

    @property
    def data_dir(self) -> Path | None:
        return self.host.data_dir

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Load the replica, restore saved subscriptions and serve until cancelled.

        Raises LocalError(INVALID_ARGUMENT) when the node already runs one, and
        LocalError(CONFIG_ERROR) when the store cannot be opened.
        """
        self.host.intercept_stream(GOSSIP_MARKER, self._on_gossip)
        unwatch = self.host.watch_agents(removed=self.remove_member)
        try:
            if self.data_dir is not None:
                self.data_dir.mkdir(parents=True, exist_ok=True)
                self._store = await AsyncCRDTStore.open(
                    self.data_dir / STORE_FILE_NAME, synchronous=self.config.synchronous
                )
                self._replica = await self._store.load(
                    self.replica_id, signer=self.host.identity, max_log=self.config.max_log
                )
            else:
                self._replica = Replica(
                    self.replica_id, signer=self.host.identity, max_log=self.config.max_log
                )
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._refresh_loop)
                if self._store is not None:
                    nursery.start_soon(self._commit_loop)
                for agent_id, doc in self._subscription_file.load():
                    card = self.host.registry.find(agent_id)
                    if card is None or card.origin is not Origin.LOCAL:
                        continue  # kept on disk for when the agent is hosted again
                    try:
                        await self.subscribe(agent_id, doc)
                    except LocalError as exc:
                        logger.warning("cannot restore %s in %s: %s", agent_id, doc, exc)
                task_status.started()
        finally:
            self._nursery = None
            unwatch()
            self.host.intercept_stream(GOSSIP_MARKER, None)
            for queue in self._queues.values():
                queue.close()
            for d in self._docs.values():
                for w in list(d.watchers):
                    w.close()
            if self._store is not None:
                # Synchronous on purpose: no commit is running once the nursery is done.
                self._store.store.close()

    async def _start(self, nursery: trio.Nursery) -> None:
        await nursery.start(self.run)

    def _running(self) -> trio.Nursery:
        if self._nursery is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "shared state is not running")
        return self._nursery

    @property
    def replica(self) -> Replica:
        """The node's replica. Raises LocalError(INVALID_ARGUMENT) before :meth:`run`."""
        if self._replica is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "shared state is not running")
        return self._replica

    # -- public API -------------------------------------------------------------------------

    async def subscribe(self, agent_id: str, doc: str) -> None:
        """Make local agent ``agent_id`` a member of ``doc``: replicate it, advertise
        ``crdt:<doc>`` on the agent's card and look for peers. Idempotent.

        Raises LocalError: INVALID_ARGUMENT (bad name, not running), AGENT_NOT_FOUND,
        INVALID_CARD (card full), or the policy's code when another local member of
        ``doc`` and this agent may not exchange messages both ways.
        """
        capability = doc_capability(doc)
        nursery = self._running()
        card = self.host.local_agent(agent_id)
        d = self._docs.get(doc)
        if d is not None and agent_id not in d.members:
            for other in d.members:
                check_mutual(self.host.policy, card, self.host.local_agent(other))
        await self.host.add_capability(
            agent_id, Capability(capability, f"CRDT document {doc}", "replicated by gossip")
        )
        d = self._docs.get(doc)  # add_capability yielded
        if d is None:
            core = GossipNode(
                self.replica,
                docs=[doc],
                rng=random.Random(self._rng.getrandbits(64)),
                now=trio.current_time(),
                config=self.config.gossip,
            )
            d = self._docs[doc] = _Doc(doc, core)
            nursery.start_soon(self._timer_loop, d)
        d.members.add(agent_id)
        await self._subscription_file.save(
            {(a, name) for name, member_doc in self._docs.items() for a in member_doc.members}
        )
        self._sync_peers(d)
        nursery.start_soon(self._discover, d)

    async def update(self, agent_id: str, doc: str, op: Op) -> Delta:
        """Apply ``op`` to ``doc`` for member ``agent_id``; returns its delta once it is
        durable (committed to SQLite when the node has a data directory), then pushes it
        to ``fanout`` peers.

        Raises LocalError: INVALID_ARGUMENT (not a member, bad operation), INTERNAL
        (the store failed: not acknowledged; the write is retried with the next commit).
        """
        d = self._docs.get(doc)
        if d is None or agent_id not in d.members:
            raise LocalError(
                ErrorCode.INVALID_ARGUMENT, f"{agent_id!r} is not subscribed to {doc!r}"
            )
        delta = self.replica.update(doc, op)
        self._local_gen += 1
        gen = self._local_gen
        self._notify(d)
        if self._store is not None:
            try:
                await self._store.commit(self.replica)
            except BaseException:
                self._dirty.set()  # the commit loop makes it durable (and lets frames go) later
                raise
        self._mark_durable(gen)
        d.core.publish(delta, trio.current_time())
        self._flush(d)
        return delta

    def remove_member(self, agent_id: str) -> None:
        """Forget ``agent_id`` as a member of every document: the node stopped hosting it.
        Its saved subscriptions stay on disk (restored when it is hosted again at a
        start); peers it talked to are reached through the other members, if any."""
        for d in self._docs.values():
            if agent_id in d.members:
                d.members.discard(agent_id)
                self._sync_peers(d)

    def read(self, doc: str) -> dict[str, Any]:
        """The current value of ``doc`` as plain data (``{}`` if unknown)."""
        return self.replica.value(doc)

    def clock(self, doc: str) -> VectorClock:
        """This replica's vector clock for ``doc``."""
        return self.replica.clock(doc)

    def root(self, doc: str) -> ORMap:
        """This replica's CRDT state of ``doc``: its registers keep their writers (the
        swarm document reads them). Raises LocalError(INVALID_ARGUMENT) if not held."""
        return self.replica.document(doc).state.root

    def watch(self, doc: str) -> Watch:
        """Change notifications for ``doc`` (see :class:`Watch`)."""
        d = self._docs.get(doc)
        if d is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"not subscribed to {doc!r}")
        w = Watch(doc, self.read, self._unwatch)
        d.watchers.add(w)
        return w

    def subscriptions(self) -> dict[str, list[str]]:
        """Document -> its local member agents."""
        return {name: sorted(d.members) for name, d in sorted(self._docs.items())}

    def peers(self, doc: str) -> tuple[str, ...]:
        """The remote agents ``doc`` is gossiped with now."""
        d = self._docs.get(doc)
        return d.core.peers if d is not None else ()

    def refused(self, doc: str) -> list[dict[str, str]]:
        """The replicas of ``doc`` (remote agents offering it, cards not expired) that
        policy forbids every local member to gossip with: ``{"agent", "peer", "code",
        "reason"}`` each, the first member's refusal."""
        d = self._docs.get(doc)
        return [] if d is None else refused_replicas(self.host, doc, d.members)

    def convergence_warning(self, doc: str) -> str | None:
        """Why ``doc`` cannot converge here, or None: it has no gossip peer while
        replicas exist that policy forbids (:meth:`refused`)."""
        if self.peers(doc):
            return None
        return convergence_warning(doc, self.refused(doc))

    def warnings(self) -> dict[str, str]:
        """Document -> :meth:`convergence_warning`, for the documents that have one."""
        return {doc: w for doc in sorted(self._docs) if (w := self.convergence_warning(doc))}

    def statistics(self, doc: str) -> GossipStats:
        """The gossip core's counters for ``doc``."""
        d = self._docs.get(doc)
        if d is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"not subscribed to {doc!r}")
        return d.core.statistics()

    def lag(self, doc: str) -> int:
        """Operations of ``doc`` that peers' digests showed and this replica lacks."""
        d = self._docs.get(doc)
        if d is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"not subscribed to {doc!r}")
        return d.core.lag(doc)

    async def refresh(self, doc: str | None = None) -> None:
        """Look peers up through discovery now and rescan the registry."""
        if doc is not None and doc not in self._docs:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, f"not subscribed to {doc!r}")
        for d in [self._docs[doc]] if doc is not None else list(self._docs.values()):
            await self._discover(d)

    # -- peers ------------------------------------------------------------------------------

    def _sync_peers(self, d: _Doc) -> None:
        eligible = eligible_peers(self.host, d.name, d.members, self._suspended)
        for peer in d.core.peers:
            if peer not in eligible:
                d.core.remove_peer(peer)
        for peer, via in eligible.items():
            d.routes[peer] = via
            card = self.host.registry.find(peer)  # the ring of links is by replica id
            d.core.add_peer(peer, None if card is None else str(card.peer_id))
        if d.core.next_deadline() <= trio.current_time():
            d.wake.set()  # new links: their requests go now, before any update

    async def _discover(self, d: _Doc) -> None:
        with trio.move_on_after(self.config.discovery_timeout):
            try:
                await self.host.find(CAPABILITY_PREFIX + d.name)
            except P2PError as exc:
                logger.info("discovery of %s failed: %s", d.name, exc)
            except Exception as exc:  # what peers published must not stop the refresh loop
                self.host.boundary.contain("discovery", f"discovery of {d.name!r}", exc)
        self._sync_peers(d)

    async def _refresh_loop(self) -> None:
        next_discovery = trio.current_time() + self.config.discovery_interval
        while True:
            await trio.sleep(self.config.refresh_interval)
            discover = trio.current_time() >= next_discovery
            if discover:
                next_discovery = trio.current_time() + self.config.discovery_interval
            for d in list(self._docs.values()):
                if discover:
                    await self._discover(d)
                else:
                    self._sync_peers(d)

    def _suspend(self, peer: str) -> None:
        self._suspended[peer] = trio.current_time() + self.config.suspend
        for d in self._docs.values():
            d.core.remove_peer(peer)

    # -- frames out -------------------------------------------------------------------------

    def _flush(self, d: _Doc) -> None:
        d.wake.set()  # the core may have a new, earlier deadline
        encoded: dict[int, dict[str, Any]] = {}  # a frame fanned out is encoded once
        for peer, msg in d.core.take_outgoing():
            via = d.routes.get(peer)
            if via is None or via not in d.members:
                self.frames_dropped += 1
                continue
            payload = encoded.get(id(msg))
            if payload is None:
                payload = encoded[id(msg)] = gossip_payload(d.name, msg.encode())
            try:
                self._queue(peer).send_nowait(_Outgoing(d.name, via, payload, self._local_gen))
            except (trio.WouldBlock, trio.ClosedResourceError):
                self.frames_dropped += 1

    def _queue(self, peer: str) -> trio.MemorySendChannel[_Outgoing]:
        queue = self._queues.get(peer)
        if queue is None:
            queue, receive = trio.open_memory_channel[_Outgoing](self.config.send_queue)
            self._queues[peer] = queue
            self._running().start_soon(self._send_loop, peer, receive)
        return queue

    async def _send_loop(self, peer: str, receive: trio.MemoryReceiveChannel[_Outgoing]) -> None:
        async with receive:
            async for item in receive:
                while self._durable_gen < item.gen:
                    await self._durable_changed.wait()
                d = self._docs.get(item.doc)
                if d is None or item.via not in d.members:
                    self.frames_dropped += 1  # its member was removed after it was queued
                    continue
                envelope = self.host.envelope(item.via, peer, MessageType.STREAM_DATA, item.payload)
                try:
                    await self.host.send(envelope)
                except P2PError as exc:
                    logger.info("gossip of %s to %s failed: %s", item.doc, peer, exc)
                    self._suspend(peer)
                    while True:  # what is queued would fail the same way
                        try:
                            receive.receive_nowait()
                        except (trio.WouldBlock, trio.EndOfChannel):
                            break
                        self.frames_dropped += 1

    # -- frames in --------------------------------------------------------------------------

    async def _on_gossip(self, source: AgentCard, target: str, envelope: Envelope) -> None:
        peer = source.id
        try:
            doc, frame = decode_gossip_payload_untrusted(envelope.payload)
            msg = decode_untrusted(frame)
        except GossipError as exc:
            self.bad_frames += 1
            logger.warning(
                "dropping gossip from %s: %s",
                peer,
                exc.message,
                extra={"source_agent": peer, "code": str(exc.code)},
            )
            self.host.events.security(
                exc.code,
                f"bad gossip from agent {peer}: {exc.message}",
                str(source.peer_id),
                envelope,
            )
            return
        d = self._docs.get(doc)
        if d is None or target not in d.members:
            return  # not replicated here: ignored (gossip.md §5)
        if peer not in d.routes or d.routes[peer] not in d.members:
            d.routes[peer] = target
        if peer not in d.core.peers and mutual(
            self.host.policy, self.host.local_agent(target), source
        ):
            self._suspended.pop(peer, None)  # it reached us: worth trying again
            d.core.add_peer(peer, str(source.peer_id))
        result = d.core.receive(peer, msg, trio.current_time())
        if result.rejected:
            self.forged_deltas += report_rejected(
                self.host.events, doc, source, envelope, result.rejected
            )
        if result.new:
            self._notify(d)
            self._dirty.set()
        self._flush(d)

    # -- timers, durability, watchers -------------------------------------------------------

    async def _timer_loop(self, d: _Doc) -> None:
        while True:
            d.wake = trio.Event()
            with trio.move_on_at(d.core.next_deadline()):
                await d.wake.wait()
                continue  # woken: wait for the possibly earlier deadline
            d.core.handle_timer(trio.current_time())
            self._flush(d)

    def _mark_durable(self, gen: int) -> None:
        if gen > self._durable_gen:
            self._durable_gen = gen
            self._durable_changed.set()
            self._durable_changed = trio.Event()

    async def _commit_loop(self) -> None:
        assert self._store is not None
        while True:
            await self._dirty.wait()
            self._dirty = trio.Event()
            gen = self._local_gen
            try:
                await self._store.commit(self.replica)
            except LocalError as exc:
                self.host.events.error(exc.code, f"shared state commit failed: {exc.message}")
                await trio.sleep(1.0)
                self._dirty.set()
            else:
                self._mark_durable(gen)

    def _notify(self, d: _Doc) -> None:
        for w in d.watchers:
            w.notify()

    def _unwatch(self, w: Watch) -> None:
        d = self._docs.get(w.doc)
        if d is not None:
            d.watchers.discard(w)


__all__ = [
    "STORE_FILE_NAME",
    "SUBSCRIPTIONS_FILE_NAME",
    "SharedConfig",
    "SharedState",
    "Watch",
]
