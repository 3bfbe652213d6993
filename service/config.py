"""Settings, read once from the environment at start-up (pydantic-settings).

No prefix on purpose: Kubernetes injects `<SERVICE>_PORT`-style variables for every Service, so a
prefix such as `PREFILL_` could collide with a Service named `prefill`. Nothing below this module
reads the environment: it receives the frozen `EngineConfig` / `ServerConfig` built here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.host import cuda_requirement, usable_cpus
from service.model.config import model_name


class ConfigError(Exception):
    """An environment variable has a value the service cannot use."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(case_sensitive=False, extra="ignore", frozen=True)

    mem_fraction_static: float = Field(0.85, gt=0.0, lt=1.0, allow_inf_nan=False, description=(
        "Fraction of the GPU memory free before the weights load that weights + CUDA graphs + "
        "KV pool may use (SGLang's meaning); the rest is reserve for activations."))
    model_path: str | None = Field(None, description=(
        "HF checkpoint directory or .gguf file; default: the embedded SmolLM2-135M-Instruct."))
    device: Literal["auto", "cuda", "cpu"] = "auto"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_prefill_tokens: int = Field(8192, ge=16, le=1 << 20,
                                    description="Token budget of one forward.")
    cuda_graph_max_tokens: int = Field(8192, ge=0, le=1 << 20, description=(
        "Largest CUDA-graph bucket (tokens); 0 disables graphs."))
    cuda_graph_buckets: str | None = Field(None, description=(
        "Comma-separated bucket ladder overriding the default (SGLang-like) ladder."))
    cuda_graph_shared_max_tokens: int = Field(32, ge=0, le=1 << 20, description=(
        "Buckets up to this many tokens capture one middle-layer graph that every layer "
        "replays (weights picked on the device): ~130 KB of driver memory per graph saved "
        "per layer and bucket. 0: one graph per layer everywhere."))
    cuda_graph_full_max_tokens: int = Field(1024, ge=0, le=1 << 20, description=(
        "Buckets up to this many tokens also capture a full graph (attention inside, one "
        "launch per forward) for batches of at most CUDA_GRAPH_FULL_MAX_SEQS prompts. "
        "0: breakable graphs only."))
    cuda_graph_full_max_seqs: int = Field(8, ge=1, le=256, description=(
        "Most prompts in a batch that replays a full graph (its attention grid covers this "
        "many sequences)."))
    cuda_graph_full_blas: Literal["cublas", "cublaslt"] = Field("cublaslt", description=(
        "BLAS library of the full graphs' GEMMs (chosen at capture; cuBLASLt avoids a split-K "
        "+ reduce pair at small row counts)."))
    fold_norms: bool = Field(True, description=(
        "Fold each layer's RMSNorm weights into the projections after them (two norm kernels "
        "fewer per layer; not for float16 models or DP_SIZE > 1)."))
    page_size: int = Field(16, ge=1, le=256)
    max_prompt_tokens: int = Field(32768, ge=1, description="Longest prompt accepted.")
    max_queue_requests: int = Field(256, ge=1, description="Prompts waiting before 429.")
    max_batch_prompts: int = Field(256, ge=1, description="Prompts in one forward at most.")
    api_key: str | None = Field(None, description=(
        "Bearer token required on POST endpoints; unset: no authentication. An empty value "
        "stops start-up (it would silently disable authentication)."))
    kv_cache_bytes: int | None = Field(None, ge=1 << 20, description=(
        "KV pool size on CPU (no GPU memory to measure); default: room for two prompts of "
        "the longest accepted length."))
    cpu_threads: int = Field(0, ge=0, le=1024, description=(
        "Threads of torch's CPU kernels; 0: the CPUs this process may use (affinity mask and "
        "cgroup CPU quota, i.e. a Kubernetes CPU limit)."))
    dp_size: int = Field(1, ge=1, le=64)
    host: str = "0.0.0.0"
    port: int = Field(8000, ge=1, le=65535)
    drain_timeout_s: float = Field(30.0, ge=0.0, le=3600.0, allow_inf_nan=False, description=(
        "On SIGTERM: seconds in-flight requests get to finish; the process exits at most "
        "SHUTDOWN_MARGIN_S later."))
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    max_body_bytes: int = Field(8 << 20, ge=1024, description="Largest request body accepted.")
    max_header_bytes: int = Field(64 << 10, ge=1024, le=16 << 20, description=(
        "Largest request head (request line + headers); 431 beyond."))
    header_timeout_s: float = Field(10.0, gt=0.0, le=3600.0, allow_inf_nan=False, description=(
        "Seconds a connection gets to send a complete request head; 408 and close beyond."))
    body_timeout_s: float = Field(60.0, gt=0.0, le=3600.0, allow_inf_nan=False, description=(
        "Seconds a request gets to send its whole body once its head is in; 408 and close "
        "beyond."))
    max_connections: int = Field(2048, ge=1, description=(
        "Open client connections at most; a connection beyond gets a 503 and is closed."))
    access_log: bool = Field(True, description=(
        "Log every HTTP request (uvicorn's access log). false: ~20 % more requests/s for short "
        "prompts, whose HTTP handling is most of their cost."))
    served_model_name: str | None = Field(None, description=(
        "Model id in /v1/models and responses; default: the checkpoint's file/directory name."))
    prefix_cache: bool = Field(True, description=(
        "Reuse the KV of full pages shared with earlier prompts (page-granular prefix cache)."))
    attention_hopper_kernel: bool = Field(True, description=(
        "On Hopper GPUs, run prefix-free head_dim-128 batches of >= 1024 tokens through the "
        "warp-specialized Gluon attention kernel (kernels/extend_attention_sm90.py); false: "
        "the plain Triton kernel everywhere."))
    model_preset: str | None = Field(None, description=(
        "Random weights of a preset shape (e.g. smollm2-135m) with the default tokenizer, for "
        "benchmarks; overrides MODEL_PATH's weights."))

    @field_validator("cuda_graph_buckets")
    @classmethod
    def _buckets(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None
        try:
            vals = [int(x) for x in v.split(",") if x.strip()]
        except ValueError as e:
            raise ValueError("must be comma-separated positive integers, e.g. 16,64,256") from e
        if not vals or any(x <= 0 for x in vals):
            raise ValueError("must be comma-separated positive integers, e.g. 16,64,256")
        return ",".join(str(x) for x in sorted(set(vals)))

    @field_validator("log_level", "device", "dtype", mode="before")
    @classmethod
    def _lower(cls, v: object) -> object:
        """Operators write INFO or CUDA as often as info or cuda."""
        return v.strip().lower() if isinstance(v, str) else v

    @field_validator("api_key")
    @classmethod
    def _api_key(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("is empty, which would disable authentication: unset API_KEY to "
                             "serve without authentication, or set a key")
        return v

    @field_validator("model_preset")
    @classmethod
    def _preset(cls, v: str | None) -> str | None:
        if v is None or not v.strip():
            return None
        from service.model.config import PRESETS

        if v not in PRESETS:
            raise ValueError(f"unknown preset; known: {', '.join(PRESETS)}")
        return v


def clip(text: str, limit: int = 80) -> str:
    """`text` cut to `limit` characters for echoing in a message."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def error_message(err: dict) -> str:
    """A pydantic error's message, with "must be a number" for NaN and infinity."""
    if err.get("type") == "finite_number":
        return "must be a number (NaN and infinity are not allowed)"
    return str(err.get("msg", "")).removeprefix("Value error, ")


def _explain(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        name = str(e["loc"][0]).upper() if e["loc"] else "?"
        lines.append(f"{name}={clip(repr(e.get('input')))}: {error_message(e)}")
    return "invalid configuration: " + "; ".join(lines)


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None
    device: str  # "cuda" | "cpu" (resolved)
    dtype: str  # "bfloat16" | "float16" | "float32" (resolved)
    mem_fraction_static: float
    max_prefill_tokens: int
    cuda_graph_max_tokens: int
    cuda_graph_buckets: tuple[int, ...] | None
    page_size: int
    max_prompt_tokens: int
    max_queue_requests: int
    max_batch_prompts: int
    kv_cache_bytes: int | None
    dp_size: int
    model_preset: str | None = None  # random weights of this preset shape (benchmarks)
    prefix_cache: bool = True
    cuda_graph_shared_max_tokens: int = 32
    attention_hopper_kernel: bool = True
    cuda_graph_full_max_tokens: int = 1024
    cuda_graph_full_max_seqs: int = 8
    cuda_graph_full_blas: str = "cublaslt"
    fold_norms: bool = True
    cpu_threads: int = 0  # torch's CPU threads; 0: leave torch's own choice

    def __post_init__(self) -> None:
        assert self.device in ("cuda", "cpu"), f"device must be resolved, got {self.device!r}"


@dataclass(frozen=True)
class ServerConfig:
    host: str
    port: int
    api_key: str | None
    drain_timeout_s: float
    log_level: str
    max_body_bytes: int
    served_model_name: str = "model"
    access_log: bool = True
    max_header_bytes: int = 64 << 10
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 2048


def load_settings(env: dict[str, str] | None = None) -> Settings:
    """Read the environment (or `env`, for tests) once; raise ConfigError naming bad variables."""
    try:
        if env is None:
            return Settings()
        return Settings(**{k.lower(): v for k, v in env.items()
                           if k.lower() in Settings.model_fields})
    except ValidationError as e:
        raise ConfigError(_explain(e)) from None


def resolve(settings: Settings, cuda_available: bool) -> tuple[EngineConfig, ServerConfig]:
    """Turn "auto" values into concrete ones; returns new frozen configs."""
    device = settings.device
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
    elif device == "cuda" and not cuda_available:
        raise ConfigError(f"DEVICE='cuda': no CUDA device is visible. {cuda_requirement()}; "
                          "use DEVICE=cpu to serve on the CPU")
    dtype = settings.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device == "cuda" else "float32"
    if settings.dp_size > 1:
        # The engine runs DP ranks (service.engine.dp, one process per GPU, in lockstep), but
        # the HTTP service drives a single rank: refuse at start-up rather than fail mid-load.
        raise ConfigError(f"DP_SIZE={settings.dp_size}: the HTTP service runs one rank; "
                          "use DP_SIZE=1 (data-parallel ranks run through service.engine.dp)")
    if settings.max_prompt_tokens > 1 << 20:
        raise ConfigError(f"MAX_PROMPT_TOKENS={settings.max_prompt_tokens}: at most 1048576")
    buckets = (tuple(int(x) for x in settings.cuda_graph_buckets.split(","))
               if settings.cuda_graph_buckets else None)
    eng = EngineConfig(
        model_path=settings.model_path, device=device, dtype=dtype,
        mem_fraction_static=settings.mem_fraction_static,
        max_prefill_tokens=settings.max_prefill_tokens,
        cuda_graph_max_tokens=settings.cuda_graph_max_tokens if device == "cuda" else 0,
        cuda_graph_buckets=buckets, page_size=settings.page_size,
        max_prompt_tokens=settings.max_prompt_tokens,
        max_queue_requests=settings.max_queue_requests,
        max_batch_prompts=settings.max_batch_prompts,
        kv_cache_bytes=settings.kv_cache_bytes, dp_size=settings.dp_size,
        model_preset=settings.model_preset, prefix_cache=settings.prefix_cache,
        cuda_graph_shared_max_tokens=settings.cuda_graph_shared_max_tokens,
        attention_hopper_kernel=settings.attention_hopper_kernel,
        cuda_graph_full_max_tokens=settings.cuda_graph_full_max_tokens,
        cuda_graph_full_max_seqs=settings.cuda_graph_full_max_seqs,
        cuda_graph_full_blas=settings.cuda_graph_full_blas,
        fold_norms=settings.fold_norms,
        cpu_threads=settings.cpu_threads or usable_cpus(),
    )
    srv = ServerConfig(host=settings.host, port=settings.port, api_key=settings.api_key or None,
                       drain_timeout_s=settings.drain_timeout_s, log_level=settings.log_level,
                       max_body_bytes=settings.max_body_bytes,
                       access_log=settings.access_log,
                       served_model_name=(settings.served_model_name
                                          or model_name(settings.model_path,
                                                        settings.model_preset)),
                       max_header_bytes=settings.max_header_bytes,
                       header_timeout_s=settings.header_timeout_s,
                       body_timeout_s=settings.body_timeout_s,
                       max_connections=settings.max_connections)
    return eng, srv
