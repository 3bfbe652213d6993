"""SwiGLU in row chunks (the graph runner's small MLP scratch) against one unchunked pass,
with the output written over its own input as the runner does."""

from __future__ import annotations

import pytest
import torch

from service.model.layers import gated_mlp, mlp_row_chunks
from service.model.quant.plain import Linear

CAP = 32
D, F = 24, 80


@pytest.fixture(scope="module")
def mlp() -> tuple[Linear, Linear]:
    torch.manual_seed(0)
    return Linear(D, 2 * F, bias=False), Linear(F, D, bias=False)


@pytest.mark.parametrize("rows", [1, 15, 16, 17, CAP, CAP + 1, 3 * CAP + 5])
def test_chunked_equals_unchunked_in_place(mlp, rows):
    gate_up, down = mlp
    x = torch.randn(rows, D)
    with torch.inference_mode():
        want = gated_mlp(x, gate_up, down, use_triton=False)  # eager: no scratch
        h = x.clone()
        scratch = torch.full((CAP, 2 * F), float("nan"))  # stale garbage must not leak
        got = gated_mlp(h, gate_up, down, use_triton=False, out=h, scratch=scratch)
    assert got.data_ptr() == h.data_ptr() and got.shape == (rows, D)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("rows, cap, sizes", [
    (17, 16, [16, 1]),
    (33, 32, [32, 1]),
    (53, 16, [16, 16, 16, 5]),
    (101, 32, [32, 32, 32, 5]),
    (96, 64, [48, 48]),  # nearly equal halves, not 64 + 32
    (3000, 1008, [1008, 1008, 984]),
    (33, 20, [20, 13]),  # rounding up to 16 never passes the cap
    (8192, 2560, [2048, 2048, 2048, 2048]),
    (8192, 2912, [2736, 2736, 2720]),
    (10, 16, [10]),
])
def test_row_chunks_are_nearly_equal_multiples_of_16(rows, cap, sizes):
    chunks = mlp_row_chunks(rows, cap)
    assert [hi - lo for lo, hi in chunks] == sizes
    assert chunks[0][0] == 0 and chunks[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))  # contiguous, no overlap
    assert all(hi - lo <= cap for lo, hi in chunks)
