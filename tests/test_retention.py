"""Retention by age of what a node remembers per envelope: finished threads in the
ThreadStore, and the ids of the duplicate window (BoundedSet).

Both are bounded by count and bytes; the age makes them level off within a minute
or two of steady traffic instead of filling to their bounds over many minutes.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.envelope import Envelope, EnvelopeFactory, MessageType
from p2pnode.core.threadstore import ENTRY_OVERHEAD, FINAL_TYPES, ThreadStore
from p2pnode.node.router import BoundedSet


class Clock:
    """A hand-stepped clock."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _exchange(
    factory: EnvelopeFactory, final: MessageType = MessageType.RESPONSE
) -> tuple[Envelope, Envelope]:
    request = factory.create("a", "b", MessageType.REQUEST, {"n": 1})
    reply = factory.reply(request, "b", final, {"ok": True})
    return request, reply


def test_a_finished_thread_is_forgotten_after_its_time() -> None:
    clock = Clock()
    store = ThreadStore(finished_ttl=60.0, clock=clock)
    factory = EnvelopeFactory()
    request, reply = _exchange(factory)
    store.add(request)  # no correlation id: not a thread
    store.add(reply, "peer")
    assert store.thread(request.id) == [reply]
    clock.now = 59.0
    assert store.thread(request.id) == [reply]
    clock.now = 60.0
    assert store.thread(request.id) == []
    assert len(store) == 0 and store.bytes == 0 and store.owners() == []


def test_an_open_thread_is_kept_and_a_touched_one_starts_over() -> None:
    clock = Clock()
    store = ThreadStore(finished_ttl=60.0, clock=clock)
    factory = EnvelopeFactory()
    request = factory.create("a", "b", MessageType.REQUEST)
    start = factory.reply(request, "b", MessageType.STREAM_START)
    store.add(start)
    clock.now = 1_000.0
    store.add(factory.reply(request, "b", MessageType.STREAM_DATA, {"chunk": 1}))
    assert len(store.thread(request.id)) == 2  # streaming: not finished, never aged
    end = factory.reply(request, "b", MessageType.STREAM_END)
    store.add(end)
    clock.now = 1_050.0
    # Another envelope in the finished thread: it goes on, and finishes again later.
    store.add(factory.reply(request, "a", MessageType.NOTIFICATION, {"thanks": 1}))
    clock.now = 1_200.0
    assert len(store.thread(request.id)) == 4
    store.add(factory.reply(request, "b", MessageType.ERROR, {"code": "X"}))
    clock.now = 1_259.0
    assert len(store.thread(request.id)) == 5
    clock.now = 1_260.0
    assert store.thread(request.id) == []


def test_under_steady_traffic_the_store_holds_a_minute_of_threads() -> None:
    clock = Clock()
    store = ThreadStore(finished_ttl=60.0, clock=clock)
    factory = EnvelopeFactory()
    sizes = []
    for second in range(600):
        clock.now = float(second)
        for _ in range(30):  # 30 answered requests a second, as a busy soak node sees
            _, reply = _exchange(factory)
            store.add(reply, "peer")
        sizes.append(len(store))
    # Level from the first minute on: 60 s of threads, far below the 10,000 bound.
    assert max(sizes[60:]) == min(sizes[60:]) == 60 * 30
    assert store.bytes <= 60 * 30 * (300 + ENTRY_OVERHEAD)  # each reply about 274 bytes


def test_the_count_and_byte_bounds_still_hold_before_the_age() -> None:
    clock = Clock()
    store = ThreadStore(max_threads=10, max_bytes=10_000, finished_ttl=60.0, clock=clock)
    factory = EnvelopeFactory()
    for _ in range(100):
        store.add(_exchange(factory)[1], "peer")
    assert len(store) == 10
    for n in range(10):  # open threads: only the count and byte bounds apply
        note = factory.create(
            "a", "b", MessageType.NOTIFICATION, "x" * 3_000, correlation_id=f"c{n}"
        )
        store.add(note, "flooder")
        assert store.bytes <= 10_000
    clock.now = 1e6
    assert len(store.thread("c9")) == 1  # never finished: kept


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.floats(0.0, 50.0),  # seconds that pass
            st.sampled_from([*FINAL_TYPES, MessageType.NOTIFICATION, MessageType.STREAM_DATA]),
            st.integers(0, 5),  # thread
        ),
        max_size=60,
    )
)
def test_only_threads_finished_long_enough_ago_are_dropped(
    steps: list[tuple[float, MessageType, int]],
) -> None:
    clock = Clock()
    store = ThreadStore(finished_ttl=60.0, clock=clock)
    factory = EnvelopeFactory()
    last: dict[str, tuple[float, MessageType]] = {}
    for gap, kind, n in steps:
        clock.now += gap
        key = f"t{n}"
        store.add(factory.create("a", "b", kind, None, correlation_id=key))
        last[key] = (clock.now, kind)
        for k, (when, final) in last.items():
            gone = final in FINAL_TYPES and clock.now - when >= 60.0
            assert (store.thread(k) == []) == gone, (k, when, final, clock.now)


# ---------------------------------------------------------------------- the duplicate window


def test_ids_are_remembered_for_the_age_then_forgotten() -> None:
    clock = Clock()
    seen = BoundedSet(1_000, max_age=60.0, clock=clock)
    assert seen.add("a")
    clock.now = 59.0
    assert not seen.add("a")
    assert seen.add("b")
    clock.now = 60.0
    assert seen.add("c")  # the first generation collected for 60 s: it becomes the older
    assert "a" in seen and "b" in seen
    clock.now = 121.0
    assert seen.add("d")
    assert "a" not in seen and "b" not in seen and "c" in seen
    assert seen.add("a")  # forgotten: new again


def test_without_an_age_only_the_count_rotates() -> None:
    clock = Clock()
    seen = BoundedSet(2, max_age=None, clock=clock)
    for key in "abc":
        seen.add(key)
        clock.now += 10_000.0
    assert all(k in seen for k in "abc")
    seen.add("d")
    seen.add("e")
    assert "a" not in seen and "b" not in seen


@settings(max_examples=200, deadline=None)
@given(
    gaps=st.lists(st.floats(0.0, 40.0), min_size=1, max_size=300),
    size=st.integers(1, 20),
)
def test_the_window_keeps_the_age_or_the_count_whichever_is_first(
    gaps: list[float], size: int
) -> None:
    clock = Clock()
    seen = BoundedSet(size, max_age=60.0, clock=clock)
    added: list[tuple[str, float]] = []
    for i, gap in enumerate(gaps):
        clock.now += gap
        key = f"k{i}"
        assert seen.add(key)
        added.append((key, clock.now))
        assert len(seen._new) + len(seen._old) <= 2 * size
        # Every key younger than the age and among the last `size` is remembered.
        for j, (k, when) in enumerate(added):
            if clock.now - when < 60.0 and len(added) - 1 - j < size:
                assert k in seen, (k, when, clock.now)
