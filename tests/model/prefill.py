"""Test helper: prefill token-id prompts through our model with a real CPU KV pool."""

from __future__ import annotations

import torch

from service.engine.batch import SeqChunk, build_batch
from service.engine.kv_pool import KVPool
from service.engine.pages import pages_for


class Prefiller:
    def __init__(self, model, page_size: int = 4, tokens: int = 4096):
        p = next(model.parameters())
        self.model = model
        self.pool = KVPool(model.cfg, tokens, page_size, p.dtype, p.device)
        self.device = p.device

    def chunk(self, ids: list[int], prefix_len: int = 0, pages: list[int] | None = None,
              all_logits: bool = False) -> SeqChunk:
        total = prefix_len + len(ids)
        pages = list(pages or [])
        need = pages_for(total, self.pool.page_size) - len(pages)
        if need > 0:
            pages += self.pool.allocator.alloc(need)
        return SeqChunk(tuple(ids), prefix_len, tuple(pages), all_logits)

    @torch.no_grad()
    def run(self, chunks: list[SeqChunk], pad_to: int | None = None) -> list[torch.Tensor]:
        """Logits rows per chunk (last token, or every token with all_logits)."""
        b = build_batch(chunks, self.pool.cache, self.device, pad_to=pad_to)
        logits = self.model(b.input_ids, b.positions, b.meta)
        return [logits[s:e] for s, e in b.logits_rows]

    def last_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        return [x[-1] for x in self.run([self.chunk(p) for p in prompts])]
