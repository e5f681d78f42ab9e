"""JSON encoding of answers: numpy float arrays read back exactly, any layout or dtype."""

from __future__ import annotations

import collections
import datetime
import decimal
import json
from collections import UserString

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rawserve.http import encoding

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


def test_non_finite_values_are_null_since_json_has_no_nan():
    assert encoding.dumps({"x": np.array([np.nan, np.inf], np.float32)}) == b'{"x":[null,null]}'
    assert encoding.dumps([float("nan"), -float("inf")]) == b"[null,null]"


def test_other_dtypes_scalars_and_empty_arrays():
    assert encoding.dumps(np.arange(3)) == b"[0,1,2]"
    assert encoding.dumps(np.float32(0.5)) == b"0.5"
    assert encoding.dumps(np.bool_(True)) == b"true"
    assert encoding.dumps(np.zeros((2, 0), np.float32)) == b"[[],[]]"
    assert encoding.dumps(np.array(["a", "b"])) == b'["a","b"]'
    assert encoding.dumps(np.longdouble(0.5)) == b"0.5"


def test_strided_arrays_are_written_in_their_logical_order():
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert json.loads(encoding.dumps(array.T)) == array.T.tolist()
    assert json.loads(encoding.dumps(array[:, ::2])) == array[:, ::2].tolist()


def test_plain_documents_match_the_standard_library():
    document = {"label": "POSITIVE", "score": 0.998, "n": [1, 2.5, None, True], "é": "ü\n"}
    assert json.loads(encoding.dumps(document)) == document
    assert encoding.dumps({1: "a"}) == b'{"1":"a"}'  # as json.dumps writes int keys


@given(
    st.recursive(
        st.integers() | st.booleans() | st.none() | st.text(max_size=3),
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(st.integers(), inner, max_size=3)
            | st.dictionaries(st.text(max_size=3), inner, max_size=3)
        ),
        max_leaves=8,
    )
)
def test_integers_of_any_size_are_written_as_the_standard_library_writes_them(document):
    """orjson writes integers of 64 bits: a handler's 2**70 was a 500."""
    assert json.loads(encoding.dumps(document)) == json.loads(json.dumps(document))


def test_a_big_integer_beside_arrays_keeps_the_arrays_encoding():
    document = {"n": -(2**80), "v": np.array([0.1, 2], np.float32), 2**70: [2**64]}
    expected = b'{"n":-1208925819614629174706176,"v":[0.1,2.0],"1180591620717411303424":'
    assert encoding.dumps(document) == expected + b"[18446744073709551616]}"


def test_what_json_cannot_hold_is_refused():
    for value in (object(), b"bytes", memoryview(b"ab"), 1j):
        with pytest.raises(TypeError):
            encoding.dumps(value)


Point = collections.namedtuple("Point", "x y")


@pytest.mark.parametrize(
    ("value", "written"),
    [
        (decimal.Decimal("2.50"), b"2.5"),
        (decimal.Decimal("-1E+3"), b"-1000"),
        (decimal.Decimal(2**59), b"576460752303423488"),
        (decimal.Decimal(10**17), b"100000000000000000"),  # 18 digits: whole
        (decimal.Decimal(10**18), b"1e+18"),  # 19: a float's
        (decimal.Decimal(2**80), b"1.2089258196146292e+24"),
        (decimal.Decimal("1E+999999"), b"null"),  # past a float's range: infinity
        ([decimal.Decimal("nan"), decimal.Decimal("-snan")], b"[null,null]"),
        (collections.deque([1, Point(2, 3)]), b"[1,[2,3]]"),
        (
            {"ids": {7}, "frozen": frozenset(), "range": range(2)},
            b'{"ids":[7],"frozen":[],"range":[0,1]}',
        ),
        (collections.ChainMap({"a": collections.UserList(["b"])}), b'{"a":["b"]}'),
        (collections.UserString("text"), b'"text"'),
        (datetime.timedelta(minutes=1, microseconds=500), b"60.0005"),
    ],
    ids=repr,
)
def test_a_handler_s_standard_library_values_are_written_as_fastapi_writes_them(value, written):
    """A handler answering a Decimal, a deque, a namedtuple or a timedelta failed its
    request with 500, where the worker let them through as plain data (the standard
    library's): written as FastAPI writes them, each a number any client reads."""
    assert encoding.dumps(value) == written
    json.loads(written)


@pytest.mark.parametrize(
    "value",
    [
        ["a\udcff", {"text": "b\ud800"}, 2**70, "é"],
        dict([("k\udcff", 1), ("k\udcfe", 2), (3, "c"), (2**70, "x")]),  # (two keys once one)
        [{"a\udcff"}, collections.deque(["b\udcff"]), frozenset(["c\udcff"])],
        collections.UserString("d\udcff"),
        np.array(["e\udcff"]),
    ],
    ids=repr,
)
def test_a_text_with_a_lone_surrogate_is_written_as_python_s_json_writes_it(value):
    """Bytes decoded with "surrogateescape" in a handler's answer: orjson refused them, a
    500 logged as the server's own unexpected error (a tester); in a key, in a set or a
    deque too (a reviewer)."""
    written = encoding.dumps(value)
    plain = value.tolist() if isinstance(value, np.ndarray) else value
    expected = json.dumps(plain, default=lambda v: str(v) if isinstance(v, UserString) else list(v))
    assert json.loads(written) == json.loads(expected)
    assert encoding.dumps_in_pieces(value) == written


@pytest.mark.parametrize(
    "value",
    [
        [np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), np.ones((1, 2, 3))],
        np.arange(12).reshape(3, 4)[:, ::2],  # strided rows
        np.zeros((0, 4), np.float32),
        np.array([[True, False]]),
        np.full((2, 2), np.nan),
        [[1, 2], (3, "é"), {"a": [np.float32(1.5)], 7: None}],
        [],
    ],
)
def test_an_answer_encoded_in_pieces_is_the_same_bytes(value):
    assert encoding.dumps_in_pieces(value) == encoding.dumps(value)


def test_an_answer_in_pieces_is_encoded_a_row_or_an_item_at_a_time(monkeypatch):
    # each orjson call holds the GIL: a large array or list must not be one call
    calls: list[object] = []
    dumps = encoding.dumps
    monkeypatch.setattr(encoding, "dumps", lambda value: calls.append(value) or dumps(value))
    rows = np.arange(6, dtype=np.float32).reshape(3, 2)
    assert encoding.dumps_in_pieces(rows) == dumps(rows)
    assert len(calls) == 3  # a row each
    calls.clear()
    assert encoding.dumps_in_pieces([{"a": 1}, "b"]) == dumps([{"a": 1}, "b"])
    assert calls == [{"a": 1}, "b"]  # an object whole
    calls.clear()
    vector = np.zeros(4, np.float32)  # one row: orjson's own float32 digits
    assert encoding.dumps_in_pieces(vector) == dumps(vector) and len(calls) == 1
