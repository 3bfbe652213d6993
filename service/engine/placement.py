"""Where forwards run: one device's runner chain, or a data-parallel group (dp.py)."""

from __future__ import annotations

from typing import Protocol

import torch

from service.config import EngineConfig
from service.engine.batch import BatchStaging
from service.engine.pages import pages_for
from service.engine.runners import Runner
from service.engine.runners.breakable import BreakableRunner
from service.engine.runners.buckets import Buckets, resolve_buckets
from service.engine.runners.capture import Graphs
from service.engine.runners.eager import EagerRunner
from service.engine.runners.full import FullGraphRunner
from service.engine.runners.graph import CudaGraphBackend
from service.model.decoder import DecoderModel
from service.model.loader import LoadedModel
from service.model.quant import apply as apply_quantization

RunnerSet = tuple[Graphs | None, list[Runner]]


class Placement(Protocol):
    warms_up: bool

    def prepare(self, loaded: LoadedModel, cfg: EngineConfig) -> None: ...
    def runners(self, model: DecoderModel, cfg: EngineConfig,
                stream: torch.cuda.Stream | None) -> RunnerSet: ...


def prepared(loaded: LoadedModel, cfg: EngineConfig, where: Placement) -> LoadedModel:
    """The loaded model as the engine runs it: its QUANTIZATION scheme applied, then placed."""
    loaded.model.attn.hopper = cfg.attention_hopper_kernel
    apply_quantization(loaded.model, cfg.quantization)  # what it frees joins the KV pool
    where.prepare(loaded, cfg)
    return loaded


def graph_sizes(cfg: EngineConfig, stream: torch.cuda.Stream | None) -> tuple[int, ...]:
    if stream is None:
        return ()
    return resolve_buckets(cfg.cuda_graph_buckets, cfg.cuda_graph_max_tokens,
                           cfg.max_prefill_tokens)


class OneDevice:
    """Full graphs, breakable graphs, eager: the first that accepts a batch runs it."""

    warms_up = True

    def prepare(self, loaded: LoadedModel, cfg: EngineConfig) -> None:
        if cfg.fold_norms and loaded.model.dtype != torch.float16:
            loaded.model.fold_norms()  # not into projections that cannot take a norm's weight

    def runners(self, model: DecoderModel, cfg: EngineConfig,
                stream: torch.cuda.Stream | None) -> RunnerSet:
        staging = BatchStaging(model.device) if stream is not None else None
        eager = EagerRunner(model, stream, staging)
        if not (sizes := graph_sizes(cfg, stream)):
            return None, [eager]
        breakable = BreakableRunner(model, Buckets(sizes), CudaGraphBackend(stream), stream,
                                    staging)
        full = None
        if cfg.cuda_graph_full_max_tokens > 0:
            context = min(cfg.max_prompt_tokens, model.max_positions)
            full = FullGraphRunner(breakable, cfg.cuda_graph_full_max_tokens,
                                   cfg.cuda_graph_full_max_seqs, pages_for(context, cfg.page_size))
        return Graphs(breakable, full), [r for r in (full, breakable, eager) if r is not None]
