"""p2pnode.services.shared.docops, the shared documents' pure conversions: the gossip
payload's decoder (a property over any JSON-like value) and the JSON document
operations of the control socket and the CLI."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.core.errors import ErrorCode, LocalError
from p2pnode.crdt.gossip import GossipError
from p2pnode.crdt.ops import CounterAdd, RegisterSet, SetAdd
from p2pnode.services.shared.docops import (
    decode_gossip_payload_untrusted,
    gossip_payload,
    op_from_json,
    value_to_json,
)


@given(
    st.recursive(
        st.none() | st.binary() | st.text() | st.integers(),
        lambda c: st.dictionaries(st.text(), c) | st.lists(c),
    )
)
def test_gossip_payload_decoder_raises_only_gossip_errors(obj: Any) -> None:
    try:
        doc, frame = decode_gossip_payload_untrusted(obj)
    except GossipError as exc:
        assert exc.code is ErrorCode.MALFORMED_MESSAGE
    else:
        assert gossip_payload(doc, frame) == obj



def test_json_operations() -> None:
    now = 1_700_000_000_000
    assert op_from_json({"op": "counter.add", "path": "n", "amount": -2}, now_ms=now) == CounterAdd(
        ("n",), -2
    )
    assert op_from_json({"op": "register.set", "path": ["a", "b"], "value": 1.5}, now_ms=now) == (
        RegisterSet(("a", "b"), 1.5, now)
    )
    assert op_from_json({"op": "set.add", "path": ["s"], "element": 3}, now_ms=now) == SetAdd(
        ("s",), 3
    )
    for bad in ({"op": "nope"}, {"op": "set.add", "path": [], "element": 1},
                {"op": "set.add", "path": ["s"], "element": True},
                {"op": "counter.add", "path": ["n"], "amount": "1"}, [1]):  # fmt: skip
        with pytest.raises(LocalError) as info:
            op_from_json(bad, now_ms=now)
        assert info.value.code is ErrorCode.INVALID_ARGUMENT
    assert value_to_json({"s": frozenset({"b", "a"}), "x": b"\x00"}) == {
        "s": ["a", "b"],
        "x": "AA==",
    }
