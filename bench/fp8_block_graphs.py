"""llmcompressor's FP8_BLOCK test checkpoint on CUDA in bf16: the last logits' relative error
against its exact W8A8 result (fp32, CPU) on each engine path: eager Triton, graphs, graphs with
Triton's block GEMM only, the engine without graphs.
Usage (repo root, on a GPU): python3 bench/fp8_block_graphs.py"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import service.model.quant.fp8_linear as fl  # noqa: E402
from service.engine.core import EngineCore  # noqa: E402
from service.model.loader import load_model  # noqa: E402
from tests.engine.helpers import engine_cfg  # noqa: E402
from tests.model.prefill import Prefiller  # noqa: E402
from tests.model.test_fp8_block import checkpoint  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return round(((a.float().cpu() - b).norm() / b.norm()).item(), 4)


def main() -> None:
    path = checkpoint(pathlib.Path(tempfile.mkdtemp()))
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist()
               for n in (5, 16, 32, 130, 144, 200)]
    want = Prefiller(load_model(path, "cpu", torch.float32).model).last_logits(prompts)
    m = load_model(path, "cuda", torch.bfloat16).model
    print("eager triton", [rel(o, w) for o, w in zip(Prefiller(m).last_logits(prompts), want)])
    for label, graphs, cublas in (("graphs", 512, True), ("graphs, triton gemm", 512, False),
                                  ("engine eager", 0, True)):
        if not cublas:
            fl.cublas_block_scales = lambda device: False
        e = EngineCore(engine_cfg(device="cuda", dtype="bfloat16", max_prefill_tokens=512,
                                  cuda_graph_max_tokens=graphs,
                                  cuda_graph_full_max_tokens=256 if graphs else 0,
                                  kv_cache_bytes=None, mem_fraction_static=0.2),
                       loaded=load_model(path, "cuda", torch.bfloat16))
        print(label, [rel(e.prefill_chunked(p), w) for p, w in zip(prompts, want)], e.runs,
              flush=True)
        e.close()


if __name__ == "__main__":
    main()
