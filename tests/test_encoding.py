"""JSON encoding of outputs: numpy-formatted float arrays read back exactly."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rawserve import encoding

finite_float32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@settings(deadline=None)  # the host is shared: timing is not what this checks
@given(
    hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=1, max_dims=4, min_side=0, max_side=6),
        elements=finite_float32,
    )
)
def test_float32_arrays_read_back_exactly(array):
    decoded = json.loads(encoding.dumps({"features": array, "n": 1}))
    assert decoded["n"] == 1
    if array.size == 0:  # JSON cannot tell [] of shape (0, 0) from shape (0,)
        assert decoded["features"] == array.tolist()
        return
    np.testing.assert_array_equal(np.array(decoded["features"], dtype=np.float32), array)
    assert np.array(decoded["features"]).shape == array.shape


@pytest.mark.parametrize(
    "value",
    [0.0, -0.0, 1.0, -1.0, 10.0, 1e-45, 1.17549435e-38, 3.4028235e38, 999999999.0, 0.1, 1e7],
)
def test_edge_values(value):
    array = np.array([value, -value], dtype=np.float32)
    np.testing.assert_array_equal(
        np.array(json.loads(encoding.dumps(array)), dtype=np.float32), array
    )


def test_float16_and_nested_documents():
    half = np.linspace(-3, 3, 50, dtype=np.float16)
    document = [{"a": half, "b": [half[:2], "text"]}, half.reshape(5, 10)]
    decoded = json.loads(encoding.dumps(document))
    np.testing.assert_array_equal(np.array(decoded[0]["a"], dtype=np.float16), half)
    assert decoded[0]["b"][1] == "text"
    assert np.array(decoded[1]).shape == (5, 10)


def test_other_arrays_and_non_finite_values_take_the_plain_path():
    assert encoding.dumps({"x": np.array([np.nan], np.float32)}) == b'{"x":[NaN]}'
    assert encoding.dumps(np.arange(3)) == b"[0,1,2]"
    assert encoding.dumps(np.float32(0.5)) == b"0.5"
    assert encoding.dumps(np.zeros((2, 0), np.float32)) == b"[[],[]]"


def test_strings_that_look_like_placeholders_stay_strings():
    text = '\x00array-0-0"'
    document = {"text": text, "v": np.ones(2, np.float32)}
    decoded = json.loads(encoding.dumps(document))
    assert decoded["text"] == text and decoded["v"] == [1.0, 1.0]
