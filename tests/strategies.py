"""Hypothesis strategies shared by the tests."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import strategies as st

from p2pnode.core.card import AgentCard, Capability, Endpoint
from p2pnode.core.envelope import Envelope, MessageType, Metadata
from p2pnode.core.identity import Identity

_IDENT_FIRST = "abcdefghijklmnopqrstuvwxyz0123456789"
#: Identifiers: ``[a-z0-9][a-z0-9._-]{0,20}``, built from two draws (a quarter of the
#: time ``st.from_regex`` takes for the same strings, and envelopes draw four each).
ident_text = st.builds(
    str.__add__, st.sampled_from(_IDENT_FIRST), st.text(_IDENT_FIRST + "._-", max_size=20)
)
short_text = st.text(min_size=1, max_size=30).filter(lambda s: s.strip() != "")

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**53), max_value=2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)

identities = st.binary(min_size=32, max_size=32).map(Identity)

capabilities = st.builds(
    Capability,
    id=ident_text,
    name=short_text,
    description=st.text(max_size=40),
    input_schema=json_values,
    output_schema=json_values,
)

addresses = st.builds(
    lambda a, b, port: f"10.{a}.{b}.1:{port}",
    st.integers(0, 255),
    st.integers(0, 255),
    st.integers(1, 65535),
)

#: A part of a card's version, ``[0-9]{1,2}``.
_version_part = st.text("0123456789", min_size=1, max_size=2)

# The parts of a card, built once here rather than inside cards() at every draw: a
# strategy built anew is validated anew, a fifth of a card's drawing time.
_card_capabilities = st.lists(capabilities, max_size=4, unique_by=lambda c: c.id)
_versions = st.lists(_version_part, min_size=3, max_size=3).map(".".join)
_protocols = st.lists(st.sampled_from(["a2a/1.0", "p2pnode/1", "mcp"]), max_size=3).map(tuple)
_endpoints = st.lists(st.builds(Endpoint, st.just("tcp+noise"), addresses), max_size=2).map(
    tuple
)
_card_addresses = st.lists(addresses, max_size=3).map(tuple)
_optional_ident = st.none() | ident_text
_optional_key = st.none() | st.binary(min_size=32, max_size=32)


@st.composite
def cards(draw: st.DrawFn, identity: Identity | None = None, signed: bool = True) -> AgentCard:
    owner = identity if identity is not None else draw(identities)
    caps = draw(_card_capabilities)
    issued = draw(st.integers(0, 2**40))
    card = AgentCard(
        id=draw(ident_text),
        name=draw(short_text),
        version=draw(_versions),
        description=draw(st.text(max_size=40)),
        tier=draw(st.integers(0, 3)),
        protocols=draw(_protocols),
        endpoints=draw(_endpoints),
        capabilities=tuple(caps),
        revision=draw(st.integers(0, 1000)),
        sandbox_id=draw(_optional_ident),
        last_seen_at=draw(st.integers(0, 2**40)),
        public_key=owner.public_key,
        addresses=draw(_card_addresses),
        noise_static_key=draw(_optional_key),
        issued_at=issued,
        expires_at=issued + draw(st.integers(1, 2**30)),
    )
    return card.signed(owner) if signed else card


metadata = st.builds(
    Metadata,
    tier=st.none() | st.integers(0, 3),
    sandbox_id=st.none() | ident_text,
    routing_hint=st.none() | st.just("capability"),
    escalation_justification=st.none() | st.text(max_size=30),
    capability=st.none() | ident_text,
)

envelopes = st.builds(
    Envelope,
    id=ident_text,
    sender=ident_text,
    recipient=ident_text | st.just("*"),
    type=st.sampled_from(list(MessageType)),
    timestamp=st.integers(1, 2**45),
    payload=json_values,
    correlation_id=st.none() | ident_text,
    metadata=st.none() | metadata,
)


# -- one field of the wrong type ------------------------------------------------------------------


def _nested_list(depth: int) -> Any:
    obj: Any = None
    for _ in range(depth):
        obj = [obj]
    return obj


def _mixed_keys(key: str, value: Any) -> dict[Any, Any]:
    # The same key as bytes and as text: keys that do not compare with each other.
    return {key.encode(): value, key: value}


_small = st.none() | st.booleans() | st.integers(0, 3) | st.text(max_size=3)

#: Values a msgpack decoder can produce, to put where a field of another type is expected:
#: scalars of every type (NaN and infinities among the floats), unhashable lists and maps,
#: maps mixing bytes and str keys, and nesting deeper than any limit.
wrong_values: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
    st.text(max_size=20),
    st.binary(max_size=40),
    st.lists(_small, max_size=3),
    st.dictionaries(st.text(max_size=3), _small, max_size=3),
    st.builds(_mixed_keys, st.text(min_size=1, max_size=4), _small),
    st.integers(2, 60).map(_nested_list),
)

#: The same for JSON decoders: no bytes, but integers of any size.
json_wrong_values: st.SearchStrategy[Any] = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),
    st.text(max_size=20),
    st.lists(_small, max_size=3),
    st.dictionaries(st.text(max_size=3), _small, max_size=3),
    st.integers(2, 60).map(_nested_list),
)


def _paths(obj: Any) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = [()]
    stack: list[tuple[tuple[Any, ...], Any]] = [((), obj)]
    while stack:
        path, node = stack.pop()
        children = (
            node.items()
            if isinstance(node, dict)
            else enumerate(node)
            if isinstance(node, list)
            else ()
        )
        for key, child in children:
            out.append((*path, key))
            stack.append(((*path, key), child))
    return out


@st.composite
def one_field_replaced(
    draw: st.DrawFn, plain: Any, values: st.SearchStrategy[Any] = wrong_values
) -> Any:
    """A copy of the decoded form ``plain`` (maps, lists, scalars) with exactly one node, at
    any depth and the root included, replaced by one of ``values``; or, for a map entry
    when ``values`` may hold bytes, its key replaced by the bytes twin (mixed key types)."""
    obj = copy.deepcopy(plain)
    path = draw(st.sampled_from(_paths(obj)))
    if not path:
        return draw(values)
    parent = obj
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if values is wrong_values and isinstance(key, str) and draw(st.integers(0, 4)) == 0:
        parent[key.encode()] = parent.pop(key)
    else:
        parent[key] = draw(values)
    return obj
