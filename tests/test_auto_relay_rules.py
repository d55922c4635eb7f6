"""The automatic relays' rules (docs/protocol/reachability.md §2.2, §7), without a
network: the choice (a pure function of offers, failures and configured relays), the
book of offers (backoff, forgetting, its bound), the ``relay`` field of a dial-back
answer (held to ReachError on any input, and to the checker's own relay), and the
driver on trio's virtual clock with fake listeners."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode, LocalError, RemoteError
from p2pnode.core.identity import Identity, PeerId
from p2pnode.services.reachability.autorelay import (
    AutoRelay,
    AutoRelayConfig,
    Offer,
    RelayBook,
    RelaySide,
    choose_relays,
)
from p2pnode.services.reachability.verdict import NatMapping, Reachability, Verdict
from p2pnode.services.reachability.wire import (
    MAX_RELAY_CHARS,
    NONCE_BYTES,
    Candidate,
    DialAnswer,
    DialRequest,
    Outcome,
    ReachError,
    Transport,
    offer_untrusted,
    parse_answer_untrusted,
)
from p2pnode.transport.relay import RelayAddress, format_relay_address
from tests.sim import wait_until

PEERS = [Identity(bytes([i + 1]) * 32).peer_id for i in range(6)]
OWN = Identity(b"\x99" * 32).peer_id
HOSTS = ["203.0.113.1", "203.0.113.2", "198.51.100.3"]
NONCE = b"n" * NONCE_BYTES
REQUEST = DialRequest(NONCE, (Candidate(Transport.TCP, "192.0.2.9", 7000),))


def relay(peer: PeerId, host: str = "203.0.113.1", port: int = 4100) -> RelayAddress:
    return RelayAddress((host, port), peer)


relays = st.builds(
    relay, st.sampled_from([*PEERS, OWN]), st.sampled_from(HOSTS), st.integers(1, 65535)
)
offers = st.builds(
    Offer,
    relays,
    st.floats(0, 100),
    st.integers(0, 3),
    st.sampled_from([0.0, 50.0, 200.0]),
)


# -- the choice ---------------------------------------------------------------------------


@given(
    st.lists(offers, max_size=10),
    st.lists(relays, max_size=3),
    st.floats(0, 300),
    st.integers(0, 4),
)
def test_the_choice_is_usable_diverse_and_as_large_as_it_can_be(
    table: list[Offer], held: list[RelayAddress], now: float, count: int
) -> None:
    chosen = choose_relays(
        table, configured=(), unreachable=True, held=held, own=OWN, now=now, count=count
    )
    usable = [o.relay for o in table if o.retry_at <= now and o.relay.relay_id != OWN]
    assert len(chosen) <= count
    assert all(r in usable for r in chosen)  # offered, not backing off, never itself
    assert len({r.address[0] for r in chosen}) == len(chosen)  # one per IP
    assert len({r.relay_id for r in chosen}) == len(chosen)  # one per relay
    if len(chosen) < count:  # nothing left out that could have been taken
        hosts, ids = {r.address[0] for r in chosen}, {r.relay_id for r in chosen}
        assert all(r.address[0] in hosts or r.relay_id in ids for r in usable)


@given(st.lists(offers, min_size=1, max_size=10), st.floats(0, 300))
def test_relays_held_and_still_usable_are_kept_first(table: list[Offer], now: float) -> None:
    first = choose_relays(
        table, configured=(), unreachable=True, held=(), own=OWN, now=now, count=2
    )
    again = choose_relays(
        table, configured=(), unreachable=True, held=first, own=OWN, now=now, count=2
    )
    assert again == first  # no churn while nothing changed
    for kept in first:
        # A held relay stays chosen even when a better one (fewer failures, older) shows up.
        better = Offer(relay(PEERS[5], "192.0.2.77"), -1.0)
        swapped = choose_relays(
            [better, *table], configured=(), unreachable=True, held=[kept], own=OWN,
            now=now, count=1,
        )  # fmt: skip
        assert swapped == (kept,)


@given(st.lists(offers, max_size=10), st.floats(0, 300), st.lists(relays, max_size=2))
def test_no_automatic_relay_with_configured_ones_or_without_an_unreachable_verdict(
    table: list[Offer], now: float, held: list[RelayAddress]
) -> None:
    configured = ("relay:192.0.2.1:4100/" + str(PEERS[0]),)
    for unreachable, given_relays in ((True, configured), (False, ()), (False, configured)):
        chosen = choose_relays(
            table, configured=given_relays, unreachable=unreachable, held=held, own=OWN,
            now=now, count=2,
        )  # fmt: skip
        assert chosen == ()


def test_one_host_running_many_relays_fills_one_place_only() -> None:
    table = [Offer(relay(p, "203.0.113.1", 4100 + i), float(i)) for i, p in enumerate(PEERS)]
    chosen = choose_relays(
        table, configured=(), unreachable=True, held=(), own=OWN, now=0.0, count=2
    )
    assert chosen == (table[0].relay,)
    # A second address of relay 0 on another host does not make it count twice.
    other = Offer(relay(PEERS[0], "198.51.100.3"), 9.0)
    chosen = choose_relays(
        [*table, other], configured=(), unreachable=True, held=(), own=OWN, now=0.0, count=2
    )
    assert chosen == (table[0].relay,)


def test_fewer_failures_then_older_offers_come_first() -> None:
    a = Offer(relay(PEERS[0], HOSTS[0]), seen=5.0, failures=1)
    b = Offer(relay(PEERS[1], HOSTS[1]), seen=9.0)
    c = Offer(relay(PEERS[2], HOSTS[2]), seen=7.0)
    chosen = choose_relays(
        [a, b, c], configured=(), unreachable=True, held=(), own=OWN, now=0.0, count=2
    )
    assert chosen == (c.relay, b.relay)


# -- the book -----------------------------------------------------------------------------


def verdict(reachability: Reachability) -> Verdict:
    return Verdict(reachability, (), (), None, NatMapping.UNKNOWN, None, ())


def book(**kw: Any) -> RelayBook:
    return RelayBook(AutoRelayConfig(**kw), OWN, ())


def test_a_failed_relay_backs_off_doubling_and_is_forgotten_after_max_failures() -> None:
    b = book(backoff_min=60.0, backoff_max=200.0, max_failures=4)
    b.verdict(verdict(Reachability.UNREACHABLE))
    r = relay(PEERS[0])
    b.offered(r, 0.0)
    assert b.wanted(0.0, ()) == (r,)
    waits = []
    now = 0.0
    for _ in range(3):
        b.failed(r, now)
        (offer,) = b.offers()
        waits.append(offer.retry_at - now)
        assert b.wanted(offer.retry_at - 0.001, ()) == ()  # skipped while it backs off
        assert b.wanted(offer.retry_at, ()) == (r,)
        assert b.next_deadline(now) == offer.retry_at
        now = offer.retry_at
    assert waits == [60.0, 120.0, 200.0]  # doubling, capped
    b.failed(r, now)
    assert b.offers() == []  # the 4th failure in a row: forgotten
    b.offered(r, now)  # offered anew by a later check: tried again
    assert b.wanted(now, ()) == (r,)


def test_a_held_reservation_clears_the_failures() -> None:
    b = book()
    r = relay(PEERS[0])
    b.offered(r, 0.0)
    b.failed(r, 0.0)
    b.held(r)
    assert b.offers() == [Offer(r, 0.0)]


def test_only_a_decisive_verdict_moves_the_book() -> None:
    b = book()
    b.offered(relay(PEERS[0]), 0.0)
    assert b.wanted(0.0, ()) == ()  # no verdict yet: no automatic relay
    b.verdict(verdict(Reachability.UNREACHABLE))
    assert len(b.wanted(0.0, ())) == 1
    b.verdict(verdict(Reachability.UNKNOWN))
    assert len(b.wanted(0.0, ())) == 1
    b.verdict(verdict(Reachability.REACHABLE))
    assert b.wanted(0.0, ()) == ()


def test_a_disabled_book_or_a_configured_relay_wants_none() -> None:
    for b in (
        book(enabled=False),
        RelayBook(AutoRelayConfig(), OWN, ("relay:192.0.2.1:4100/" + str(PEERS[5]),)),
    ):
        b.verdict(verdict(Reachability.UNREACHABLE))
        b.offered(relay(PEERS[0]), 0.0)
        assert b.wanted(0.0, ()) == ()


@given(
    st.lists(
        st.tuples(st.sampled_from(["offer", "fail", "held"]), relays, st.floats(0, 1000)),
        max_size=60,
    )
)
def test_the_book_stays_bounded_and_one_offer_per_relay(ops: list[Any]) -> None:
    b = book(max_offers=3)
    for op, r, now in ops:
        if op == "offer":
            b.offered(r, now)
        elif op == "fail":
            b.failed(r, now)
        else:
            b.held(r)
        table = b.offers()
        assert len(table) <= 3
        assert len({o.relay.relay_id for o in table}) == len(table)


def test_a_full_book_makes_room_only_in_place_of_a_relay_backing_off() -> None:
    b = book(max_offers=2)
    b.offered(relay(PEERS[0]), 0.0)
    b.offered(relay(PEERS[1]), 0.0)
    b.offered(relay(PEERS[2]), 0.0)
    assert [o.relay.relay_id for o in b.offers()] == PEERS[:2]
    assert b.dropped == 1
    b.failed(relay(PEERS[0]), 1.0)
    b.offered(relay(PEERS[2]), 2.0)
    assert [o.relay.relay_id for o in b.offers()] == [PEERS[1], PEERS[2]]


def test_configuration_is_checked() -> None:
    with pytest.raises(Exception, match="must be positive"):
        AutoRelayConfig(backoff_min=0)
    with pytest.raises(Exception, match="must be positive"):
        AutoRelayConfig(max_offers=0)


# -- the wire -----------------------------------------------------------------------------


def answer(relay_text: Any) -> dict[str, Any]:
    payload = DialAnswer(NONCE, ("192.0.2.9", 5000), (Outcome.UNREACHABLE,)).to_payload()
    payload["relay"] = relay_text
    return payload


@given(st.sampled_from(PEERS), st.sampled_from([*HOSTS, "2001:db8::7"]), st.integers(1, 65535))
def test_an_offered_relay_survives_the_wire(peer: PeerId, host: str, port: int) -> None:
    offered = DialAnswer(NONCE, None, (Outcome.REFUSED,), RelayAddress((host, port), peer))
    assert parse_answer_untrusted(offered.to_payload(), REQUEST) == offered
    # No relay: no key at all, so an old requester sees the answer it always saw.
    assert "relay" not in DialAnswer(NONCE, None, (Outcome.REFUSED,)).to_payload()


@pytest.mark.parametrize(
    "bad",
    [
        7,
        b"relay:203.0.113.1:4100/x",
        "",
        "203.0.113.1:4100",
        f"relay:203.0.113.1:4100/{PEERS[0]}x",
        f"relay:relay.example:4100/{PEERS[0]}",  # a name: nothing is resolved on a word
        f"relay:203.0.113.1:0/{PEERS[0]}",
        f"relay:203.0.113.1:4100/{PEERS[0]}" + " " * MAX_RELAY_CHARS,
        "relay:" + "1" * (MAX_RELAY_CHARS + 1),
    ],
)
def test_a_malformed_relay_fails_the_answer(bad: Any) -> None:
    with pytest.raises(ReachError) as caught:
        parse_answer_untrusted(answer(bad), REQUEST)
    assert caught.value.code is ErrorCode.INVALID_INPUT


@given(st.one_of(st.none(), st.integers(), st.text(max_size=200), st.binary(max_size=40)))
def test_any_relay_value_parses_or_raises_reach_error(value: Any) -> None:
    try:
        parsed = parse_answer_untrusted(answer(value), REQUEST)
    except ReachError:
        return
    assert parsed.relay is None or str(parsed.relay) == value


def test_only_the_checkers_own_relay_at_its_channels_ip_is_taken() -> None:
    checker = PEERS[0]
    text = format_relay_address(("203.0.113.1", 4100), checker)
    parsed = parse_answer_untrusted(answer(text), REQUEST)
    assert offer_untrusted(parsed, checker, "203.0.113.1") == relay(checker)
    for who, host in ((PEERS[1], "203.0.113.1"), (checker, "203.0.113.2"), (checker, None)):
        with pytest.raises(ReachError) as caught:
            offer_untrusted(parsed, who, host)
        assert caught.value.code is ErrorCode.INVALID_INPUT
    with pytest.raises(ReachError):
        offer_untrusted(parse_answer_untrusted(answer(None), REQUEST), checker, "203.0.113.1")


# -- the driver ---------------------------------------------------------------------------


@dataclass
class FakeListener:
    reservation: object | None = None
    failure: BaseException | None = None


@dataclass
class FakeNode:
    """The node as the driver sees it: listeners it starts, cards it publishes."""

    verdict: Verdict | None = None
    running: dict[RelayAddress, FakeListener] = field(default_factory=dict)
    published: list[tuple[str, ...]] = field(default_factory=list)
    asked: int = 0

    def start(self, r: RelayAddress) -> FakeListener:
        self.running[r] = FakeListener()
        return self.running[r]

    def stop(self, r: RelayAddress) -> None:
        del self.running[r]

    async def publish(self, relays: tuple[str, ...]) -> bool:
        self.published.append(relays)
        return True

    def want_offers(self) -> None:
        self.asked += 1

    def driver(self, config: AutoRelayConfig, configured: tuple[str, ...] = ()) -> AutoRelay:
        side = RelaySide(
            self.start, self.stop, self.publish, lambda: self.verdict, self.want_offers
        )
        return AutoRelay(side, RelayBook(config, OWN, configured))


async def test_the_driver_reserves_lists_replaces_and_drops(autojump_clock: Any) -> None:
    node = FakeNode()
    auto = node.driver(AutoRelayConfig(reserve_timeout=15.0, backoff_min=60.0))
    a, b, c = (relay(p, h) for p, h in zip(PEERS, HOSTS, strict=False))
    for r in (a, b, c):
        auto.offered(r)
    await auto.step(trio.current_time())
    assert node.running == {}  # no verdict yet
    node.verdict = verdict(Reachability.UNREACHABLE)
    await auto.step(trio.current_time())
    assert set(node.running) == {a, b}
    assert node.published == []  # nothing is listed before a reservation is held
    node.running[a].reservation = node.running[b].reservation = object()
    await auto.step(trio.current_time())
    assert node.published == [(str(a), str(b))]

    # a refuses a renewal: dropped at once, c takes its place (listed once reserved).
    node.running[a].reservation = None
    node.running[a].failure = RemoteError(ErrorCode.RELAY_REFUSED, "no", reason="X")
    await auto.step(trio.current_time())
    assert set(node.running) == {b, c}
    assert node.published[-1] == (str(b),)

    # c never grants one: it fails after reserve_timeout; a backs off, so none is left.
    await trio.sleep(14.0)
    await auto.step(trio.current_time())
    assert c in node.running
    await trio.sleep(1.0)
    await auto.step(trio.current_time())
    assert set(node.running) == {b}
    assert node.asked == 1  # too few relays to try: a check is asked for, once
    await auto.step(trio.current_time())
    assert node.asked == 1

    # a's backoff ends: it is tried again.
    await trio.sleep(60.0)
    await auto.step(trio.current_time())
    assert set(node.running) == {a, b}

    # A reachable verdict drops every automatic relay and its endpoints.
    node.verdict = verdict(Reachability.REACHABLE)
    await auto.step(trio.current_time())
    assert node.running == {}
    assert node.published[-1:] == [()]


async def test_a_node_with_configured_relays_starts_none(autojump_clock: Any) -> None:
    node = FakeNode(verdict=verdict(Reachability.UNREACHABLE))
    auto = node.driver(AutoRelayConfig(), configured=(f"relay:192.0.2.1:4100/{PEERS[5]}",))
    auto.offered(relay(PEERS[0]))
    with trio.move_on_after(30):
        await auto.run()
    assert node.running == {}
    assert node.published == []
    assert node.asked == 0


def test_the_protocol_doc_states_the_defaults_the_code_uses() -> None:
    doc = (Path(__file__).parent.parent / "docs/protocol/reachability.md").read_text()
    section = doc[doc.index("## 7. Automatic relays") :]
    cfg = AutoRelayConfig()
    assert f"up to {cfg.relays} reservations at once" in section
    assert f"at most {cfg.max_offers} offers" in section
    assert f"no reservation for {cfg.reserve_timeout:g} s" in section
    assert f"skipped for {cfg.backoff_min:g} s" in section
    assert f"up to {cfg.backoff_max:g} s" in section
    assert f"{cfg.max_failures} failures in a row" in section
    assert f"looked at every {cfg.poll:g} s" in section
    assert f"at most {MAX_RELAY_CHARS} characters" in doc


async def test_a_closing_node_that_starts_no_relay_does_not_stop_the_driver(
    autojump_clock: Any,
) -> None:
    node = FakeNode(verdict=verdict(Reachability.UNREACHABLE))

    def closing(r: RelayAddress) -> FakeListener:
        raise LocalError(ErrorCode.INVALID_ARGUMENT, "the LinkManager is not open")

    side = RelaySide(closing, node.stop, node.publish, lambda: node.verdict, node.want_offers)
    auto = AutoRelay(side, RelayBook(AutoRelayConfig(), OWN, ()))
    auto.offered(relay(PEERS[0]))
    await auto.step(trio.current_time())
    assert auto.statistics()["chosen"] == []
    assert node.published == []


async def test_the_driver_looks_once_per_poll_and_at_a_backoffs_end(autojump_clock: Any) -> None:
    node = FakeNode(verdict=verdict(Reachability.UNREACHABLE))
    looks: list[float] = []

    def seen() -> Verdict | None:
        looks.append(trio.current_time())
        return node.verdict

    side = RelaySide(node.start, node.stop, node.publish, seen, node.want_offers)
    book = RelayBook(AutoRelayConfig(poll=1.0, backoff_min=2.5), OWN, ())
    book.offered(relay(PEERS[0]), 0.0)
    book.failed(relay(PEERS[0]), trio.current_time())  # backs off until now + 2.5
    start = trio.current_time()
    with trio.move_on_after(60.5):
        await AutoRelay(side, book).run()
    offsets = [round(t - start, 3) for t in looks]
    assert offsets[:5] == [0.0, 1.0, 2.0, 2.5, 3.5]  # woken at the backoff's end too
    assert len(offsets) == 61  # then once a second up to 59.5: never a busy loop


async def test_an_idle_driver_waits_for_an_offer_or_a_verdict(autojump_clock: Any) -> None:
    """A node that wants no relay (no unreachable verdict) and holds none is not woken
    by a timer: only an offer or a new verdict makes it look again, at once."""
    node = FakeNode()
    looks: list[float] = []

    def seen() -> Verdict | None:
        looks.append(trio.current_time())
        return node.verdict

    side = RelaySide(node.start, node.stop, node.publish, seen, node.want_offers)
    auto = AutoRelay(side, RelayBook(AutoRelayConfig(poll=1.0), OWN, ()))
    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        await nursery.start(auto.run)
        await trio.sleep(600)
        assert len(looks) == 1
        auto.offered(relay(PEERS[0]))
        await wait_until(lambda: len(looks) == 2)
        assert looks[-1] == start + 600  # at once, not at a timer
        node.verdict = verdict(Reachability.UNREACHABLE)
        auto.poke()
        await trio.sleep(0.5)
        assert len(looks) == 3 and set(node.running) == {relay(PEERS[0])}
        await trio.sleep(10)  # it wants a relay now: it looks every poll
        assert len(looks) == 13
        nursery.cancel_scope.cancel()


async def test_early_checks_for_offers_back_off_while_none_come(autojump_clock: Any) -> None:
    """No relay is offered: a check is asked for at once, then after 60 s, doubling
    up to ``backoff_max``."""
    node = FakeNode(verdict=verdict(Reachability.UNREACHABLE))
    asked: list[float] = []
    start = trio.current_time()

    def want() -> None:
        asked.append(trio.current_time() - start)

    auto = AutoRelay(
        RelaySide(node.start, node.stop, node.publish, lambda: node.verdict, want),
        RelayBook(AutoRelayConfig(backoff_min=60.0, backoff_max=240.0, poll=1.0), OWN, ()),
    )
    with trio.move_on_after(1000):
        await auto.run()
    assert asked == [0.0, 60.0, 180.0, 420.0, 660.0, 900.0]  # 60, 120, 240, 240, ...
