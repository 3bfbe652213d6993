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
    from service.engine.pages import page_table_array

    t = torch.from_numpy(page_table_array([(5, 9, 2), (), (7,)]))
    assert t.dtype == torch.int32 and t.tolist() == [[5, 9, 2], [0, 0, 0], [7, 0, 0]]
    assert page_table_array([]).shape == (0, 1)


def test_batch_tensors_share_two_transfers_and_start_aligned() -> None:
    """ids/positions/slots/logit rows travel in one int64 buffer, the rest in one int32 buffer;
    each view starts 16-byte aligned (Triton specializes kernels on pointer alignment)."""
    kv = KVCache([torch.zeros(64, 1, 4)], [torch.zeros(64, 1, 4)], 4)
    chunks = [SeqChunk((1, 2, 3), 2, (1, 2)), SeqChunk((4,), 0, (3,), all_logits=True),
              SeqChunk((5, 6, 7, 8, 9), 1, (4, 5))]
    b = build_batch(chunks, kv, "cpu", pad_to=16)
    m = b.meta
    i64 = (b.input_ids, b.positions, m.slot_mapping, m.logits_indices)
    i32 = (m.cu_seqlens_q, m.prefix_lens, m.page_table)
    assert len({t.untyped_storage().data_ptr() for t in i64}) == 1
    assert len({t.untyped_storage().data_ptr() for t in i32}) == 1
    for t in i64 + i32:
        assert t.data_ptr() % 16 == 0 and t.is_contiguous()
    assert m.page_table.tolist() == [[1, 2], [3, 0], [4, 5]]
    assert b.positions[:9].tolist() == [2, 3, 4, 0, 1, 2, 3, 4, 5]
