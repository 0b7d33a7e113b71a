"""The CLI's JSON writer against the standard library's json.dumps(indent=2, allow_nan=False)."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zplan.cli.json_out import dumps

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text()
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner)
    | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    | st.dictionaries(st.integers() | st.booleans() | st.none(), inner, max_size=2),
    max_leaves=30)


def reference(obj):
    try:
        return json.dumps(obj, indent=2, allow_nan=False)
    except ValueError as e:
        return e


@settings(max_examples=300, deadline=None)
@given(values)
def test_same_text_or_same_error_as_the_standard_library(obj):
    want = reference(obj)
    if isinstance(want, ValueError):
        with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
            dumps(obj)
    else:
        assert dumps(obj) == want


def test_an_estimate_is_written_as_the_standard_library_writes_it():
    from zplan.estimate import estimate, to_json
    from zplan.scenario_options import ScenarioOptions, build

    sc = build(ScenarioOptions(model="mixtral-8x7b", gpus="16", checkpointing="full"))
    obj = to_json(sc, estimate(sc))
    assert dumps(obj) == json.dumps(obj, indent=2, allow_nan=False)


def test_subclasses_of_the_json_types_are_written_as_their_base():
    class Count(int):
        def __repr__(self):
            return "Count()"

    obj = {"a": [Count(3), True, 1.5, "\u00e9\n"], "b": {}, "c": []}
    assert dumps(obj) == json.dumps(obj, indent=2, allow_nan=False)
