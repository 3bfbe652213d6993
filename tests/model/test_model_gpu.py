"""The model end to end on CUDA: Triton kernels vs the PyTorch reference path, bf16."""

from __future__ import annotations

import pytest
import torch

from service.model.attention import AttentionBackend
from service.model.config import preset
from service.model.loader import random_model
from tests.model.prefill import Prefiller

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _use(model, kind: str) -> None:
    c = model.cfg
    model.attn = AttentionBackend(kind, c.num_heads, c.num_kv_heads, c.head_dim)
    model.set_kernels(kind == "triton")


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b"])
def test_triton_matches_reference_on_varlen_batch_with_prefix(name):
    model = random_model(preset(name), "cuda", torch.bfloat16, seed=1)
    g = torch.Generator().manual_seed(2)
    lengths = [1, 37, 200, 1000, 3]
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist()
               for n in lengths]
    outs = {}
    for kind in ("torch", "triton"):
        _use(model, kind)
        pre = Prefiller(model, page_size=16, tokens=8192)
        # the last prompt gets a 77-token cached prefix written by an earlier forward
        base = torch.randint(0, model.cfg.vocab_size, (77,), generator=g.manual_seed(3)).tolist()
        first = pre.chunk(base)
        pre.run([first])
        chunks = [pre.chunk(p) for p in prompts[:-1]]
        chunks.append(pre.chunk(prompts[-1], prefix_len=77, pages=list(first.pages)))
        outs[kind] = [x[-1].float() for x in pre.run(chunks)]
    for ref, out in zip(outs["torch"], outs["triton"]):
        assert torch.isfinite(out).all()
        rel = ((out - ref).norm() / ref.norm()).item()
        assert rel <= 2e-2, f"{name}: logits relative error {rel:.3g}"
        assert out.argmax().item() == ref.argmax().item()
