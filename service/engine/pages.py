"""Page arithmetic, in one place: tokens to pages, and (page, offset) to flat KV slots.

Invariant: slot = page * page_size + offset; page 0 is the dummy page (slot 0 takes padding).
"""

from __future__ import annotations

import torch

DUMMY_SLOT = 0


def pages_for(tokens: int, page_size: int) -> int:
    """Pages needed to hold `tokens` tokens."""
    return -(-tokens // page_size)


def round_down_to_pages(tokens: int, page_size: int) -> int:
    return (tokens // page_size) * page_size


def slots_for(pages: list[int], start: int, count: int, page_size: int) -> list[int]:
    """KV slots of token positions [start, start+count) of a sequence that owns `pages`."""
    assert pages_for(start + count, page_size) <= len(pages), (
        f"positions up to {start + count} need {pages_for(start + count, page_size)} pages, "
        f"sequence owns {len(pages)}"
    )
    return [pages[p // page_size] * page_size + p % page_size for p in range(start, start + count)]


def page_table_tensor(page_lists: list[list[int]], device: torch.device | str) -> torch.Tensor:
    """(B, max_pages) int32 page table; rows padded with the dummy page."""
    width = max((len(p) for p in page_lists), default=0) or 1
    table = torch.zeros(len(page_lists), width, dtype=torch.int32)
    for i, pages in enumerate(page_lists):
        if pages:
            table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return table.to(device, non_blocking=True)
