"""Static buffers: the arena is sized for attention and the MLP scratch is cut to the rows that
fit in it (several MLP rows per token, a gather, keep the whole scratch)."""

from __future__ import annotations

import pytest
import torch

from service.engine.runners import buffers
from service.engine.runners.buffers import MLP_MIN_ROWS, StaticBuffers, mlp_chunk_rows
from service.model.families import preset
from tests.engine.helpers import tiny_cfg

ROWS = 8192  # the largest default bucket


def _allocate(cfg, m: int, world: int = 1) -> StaticBuffers:
    # meta tensors: the real presets' shapes without their memory
    return StaticBuffers.allocate(cfg, m, torch.bfloat16, "meta",
                                  2 * cfg.intermediate_size // world, world)


def _break_width(cfg) -> int:
    return cfg.q_size + 2 * cfg.kv_size + cfg.q_size  # qkv | attn


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b",
                                  "llama-3.1-8b"])
def test_real_presets_chunk_the_mlp_at_4096_rows(name):
    """At 8,192 rows every real MLP runs in two 4,096-row chunks (MLP_MIN_ROWS); the arena
    holds the larger of the break and one chunk, never the whole 8,192-row gate|up."""
    cfg = preset(name)
    bufs = _allocate(cfg, ROWS)
    chunk = MLP_MIN_ROWS * 2 * cfg.intermediate_size
    assert bufs.mlp_rows == MLP_MIN_ROWS
    assert bufs.arena.numel() == max(ROWS * _break_width(cfg), chunk)
    assert bufs.arena.numel() < ROWS * 2 * cfg.intermediate_size  # what the MLP alone needed


@pytest.mark.parametrize("n", [16, 1712, 4096, 4097, 8192])
def test_views_cut_the_mlp_scratch_to_the_chunk_rows(n):
    cfg = preset("qwen2.5-0.5b")
    bufs = _allocate(cfg, ROWS)
    v = bufs.views(n)
    assert v.mlp_scratch.shape == (min(n, bufs.mlp_rows), 2 * cfg.intermediate_size)
    assert v.qkv.shape == (n, cfg.q_size + 2 * cfg.kv_size) and v.attn.shape == (n, cfg.q_size)
    assert v.hidden.shape == (n, cfg.hidden_size)


def test_views_share_the_arena_start_and_stay_inside_it(monkeypatch):
    monkeypatch.setattr(buffers, "MLP_MIN_ROWS", 16)  # tiny shapes: chunks of 16 rows
    cfg = tiny_cfg(intermediate_size=160)  # 2F = 320 wide, the break 96
    bufs = StaticBuffers.allocate(cfg, 64, torch.float32, "cpu", 2 * cfg.intermediate_size)
    assert bufs.mlp_rows == 16 and bufs.arena.numel() == 64 * 96
    end = bufs.arena.data_ptr() + bufs.arena.numel() * 4
    for n in (4, 16, 17, 64):
        v = bufs.views(n)
        assert v.mlp_scratch.data_ptr() == v.qkv.data_ptr() == bufs.arena.data_ptr()
        assert v.mlp_scratch.shape == (min(n, 16), 320) and v.mlp_scratch.is_contiguous()
        assert v.attn.data_ptr() >= v.qkv.data_ptr() + 64 * 64 * 4  # disjoint from qkv
        for t in (v.qkv, v.attn, v.mlp_scratch):
            assert t.data_ptr() + t.numel() * 4 <= end


def test_chunk_rows_fit_round_down_and_never_exceed_the_old_arena(monkeypatch):
    monkeypatch.setattr(buffers, "MLP_MIN_ROWS", 16)  # tiny shapes: chunks of 16 rows
    assert mlp_chunk_rows(100 * 10, 10, 64) == 64  # everything fits: no chunking
    assert mlp_chunk_rows(40 * 10, 10, 64) == 32  # 40 fit, a multiple of 16
    assert mlp_chunk_rows(3 * 10, 10, 64) == 16  # too few fit: 16 rows, the arena grows
    assert mlp_chunk_rows(3 * 10, 10, 8) == 8  # a tiny largest bucket needs no more than itself
    cfg = tiny_cfg(intermediate_size=4096)  # 2F far wider than the break
    for m in (8, 16, 40, 64):
        bufs = _allocate(cfg, m)
        old = max(m * 2 * cfg.intermediate_size, m * _break_width(cfg))
        assert bufs.arena.numel() == max(m * _break_width(cfg),
                                         bufs.mlp_rows * 2 * cfg.intermediate_size) <= old
        assert bufs.mlp_rows == min(m, 16)


@pytest.mark.parametrize("name", ["smollm2-135m", "llama-3.2-1b"])
def test_two_rows_per_token_keep_the_full_gathered_scratch(name):
    cfg = preset(name)
    world, width = 2, cfg.intermediate_size  # this rank's gate|up: 2F / 2
    bufs = _allocate(cfg, ROWS, world)
    assert bufs.mlp_rows == ROWS
    assert bufs.arena.numel() == max(ROWS * world * width, ROWS * _break_width(cfg))
    for n in (1, 1712, ROWS):
        v = bufs.views(n)
        assert v.mlp_scratch.shape == (world * n, width)
