"""Engine test helpers: a tiny random model, configs, chunks that own KV pages."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from service.config import EngineConfig
from service.engine.batch import SeqChunk
from service.engine.kv_pool import KVPool
from service.engine.pages import pages_for
from service.model.config import ModelConfig
from service.model.families import preset
from service.model.loader import LoadedModel, random_model

PAGE = 4


def tiny_cfg(**kw) -> ModelConfig:
    base = dict(arch="llama", vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2,
                num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=512)
    return ModelConfig(**{**base, **kw})


def tiny_model(seed: int = 0, **kw):
    return random_model(tiny_cfg(**kw), "cpu", torch.float32, seed=seed)


def tiny_loaded(seed: int = 0, **kw) -> LoadedModel:
    m = tiny_model(seed, **kw)
    return LoadedModel(m, None, m.cfg, Path("random-tiny"), 0.0)


def engine_cfg(**kw) -> EngineConfig:
    base = dict(model_path=None, device="cpu", dtype="float32", mem_fraction_static=0.85,
                max_prefill_tokens=64, cuda_graph_max_tokens=0, cuda_graph_buckets=None,
                page_size=PAGE, max_prompt_tokens=4096, max_queue_requests=16,
                max_batch_prompts=16, kv_cache_bytes=1 << 20)
    return EngineConfig(**{**base, **kw})


def prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def chunk(pool: KVPool, ids: list[int], prefix_len: int = 0,
          pages: list[int] | None = None) -> SeqChunk:
    """A chunk of `ids` after `prefix_len` cached tokens; allocates the pages it lacks."""
    pages = list(pages or [])
    need = pages_for(prefix_len + len(ids), pool.page_size) - len(pages)
    if need > 0:
        pages += pool.allocator.alloc(need)
    return SeqChunk(tuple(ids), prefix_len, tuple(pages))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Runners:
    """A model's runners as the engine orders them (full graph, breakable graphs, eager), the
    graphs captured: EngineCore's routing without its sizing. On CUDA (the model's device) the
    graphs are real, on one stream; on the CPU the backend is device-free."""

    def __init__(self, model, buckets, full_max: int = 0, seqs: int = 3, pages: int = 40,
                 staging: bool = False, page: int = PAGE):
        from service.engine.batch import BatchStaging
        from service.engine.runners.breakable import BreakableRunner
        from service.engine.runners.buckets import Buckets
        from service.engine.runners.eager import EagerRunner
        from service.engine.runners.full import FullGraphRunner
        from service.engine.runners.graph import CudaGraphBackend, SegmentBackend

        self.model, self.cfg = model, model.cfg
        device = model.embed_tokens.weight.device
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        backend = CudaGraphBackend(self.stream) if cuda else SegmentBackend()
        stage = BatchStaging(device) if staging or cuda else None
        self.eager = EagerRunner(model, self.stream, stage)
        self.breakable = BreakableRunner(model, Buckets(tuple(buckets)), backend, self.stream,
                                         stage)
        self.full = (FullGraphRunner(self.breakable, full_max, seqs, pages) if full_max
                     else None)
        self.counts = {"graph": 0, "eager": 0}
        self.runs = {"full": 0, "breakable": 0, "eager": 0}
        with torch.inference_mode():
            scratch = KVPool(model.cfg, page, page, model.dtype, device).cache
            self.breakable.capture(scratch)
            if self.full is not None:
                self.full.capture(scratch)

    def close(self) -> None:
        if self.full is not None:
            self.full.close()
        self.breakable.close()
        self.backend.close()

    @property
    def backend(self):
        return self.breakable.backend

    def pad_to_bucket(self, n: int) -> int | None:
        return self.breakable.buckets.pad_to_bucket(n)

    def prefill(self, chunks, kv):
        """(logits, batch, mode) from the first runner that takes the batch."""
        tokens = sum(c.num_tokens for c in chunks)
        runner = next(r for r in (self.full, self.breakable, self.eager)
                      if r is not None and r.can_run(chunks, tokens))
        logits, batch, mode = runner.run(chunks, kv)
        self.counts[mode] += 1
        self.runs[runner.name] += 1
        return logits, batch, mode

    @property
    def full_forwards(self) -> int:
        return self.runs["full"]


def runners_on(device: str, seed: int) -> tuple:
    """A tiny fp32 model on the CPU or a 3-layer bf16 SmolLM2 on CUDA: (model, its Runners, a KV
    pool, the tolerance against eager)."""
    if device == "cpu":
        model, page, tol = tiny_model(seed=seed), 4, 1e-4
    else:
        model = random_model(preset("smollm2-135m", num_layers=3), "cuda", torch.bfloat16)
        page, tol = 16, 3e-2
    runners = Runners(model, (8, 16, 32, 64), full_max=32, seqs=3, pages=40, page=page)
    return model, runners, KVPool(model.cfg, 4096, page, model.dtype, model.device), tol


GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def runners_setup(seed: int):
    """A module fixture over the CPU and CUDA: runners_on(device, seed), closed afterwards."""
    @pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=GPU)])
    def setup(request):
        model, runners, pool, tol = runners_on(request.param, seed=seed)
        yield model, runners, pool, tol
        runners.close()
    return setup
