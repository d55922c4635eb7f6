"""Durable replicas: documents and delta logs in SQLite.

Theory of operation
-------------------
A replica journals what changed (:class:`~p2pnode.crdt.replica.Changes`):
deltas appended to a document's log, deltas evicted from it, checkpoints
kept (the latest per origin), and documents whose *snapshot* (CRDT state,
applied-operation set, log floors) must be rewritten because something
entered the state without a log entry (a delta below the floor, a
checkpoint) or the log was compacted. Deltas and checkpoints are stored
**sealed**, with their origin's signature, exactly as peers get them, so a
restarted node serves them again (docs/protocol/gossip.md §3).
:meth:`CRDTStore.prepare` turns the journal into a :class:`Batch` of encoded
rows (pure CPU, on the caller's thread, which owns the replica);
:meth:`CRDTStore.write` commits the batch in one SQLite transaction. Only
after ``write`` returns is an update durable, and only then may the caller
acknowledge it (DESIGN.md, "Durability").

Reload is exact because the in-memory document always equals its last
snapshot joined with every delta still in its log and every checkpoint held,
the ``deltas`` table holds exactly the log (rows are deleted in the
transaction that records their eviction, together with the snapshot that
covers them) and the ``checkpoints`` table the latest checkpoint per origin.
Joins are idempotent, so replaying what the snapshot already contains changes
nothing. Rows come from this node's own disk and are not verified again.

Schema 1 (gossip version 1) held unsigned deltas, which no peer accepts and
this node cannot sign for their origins: such a file is refused with
``CONFIG_ERROR`` naming it (move it aside; peers refill the documents).

Durability settings: WAL journal mode with ``synchronous=FULL`` by default, so
every commit fsyncs the WAL and survives power loss as well as ``kill -9``.
``synchronous=NORMAL`` in WAL mode is still safe against a killed process
(the WAL is written before COMMIT returns; only the fsync is deferred to
checkpoints) but may lose the last commits on power loss; it is offered as an
option for nodes that accept that trade.

Threads: the sync :class:`CRDTStore` opens its connection with
``check_same_thread=False`` and serialises every use behind a
:class:`threading.Lock`, so the async wrapper may run calls on any
``trio.to_thread`` worker; the replica itself is only touched on the trio
thread.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from dataclasses import dataclass, field
from typing import Any

import trio

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.wire import WireError, WireLimits, pack, unpack_untrusted
from p2pnode.crdt.clock import CRDTError, valid_counter_untrusted, valid_replica_id_untrusted
from p2pnode.crdt.delta import Delta, Opened
from p2pnode.crdt.dots import DotContext
from p2pnode.crdt.ops import Op
from p2pnode.crdt.replica import Document, Replica
from p2pnode.crdt.types import DocState

SCHEMA_VERSION = 2
_SNAPSHOT_LIMITS = WireLimits(max_size=256 * 1024 * 1024, max_depth=32)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS documents (name TEXT PRIMARY KEY, snapshot BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS deltas (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    doc TEXT NOT NULL,
    origin TEXT NOT NULL,
    seq INTEGER NOT NULL,
    data BLOB NOT NULL,
    UNIQUE (doc, origin, seq)
);
CREATE TABLE IF NOT EXISTS checkpoints (
    doc TEXT NOT NULL,
    origin TEXT NOT NULL,
    seq INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (doc, origin)
);
"""


@dataclass(slots=True)
class Batch:
    """Encoded rows for one transaction (built on the replica's thread)."""

    deltas: list[tuple[str, str, int, bytes]] = field(default_factory=list)
    evicted: list[tuple[str, str, int]] = field(default_factory=list)
    snapshots: list[tuple[str, bytes]] = field(default_factory=list)
    checkpoints: list[tuple[str, str, int, bytes]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.deltas) + len(self.evicted) + len(self.snapshots) + len(self.checkpoints)


def _encode_snapshot(d: Document) -> bytes:
    return pack([d.state.to_wire(), d.applied.to_wire(), dict(sorted(d.floor.items()))])


def _decode_snapshot(data: bytes) -> Document:
    try:
        obj = unpack_untrusted(data, _SNAPSHOT_LIMITS)
        if not isinstance(obj, list) or len(obj) != 3 or not isinstance(obj[2], dict):
            raise CRDTError("snapshot is not [state, applied, floor]")
        floor = {
            valid_replica_id_untrusted(o): valid_counter_untrusted(n) for o, n in obj[2].items()
        }
        return Document(
            state=DocState.from_wire_untrusted(obj[0]),
            applied=DotContext.from_wire_untrusted(obj[1]),
            floor=floor,
        )
    except (CRDTError, WireError) as exc:
        raise LocalError(ErrorCode.CONFIG_ERROR, f"corrupt snapshot: {exc.message}") from exc


def _decode_row(data: bytes, what: str) -> Delta:
    try:
        return Opened.open_untrusted(data).trusted()
    except CRDTError as exc:
        raise LocalError(ErrorCode.CONFIG_ERROR, f"corrupt {what} row: {exc}") from exc


class CRDTStore:
    """SQLite persistence for one replica's documents (see module docstring).

    Raises LocalError(CONFIG_ERROR) if the file cannot be opened, belongs to
    another replica or another schema version (schema 1: unsigned deltas), or
    holds corrupt rows.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, synchronous: str = "FULL", timeout: float = 5.0
    ) -> None:
        """``timeout``: seconds to wait for another connection's lock before failing."""
        if synchronous not in ("FULL", "NORMAL"):
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "synchronous must be FULL or NORMAL")
        self._lock = threading.Lock()
        # A batch whose transaction failed; retried (first) with the next write.
        self._failed: Batch | None = None
        try:
            # isolation_level=None: we issue BEGIN/COMMIT ourselves.
            self._db: sqlite3.Connection | None = sqlite3.connect(
                os.fspath(path), check_same_thread=False, isolation_level=None, timeout=timeout
            )
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={synchronous}")
            self._db.executescript(_SCHEMA)
            row = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
            if row is None:
                self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            elif row[0] == "1":
                raise LocalError(
                    ErrorCode.CONFIG_ERROR,
                    f"{os.fspath(path)} holds unsigned CRDT deltas (store schema 1), which "
                    "peers no longer accept: move it aside and restart; peers refill the "
                    "documents by anti-entropy",
                )
            elif row[0] != str(SCHEMA_VERSION):
                raise LocalError(ErrorCode.CONFIG_ERROR, f"store schema {row[0]} is unsupported")
        except sqlite3.Error as exc:
            raise LocalError(ErrorCode.CONFIG_ERROR, f"cannot open store: {exc}") from exc

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "store is closed")
        return self._db

    def close(self) -> None:
        """Close the database (idempotent)."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def __enter__(self) -> CRDTStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def load(self, replica_id: str, **replica_kwargs: Any) -> Replica:
        """A replica restored from disk: documents, clocks, logs, floors and
        checkpoints exactly. ``replica_kwargs`` go to :class:`Replica` (``signer``,
        ``max_log``, ...).

        The first load binds the file to ``replica_id``; later loads with
        another id raise LocalError(CONFIG_ERROR).
        """
        replica = Replica(replica_id, journal=True, **replica_kwargs)
        with self._lock:
            db = self._conn()
            try:
                row = db.execute("SELECT value FROM meta WHERE key='replica'").fetchone()
                if row is None:
                    db.execute("INSERT INTO meta VALUES ('replica', ?)", (replica_id,))
                elif row[0] != replica_id:
                    raise LocalError(ErrorCode.CONFIG_ERROR, f"store belongs to replica {row[0]!r}")
                docs = {
                    name: _decode_snapshot(blob)
                    for name, blob in db.execute("SELECT name, snapshot FROM documents")
                }
                rows = db.execute("SELECT doc, data FROM deltas ORDER BY id").fetchall()
                checkpoints = db.execute("SELECT doc, data FROM checkpoints").fetchall()
            except sqlite3.Error as exc:
                raise LocalError(ErrorCode.CONFIG_ERROR, f"cannot read store: {exc}") from exc
        for name, data in rows:
            delta = _decode_row(data, "delta")
            d = docs.setdefault(name, Document())
            d.state.join(delta.state)
            d.applied.add((delta.origin, delta.seq))
            d.log[(delta.origin, delta.seq)] = delta
        for name, data in checkpoints:
            cp = _decode_row(data, "checkpoint")
            d = docs.setdefault(name, Document())
            d.state.join(cp.state)
            d.applied.join(DotContext({cp.origin: cp.seq}))
            d.checkpoints[cp.origin] = cp
        for name, d in docs.items():
            replica.restore(name, d)
        return replica

    @staticmethod
    def prepare(replica: Replica) -> Batch:
        """Drain ``replica``'s journal into encoded rows (call on the replica's thread).

        Raises LocalError(INVALID_ARGUMENT) for a replica that keeps no journal
        (one not obtained from :meth:`load`).
        """
        if not replica.journal:
            raise LocalError(ErrorCode.INVALID_ARGUMENT, "replica keeps no journal; use load()")
        changes = replica.take_changes()
        latest: dict[tuple[str, str], Delta] = {}
        for cp in changes.checkpoints:
            latest[(cp.doc, cp.origin)] = cp  # later ones have higher seqs
        batch = Batch(
            deltas=[(d.doc, d.origin, d.seq, d.sealed_bytes()) for d in changes.appended],
            evicted=list(changes.evicted),
            checkpoints=[(c.doc, c.origin, c.seq, c.sealed_bytes()) for c in latest.values()],
        )
        for name in sorted(changes.snapshot):
            batch.snapshots.append((name, _encode_snapshot(replica.document(name))))
        return batch

    def write(self, batch: Batch) -> None:
        """Commit ``batch`` in one transaction; durable when this returns.

        Raises LocalError(INTERNAL) if SQLite fails (the transaction is rolled back).
        """
        with self._lock:
            if self._failed is not None:
                f, self._failed = self._failed, None
                batch = Batch(
                    f.deltas + batch.deltas,
                    f.evicted + batch.evicted,
                    f.snapshots + batch.snapshots,
                    f.checkpoints + batch.checkpoints,
                )
            if not batch:
                return
            db = self._conn()
            try:
                db.execute("BEGIN IMMEDIATE")
                db.executemany(
                    "INSERT OR IGNORE INTO deltas (doc, origin, seq, data) VALUES (?, ?, ?, ?)",
                    batch.deltas,
                )
                db.executemany(
                    "DELETE FROM deltas WHERE doc=? AND origin=? AND seq=?", batch.evicted
                )
                db.executemany(
                    "INSERT INTO documents (name, snapshot) VALUES (?, ?) "
                    "ON CONFLICT(name) DO UPDATE SET snapshot=excluded.snapshot",
                    batch.snapshots,
                )
                db.executemany(
                    "INSERT INTO checkpoints (doc, origin, seq, data) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT(doc, origin) DO UPDATE SET seq=excluded.seq, data=excluded.data "
                    "WHERE excluded.seq > checkpoints.seq",
                    batch.checkpoints,
                )
                db.execute("COMMIT")
            except sqlite3.Error as exc:
                if db.in_transaction:
                    db.execute("ROLLBACK")
                self._failed = batch
                raise LocalError(ErrorCode.INTERNAL, f"store write failed: {exc}") from exc

    def commit(self, replica: Replica) -> int:
        """Persist everything ``replica`` changed since the last commit; returns rows written."""
        batch = self.prepare(replica)
        self.write(batch)
        return len(batch)

    def update(self, replica: Replica, doc: str, op: Op) -> Delta:
        """Apply a local operation and return its delta once it is durable."""
        delta = replica.update(doc, op)
        self.commit(replica)
        return delta


class AsyncCRDTStore:
    """trio wrapper: SQLite work runs in ``trio.to_thread``; commits are serialised FIFO.

    Build with :meth:`open`; use as ``async with``.
    """

    def __init__(self, store: CRDTStore) -> None:
        self.store = store
        self._lock = trio.Lock()
        self._limiter = trio.CapacityLimiter(1)

    @classmethod
    async def open(
        cls, path: str | os.PathLike[str], *, synchronous: str = "FULL"
    ) -> AsyncCRDTStore:
        """Open (or create) the store file off the trio thread."""
        store = await trio.to_thread.run_sync(
            lambda: CRDTStore(path, synchronous=synchronous), limiter=trio.CapacityLimiter(1)
        )
        return cls(store)

    async def __aenter__(self) -> AsyncCRDTStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the database."""
        async with self._lock:
            await trio.to_thread.run_sync(self.store.close, limiter=self._limiter)

    async def load(self, replica_id: str, **replica_kwargs: Any) -> Replica:
        """See :meth:`CRDTStore.load`."""
        async with self._lock:
            return await trio.to_thread.run_sync(
                lambda: self.store.load(replica_id, **replica_kwargs), limiter=self._limiter
            )

    async def commit(self, replica: Replica) -> int:
        """Persist the replica's changes; returns when they are durable.

        The journal is drained on the trio thread; the write is not cancellable
        once started (an interrupted commit would leave the caller unsure).
        """
        async with self._lock:
            batch = CRDTStore.prepare(replica)
            await trio.to_thread.run_sync(self.store.write, batch, limiter=self._limiter)
            return len(batch)

    async def update(self, replica: Replica, doc: str, op: Op) -> Delta:
        """Apply a local operation; return its delta only after it is durable."""
        delta = replica.update(doc, op)
        await self.commit(replica)
        return delta
