"""The gateway's answer parts: its shortcut for a bare text part makes the very Part the
protobuf JSON mapping makes, and every other part still goes through that mapping."""

from __future__ import annotations

from typing import Any

from a2a.types import Part
from google.protobuf.json_format import ParseDict
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.bridges.a2a.gateway import _parts
from p2pnode.bridges.a2a.mapping import parts_of_payload

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(st.text(max_size=64))
def test_a_text_answer_is_the_part_the_json_mapping_makes(text: str) -> None:
    (part,) = _parts(parts_of_payload(text))
    assert part == ParseDict({"text": text}, Part())
    assert part.WhichOneof("content") == "text" and part.text == text


@given(_json)
def test_every_answer_is_the_parts_the_json_mapping_makes(value: Any) -> None:
    parts = parts_of_payload(value)
    assert _parts(parts) == [ParseDict(part, Part()) for part in parts]
