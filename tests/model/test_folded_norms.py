"""Folded norms (DecoderModel.fold_norms): the same forward as the unfolded model, eagerly, on the
Triton kernels (CPU: the interpreter), and through the graph runner's breakable
and full graphs, whose segments then add into the residual and run no norm kernel but the
final one."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from service.engine.batch import build_batch
from service.engine.dp import DPGroup
from service.engine.kv_pool import KVPool
from service.model.layers import gated_mlp
from service.model.loader import LoadedModel, random_model
from service.model.quant.plain import Linear
from tests.engine.helpers import PAGE, Runners, chunk, engine_cfg, prompts, tiny_cfg

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def spread_model(arch: str = "llama", dtype=torch.float32, layers: int = 3, seed: int = 5,
                 attn: str = "torch"):
    """A tiny model whose norm weights are far from 1, so a fold that skipped or misplaced
    them shows (random_model draws them near 1)."""
    cfg = tiny_cfg(arch=arch, qkv_bias=arch == "qwen2", num_layers=layers)
    m = random_model(cfg, "cpu", torch.float32, attn_backend=attn, seed=seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.3, 2.0)
    return m.to(dtype)


def forward(model, chunks_of, lengths, seed=2):
    pool = KVPool(model.cfg, 256, PAGE, next(model.parameters()).dtype, "cpu")
    chunks = [chunk(pool, p) for p in prompts(model.cfg.vocab_size, lengths, seed)]
    b = build_batch(chunks, pool.cache, "cpu")
    with torch.inference_mode():
        return chunks_of(model, chunks, pool, b), pool


def eager(model, chunks, pool, b):
    return model(b.input_ids, b.positions, b.meta)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_folded_forward_matches_the_unfolded_one(arch):
    model = spread_model(arch)
    want, want_pool = forward(model, eager, [7, 3])
    folded = copy.deepcopy(model)
    folded.fold_norms()
    assert folded.norms_folded and all(layer.folded for layer in folded.layers)
    lay, ref = folded.layers[1], model.layers[1]
    assert not torch.equal(lay.qkv_proj.weight, ref.qkv_proj.weight)
    torch.testing.assert_close(lay.qkv_proj.weight,
                               ref.qkv_proj.weight * ref.attn_norm.weight, atol=0,
                               rtol=1e-6)
    got, pool = forward(folded, eager, [7, 3])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for a, b in zip(pool.cache.k + pool.cache.v, want_pool.cache.k + want_pool.cache.v):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)  # the same KV, bias included
    before = [p.clone() for p in folded.parameters()]
    folded.fold_norms()  # idempotent
    assert all(torch.equal(a, b) for a, b in zip(before, folded.parameters()))


def test_folded_bf16_stays_within_rounding():
    model = spread_model("qwen2", dtype=torch.bfloat16)
    want, _ = forward(model, eager, [9])
    folded = copy.deepcopy(model)
    folded.fold_norms()
    got, _ = forward(folded, eager, [9])
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < 2e-2, err


def test_folded_gated_mlp_adds_into_its_input_in_chunks():
    """The runner's MLP scratch holds fewer rows than the batch: each chunk reads its rows
    (gate/up and the rstd) before down adds into them."""
    torch.manual_seed(0)
    d, f, eps = 24, 40, 1e-5
    g = torch.rand(d) + 0.5
    gate_up = Linear(d, 2 * f, bias=False)
    down = Linear(f, d, bias=False)
    x = 3 * torch.randn(37, d)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g
    with torch.inference_mode():
        want = x + gated_mlp(normed, gate_up, down, use_triton=False)
        gate_up.weight.mul_(g)
        h = x.clone()
        got = gated_mlp(h, gate_up, down, use_triton=False, out=h,
                     scratch=torch.full((16, 2 * f), float("nan")), norm_eps=eps)
    assert got.data_ptr() == h.data_ptr()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def graphed(full: int, triton: bool = False):
    def run(model, chunks, pool, b):
        if triton:
            model.set_kernels(True)
        model.fold_norms()  # as the engine does before building its runners
        runner = Runners(model, (8, 16, 32), full, seqs=3, pages=40)
        logits, _, mode = runner.prefill(chunks, pool.cache)
        assert mode == "graph"
        return logits, runner.full_forwards
    return run


@pytest.mark.parametrize("full", [0, 32], ids=["breakable", "full"])
def test_runner_folds_and_its_graphs_match_the_unfolded_model(full):
    model = spread_model("qwen2", layers=4)
    want, _ = forward(model, eager, [6, 5])
    (got, fulls), _ = forward(copy.deepcopy(model), graphed(full), [6, 5])
    assert fulls == (1 if full else 0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not INTERPRET, reason="CPU check through Triton's interpreter")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_folded_triton_kernels_match_the_unfolded_reference():
    """RoPE's and SiLU's folded-norm paths (QKV bias added after the norm scale) on the Triton
    kernels, through the breakable graphs."""
    model = spread_model("qwen2", layers=4)
    want, _ = forward(model, eager, [6, 5])
    tri = copy.deepcopy(model)
    tri.attn = type(model.attn)("triton", model.cfg)
    (got, _), _ = forward(tri, graphed(0, triton=True), [6, 5])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_engine_folds_except_for_fp16_and_data_parallel():
    from pathlib import Path

    from service.engine.core import EngineCore

    def core(model, **kw):
        loaded = LoadedModel(model, None, model.cfg, Path("spread"), 0.0)
        return EngineCore(engine_cfg(**kw.pop("cfg", {})), loaded=loaded, **kw).model

    assert core(spread_model()).norms_folded
    assert not core(spread_model(dtype=torch.float16), cfg=dict(dtype="float16")).norms_folded
    assert not core(spread_model(), dp_group=DPGroup()).norms_folded


def test_fold_norms_setting_reaches_the_engine():
    from service.config import load_settings, resolve
    from service.engine.core import EngineCore
    from tests.engine.helpers import engine_cfg, tiny_loaded

    assert resolve(load_settings({}), False)[0].fold_norms
    assert not resolve(load_settings({"FOLD_NORMS": "false"}), False)[0].fold_norms
    on = EngineCore(engine_cfg(), loaded=tiny_loaded())
    off = EngineCore(engine_cfg(fold_norms=False), loaded=tiny_loaded())
    assert on.model.norms_folded and not off.model.norms_folded


def test_large_batches_keep_the_norm_kernels_with_unit_weights(monkeypatch):
    """Above FUSED_NORM_MAX_ELEMS the folded model runs the norm kernels (unit weights) and
    plain GEMMs: the same function; the runner picks per bucket (8 rows fused, 32 not)."""
    from service.model import decoder

    model = spread_model("qwen2", layers=3)
    monkeypatch.setattr(decoder, "FUSED_NORM_MAX_ELEMS", 8 * model.cfg.hidden_size)
    folded = copy.deepcopy(model)
    folded.fold_norms()
    assert all(float(n.weight.detach().min()) == float(n.weight.detach().max()) == 1.0
               for layer in folded.layers
               for n in (layer.attn_norm, layer.mlp_norm))
    assert folded.fuses_norm(8) and not folded.fuses_norm(9)
    for lengths in ([4, 2], [12, 9]):  # 6 rows: fused; 21 rows: norm kernels
        want, _ = forward(model, eager, lengths)
        got, _ = forward(folded, eager, lengths)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        (graph, _), _ = forward(copy.deepcopy(model), graphed(0), lengths)
        torch.testing.assert_close(graph, want, atol=1e-4, rtol=1e-4)
