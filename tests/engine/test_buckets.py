"""Bucket ladder, selection and padding rules, as tables of cases."""

from __future__ import annotations

import pytest

from service.engine.runners.buckets import Buckets, default_ladder, resolve_buckets


def test_default_ladder_to_8192_matches_sglang_steps():
    b = default_ladder(8192)
    assert len(b) == 58
    assert b[:8] == (4, 8, 12, 16, 20, 24, 28, 32)
    assert b[8:10] == (48, 64) and 256 in b and 240 in b
    assert b[22:24] == (288, 320) and 512 in b
    assert (576, 640) == b[30:32] and 1024 in b
    assert (1280, 1536) == b[38:40] and 4096 in b
    assert b[-8:] == (4608, 5120, 5632, 6144, 6656, 7168, 7680, 8192)
    steps = {y - x for x, y in zip(b, b[1:])}
    assert steps == {4, 16, 32, 64, 256, 512}


@pytest.mark.parametrize("cap, expect_last, expect_len", [
    (8192, 8192, 58),
    (5000, 5000, 52),  # 4608 is on the ladder; the cap itself becomes the last bucket
    (1024, 1024, 38),
    (30, 30, 8),  # 4..28 then 30
    (4, 4, 1),
    (3, 3, 1),
])
def test_ladder_cap(cap, expect_last, expect_len):
    b = default_ladder(cap)
    assert b[-1] == expect_last and len(b) == expect_len
    assert list(b) == sorted(set(b))


@pytest.mark.parametrize("explicit, graph_max, prefill_max, expect", [
    (None, 8192, 8192, default_ladder(8192)),
    (None, 8192, 2048, default_ladder(2048)),  # capped by MAX_PREFILL_TOKENS
    (None, 1024, 8192, default_ladder(1024)),  # capped by CUDA_GRAPH_MAX_TOKENS
    (None, 0, 8192, ()),  # graphs off
    ((16, 64, 256), 8192, 8192, (16, 64, 256)),
    ((256, 16, 64, 4096), 1000, 8192, (16, 64, 256)),  # explicit, over the cap dropped
])
def test_resolve_buckets(explicit, graph_max, prefill_max, expect):
    assert resolve_buckets(explicit, graph_max, prefill_max) == expect


# (buckets, tokens, padded-to bucket or None, graph?)
CASES = [
    ((4, 16), 1, 4, False),  # 4 > 2·1
    ((4, 16), 2, 4, True),
    ((4, 16), 4, 4, True),
    ((4, 16), 5, 16, False),  # 16 > 2·5: eager
    ((4, 16), 7, 16, False),
    ((4, 16), 8, 16, True),  # 16 = 2·8: graph
    ((4, 16), 16, 16, True),
    ((4, 16), 17, None, False),  # over the largest bucket
    ((4, 16), 0, 4, False),  # nothing to run
    (default_ladder(8192), 33, 48, True),
    (default_ladder(8192), 257, 288, True),
    (default_ladder(8192), 1025, 1280, True),
    (default_ladder(8192), 4097, 4608, True),
    (default_ladder(8192), 8192, 8192, True),
    (default_ladder(8192), 8193, None, False),
]


@pytest.mark.parametrize("sizes, n, bucket, graph", CASES)
def test_selection_and_padding(sizes, n, bucket, graph):
    b = Buckets(tuple(sizes))
    assert b.pad_to_bucket(n) == bucket
    assert b.use_graph(n) is graph


def test_every_count_up_to_the_max_has_a_bucket_within_2x_on_the_default_ladder():
    b = Buckets(default_ladder(8192))
    for n in range(1, 8193):
        p = b.pad_to_bucket(n)
        assert p >= n and (p <= 2 * n or n < 4)


def test_capture_order_is_largest_first_and_buckets_validate():
    assert Buckets((4, 8, 16)).capture_order() == (16, 8, 4)
    with pytest.raises(AssertionError):
        Buckets((8, 4))
    assert Buckets(()).largest == 0 and Buckets(()).pad_to_bucket(1) is None
