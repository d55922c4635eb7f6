"""A tool's arguments are held to the JSON Schema it advertises, with no coercion
(docs/protocol/tools.md §4): ``"4"`` is not an integer, ``1`` is not a boolean."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2pnode.agent.toolschema import derived_arguments


def estimate(
    tasks: int,
    parallel: int = 1,
    ratio: float = 1.0,
    dry: bool = False,
    names: tuple[str, ...] = (),
) -> float:
    return 0.0


CONVERSION, _ = derived_arguments(estimate, skip=lambda annotation: False)
VALIDATOR = jsonschema.Draft202012Validator(CONVERSION.schema)

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    # (pydantic refuses integral floats past 64 bits for an integer: a limit, not coercion)
    | st.floats(-1e15, 1e15, allow_nan=False)
    | st.text(max_size=8)
    | st.sampled_from(["4", "1.5", "true", "", "0"])
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
PARAMETERS = ["tasks", "parallel", "ratio", "dry", "names"]
arguments = st.dictionaries(
    st.sampled_from([*PARAMETERS, "extra"]), json_values, max_size=5
) | st.builds(
    lambda tasks, rest: {"tasks": tasks, **rest},
    json_scalars,
    st.dictionaries(st.sampled_from(PARAMETERS[1:]), json_values, max_size=4),
)


@given(arguments)
def test_arguments_are_accepted_exactly_when_the_advertised_schema_admits_them(
    value: dict[str, Any],
) -> None:
    converted, problem = CONVERSION.convert(value)
    assert (problem is None) == VALIDATOR.is_valid(value), (value, problem)
    if problem is not None:
        assert problem.startswith("arguments")
        assert converted is None


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"tasks": "4"}, "arguments.tasks: '4' is not of type 'integer'"),
        ({"tasks": True}, "arguments.tasks: True is not of type 'integer'"),
        ({"tasks": 4, "dry": 1}, "arguments.dry: 1 is not of type 'boolean'"),
        ({"tasks": 4, "ratio": "2"}, "arguments.ratio: '2' is not of type 'number'"),
        ({"tasks": 4, "names": "ab"}, "arguments.names: Input should be a valid tuple"),
    ],
)
def test_a_value_of_another_type_is_refused_naming_its_path(
    value: dict[str, Any], problem: str
) -> None:
    converted, found = CONVERSION.convert(value)
    assert converted is None and found is not None and found.startswith(problem), found


def test_values_of_the_declared_types_pass_converted() -> None:
    converted, problem = CONVERSION.convert({"tasks": 4.0, "ratio": 2, "names": ["a"]})
    assert problem is None
    assert converted == {"tasks": 4, "ratio": 2.0, "names": ("a",)}
    assert type(converted["tasks"]) is int and type(converted["ratio"]) is float
