"""Eager forwards: the fallback runner (it runs any batch) and the only one on a CPU."""

from __future__ import annotations

import torch

from service.engine.batch import BatchStaging, PrefillBatch, build_batch
from service.engine.runners import (
    Chunks,
    on_stream,
    picked_rows,
    pools,
    with_hidden,
    with_pooled,
)
from service.model.decoder import DecoderModel
from service.model.meta import KVCache


class EagerRunner:
    name = "eager"

    def __init__(self, model: DecoderModel, stream: torch.cuda.Stream | None = None,
                 staging: BatchStaging | None = None):
        self.model, self.stream, self.staging = model, stream, staging
        self.device = model.device

    def can_run(self, chunks: Chunks, tokens: int) -> bool:
        return True

    @torch.inference_mode()
    def run(self, chunks: Chunks, kv: KVCache) -> tuple[torch.Tensor, PrefillBatch, str]:
        """NOTE: the logits are allocated on the runner's stream (the next forward waits on it)."""
        with on_stream(self.stream):
            batch = build_batch(chunks, kv, self.device, staging=self.staging)
            picked = picked_rows(self.model, batch, chunks)
            if batch.num_tokens == 0:
                logits = torch.empty(0, self.model.cfg.vocab_size, device=self.device)
            elif pools(chunks):
                h = self.model.hidden_states(batch.input_ids, batch.positions, batch.meta)
                logits = self.model.logits(h, batch.meta, picked)
                batch = with_pooled(batch, h, chunks)
            else:
                logits = self.model(batch.input_ids, batch.positions, batch.meta, picked)
        return logits, with_hidden(batch, picked), "eager"
