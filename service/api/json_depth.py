"""One bound on how deep a request's JSON nests (parsers, `tojson` and `repr` recurse): deeper than
MAX_JSON_DEPTH is a 400 naming where, never a RecursionError."""

from __future__ import annotations

import json
import re
from typing import Any

MAX_JSON_DEPTH = 128  # serde_json's default; tool schemas and arguments nest a few levels
TOO_DEEP = f"nests JSON more than {MAX_JSON_DEPTH} levels deep"
_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},]')
_NESTED = {dict, list}
_WALK_TOKENS = 1 << 18  # tokens of a body read, at most, to locate a too-deep value


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """`value` (parsed JSON) has lists or dicts nested more than `limit` deep."""
    level = [value] if type(value) in _NESTED else []
    for _ in range(limit):
        deeper: list[Any] = []
        for v in level:
            items = v.values() if type(v) is dict else v
            if not _NESTED.isdisjoint(map(type, items)):  # C-speed scan of a flat list
                deeper += [c for c in items if type(c) in _NESTED]
        if not deeper:
            return False
        level = deeper
    return True


def loads(text: str) -> Any:
    """json.loads within MAX_JSON_DEPTH; a ValueError ends "<field> ..." with what is wrong."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(TOO_DEEP) from None
    except ValueError as e:
        raise ValueError(f"is not JSON: {e}") from None
    if too_deep(value):
        raise ValueError(TOO_DEEP)
    return value


def deep_path(raw: bytes) -> str | None:
    """Where a body first nests more than MAX_JSON_DEPTH deep ("messages[1].tool_calls[0]..."),
    or None when it does not within the first _WALK_TOKENS tokens."""
    text = raw.decode(json.detect_encoding(raw), "replace")
    path: list[Any] = []  # per open container: its child's index (list) or key (dict)
    key_next = False
    for n, m in enumerate(_TOKEN.finditer(text)):
        tok = m.group()
        if n > _WALK_TOKENS:
            return None
        if tok in "[{":
            if len(path) == MAX_JSON_DEPTH:
                return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path
                               ).removeprefix(".")
            path.append(0 if tok == "[" else "")
            key_next = tok == "{"
        elif tok in "]}":
            if path:
                path.pop()
        elif tok == ",":
            if path and isinstance(path[-1], int):
                path[-1] += 1
            key_next = bool(path) and isinstance(path[-1], str)
        elif key_next:
            path[-1], key_next = tok[1:-1], False
    return None
