"""Per-app state (no globals): configs, the engine client, tokenizer, metrics, drain flag."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass, field

from service.api.engine_client import EngineClient
from service.config import EngineConfig, ServerConfig
from service.engine.interface import SHUTTING_DOWN, EngineStats, NotReady
from service.engine.pages import pages_for
from service.metrics import Metrics
from service.model.tokenizer import TextTokenizer


@dataclass
class AppState:
    engine_cfg: EngineConfig
    server_cfg: ServerConfig
    engine: EngineClient
    tokenizer: TextTokenizer
    metrics: Metrics
    draining: bool = False
    active_requests: int = 0  # HTTP requests waiting on the engine (drain waits for 0)
    # one big body's tokenization at a time (service.api.prompts.off_loop): its memory bounds
    big_inputs: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def ready(self) -> bool:
        return self.engine.state == "ready" and not self.draining

    @property
    def model_name(self) -> str:
        return self.server_cfg.served_model_name

    @property
    def prompt_limit(self) -> tuple[int, str]:
        """The longest prompt that can run, and which limit sets it."""
        limits = [(self.engine_cfg.max_prompt_tokens, "MAX_PROMPT_TOKENS")]
        info = self.engine.info
        if info is not None:
            limits += [(info.context_length, "the model's context length"),
                       (info.kv_capacity_tokens, "the KV pool's capacity")]
        return min(limits, key=lambda x: x[0])

    @property
    def max_prompt_tokens(self) -> int:
        return self.prompt_limit[0]

    def begin_drain(self) -> None:
        self.draining = True

    def refusal(self) -> Exception | None:
        """Why a prefill request would be refused now, or None."""
        if self.draining:
            return NotReady(SHUTTING_DOWN)
        return self.engine.admission_error()

    def snapshot(self, stats: EngineStats) -> dict[str, float | str]:
        snap: dict[str, float | str] = {
            "mem_fraction_static": self.engine_cfg.mem_fraction_static,
            "queue_requests": stats.queue_requests,
            "queue_limit_requests": self.engine_cfg.max_queue_requests,
            "running_requests": stats.running_requests,
            "ready": 1.0 if self.ready else 0.0,
            **{f"kv_transfer_{k}": v for k, v in stats.kv_transfer.items()},
        }
        info = self.engine.info
        if info is not None:
            mem = info.memory
            for k in ("capture_bytes", "capture_seconds", "retained_input_bytes", "kv_bytes",
                      "weights_bytes"):
                snap[k] = getattr(mem, k)
            cap, used = info.kv_capacity_tokens, stats.kv_used_tokens
            snap.update(kv_tokens=cap, kv_used_tokens=used,
                        kv_usage_ratio=used / cap if cap else 0.0,
                        page_size=info.page_size, kv_pages=pages_for(cap, info.page_size),
                        kv_bytes_per_token=info.kv_bytes_per_token,
                        kv_windowed_bytes_per_token=info.windowed_kv_bytes_per_token,
                        graph_buckets=len(mem.buckets), mem_fraction_static=mem.mem_fraction_static,
                        dtype=self.engine_cfg.dtype, quantization=info.quantization)
        return snap

    def info(self, stats: EngineStats) -> dict:
        cfg = self.engine_cfg
        out: dict = {
            "state": "draining" if self.draining else self.engine.state,
            "error": self.engine.error,
            "model": self.model_name,
            "device": cfg.device,
            "dtype": cfg.dtype,
            "limits": {
                "max_prefill_tokens": cfg.max_prefill_tokens,
                "max_prompt_tokens": self.max_prompt_tokens,
                "max_queue_requests": cfg.max_queue_requests,
                "max_batch_prompts": cfg.max_batch_prompts,
                "max_body_bytes": self.server_cfg.max_body_bytes,
            },
        }
        info = self.engine.info
        if info is None:
            return out
        mem = info.memory
        # NOTE: no model_path: /info is open without the API key, and the path says how the
        # host is laid out (the start-up log names it); "model" is the served name
        out.update({
            "model_preset": cfg.model_preset,
            "architecture": info.architecture,
            "quantization": info.quantization,
            "vocab_size": info.vocab_size,
            "device_name": info.device_name,
            "load_seconds": round(info.load_seconds, 3),
            "graph": {"enabled": bool(mem.buckets), "buckets": list(mem.buckets),
                      "max_tokens": cfg.cuda_graph_max_tokens,
                      "full_buckets": list(mem.full_buckets),
                      "full_max_seqs": cfg.cuda_graph_full_max_seqs},
            "memory": dataclasses.asdict(mem),
            "kv": {"page_size": info.page_size, "capacity_tokens": info.kv_capacity_tokens,
                   "bytes_per_token": info.kv_bytes_per_token,
                   "windowed_layers_bytes_per_token": info.windowed_kv_bytes_per_token,
                   "used_tokens": stats.kv_used_tokens,
                   "prefix_cached_tokens": stats.kv_cached_tokens},
            "prefix_cache": cfg.prefix_cache,
            "forward_counts": stats.forwards,
            "full_graph_forwards": stats.runner_forwards.get("full", 0),
        })
        return out
