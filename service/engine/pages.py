"""Page arithmetic, in one place: slot = page * page_size + offset; page 0 is the dummy page."""

from __future__ import annotations

import hashlib
import itertools

import numpy as np

DUMMY_SLOT = 0
KEY_BYTES = 16  # a prefix-cache page key: a blake2b digest


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def flatten_pages(page_lists: list[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
    """(pages per sequence, every page id in order) as int64 arrays."""
    lengths = np.fromiter((len(p) for p in page_lists), np.int64, len(page_lists))
    flat = np.fromiter(itertools.chain.from_iterable(page_lists), np.int64, int(lengths.sum()))
    return lengths, flat


def token_slots(page_lists: list[tuple[int, ...]], prefix_lens: np.ndarray, counts: np.ndarray,
                page_size: int, flat: tuple[np.ndarray, np.ndarray] | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """Positions and KV slots of every new token of a batch, flattened over its sequences."""
    lengths, flat = flat if flat is not None else flatten_pages(page_lists)
    need = -(-(prefix_lens + counts) // page_size)
    if (need > lengths).any():
        b = int(np.argmax(need > lengths))
        raise AssertionError(f"positions up to {int(prefix_lens[b] + counts[b])} need "
                             f"{int(need[b])} pages, sequence owns {int(lengths[b])}")
    every = (flat[:, None] * page_size + np.arange(page_size, dtype=np.int64)).ravel()
    pos = np.arange(int(counts.sum()), dtype=np.int64)
    pos += np.repeat(prefix_lens - (np.cumsum(counts) - counts), counts)
    return pos, every[pos + np.repeat((np.cumsum(lengths) - lengths) * page_size, counts)]


def page_table_array(page_lists: list[tuple[int, ...]],
                     flat: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    lengths, flat = flat if flat is not None else flatten_pages(page_lists)
    table = np.zeros((len(lengths), int(lengths.max(initial=0)) or 1), np.int32)
    table[np.arange(table.shape[1]) < lengths[:, None]] = flat
    return table


def page_keys(token_ids, page_size: int) -> list[bytes]:
    """Chain keys of every full page of `token_ids` (ints or an int64 array: the same keys)."""
    ids = np.asarray(token_ids, dtype=np.int64)
    data = memoryview(ids).cast("B")
    step = page_size * ids.itemsize
    keys, parent = [], b""
    for start in range(0, (len(ids) // page_size) * step, step):
        parent = hashlib.blake2b(parent + data[start:start + step], digest_size=KEY_BYTES).digest()
        keys.append(parent)
    return keys


def split_keys(blob: bytes) -> list[bytes]:
    return [blob[i:i + KEY_BYTES] for i in range(0, len(blob), KEY_BYTES)]


def common_prefix(prompts: list[np.ndarray]) -> int:
    """Tokens every prompt starts with (the prompts share those tokens' KV pages)."""
    first = prompts[0]
    n = min(map(len, prompts))
    for p in prompts[1:]:
        diff = np.flatnonzero(p[:n] != first[:n])
        n = int(diff[0]) if len(diff) else n
    return n
