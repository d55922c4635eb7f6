"""The fuzzer's table at a small count, the fuzzer's own checks, and one wrong field per
decoder: every parser of peer data raises only its layer's RemoteError (STYLE.md §8)."""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import trio
import trio.lowlevel
import trio.testing
from fuzz import TABLE, run_table, select
from fuzz_engine import (
    Entry,
    Harness,
    Limits,
    LiveEntry,
    Report,
    require_boundary,
    run_entry,
    run_live,
)
from fuzz_mutate import pack_plain, unpack_plain
from fuzz_seeds import (
    INITIATOR,
    cards,
    clock_seeds,
    datagram_seeds,
    delta_seeds,
    envelope_json_seeds,
    envelope_seeds,
    frame_seeds,
    gossip_frames,
    gossip_payload_seeds,
    provider_payload,
    records,
    registry_seed,
    sealed_seeds,
    tool_seeds,
    value_seeds,
)
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from p2pnode.core.boundary import FailureBoundary
from p2pnode.core.errors import ErrorCode, RemoteError
from p2pnode.dht.rpcwire import HEADER_BYTES
from tests.strategies import json_wrong_values, one_field_replaced, wrong_values

COUNT = 300
ENTRIES = {t.name: t for t in TABLE if isinstance(t, Entry)}


# -- the table, as scripts/fuzz.py runs it --------------------------------------------------------


#: What a live entry's inputs must reach, as a count in its report: past the transport
#: and the decoders, into the handlers.
REACHES = {
    "live.dht_datagram": ("requests handled",),
    "live.dht_lookup": ("providers found",),
    "live.node_frame": ("envelopes received", "node.typed"),
    "live.control": ("ok",),
    "live.channel": ("message",),
}


@pytest.mark.parametrize("target", TABLE, ids=lambda t: t.name)
def test_entry_point_holds(target: Entry | LiveEntry) -> None:
    (report,) = run_table([target], lambda _: COUNT, seed=1)
    assert report.inputs == COUNT
    assert report.ok, "\n".join(report.problems())
    if isinstance(target, Entry):
        # The inputs reach past the parser's first check, and some are turned away.
        assert report.outcomes["accepted"] > 0
        assert sum(report.outcomes.values()) - report.outcomes["accepted"] > 0
    else:
        for outcome in REACHES[target.name]:
            assert report.outcomes[outcome] > 0, outcome


def test_every_live_entry_says_what_it_reaches() -> None:
    assert set(REACHES) == {t.name for t in TABLE if isinstance(t, LiveEntry)}


def test_every_untrusted_parser_is_in_the_table() -> None:
    names = {t.name for t in TABLE}
    for required in (
        "frame", "card.msgpack", "card.json", "envelope.msgpack", "envelope.json",
        "envelope.dict", "registry", "tool.json", "dht.datagram", "dht.rpc", "dht.value",
        "dht.collector", "dht.record", "dht.provider", "secure.handshake", "secure.payload",
        "noise.message", "framing", "attach.session",
        "crdt.clock", "crdt.delta", "crdt.sealed", "crdt.gossip", "live.dht_datagram",
        "live.dht_lookup", "live.node_frame", "live.control", "live.channel",
    ):  # fmt: skip
        assert required in names
    with pytest.raises(KeyError):
        select(["no.such.entry"])


def test_a_seed_replays_the_same_inputs() -> None:
    entry = ENTRIES["card.msgpack"]
    first = [entry.generate(random.Random("7:x")) for _ in range(50)]
    assert first == [entry.generate(random.Random("7:x")) for _ in range(50)]
    a, b = (run_entry(entry, 200, seed=3) for _ in range(2))
    assert a.outcomes == b.outcomes
    assert run_entry(entry, 200, seed=4).outcomes != a.outcomes


# -- the fuzzer's own checks ----------------------------------------------------------------------


def _planted(data: bytes) -> None:
    if data and data[0] < 16:
        raise TypeError("planted")
    raise RemoteError(ErrorCode.MALFORMED_MESSAGE, "fine")


def test_an_untyped_exception_fails_the_entry_with_a_shrunk_input() -> None:
    entry = Entry("planted", lambda rng: rng.randbytes(rng.randrange(1, 40)), _planted)
    report = run_entry(entry, 300, seed=1)
    assert not report.ok
    failure = report.failures["TypeError"]
    assert isinstance(failure.data, bytes) and len(failure.data) == 1 and failure.data[0] < 16
    assert "test_fuzz.py" in failure.where
    assert report.outcomes["RemoteError:MALFORMED_MESSAGE"] > 0


def test_a_slow_input_fails_the_entry() -> None:
    def run(data: int) -> None:
        if data == 0:  # 50 ms of CPU (the limit counts CPU time, not waiting)
            end = time.process_time() + 0.05
            while time.process_time() < end:
                pass

    report = run_entry(Entry("slow", lambda rng: rng.randrange(50), run), 200, 1, Limits(0.02))
    assert report.slow and not report.ok
    assert report.slowest_input == 0


def test_a_hanging_input_is_interrupted_and_fails_the_entry() -> None:
    def run(data: int) -> None:
        while data == 3:  # a parser stuck in a loop
            pass

    limits = Limits(hang_seconds=0.2)
    report = run_entry(Entry("hang", lambda rng: rng.randrange(8), run), 40, 1, limits)
    assert not report.ok
    assert report.failures["InputHung"].data == 3
    assert report.outcomes["accepted"] > 0  # the run went on after the hang


def test_memory_growth_fails_the_entry() -> None:
    kept: list[bytes] = []
    leaky = Entry("leaky", lambda rng: rng.randbytes(64), kept.append)
    report = run_entry(leaky, 2000, seed=1, limits=Limits(max_block_growth=1000))
    assert report.leaked and not report.ok
    tidy = run_entry(Entry("tidy", lambda rng: rng.randbytes(64), len), 2000, 1)
    assert tidy.ok and abs(tidy.block_growth) < 1000


@dataclass
class _Owner:
    boundary: FailureBoundary


class _PlantedHarness:
    """Contains a ValueError for inputs below 5, lets a KeyError escape for input 7, waits
    for ever on input 9."""

    def __init__(self, owner: object) -> None:
        self._boundary = require_boundary(owner)

    def boundaries(self) -> dict[str, FailureBoundary]:
        return {"planted": self._boundary}

    def outcomes(self) -> dict[str, int]:
        return {}

    async def feed(self, data: Any) -> None:
        await trio.lowlevel.checkpoint()
        if data == 7:
            raise KeyError("escaped")
        if data == 9:
            await trio.sleep_forever()  # on the virtual clock: fails after 120 s, at once
        with self._boundary.guard("peer", "input"):
            if data < 5:
                raise ValueError("contained")
            raise RemoteError(ErrorCode.MALFORMED_MESSAGE, "typed")


def _live_report(owner: object) -> Report:
    @asynccontextmanager
    async def open_harness() -> AsyncIterator[Harness]:
        yield _PlantedHarness(owner)

    entry = LiveEntry("planted", lambda rng: rng.randrange(20), open_harness)

    async def main() -> Report:
        return await run_live(entry, 200, seed=1)

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_live_defects_fail_the_entry() -> None:
    report = _live_report(_Owner(FailureBoundary(logging.getLogger("p2pnode.test_fuzz"))))
    assert not report.ok
    assert report.failures["planted contained ValueError"].data < 5
    assert "test_fuzz.py" in report.failures["planted contained ValueError"].where
    assert report.failures["KeyError"].data == 7
    assert report.failures["TooSlowError"].data == 9
    assert report.outcomes["planted.typed"] > 0
    assert report.outcomes["planted.unexpected ValueError"] > 0


def test_a_live_entry_without_its_boundary_fails_loudly() -> None:
    report = _live_report(object())
    assert not report.ok and report.inputs == 0
    (failure,) = report.failures.values()
    assert "no FailureBoundary" in failure.message


# -- one field of the wrong type, per decoder ---------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A decoder of the table, fed valid plain forms with one field replaced."""

    entry: str
    seeds: Callable[[], Sequence[Any]]
    encode: Callable[[Any], Any] = pack_plain
    json: bool = False


def _plains(seeds: Callable[[], Sequence[bytes]]) -> Callable[[], list[Any]]:
    return lambda: [unpack_plain(s) for s in seeds()]


def _card_plains() -> list[Any]:
    return [c.to_dict() for c in cards()]


def _datagram(plain: Any) -> bytes:
    return datagram_seeds()[0][:HEADER_BYTES] + pack_plain(plain)


def _request_plains() -> list[Any]:
    return [unpack_plain(d[HEADER_BYTES:]) for d in datagram_seeds()[:5]]


def _no_encoding(plain: Any) -> Any:
    return plain


CASES = [
    Case("card.msgpack", _card_plains),
    Case("card.json", _card_plains, json.dumps, json=True),
    Case("card.dict", _card_plains, _no_encoding),
    Case("envelope.msgpack", _plains(envelope_seeds)),
    Case("envelope.dict", _plains(envelope_seeds), _no_encoding),
    Case("envelope.json", lambda: [json.loads(t) for t in envelope_json_seeds()], json.dumps, True),
    Case("frame", _plains(frame_seeds)),
    Case("registry", _plains(lambda: (registry_seed(),))),
    Case("tool.json", lambda: [json.loads(t) for t in tool_seeds()], json.dumps, json=True),
    Case("dht.datagram", _request_plains, _datagram),
    Case("dht.value", _plains(value_seeds)),
    Case("dht.record", _plains(lambda: tuple(r.to_bytes() for r in records()))),
    Case("dht.provider", _plains(lambda: (provider_payload(),))),
    Case("secure.payload", _plains(lambda: (INITIATOR.payload,))),
    Case("crdt.clock", _plains(clock_seeds)),
    Case("crdt.delta", _plains(delta_seeds)),
    Case("crdt.sealed", _plains(sealed_seeds)),
    Case("crdt.gossip", _plains(gossip_frames)),
    Case("crdt.gossip_payload", _plains(gossip_payload_seeds)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.entry)
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_one_wrong_field_raises_only_the_typed_error(case: Case, data: st.DataObject) -> None:
    entry = ENTRIES[case.entry]
    plain = data.draw(st.sampled_from(case.seeds()))
    bad = data.draw(one_field_replaced(plain, json_wrong_values if case.json else wrong_values))
    try:
        encoded = case.encode(bad)
    except (TypeError, ValueError, OverflowError):
        reject()  # a value this encoder cannot carry never reaches the decoder
    try:
        entry.run(encoded)
    except entry.expected:
        pass
