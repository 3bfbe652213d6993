"""Page arithmetic, in one place: tokens to pages, and (page, offset) to flat KV slots.

Invariant: slot = page * page_size + offset; page 0 is the dummy page (slot 0 takes padding).
"""

from __future__ import annotations

import itertools

import numpy as np

DUMMY_SLOT = 0


def pages_for(tokens: int, page_size: int) -> int:
    """Pages needed to hold `tokens` tokens."""
    return -(-tokens // page_size)


def token_slots(page_lists: list[tuple[int, ...]], prefix_lens: np.ndarray, counts: np.ndarray,
                page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Positions and KV slots of every new token of a batch, flattened over its sequences.

    Sequence b's new tokens sit at positions [prefix_lens[b], prefix_lens[b] + counts[b]) and its
    pages cover them. Vectorized: building a batch stays O(tokens) in C, not in Python.
    """
    for pages, p, n in zip(page_lists, prefix_lens.tolist(), counts.tolist()):
        assert pages_for(p + n, page_size) <= len(pages), (
            f"positions up to {p + n} need {pages_for(p + n, page_size)} pages, "
            f"sequence owns {len(pages)}")
    t = int(counts.sum())
    firsts = np.repeat(np.cumsum(counts) - counts, counts)  # flat index of each token's seq start
    pos = np.arange(t, dtype=np.int64) - firsts + np.repeat(prefix_lens, counts)
    lengths = np.fromiter((len(p) for p in page_lists), np.int64, len(page_lists))
    flat = np.fromiter(itertools.chain.from_iterable(page_lists), np.int64, int(lengths.sum()))
    page = flat[np.repeat(np.cumsum(lengths) - lengths, counts) + pos // page_size]
    return pos, page * page_size + pos % page_size


def page_table_array(page_lists: list[tuple[int, ...]]) -> np.ndarray:
    """(B, max_pages) int32 page table on the host; rows padded with the dummy page."""
    lengths = np.fromiter((len(p) for p in page_lists), np.int64, len(page_lists))
    table = np.zeros((len(page_lists), int(lengths.max(initial=0)) or 1), np.int32)
    flat = np.fromiter(itertools.chain.from_iterable(page_lists), np.int32, int(lengths.sum()))
    rows = np.repeat(np.arange(len(page_lists)), lengths)
    cols = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    table[rows, cols] = flat
    return table
