"""What the API knows of the engine, as plain data (no torch) that crosses process boundaries."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

MAX_TOP_LOGPROBS = 20
MAX_LOGPROB_TOKEN_IDS = 256  # named tokens whose logprobs one request may ask for
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 1e4
MAX_LOGIT_BIAS = 100.0  # OpenAI's range
POOL_MODES = ("", "last", "mean", "cls")
MAX_INT32 = (1 << 31) - 1  # token ids and top_k: what crosses the sockets as int32 or msgpack


class QueueFull(Exception):
    """Too many prompts are waiting; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


SHUTTING_DOWN = "server is draining (shutting down); retry on another replica"


class NotReady(Exception):
    """The engine is loading, draining, stopped or dead."""


class ForwardFailed(Exception):
    """The forward of this request's batch raised."""


class KVPoolExhausted(Exception):
    """The KV pool cannot hold the pages asked for."""


class InvalidRequest(Exception):
    """The engine refused a request it cannot run as sent: a worker's check missed it."""


class RequestDropped(Exception):
    """The engine dropped a request before answering it."""


class EngineTimeout(Exception):
    """The engine did not answer a request within REQUEST_TIMEOUT_S."""



def admission_error(state: str, error: str | None, queued: int, prompts: int, max_queue: int,
                    retry_after_s: int) -> Exception | None:
    """Why `prompts` more prompts cannot join `queued` ones now, or None."""
    if state != "ready":
        return NotReady(f"engine is {state}{f': {error}' if error else ''}")
    if queued + prompts > max_queue:
        return QueueFull(f"{queued} prompts queued, limit {max_queue}", retry_after_s)
    return None

@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    top_logprobs: int = 0  # alternatives reported for the next token (and prompt positions)
    prompt_logprobs: bool = False
    logprob_token_ids: tuple[int, ...] = ()  # reported whatever their rank
    # vLLM's meaning below; the logprobs reported stay those of the raw logits
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # on the prompt's tokens: logit / p if > 0, else logit × p
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, added to its logit)
    allowed_token_ids: tuple[int, ...] = ()  # non-empty: only these may come first
    banned_token_ids: tuple[int, ...] = ()  # never first (min_tokens: the stop tokens)
    pool: str = ""  # last | mean | cls: the prompt's pooled final-norm hidden state comes back
    head: bool = False  # the score head's raw logits of the last token come back
    remote_decode: bool = False  # the prompt's KV is left for a decode to pull (KV_TRANSFER)

    def __post_init__(self) -> None:
        # NOTE: ValueError, not assert: msgspec reports it as the decoded message's invalid field
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], "
                             f"got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k <= MAX_INT32:
            raise ValueError(f"top_k must be in [0, {MAX_INT32}], got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 1 << 63:
            raise ValueError(f"seed must be in [0, 2^63), got {self.seed}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {self.top_logprobs}")
        if len(self.logprob_token_ids) > MAX_LOGPROB_TOKEN_IDS:
            raise ValueError(f"at most {MAX_LOGPROB_TOKEN_IDS} logprob_token_ids, "
                             f"got {len(self.logprob_token_ids)}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], "
                             f"got {self.repetition_penalty}")
        if self.pool not in POOL_MODES:
            raise ValueError(f"pool must be one of {POOL_MODES}, got {self.pool!r}")
        if any(not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in self.logit_bias):
            raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, "
                             f"{MAX_LOGIT_BIAS:g}]")

    @property
    def shaped(self) -> bool:
        """The logits are changed before the token is chosen: the device's argmax is not it."""
        return bool(self.repetition_penalty != 1.0 or self.logit_bias or self.allowed_token_ids
                    or self.banned_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class TokenLogprob(NamedTuple):
    id: int
    logprob: float


class PositionLogprobs(NamedTuple):
    token: TokenLogprob
    top: list[TokenLogprob]
    named: list[float] | None = None  # of SamplingParams.logprob_token_ids, in that order
    rank: int = 0  # of `token` by logprob, 1 = the most likely (prompt positions; 0 elsewhere)


class PromptResult(NamedTuple):
    prompt_tokens: int
    cached_tokens: int
    next: PositionLogprobs
    prompt_logprobs: list[PositionLogprobs] | None  # positions 1..n-1 (position 0 has none)
    queue_s: float
    prefill_s: float
    embedding: bytes | None = None  # SamplingParams.pool's vector, float32 little-endian
    scores: bytes | None = None  # SamplingParams.head's logits, float32 little-endian
    kv_transfer: dict[str, Any] | None = None  # remote_decode: vLLM's kv_transfer_params


@dataclass(frozen=True)
class MemoryReport:
    free_before_bytes: int
    weights_bytes: int
    capture_bytes: int
    retained_input_bytes: int
    kv_bytes: int
    kv_tokens: int
    reserve_bytes: int
    eager_peak_bytes: int
    mem_fraction_static: float
    capture_seconds: float
    buckets: tuple[int, ...] = field(default_factory=tuple)
    free_after_capture_bytes: int = 0
    static_buffer_bytes: int = 0  # the runner's shared max-size buffers (part of capture)
    graphs: int = 0
    path: str = "cpu"
    full_buckets: tuple[int, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class EngineInfo:
    model_path: str
    architecture: str
    vocab_size: int
    context_length: int
    page_size: int
    kv_capacity_tokens: int
    memory: MemoryReport
    load_seconds: float = 0.0
    device_name: str = "cpu"
    kv_bytes_per_token: int = 0  # K and V of every layer, windowed layers included
    windowed_kv_bytes_per_token: int = 0  # the windowed (sliding-attention) layers' share
    quantization: str = "none"  # the projections' precision when not the model's dtype
    pooling: str = ""  # last | mean | cls when /v1/embeddings is served (POOLING)
    normalize: bool = False
    lm_head: bool = True  # False: a head-less embedding checkpoint; generation is refused
    head: str = ""  # the score head (SCORE_HEAD): classify | yes-no; "" when none
    labels: tuple[str, ...] = ()  # id2label order
    pad_id: int | None = None  # the score head reads the last token that is not this one
    activation: str = ""  # the score head's: classify | sigmoid | identity (model/heads.py)


@dataclass(frozen=True)
class EngineStats:
    queue_requests: int = 0
    running_requests: int = 0
    kv_used_tokens: int = 0  # whole pages held by in-flight prompts
    kv_cached_tokens: int = 0  # published prefix-cache pages, in use or evictable
    forwards: dict[str, int] = field(default_factory=dict)
    runner_forwards: dict[str, int] = field(default_factory=dict)
    kv_leased_pages: int = 0  # pages kept past their prompts' answers (finish.py)
    kv_leased_tokens: int = 0
    leases_expired: int = 0
    kv_transfer: dict[str, int] = field(default_factory=dict)  # the KV producer's counters
