"""What the HTTP API may know of the engine, as plain data; it never reads the engine itself."""

from __future__ import annotations

from dataclasses import dataclass, field

from service.engine.memory import MemoryReport


@dataclass(frozen=True)
class EngineInfo:
    model_path: str
    architecture: str
    vocab_size: int
    context_length: int  # the model's positions
    page_size: int
    kv_capacity_tokens: int
    memory: MemoryReport


@dataclass(frozen=True)
class EngineStats:
    queue_requests: int = 0  # prompts waiting for admission
    running_requests: int = 0  # prompts admitted and not finished
    kv_used_tokens: int = 0  # whole pages held by in-flight prompts
    kv_cached_tokens: int = 0  # published prefix-cache pages, in use or evictable
    forwards: dict[str, int] = field(default_factory=dict)  # by mode: graph, eager
    runner_forwards: dict[str, int] = field(default_factory=dict)  # by runner: full, ...
