"""The reachability check's sans-IO parts: the dial-back wire format (every parser holds
to ReachError on any input) and the verdict rule (docs/protocol/reachability.md §4):
one liar never decides; any two agreeing checkers of three do."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.services.reachability.verdict import (
    NatMapping,
    Reachability,
    Report,
    decide,
    pick_checkers,
    quorum_value,
)
from p2pnode.services.reachability.wire import (
    MAX_ADDRESSES,
    NONCE_BYTES,
    Candidate,
    DialAnswer,
    DialRequest,
    Outcome,
    ReachError,
    Transport,
    parse_answer_untrusted,
    parse_request_untrusted,
)

TCP = Candidate(Transport.TCP, "203.0.113.7", 7400)
UDP = Candidate(Transport.UDP, "203.0.113.7", 7400)
NONCE = b"n" * NONCE_BYTES

outcomes = st.sampled_from(list(Outcome))
hosts = st.sampled_from(["203.0.113.7", "198.51.100.1", "10.0.0.2"])
addresses = st.tuples(hosts, st.integers(1, 65535))


def report(name: str, tcp: Outcome, udp: Outcome, **kw: Any) -> Report:
    return Report(name, {TCP: tcp, UDP: udp}, **kw)


# -- the wire -----------------------------------------------------------------------------


candidates = st.builds(Candidate, st.sampled_from(list(Transport)), hosts, st.integers(1, 65535))


@given(st.lists(candidates, min_size=1, max_size=MAX_ADDRESSES, unique=True))
def test_a_request_and_its_answer_survive_the_wire(cands: list[Candidate]) -> None:
    request = DialRequest(NONCE, tuple(cands))
    assert parse_request_untrusted(request.to_payload()) == request
    answer = DialAnswer(NONCE, ("198.51.100.1", 4000), tuple(Outcome.REACHED for _ in cands))
    assert parse_answer_untrusted(answer.to_payload(), request) == answer


json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=20,
)


@given(json_like)
def test_any_payload_parses_or_raises_reach_error(payload: Any) -> None:
    request = DialRequest(NONCE, (TCP,))
    for parse in (parse_request_untrusted, lambda p: parse_answer_untrusted(p, request)):
        try:
            parse(payload)
        except ReachError:
            pass


@given(
    st.dictionaries(
        st.sampled_from(["nonce", "addrs", "observed", "results"]), json_like, max_size=4
    )
)
def test_any_map_with_the_right_keys_parses_or_raises_reach_error(payload: Any) -> None:
    request = DialRequest(NONCE, (TCP,))
    for parse in (parse_request_untrusted, lambda p: parse_answer_untrusted(p, request)):
        try:
            parse(payload)
        except ReachError:
            pass


@pytest.mark.parametrize(
    ("addrs", "code"),
    [
        ([["tcp", "203.0.113.7", 1]] * 2, "INVALID_INPUT"),  # named twice
        ([["tcp", f"203.0.113.{i}", 1] for i in range(MAX_ADDRESSES + 1)], "TOO_MANY_ITEMS"),
        ([["tcp", "example.org", 1]], "INVALID_INPUT"),  # never a name to resolve
        ([["tcp", "203.0.113.7", 0]], "INVALID_INPUT"),
        ([["tcp", "203.0.113.7", True]], "INVALID_INPUT"),
        ([["quic", "203.0.113.7", 1]], "INVALID_INPUT"),
        ([], "INVALID_INPUT"),
    ],
)
def test_a_bad_request_is_refused_with_its_code(addrs: list[Any], code: str) -> None:
    with pytest.raises(ReachError) as info:
        parse_request_untrusted({"nonce": NONCE, "addrs": addrs})
    assert str(info.value.code) == code


def test_an_answer_to_another_nonce_or_of_the_wrong_length_is_refused() -> None:
    request = DialRequest(NONCE, (TCP, UDP))
    good = DialAnswer(NONCE, None, (Outcome.REACHED, Outcome.REFUSED)).to_payload()
    assert parse_answer_untrusted(good, request).outcomes[1] is Outcome.REFUSED
    with pytest.raises(ReachError, match="nonce"):
        parse_answer_untrusted({**good, "nonce": b"x" * NONCE_BYTES}, request)
    with pytest.raises(ReachError, match="one outcome per candidate"):
        parse_answer_untrusted({**good, "results": ["reached"]}, request)


# -- the verdict --------------------------------------------------------------------------


@given(outcomes, outcomes, st.none() | addresses)
def test_one_checker_alone_decides_nothing(
    tcp: Outcome, udp: Outcome, seen: tuple[str, int] | None
) -> None:
    verdict = decide([report("liar", tcp, udp, observed=seen, mapped=seen)], [TCP, UDP])
    assert verdict.reachability is Reachability.UNKNOWN
    assert verdict.confirmed == verdict.denied == ()
    assert verdict.external_ip is None
    assert verdict.mapping is NatMapping.UNKNOWN


@given(outcomes, st.booleans())
def test_a_liar_against_one_honest_checker_leaves_it_unknown(lie: Outcome, first: bool) -> None:
    honest = Outcome.UNREACHABLE if lie is Outcome.REACHED else Outcome.REACHED
    pair = [report("honest", honest, honest), report("liar", lie, lie)]
    verdict = decide(pair if first else pair[::-1], [TCP, UDP])
    assert verdict.reachability is Reachability.UNKNOWN
    assert verdict.confirmed == verdict.denied == ()


@given(
    st.sampled_from([Outcome.REACHED, Outcome.UNREACHABLE, Outcome.REFUSED]),
    outcomes,
    st.permutations([0, 1, 2]),
)
def test_any_two_agreeing_of_three_decide(agreed: Outcome, liar: Outcome, order: list[int]) -> None:
    reports = [report("a", agreed, agreed), report("b", agreed, agreed), report("l", liar, liar)]
    verdict = decide([reports[i] for i in order], [TCP, UDP])
    if agreed is Outcome.REACHED:
        assert verdict.reachability is Reachability.REACHABLE
        assert verdict.confirmed == (TCP, UDP)
    else:  # refused counts as not reached: the request came from another IP
        assert verdict.reachability is Reachability.UNREACHABLE
        assert verdict.denied == (TCP, UDP)


@given(st.lists(outcomes, min_size=3, max_size=3))
def test_a_checker_reporting_twice_counts_once(said: list[Outcome]) -> None:
    twice = [report("a", Outcome.REACHED, Outcome.REACHED)] * 2
    verdict = decide(twice, [TCP, UDP])
    assert verdict.reachability is Reachability.UNKNOWN
    assert verdict.checkers == ("a",)


@given(addresses, addresses, st.permutations([0, 1, 2]))
def test_the_external_address_needs_two_agreeing(
    true: tuple[str, int], lie: tuple[str, int], order: list[int]
) -> None:
    reached = Outcome.REACHED
    reports = [
        report("a", reached, reached, observed=true, mapped=true),
        report("b", reached, reached, observed=true, mapped=true),
        report("l", reached, reached, observed=lie, mapped=lie),
    ]
    verdict = decide([reports[i] for i in order], [TCP, UDP])
    assert verdict.external_ip == true[0]
    assert verdict.mapping is NatMapping.CONSISTENT
    assert verdict.external_udp == true
    alone = decide([reports[2]], [TCP, UDP])
    assert alone.external_ip is None and alone.mapping is NatMapping.UNKNOWN


def test_three_different_mapped_ports_are_an_inconsistent_mapping() -> None:
    ports = [report(n, Outcome.REFUSED, Outcome.REFUSED, mapped=("198.51.100.9", p))
             for n, p in (("a", 1000), ("b", 2000), ("c", 3000))]  # fmt: skip
    verdict = decide(ports, [TCP, UDP])
    assert verdict.mapping is NatMapping.INCONSISTENT
    assert verdict.external_udp is None
    assert verdict.reachability is Reachability.UNREACHABLE


@given(st.lists(st.sampled_from("abcdef"), max_size=8))
def test_quorum_value_is_a_strict_plurality_of_at_least_two(values: list[str]) -> None:
    value = quorum_value(values)
    if value is not None:
        count = values.count(value)
        assert count >= 2
        assert all(values.count(v) < count for v in set(values) - {value})


@given(
    st.lists(st.integers(0, 20), max_size=10),
    st.lists(st.integers(0, 20), max_size=10),
    st.integers(1, 6),
    st.randoms(),
)
def test_checkers_come_from_the_lookup_first_and_never_twice(
    looked_up: list[int], met: list[int], count: int, rng: random.Random
) -> None:
    chosen = pick_checkers(looked_up, met, rng, count=count, exclude=[0])
    assert len(chosen) == len(set(chosen)) <= count
    assert 0 not in chosen
    assert set(chosen) <= set(looked_up) | set(met)
    available = (set(looked_up) | set(met)) - {0}
    assert len(chosen) == min(count, len(available))
    if set(looked_up) - {0}:
        assert chosen[0] in looked_up  # the network, not the node, names the first
