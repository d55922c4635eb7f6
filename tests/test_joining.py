"""Joining's rules without a network (docs/protocol/node.md "Joining"): the bootstrap
address forms, the one-line status, warnings once per address, the retry schedule
(driven with injected dialing on trio's virtual clock), and the DHT's rejoin and
republish hooks that keep a node's records where readers look."""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.dht.publish import Publisher
from p2pnode.dht.records import RecordKind, RecordStore, SignedRecord
from p2pnode.dht.rejoin import Rejoin, RejoinState
from p2pnode.dht.routing import Contact
from p2pnode.node.config import KernelConfig, bootstrap_problem, format_address, parse_bootstrap
from p2pnode.node.joining import Joining, JoinLog, JoinState, JoinStatus, Outcome
from p2pnode.transport.net import Address
from tests.sim.dht import identity, virtual_ms
from tests.sim.waiting import wait_until

# -- address forms ------------------------------------------------------------------------------

LABEL = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)
HOST_NAMES = st.lists(LABEL, min_size=1, max_size=4).map(".".join)
HOSTS = st.one_of(
    HOST_NAMES,
    st.ip_addresses(v=4).map(str),
    st.ip_addresses(v=6).map(str),
)
PORTS = st.integers(min_value=1, max_value=65535)


@given(host=HOSTS, port=PORTS)
def test_every_accepted_form_reads_back_as_written(host: str, port: int) -> None:
    assert parse_bootstrap(format_address((host, port))) == (host, port)
    assert bootstrap_problem((host, port)) is None


@given(text=st.text(max_size=40))
def test_any_text_is_an_address_or_a_config_error_naming_it(text: str) -> None:
    try:
        host, port = parse_bootstrap(text)
    except LocalError as exc:
        assert exc.code is ErrorCode.CONFIG_ERROR
        assert repr(text) in exc.message
    else:
        assert 1 <= port <= 65535 and bootstrap_problem((host, port)) is None


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("http://seed.example.org:7400", "a URL (http://) is not a bootstrap address"),
        ("seed.example.org", "no port"),
        ("seed.example.org:0", "the port must be 1-65535"),
        ("seed.example.org:65536", "the port must be 1-65535"),
        ("seed.example.org:port", "the port must be 1-65535"),
        ("seed example:7400", "is not a host name or an IP address"),
        ("[::1:7400", "unbalanced brackets"),
        (":7400", "no port"),
    ],
)
def test_a_malformed_bootstrap_address_is_a_config_error(text: str, why: str) -> None:
    with pytest.raises(LocalError) as info:
        parse_bootstrap(text)
    assert info.value.code is ErrorCode.CONFIG_ERROR
    assert info.value.message.startswith(f"bootstrap address {text!r}: ")
    assert why in info.value.message


def test_the_library_config_refuses_a_malformed_bootstrap_pair() -> None:
    assert KernelConfig(bootstrap=(("localhost", 7400), ("::1", 7400))).bootstrap
    for bad in (("x", 0), ("", 7400), ("http://x", 1)):
        with pytest.raises(LocalError) as info:
            KernelConfig(bootstrap=(bad,))
        assert info.value.code is ErrorCode.CONFIG_ERROR


# -- status and log -----------------------------------------------------------------------------


def test_the_status_line_says_whether_the_node_joined() -> None:
    def line(state: JoinState, reached: int = 0, peers: int = 0, due: float | None = None) -> str:
        return JoinStatus(state, 2, reached, peers, 3, due).summary()

    assert line(JoinState.JOINED, 1, 3) == "joined via 1 of 2 bootstrap peers, 3 peers"
    assert line(JoinState.RETRYING, due=7.6) == (
        "not joined: no bootstrap peer answered; retrying in 8 s, 0 peers"
    )
    alone = "no bootstrap peers (others join through this node), 1 peer"
    assert line(JoinState.ALONE, peers=1) == alone
    assert JoinStatus(JoinState.JOINED, 0, 0, 1, 0, None).summary() == "joined, 1 peer"
    as_dict = JoinStatus(JoinState.RETRYING, 2, 0, 0, 3, 4.0).to_dict()
    assert as_dict["joined"] is False and as_dict["state"] == "retrying"
    assert as_dict["summary"].startswith("not joined")


def test_each_failing_address_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="p2pnode.node")
    log = JoinLog()
    for _ in range(5):
        log.outcome("a.example:1", Outcome.UNRESOLVED, "no such name", retrying=True)
        log.outcome("10.0.0.9:1", Outcome.UNREACHABLE, "refused", retrying=True)
        log.outcome("10.0.0.8:1", Outcome.DHT_ONLY, "", retrying=False)
        log.outcome("10.0.0.7:1", Outcome.CHANNEL, "", retrying=False)
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said == [
        (logging.WARNING, "bootstrap a.example:1: cannot resolve the host: no such name; "
                          "retrying with backoff"),
        (logging.WARNING, "bootstrap 10.0.0.9:1: unreachable: refused; retrying with backoff"),
        (logging.INFO, "bootstrap 10.0.0.8:1: no p2pnode channel there; joining by its DHT"),
    ]  # fmt: skip
    # Another kind of failure of the same address is news.
    assert log.outcome("a.example:1", Outcome.UNREACHABLE, "refused", retrying=True)


# -- attempts and retries, dialing injected -----------------------------------------------------


class FakeSwarm:
    """What joining dials, answering from ``up_at`` (trio time) on; names resolve to
    ``10.0.0.x`` except those in ``unresolvable``."""

    def __init__(self, up_at: float, unresolvable: frozenset[str] = frozenset()) -> None:
        self.up_at = up_at
        self.unresolvable = unresolvable
        self.dials: list[float] = []
        self.published = 0
        self.bootstrapped: list[list[Address]] = []

    async def resolve(self, address: Address) -> Address:
        if address[0] in self.unresolvable:
            raise OSError("Name or service not known")
        return address if address[0][0].isdigit() else ("10.0.0.99", address[1])

    async def open_channel(self, address: Address) -> object:
        self.dials.append(trio.current_time())
        await trio.sleep(0.01)
        if trio.current_time() < self.up_at:
            raise OSError(f"connection refused by {address}")
        return object()

    async def bootstrap(self, addresses: list[Address]) -> None:
        self.bootstrapped.append(addresses)

    async def publish(self) -> None:
        self.published += 1


def joining_for(
    swarm: FakeSwarm,
    bootstrap: tuple[Address, ...],
    seed: int = 1,
    bootstrap_dht: Callable[[list[Address]], Awaitable[None]] | None = None,
) -> Joining:
    return Joining(
        bootstrap,
        open_channel=swarm.open_channel,
        bootstrap_dht=swarm.bootstrap if bootstrap_dht is None else bootstrap_dht,
        publish=swarm.publish,
        is_own=lambda address: address == ("10.0.0.1", 7000),
        peers=lambda: 0,
        dht_contacts=lambda: 0,
        dial_timeout=5.0,
        rng=random.Random(seed),
        resolve=swarm.resolve,
    )


async def test_retries_back_off_until_a_bootstrap_peer_answers(autojump_clock: Any) -> None:
    swarm = FakeSwarm(up_at=100.0, unresolvable=frozenset({"gone.example"}))
    joining = joining_for(swarm, (("10.0.0.1", 7000), ("seed.example", 7000), ("gone.example", 1)))
    async with trio.open_nursery() as nursery:
        assert await joining.join(nursery) == 0
        assert joining.state is JoinState.RETRYING
        assert joining.outcomes == {
            ("10.0.0.1", 7000): Outcome.SELF,
            ("seed.example", 7000): Outcome.UNREACHABLE,
            ("gone.example", 1): Outcome.UNRESOLVED,
        }
        status = joining.status(trio.current_time())
        assert (status.bootstrap, status.reached) == (2, 0)
        assert status.next_attempt_in is not None and 1.5 <= status.next_attempt_in <= 2.5
        await wait_until(lambda: joining.state is JoinState.JOINED, timeout=400, interval=1.0)
    # Each gap doubles (±25%) from 2 s, as the DHT's rejoin schedule does.
    gaps = [b - a for a, b in zip(swarm.dials, swarm.dials[1:], strict=False)]
    for n, gap in enumerate(gaps):
        expected = min(2.0 * 2**n, 300.0)
        assert 0.75 * expected <= gap - 0.01 <= 1.25 * expected, (n, gaps)
    assert len(swarm.dials) == len(gaps) + 1 <= 7
    assert swarm.dials[-1] >= 100.0
    assert swarm.bootstrapped[-1] == [("10.0.0.99", 7000)]  # the name, resolved
    assert swarm.published == 1  # once joined, the cards go out again
    assert joining.status(trio.current_time()).summary() == (
        "joined via 1 of 2 bootstrap peers, 0 peers"
    )


async def test_a_list_naming_only_this_node_leaves_it_alone(autojump_clock: Any) -> None:
    swarm = FakeSwarm(up_at=0.0)
    joining = joining_for(swarm, (("10.0.0.1", 7000),))
    async with trio.open_nursery() as nursery:
        assert await joining.join(nursery) == 0
        assert joining.state is JoinState.ALONE
    assert swarm.dials == []  # and no retry loop was started


async def test_connecting_joins_and_bootstraps_an_empty_dht(autojump_clock: Any) -> None:
    swarm = FakeSwarm(up_at=0.0)
    joining = joining_for(swarm, ())
    assert joining.state is JoinState.ALONE
    await joining.connected(("10.0.0.5", 7000))
    assert joining.joined
    assert swarm.bootstrapped == [[("10.0.0.5", 7000)]] and swarm.published == 1


# -- the DHT's hooks ----------------------------------------------------------------------------

SEED = ("10.0.0.1", 4000)


def test_rejoin_says_when_the_table_refilled() -> None:
    rejoin = Rejoin(random.Random(1))
    rejoin.remember_bootstrap([SEED])
    assert rejoin.observe(3, 0.0) is False  # it never was empty
    assert rejoin.observe(0, 1.0) is False
    assert rejoin.state is RejoinState.WAITING
    assert rejoin.observe(2, 2.0) is True  # a peer's request refilled it
    rejoin.observe(0, 3.0)
    assert rejoin.handle_timer(rejoin.next_deadline())
    assert rejoin.finished(0, 10.0) is False
    assert rejoin.handle_timer(rejoin.next_deadline())
    assert rejoin.finished(1, 20.0) is True


@given(batches=st.lists(st.lists(st.integers(1, 50), max_size=6), min_size=1, max_size=8))
def test_bootstrap_addresses_accumulate_newest_kept(batches: list[list[int]]) -> None:
    rejoin = Rejoin(random.Random(1), max_seeds=8)
    for batch in batches:
        rejoin.remember_bootstrap([("10.0.0.1", p) for p in batch])
    seeds = rejoin.seeds
    assert len(seeds) == len(set(seeds)) <= 8
    last = list(dict.fromkeys(("10.0.0.1", p) for p in batches[-1]))[-8:]
    if last:
        assert seeds[-len(last) :] == last  # the latest batch is all there


async def test_republish_now_puts_every_kept_record_before_it_is_due(
    autojump_clock: Any,
) -> None:
    owner = identity(random.Random(2))
    stored: list[bytes] = []

    async def lookup(key: bytes) -> tuple[list[Contact], list[SignedRecord]]:
        return [Contact(bytes(20), "10.0.0.2", 4000)], []

    async def store(contacts: list[Contact], key: bytes, value: bytes) -> int:
        stored.append(key)
        return len(contacts)

    publisher = Publisher(
        RecordStore(), lookup, store, wall_clock_ms=virtual_ms, republish_interval=1800.0
    )
    publisher.start(0.0)
    keys = [bytes([n]) * 32 for n in range(3)]
    for key in keys:

        def make(key: bytes = key) -> SignedRecord:
            return SignedRecord.create(
                owner, RecordKind.PROVIDER, key, 1, virtual_ms() + 60_000, b"x"
            )

        publisher.keep(key, RecordKind.PROVIDER, make)
    assert await publisher.republish_if_due(10.0) == 0  # not due for half an hour
    assert await publisher.republish_now(10.0) == 3
    assert stored == keys


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), up_at=st.floats(0.0, 2000.0))
def test_attempts_follow_the_backoff_and_stop_at_the_first_answer(seed: int, up_at: float) -> None:
    swarm = FakeSwarm(up_at=up_at)
    joining = joining_for(swarm, (("10.0.0.2", 7000),), seed=seed)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            await joining.join(nursery)
            await wait_until(lambda: joining.joined, timeout=up_at + 400, interval=1.0)

    trio.run(run, clock=trio.testing.MockClock(autojump_threshold=0))
    dials = swarm.dials
    # Joined at the first attempt after the peer came up, never before, never twice.
    assert dials[-1] + 0.01 >= up_at and all(d + 0.01 < up_at for d in dials[:-1])
    for n, (a, b) in enumerate(itertools.pairwise(dials)):
        expected = min(2.0 * 2**n, 300.0)
        assert 0.75 * expected <= b - a - 0.01 <= 1.25 * expected
    assert joining.status(0.0).attempts == len(dials)


async def test_a_failing_attempt_in_the_background_is_logged_and_tried_again(
    autojump_clock: Any, caplog: pytest.LogCaptureFixture
) -> None:
    swarm = FakeSwarm(up_at=0.0)
    calls: list[float] = []

    async def broken_then_fine(addresses: list[Address]) -> None:
        calls.append(trio.current_time())
        if len(calls) == 2:  # the first retry: something unexpected goes wrong
            raise ValueError("unexpected")

    swarm.up_at = 5.0
    joining = joining_for(swarm, (("10.0.0.2", 7000),), bootstrap_dht=broken_then_fine)
    async with trio.open_nursery() as nursery:
        await joining.join(nursery)
        await wait_until(lambda: joining.joined, timeout=120, interval=1.0)
    assert len(calls) >= 3
    failed = [r for r in caplog.records if "the attempt failed: ValueError" in r.getMessage()]
    assert len(failed) == 1 and failed[0].levelno == logging.ERROR
