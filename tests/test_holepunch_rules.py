"""The hole-punch rules (docs/protocol/holepunch.md §3-4): one attempt's state machine,
the per-peer budget, and the responder's refusals, without sockets."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.agent.definition import Agent
from p2pnode.core.card import AgentCard
from p2pnode.core.envelope import Envelope, MessageType
from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.core.identity import Identity, PeerId
from p2pnode.node.holepunch import (
    Connect,
    HolePunchError,
    HolePunchService,
    Observe,
    Punch,
    PunchBudget,
    PunchConfig,
    PunchState,
    Role,
    Sync,
    dialable,
    encode_message,
)
from p2pnode.node.service import ServiceHost
from p2pnode.transport.net import Address

CONFIG = PunchConfig()
OWN: tuple[Address, ...] = (("203.0.113.5", 7000), ("10.0.0.2", 7000))
PEER: tuple[Address, ...] = (("203.0.113.9", 7000),)
TERMINAL = {PunchState.DIRECT, PunchState.FAILED}
ALLOWED = {
    PunchState.IDLE: {PunchState.EXPECT_REPLY, PunchState.EXPECT_SYNC, PunchState.FAILED},
    PunchState.EXPECT_REPLY: {PunchState.DIALING, PunchState.FAILED},
    PunchState.EXPECT_SYNC: {PunchState.DIALING, PunchState.FAILED},
    PunchState.DIALING: TERMINAL,
}

Step = Callable[[Punch, float], object]
STEPS: dict[str, Step] = {
    "start": lambda p, now: p.start(now),
    "reply": lambda p, now: p.receive_reply(Connect(PEER), now),
    "connect": lambda p, now: p.receive_connect(Connect(PEER), now),
    "sync": lambda p, now: p.receive_sync(now),
    "dialed-direct": lambda p, now: p.dialed(True),
    "dialed-relayed": lambda p, now: p.dialed(False),
    "fail": lambda p, now: p.fail(),
    "timer": lambda p, now: p.handle_timer(now),
}


@given(
    st.sampled_from(list(Role)),
    st.lists(st.tuples(st.sampled_from(sorted(STEPS)), st.floats(0, 20)), max_size=12),
)
def test_every_step_is_a_listed_transition_or_refused_unchanged(
    role: Role, steps: list[tuple[str, float]]
) -> None:
    punch = Punch(role, OWN, CONFIG)
    now = 0.0
    for name, dt in steps:
        now += dt
        before = punch.state
        try:
            STEPS[name](punch, now)
        except (LocalError, HolePunchError) as exc:
            assert exc.code in (ErrorCode.ILLEGAL_TRANSITION,)
            assert punch.state is before  # refused: unchanged
            continue
        after = punch.state
        if before in TERMINAL:
            assert after is before  # an ended attempt stays ended
        elif after is not before:
            assert after in ALLOWED[before], (name, before, after)


@given(st.floats(0, 100), st.floats(0, 5))
def test_initiator_dials_half_a_round_trip_after_sync(t0: float, rtt: float) -> None:
    punch = Punch(Role.INITIATOR, OWN, CONFIG)
    assert punch.start(t0) == Connect(OWN)
    delay = punch.receive_reply(Connect(PEER), t0 + rtt)
    assert delay == pytest.approx(rtt / 2)
    assert punch.state is PunchState.DIALING and punch.dial_targets == PEER
    assert punch.hold >= 0.25


candidate_ips = st.one_of(
    st.ip_addresses(v=4).map(str),
    st.sampled_from(["127.0.0.1", "0.0.0.0", "224.0.0.1", "255.255.255.255", "::1", "::"]),
)


@given(
    st.lists(st.tuples(candidate_ips, st.integers(1, 65535)), max_size=8, unique=True),
    st.booleans(),
)
def test_dialed_candidates_are_the_first_dialable_ones(
    peer: list[Address], on_loopback: bool
) -> None:
    own: tuple[Address, ...] = (("127.0.0.1", 7000),) if on_loopback else OWN
    punch = Punch(Role.RESPONDER, own, CONFIG)
    punch.receive_connect(Connect(tuple(peer)), 0.0)
    punch.receive_sync(0.1)
    targets = punch.dial_targets
    assert len(targets) <= CONFIG.max_dials
    assert (
        list(targets)
        == [a for a in peer if dialable(a[0], loopback=on_loopback)][: CONFIG.max_dials]
    )
    for host, _ in targets:  # never the host's own services on a peer's word
        ip = ipaddress.ip_address(host)
        assert not (ip.is_unspecified or ip.is_multicast or ip.is_reserved)
        assert on_loopback or not ip.is_loopback


def test_responder_fails_without_sync_by_the_deadline() -> None:
    punch = Punch(Role.RESPONDER, OWN, CONFIG)
    assert punch.receive_connect(Connect(PEER), 10.0) == Connect(OWN)
    states = []
    for now in (10.0 + CONFIG.sync_timeout - 0.01, 10.0 + CONFIG.sync_timeout):
        punch.handle_timer(now)
        states.append(punch.state)
    assert states == [PunchState.EXPECT_SYNC, PunchState.FAILED]
    with pytest.raises(HolePunchError) as raised:
        punch.receive_sync(20.0)
    assert raised.value.details["reason"] == "UNEXPECTED_SYNC"


def test_initiator_fails_without_an_answer_by_the_deadline() -> None:
    punch = Punch(Role.INITIATOR, OWN, CONFIG)
    punch.start(0.0)
    punch.handle_timer(CONFIG.answer_timeout)
    assert punch.state is PunchState.FAILED
    with pytest.raises(LocalError):
        punch.receive_reply(Connect(PEER), CONFIG.answer_timeout + 1)


def test_roles_do_not_take_each_others_messages() -> None:
    with pytest.raises(LocalError):
        Punch(Role.RESPONDER, OWN, CONFIG).start(0.0)
    with pytest.raises(LocalError):
        Punch(Role.INITIATOR, OWN, CONFIG).receive_connect(Connect(PEER), 0.0)
    responder = Punch(Role.RESPONDER, OWN, CONFIG)
    responder.receive_connect(Connect(PEER), 0.0)
    with pytest.raises(LocalError):
        responder.receive_reply(Connect(PEER), 0.1)  # only an initiator expects a reply
    assert responder.state is PunchState.EXPECT_SYNC


# -- the budget -------------------------------------------------------------------------

PEERS = [Identity.generate().peer_id for _ in range(3)]


@given(st.lists(st.tuples(st.integers(0, 2), st.floats(0, 200), st.booleans()), max_size=40))
def test_budget_is_three_failures_then_the_backoff(events: list[tuple[int, float, bool]]) -> None:
    budget = PunchBudget(CONFIG)
    model: dict[int, tuple[int, float]] = {}  # peer -> failures in a row, last failure
    now = 0.0
    for who, dt, direct in events:
        now += dt
        peer = PEERS[who]
        count, last = model.get(who, (0, 0.0))
        blocked = count >= CONFIG.max_attempts and now < last + CONFIG.backoff
        assert (budget.retry_after(peer, now) > 0) == blocked
        if blocked:
            assert budget.retry_after(peer, now) == pytest.approx(last + CONFIG.backoff - now)
            continue  # nobody starts an attempt the budget refuses
        budget.note(peer, now, direct=direct)
        if direct:
            model.pop(who, None)
        else:
            fresh = count >= CONFIG.max_attempts  # the back-off was over
            model[who] = ((0 if fresh else count) + 1, now)


def test_budget_remembers_at_most_max_peers() -> None:
    config = PunchConfig(max_peers=4)
    budget = PunchBudget(config)
    peers = [Identity.generate().peer_id for _ in range(10)]
    for i, peer in enumerate(peers):
        for _ in range(config.max_attempts):
            budget.note(peer, float(i), direct=False)
    assert len(budget) == 4
    assert budget.retry_after(peers[-1], 10.0) > 0  # the newest are kept
    assert budget.retry_after(peers[0], 10.0) == 0


# -- the responder's refusals -----------------------------------------------------------


@dataclass
class _Links:
    """Fake kernel side: the channel to each peer is relayed unless listed direct."""

    direct: set[PeerId] = field(default_factory=set)

    def relayed(self, peer: PeerId) -> bool | None:
        return peer not in self.direct

    def observed(self, peer: PeerId) -> Address | None:
        return ("198.51.100.7", 40000) if peer in self.direct else None

    def direct_peers(self) -> list[PeerId]:
        return []  # no OBSERVE: the candidates are the listen address alone

    def listen_address(self) -> Address:
        return ("10.0.0.2", 7000)

    def sender(self) -> str:
        return "me"

    def cards_of(self, peer: PeerId) -> list[AgentCard]:
        return []

    def watch_open(self, watcher: Callable[[PeerId, bool], object]) -> None:
        pass

    async def adopt_punched(
        self, stream: trio.abc.Stream, peer: PeerId, *, initiator: bool
    ) -> None:
        raise AssertionError("no dial in these tests")


@dataclass
class _Card:
    peer_id: PeerId


@dataclass
class _Host:
    """Fake service host: security events recorded."""

    security_events: list[tuple[ErrorCode, str]] = field(default_factory=list)

    @property
    def events(self) -> _Host:
        return self

    def security(self, code: ErrorCode, what: str, *args: Any) -> None:
        self.security_events.append((code, what))


@dataclass
class _Envelope:
    payload: Any
    sender: str = "peer-agent"


async def _ask(service: HolePunchService, peer: PeerId, payload: Any) -> Any:
    """The service's answer to ``payload`` from ``peer-agent`` of ``peer`` (the sender
    card the kernel found for the channel it came on)."""
    reply = await service.serve(
        cast(Agent, None),
        cast(Envelope, _Envelope(payload)),
        "holepunch",
        cast(AgentCard, _Card(peer)),
    )
    assert reply is not None
    return reply


async def _dial_nowhere(local: Address, remote: Address) -> trio.abc.Stream:
    raise OSError("unreachable in this test")


def _service(host: _Host, links: _Links, **config: Any) -> HolePunchService:
    return HolePunchService(cast(ServiceHost, host), links, _dial_nowhere, PunchConfig(**config))


def _reason(reply: Any) -> str:
    assert reply.type is MessageType.ERROR
    return str(reply.payload["details"]["reason"])


async def test_refusals(autojump_clock: Any) -> None:
    peer = Identity.generate().peer_id
    host, links = _Host(), _Links()
    service = _service(host, links, sync_timeout=1.0, dial_timeout=0.5)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        malformed = await _ask(service, peer, {"type": "connect", "addresses": [1]})
        assert _reason(malformed) == "MALFORMED"
        assert host.security_events and host.security_events[0][0] is ErrorCode.MALFORMED_MESSAGE
        assert _reason(await _ask(service, peer, encode_message(Sync()))) == "UNEXPECTED_SYNC"
        assert _reason(await _ask(service, peer, encode_message(Observe()))) == "NOT_DIRECT"
        # Three CONNECTs whose SYNC never comes fail, then the budget refuses.
        for _ in range(CONFIG.max_attempts):
            answer = await _ask(service, peer, encode_message(Connect((("203.0.113.9", 7000),))))
            assert answer.type is MessageType.RESPONSE
            assert answer.payload == encode_message(Connect((("10.0.0.2", 7000),)))
            busy = await _ask(service, peer, encode_message(Connect(())))  # one at a time
            assert _reason(busy) == "RATE_LIMITED" and busy.payload["code"] == "BUSY"
            await trio.sleep(1.5)  # past the SYNC deadline
        refused = await _ask(service, peer, encode_message(Connect(())))
        assert _reason(refused) == "RATE_LIMITED"
        assert refused.payload["details"]["retryAfterMs"] > 200_000
        assert service.statistics()["failed"] == CONFIG.max_attempts
        links.direct.add(peer)  # once the channel is direct there is nothing to punch
        assert _reason(await _ask(service, peer, encode_message(Connect(())))) == "NOT_RELAYED"
        observed = await _ask(service, peer, encode_message(Observe()))
        assert observed.payload == {"type": "observed", "address": "198.51.100.7:40000"}
        nursery.cancel_scope.cancel()


async def test_connect_then_sync_dials_and_fails_back_to_relayed(autojump_clock: Any) -> None:
    peer = Identity.generate().peer_id
    host, links = _Host(), _Links()
    service = _service(host, links, dial_timeout=0.5)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        await _ask(service, peer, encode_message(Connect((("203.0.113.9", 7000),))))
        assert (await _ask(service, peer, encode_message(Sync()))).payload == {"type": "sync"}
        assert _reason(await _ask(service, peer, encode_message(Sync()))) == "UNEXPECTED_SYNC"
        await trio.sleep(1.0)  # the dials (all refused by _dial_nowhere) end
        assert service.statistics() == {"attempts": 1, "direct": 0, "failed": 1, "refused": 1}
        nursery.cancel_scope.cancel()


async def test_a_node_that_cannot_punch_refuses_connect() -> None:
    peer = Identity.generate().peer_id
    service = HolePunchService(cast(ServiceHost, _Host()), _Links(), None)
    async with trio.open_nursery() as nursery:
        await nursery.start(service.run)
        assert _reason(await _ask(service, peer, encode_message(Connect(())))) == "UNSUPPORTED"
        nursery.cancel_scope.cancel()
