"""Reading request fields as vLLM does: pydantic's lax bool for `stream`."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from gateway.proxy.body import InvalidField, lax_bool, wants_stream

TRUE = ["1", "t", "true", "y", "yes", "on", "True", "TRUE", "tRuE", "Yes", "ON", "T", "Y"]
FALSE = ["0", "f", "false", "n", "no", "off", "False", "FALSE", "No", "OFF", "F", "N"]
INVALID: list[Any] = [
    "nope", "", " true", "true ", "01", "1.0", "2", "-1", "tru", "yess", "null",
    2, -1, 1.5, 0.5, math.nan, math.inf, [], [True], {}, {"stream": True},
]  # fmt: skip
VLLM_BOOL = TypeAdapter(bool | None)  # what vLLM's `stream: bool | None = False` runs


@pytest.mark.parametrize("value", [True, 1, 1.0, *TRUE])
def test_true_values(value: Any) -> None:
    """Every value pydantic's lax bool reads as true is true."""
    assert lax_bool(value, "stream") is True


@pytest.mark.parametrize("value", [False, 0, 0.0, -0.0, *FALSE])
def test_false_values(value: Any) -> None:
    """Every value pydantic's lax bool reads as false is false."""
    assert lax_bool(value, "stream") is False


@pytest.mark.parametrize("value", INVALID)
def test_invalid_values_name_the_field(value: Any) -> None:
    """Anything else is refused, naming the field and quoting the value."""
    with pytest.raises(InvalidField) as caught:
        lax_bool(value, "stream")
    assert caught.value.field == "stream"
    assert "stream" in str(caught.value)


def test_absent_or_null_stream_is_not_a_stream() -> None:
    """No `stream`, or null, means a whole answer, as vLLM's default False does."""
    assert wants_stream({}) is False
    assert wants_stream({"stream": None}) is False
    assert wants_stream({"stream": "yes"}) is True


def test_long_invalid_values_are_shortened_in_the_message() -> None:
    """A huge invalid value is quoted only in part."""
    with pytest.raises(InvalidField) as caught:
        lax_bool("x" * 10_000, "stream")
    assert len(str(caught.value)) < 200


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-3, max_value=3)
    | st.integers()
    | st.floats()
    | st.sampled_from([*TRUE, *FALSE, *INVALID[:11]])
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner),
    max_leaves=4,
)


@given(json_values)
def test_agrees_with_pydantic(value: Any) -> None:
    """For any JSON value, the gateway's reading equals pydantic's lax `bool | None`."""
    try:
        expected: bool | None = VLLM_BOOL.validate_python(value)
    except ValidationError:
        with pytest.raises(InvalidField):
            lax_bool(value, "stream")
    else:
        assert lax_bool(value, "stream") is expected
