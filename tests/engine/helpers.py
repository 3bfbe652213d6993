"""Engine test helpers: a tiny random model, configs, chunks that own KV pages."""

from __future__ import annotations

import socket
from pathlib import Path

import torch

from service.config import EngineConfig
from service.engine.batch import SeqChunk
from service.engine.kv_pool import KVPool
from service.engine.pages import pages_for
from service.model.config import ModelConfig
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
                max_batch_prompts=16, kv_cache_bytes=1 << 20, dp_size=1)
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
