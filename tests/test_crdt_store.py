"""Durable replicas: exact reload (signed deltas and checkpoints included), acknowledged
updates survive SIGKILL, the trio wrapper, stores of unsigned deltas refused."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.crdt.clock import VectorClock
from p2pnode.crdt.ops import CounterAdd, MapRemove, Op, RegisterSet, SetAdd, SetRemove
from p2pnode.crdt.replica import Replica
from p2pnode.crdt.store import AsyncCRDTStore, CRDTStore
from tests.crdtkeys import identity, replica, rid

paths = st.sampled_from([("t1", "s"), ("t1", "n"), ("t2",), ("t3", "x", "y")])
ops: st.SearchStrategy[Op] = st.one_of(
    st.builds(CounterAdd, paths, st.integers(1, 3)),
    st.builds(RegisterSet, paths, st.sampled_from(["a", "b"]), st.integers(1, 5)),
    st.builds(SetAdd, paths, st.sampled_from(["a", "b"])),
    st.builds(SetRemove, paths, st.sampled_from(["a", "b"])),
    st.builds(MapRemove, paths),
)


def assert_same(a: Replica, b: Replica) -> None:
    assert a.documents() == b.documents()
    for name in a.documents():
        da, db = a.document(name), b.document(name)
        assert da.state == db.state
        assert da.applied == db.applied
        assert da.floor == db.floor
        assert list(da.log) == list(db.log)
        assert [d.sealed_bytes() for d in da.log.values()] == [
            d.sealed_bytes() for d in db.log.values()
        ]
        assert {o: c.sealed_bytes() for o, c in da.checkpoints.items()} == {
            o: c.sealed_bytes() for o, c in db.checkpoints.items()
        }
        assert a.clock(name) == b.clock(name)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    script=st.lists(
        st.tuples(
            st.sampled_from(["local", "remote", "checkpoint"]), st.sampled_from(["d1", "d2"]), ops
        ),
        max_size=30,
    ),
    commit_every=st.integers(1, 5),
)
def test_write_close_reopen_is_exact(
    tmp_path: Path, script: list[tuple[str, str, Op]], commit_every: int
) -> None:
    db = tmp_path / f"s{os.urandom(4).hex()}.db"
    store = CRDTStore(db)
    me = store.load(rid("me"), signer=identity("me"), max_log=4)
    peer = replica("peer", max_log=4)
    for i, (kind, doc, op) in enumerate(script):
        try:
            if kind == "local":
                me.update(doc, op)
            else:
                delta = peer.update(doc, op)
                checkpoint = peer.checkpoint(doc, peer.replica_id)
                if kind == "remote":
                    me.apply_delta(delta)
                elif checkpoint is not None:  # the peer's latest, as anti-entropy serves it
                    me.apply_delta(checkpoint)
        except LocalError:
            pass  # kind conflicts between local writes
        if i % commit_every == 0:
            store.commit(me)
    store.commit(me)
    store.close()
    with CRDTStore(db) as again:
        assert_same(me, again.load(rid("me"), signer=identity("me"), max_log=4))


def test_reload_then_continue_numbering(tmp_path: Path) -> None:
    with CRDTStore(tmp_path / "a.db") as store:
        r = store.load("A")
        store.update(r, "doc", CounterAdd(("n",), 2))
        store.update(r, "doc", CounterAdd(("n",), 3))
    with CRDTStore(tmp_path / "a.db") as store:
        r = store.load("A")
        assert r.value("doc") == {"n": 5}
        d = store.update(r, "doc", CounterAdd(("n",), 1))
        assert d.seq == 3
        missing = r.missing_for("doc", VectorClock())
        assert [x.seq for x in missing] == [1, 2, 3]


def test_signed_deltas_and_checkpoints_are_served_again_after_a_restart(tmp_path: Path) -> None:
    # gossip.md §9: the origin's signatures are stored with what they sign, so a restarted
    # node serves deltas and checkpoints that peers verify.
    a = rid("A")
    with CRDTStore(tmp_path / "a.db") as store:
        r = store.load(a, signer=identity("A"), max_log=8)
        for i in range(20):
            store.update(r, "doc", SetAdd(("s",), i))
        before = r.missing_for("doc", VectorClock())
    with CRDTStore(tmp_path / "a.db") as store:
        r = store.load(a, signer=identity("A"), max_log=8)
        served = r.missing_for("doc", VectorClock())
        assert [d.sealed for d in served] == [d.sealed for d in before]
        assert served[0].is_checkpoint  # the log was compacted past seq 1
        fresh = replica("B")
        for d in served:
            assert fresh.receive_delta_untrusted(d.sealed, source="A") is not None
        assert fresh.value("doc") == r.value("doc") == {"s": frozenset(range(20))}
        # The next checkpoint still covers 1..seq: it builds on the one stored.
        for i in range(20, 24):
            store.update(r, "doc", SetAdd(("s",), i))
        checkpoint = r.checkpoint("doc", a)
        assert checkpoint is not None and checkpoint.seq == 24
        alone = replica("C")
        assert alone.receive_delta_untrusted(checkpoint.sealed, source="A") is not None
        assert alone.value("doc") == {"s": frozenset(range(24))}


def test_a_store_of_unsigned_deltas_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    con = sqlite3.connect(path)  # what schema 1 (gossip version 1) left behind
    con.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    con.execute("INSERT INTO meta VALUES ('schema', '1')")
    con.commit()
    con.close()
    with pytest.raises(LocalError) as info:
        CRDTStore(path)
    assert info.value.code is ErrorCode.CONFIG_ERROR
    assert str(path) in info.value.message and "unsigned" in info.value.message


def test_store_is_bound_to_one_replica(tmp_path: Path) -> None:
    with CRDTStore(tmp_path / "a.db") as store:
        store.load("A")
        with pytest.raises(LocalError) as info:
            store.load("B")
        assert info.value.code is ErrorCode.CONFIG_ERROR


def test_corrupt_rows_are_config_errors(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    with CRDTStore(path) as store:
        r = store.load("A", max_log=2)
        for _ in range(4):
            store.update(r, "doc", SetAdd(("s",), "x"))
    con = sqlite3.connect(path)
    con.execute("UPDATE documents SET snapshot = x'c1'")
    con.commit()
    con.close()
    with CRDTStore(path) as store, pytest.raises(LocalError) as info:
        store.load("A")
    assert info.value.code is ErrorCode.CONFIG_ERROR


def test_failed_write_is_not_acknowledged_and_is_retried(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    store = CRDTStore(path, timeout=0.01)
    r = store.load("A")
    store.update(r, "doc", CounterAdd(("n",), 1))
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    with pytest.raises(LocalError) as info:
        store.update(r, "doc", CounterAdd(("n",), 10))  # not acknowledged
    assert info.value.code is ErrorCode.INTERNAL
    blocker.execute("ROLLBACK")
    blocker.close()
    store.update(r, "doc", CounterAdd(("n",), 100))  # commits the earlier batch too
    store.close()
    with CRDTStore(path) as again:
        assert again.load("A").value("doc") == {"n": 111}


def test_commit_needs_a_journaling_replica(tmp_path: Path) -> None:
    with CRDTStore(tmp_path / "a.db") as store, pytest.raises(LocalError):
        store.commit(Replica("A"))


def test_closed_store_and_bad_options(tmp_path: Path) -> None:
    with pytest.raises(LocalError):
        CRDTStore(tmp_path / "a.db", synchronous="OFF")
    store = CRDTStore(tmp_path / "a.db")
    store.close()
    store.close()
    with pytest.raises(LocalError):
        store.load("A")
    with pytest.raises(LocalError) as info:
        CRDTStore(tmp_path / "missing-dir" / "a.db")
    assert info.value.code is ErrorCode.CONFIG_ERROR


def test_pragmas(tmp_path: Path) -> None:
    with CRDTStore(tmp_path / "a.db") as store:
        store.load("A")
    con = sqlite3.connect(tmp_path / "a.db")
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    con.close()


async def test_async_store_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "a.db"
    async with await AsyncCRDTStore.open(path) as store:
        r = await store.load("A")
        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(store.update, r, "doc", SetAdd(("s",), f"e{i}"))
        await store.update(r, "doc", CounterAdd(("n",), 7))
    async with await AsyncCRDTStore.open(path) as store:
        again = await store.load("A")
    assert again.value("doc") == {"n": 7, "s": frozenset(f"e{i}" for i in range(10))}
    assert_same(r, again)


WRITER = textwrap.dedent(
    """
    import sys
    from p2pnode.crdt.ops import CounterAdd, SetAdd
    from p2pnode.crdt.store import CRDTStore

    store = CRDTStore(sys.argv[1])
    replica = store.load("writer", max_log=16)
    i = 0
    while True:
        i += 1
        store.update(replica, "doc", SetAdd(("acked",), i))
        store.update(replica, "doc", CounterAdd(("n",), 1))
        print(i, flush=True)
    """
)


@pytest.mark.slow
def test_acknowledged_updates_survive_sigkill(tmp_path: Path) -> None:
    path = tmp_path / "w.db"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert proc.stdout is not None
    acked = 0
    try:
        for line in proc.stdout:
            acked = int(line)
            if acked >= 60:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert acked >= 60
    with CRDTStore(path) as store:
        r = store.load("writer", max_log=16)
    value = r.value("doc")
    assert set(range(1, acked + 1)) <= value["acked"]
    assert value["n"] >= acked
    # The log was compacted many times; a fresh peer gets the checkpoint and the rest.
    served = r.missing_for("doc", Replica("x").clock("doc"))
    assert served[0].is_checkpoint
    fresh = Replica("x")
    for delta in served:
        fresh.apply_delta(delta)
    assert fresh.value("doc") == value
