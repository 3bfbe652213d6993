"""The one bound on JSON nesting: exact at the limit, blind to brackets inside strings."""

from __future__ import annotations

import json

import pytest

from service.api.json_depth import MAX_JSON_DEPTH, deep_path, loads, too_deep


def nest(depth: int, leaf: object = 1) -> object:
    value = leaf
    for i in range(depth):
        value = [value] if i % 2 else {"k": value, "s": "[[{"}
    return value


def test_too_deep_is_exact_at_the_limit() -> None:
    assert not too_deep(nest(MAX_JSON_DEPTH)) and too_deep(nest(MAX_JSON_DEPTH + 1))
    assert not too_deep([list(range(10_000)), {"a": [[]]}], 4) and too_deep([[[[[]]]]], 4)
    assert not too_deep("[[[[[[") and not too_deep(None) and not too_deep({}, 1)


def test_loads_refuses_what_nests_too_deep() -> None:
    assert loads(json.dumps(nest(MAX_JSON_DEPTH))) == nest(MAX_JSON_DEPTH)
    for text in (json.dumps(nest(MAX_JSON_DEPTH + 1)), "[" * 100_000 + "]" * 100_000):
        with pytest.raises(ValueError, match="more than 128 levels deep"):
            loads(text)


def test_deep_path_names_the_first_value_past_the_limit() -> None:
    """The body is level 1: the path has MAX_JSON_DEPTH parts, read past brackets in strings."""
    body = {"a": "]]}}\\\"[[", "b]c": [1, {"d": 2}, [3, nest(MAX_JSON_DEPTH - 3)]]}
    assert deep_path(json.dumps(body).encode()) is None
    body["b]c"][2][1] = nest(MAX_JSON_DEPTH - 2, "x\\\"]")
    path = deep_path(json.dumps(body).encode("utf-16"))
    assert path.startswith("b]c[2][1][0].k[0].k[0]"), path
    assert path.count("[") + path.count(".") == MAX_JSON_DEPTH - 1
