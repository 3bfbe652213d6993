"""Batch flattening: positions, KV slots through scattered pages, padding, logits rows."""

from __future__ import annotations

import random

import torch

from service.engine.batch import SeqChunk, build_batch
from service.engine.pages import DUMMY_SLOT, pages_for
from service.model.meta import KVCache


def _kv(page_size: int) -> KVCache:
    return KVCache(k=[torch.zeros(1)], v=[torch.zeros(1)], page_size=page_size)


def test_slots_follow_scattered_pages_and_padding_goes_to_the_dummy_slot() -> None:
    rng = random.Random(0)
    for page_size in (1, 4, 16):
        chunks, expect_pos, expect_slots = [], [], []
        free = list(range(1, 400))
        rng.shuffle(free)
        for _ in range(rng.randint(1, 9)):
            prefix, n = rng.randint(0, 40), rng.randint(0, 30)
            pages = tuple(free.pop() for _ in range(pages_for(prefix + n, page_size)))
            chunks.append(SeqChunk(tuple(rng.randrange(1000) for _ in range(n)), prefix, pages,
                                   all_logits=rng.random() < 0.3))
            for p in range(prefix, prefix + n):
                expect_pos.append(p)
                expect_slots.append(pages[p // page_size] * page_size + p % page_size)
        t = len(expect_pos)
        b = build_batch(chunks, _kv(page_size), "cpu", pad_to=t + 5)
        assert b.positions.tolist() == expect_pos + [0] * 5
        assert b.meta.slot_mapping.tolist() == expect_slots + [DUMMY_SLOT] * 5
        assert b.input_ids.tolist() == [x for c in chunks for x in c.token_ids] + [0] * 5
        cu = b.meta.cu_seqlens_q.tolist()
        assert cu[-1] == t and b.meta.q_lens == tuple(c.num_tokens for c in chunks)
        idx = b.meta.logits_indices.tolist()
        for c, (s, e), lo, hi in zip(chunks, b.logits_rows, cu[:-1], cu[1:]):
            want = list(range(lo, hi)) if c.all_logits else ([hi - 1] if hi > lo else [])
            assert idx[s:e] == want


def test_page_table_rows_padded_with_the_dummy_page() -> None:
    from service.engine.pages import page_table_tensor

    t = page_table_tensor([(5, 9, 2), (), (7,)], "cpu")
    assert t.dtype == torch.int32 and t.tolist() == [[5, 9, 2], [0, 0, 0], [7, 0, 0]]
    assert page_table_tensor([], "cpu").shape == (0, 1)
