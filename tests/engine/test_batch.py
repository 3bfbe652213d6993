"""Batch flattening: positions, KV slots through scattered pages, padding, logits rows."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from service.engine.batch import BatchStaging, SeqChunk, build_batch
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


def _tensors(b) -> tuple[torch.Tensor, ...]:
    m = b.meta
    return (b.input_ids, b.positions, m.slot_mapping, m.logits_indices, b.last_rows,
            m.cu_seqlens_q, m.prefix_lens, m.page_table)


@pytest.mark.parametrize("staged", [False, True])
def test_batch_tensors_share_one_transfer_and_start_aligned(staged) -> None:
    """Every tensor of a batch is a view of one buffer of int64 words (one copy to the device);
    each starts 16-byte aligned (Triton specializes kernels on pointer alignment)."""
    kv = KVCache([torch.zeros(64, 1, 4)], [torch.zeros(64, 1, 4)], 4)
    chunks = [SeqChunk((1, 2, 3), 2, (1, 2)), SeqChunk((4,), 0, (3,), all_logits=True),
              SeqChunk((5, 6, 7, 8, 9), 1, (4, 5))]
    b = build_batch(chunks, kv, "cpu", pad_to=16,
                    staging=BatchStaging("cpu") if staged else None)
    m = b.meta
    assert len({t.untyped_storage().data_ptr() for t in _tensors(b)}) == 1
    for t in _tensors(b):
        assert t.data_ptr() % 16 == 0 and t.is_contiguous()
    assert m.page_table.tolist() == [[1, 2], [3, 0], [4, 5]]
    assert b.positions[:9].tolist() == [2, 3, 4, 0, 1, 2, 3, 4, 5]
    assert m.cu_seqlens_q.tolist() == [0, 3, 4, 9] and m.prefix_lens.tolist() == [2, 0, 1]
    assert b.last_rows.tolist() == [0, 1, 2] and m.logits_indices.tolist() == [2, 3, 8]
    assert (b.layout is not None) == staged


def _random_chunks(rng: random.Random, page_size: int) -> list[SeqChunk]:
    free = list(range(1, 600))
    rng.shuffle(free)
    out = []
    for _ in range(rng.randint(1, 7)):
        prefix, n = rng.randint(0, 40), rng.randint(1, 30)
        pages = [free.pop() for _ in range(pages_for(prefix + n, page_size))]
        ids = [rng.randrange(1000) for _ in range(n)]
        out.append(SeqChunk(ids, prefix, pages, rng.random() < 0.3))
    return out


def test_staged_batches_equal_fresh_ones_and_reuse_their_addresses() -> None:
    """Through a BatchStaging a batch holds the same values as through fresh buffers; a later
    batch of the same shape lands at the same addresses (what lets the runner reuse a bound
    attention launch), and a larger one grows the buffers under a new generation."""
    rng = random.Random(1)
    staging, kv = BatchStaging("cpu"), _kv(4)
    for _ in range(30):
        chunks = _random_chunks(rng, 4)
        t = sum(c.num_tokens for c in chunks)
        fresh = build_batch(chunks, kv, "cpu", pad_to=t + 3)
        staged = build_batch(chunks, kv, "cpu", pad_to=t + 3, staging=staging)
        for a, b in zip(_tensors(fresh), _tensors(staged)):
            assert a.dtype == b.dtype and a.tolist() == b.tolist()
        assert staged.logits_rows == fresh.logits_rows and staged.meta.q_lens == fresh.meta.q_lens
        again = [dataclasses.replace(c, ids=c.ids + 1) for c in chunks]  # same shape, other ids
        before = [x.data_ptr() for x in _tensors(staged)]
        other = build_batch(again, kv, "cpu", pad_to=t + 3, staging=staging)
        assert [x.data_ptr() for x in _tensors(other)] == before
        assert other.layout == staged.layout
        assert other.input_ids[:t].tolist() == [x + 1 for c in chunks for x in c.token_ids]
    gen = staging.generation
    big = [SeqChunk(list(range(8000)), 0, range(1, 1 + pages_for(8000, 4)))]
    b = build_batch(big, kv, "cpu", staging=staging)
    assert staging.generation == gen + 1 and b.input_ids.tolist() == list(range(8000))
    assert b.meta.slot_mapping.tolist() == [4 + i for i in range(8000)]


def test_chunk_ids_are_int64_whatever_they_are_given_as() -> None:
    c = SeqChunk([3, 1, 4], 2, [7])
    assert c.token_ids == (3, 1, 4) and c.ids.dtype == np.int64 and c.pages == (7,)
    assert c == SeqChunk(np.array([3, 1, 4], dtype=np.int32), 2, (7,))
    assert c != SeqChunk((3, 1, 5), 2, (7,)) and c != SeqChunk((3, 1, 4), 1, (7,))


def test_page_keys_are_the_same_for_tuples_and_arrays() -> None:
    from service.engine.pages import page_keys

    ids = tuple(random.Random(2).randrange(150_000) for _ in range(70))
    keys = page_keys(ids, 16)
    assert len(keys) == 4 and len(set(keys)) == 4
    assert page_keys(np.array(ids, dtype=np.int64), 16) == keys
    assert page_keys(ids[:64] + (0,) * 6, 16) == keys  # only full pages are keyed
    assert page_keys(ids[:16] + (9,) + ids[17:], 16)[1:] != keys[1:]  # the chain: later keys


def test_a_chunk_without_pages_for_its_tokens_is_refused() -> None:
    chunks = [SeqChunk((1, 2), 0, (3,)), SeqChunk((1,) * 5, 4, (5, 6))]  # 9 positions, 8 slots
    with pytest.raises(AssertionError, match="positions up to 9 need 3 pages, sequence owns 2"):
        build_batch(chunks, _kv(4), "cpu")
