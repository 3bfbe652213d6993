"""Where a long text (list of ids) is cut so that its pieces, tokenized (decoded) apart, give
the whole's tokens (text): before a space after a non-space, or punctuation after a letter, never
inside an added token. No pre-token of the GPT-2, Llama 3 or Qwen2 splits holds either pair."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterator, Sequence

import numpy as np

PIECE_CHARS = 1 << 16  # characters per piece of a long text
RUN_CHARS = 1 << 20  # the most characters tokenized in one call (about 200 bytes of memory each)
PIECE_IDS = 1 << 16  # token ids per piece of a long detokenization
CUT_CONTEXT = 8  # ids each side of an id cut whose text is checked (a character spans <= 4)
CUT_TRIES = 1024  # id cuts tried before the rest is decoded in one call
_CUT = re.compile(r"(?<=\S) |(?<=[^\W\d_])[^\w\s]")


class RunTooLong(ValueError):
    """A text has more than RUN_CHARS characters with no place to cut them."""


def cut_at(text: str, pos: int, end: int, added: Sequence[str]) -> int | None:
    """The first cut in text[pos:end], or None."""
    for m in _CUT.finditer(text, pos, end):
        c = m.start()
        if text[c] != " " and not (unicodedata.category(text[c - 1])[0] == "L"
                                   and unicodedata.category(text[c])[0] == "P"):
            continue
        # an added token found in this range holds text[c - 1] and text[c]
        if not any(text.find(t, max(c - len(t) + 1, 0), c + len(t) - 1) >= 0 for t in added):
            return c
    return None


def text_pieces(text: str, added: Sequence[str], exact: bool = True) -> Iterator[str]:
    """`text` in pieces of about PIECE_CHARS; RunTooLong past RUN_CHARS uncut unless not `exact`."""
    start = 0
    while len(text) - start > PIECE_CHARS:
        c = cut_at(text, start + PIECE_CHARS, start + RUN_CHARS, added)
        if c is None:
            if len(text) - start <= RUN_CHARS:
                break
            if exact:
                raise RunTooLong(f"{RUN_CHARS} characters from character {start} on hold no "
                                 "space or punctuation to cut them at; longer runs are refused")
            c = start + PIECE_CHARS
        yield text[start:c]
        start = c
    yield text[start:]


def tail_starts(text: str, size: int, added: Sequence[str]) -> Iterator[int]:
    """Cuts that start tails of about size, 2 size, 4 size ... characters; 0 (the whole) last."""
    last = len(text)
    while size < len(text):
        c = cut_at(text, len(text) - size, last, added)
        if c is not None:
            yield c
            last = c
        size *= 2
    yield 0


def _joins(ids: np.ndarray, c: int, decode: Callable[[list[int]], str]) -> bool:
    a, b = ids[c - CUT_CONTEXT:c].tolist(), ids[c:c + CUT_CONTEXT].tolist()
    return decode(a + b) == decode(a) + decode(b)


def id_pieces(ids: np.ndarray, decode: Callable[[list[int]], str]) -> Iterator[np.ndarray]:
    """`ids` in pieces of about PIECE_IDS, cut where no character or decoder rule straddles."""
    start = 0
    while len(ids) - start > PIECE_IDS:
        first = start + PIECE_IDS
        c = next((c for c in range(first, min(first + CUT_TRIES, len(ids)))
                  if _joins(ids, c, decode)), None)
        if c is None:
            break
        yield ids[start:c]
        start = c
    yield ids[start:]
