"""Every Prometheus metric of the service, in base units, labelled with `model_name`.

Counters and histograms: per-process files any worker's scrape sums; gauges: a snapshot."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
    values,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector


class PromptTimes(Protocol):
    """What one answered prompt's metrics read."""

    prompt_tokens: int
    cached_tokens: int
    queue_s: float
    prefill_s: float

REQUEST_STATUSES = ("ok", "bad_request", "rejected", "error", "cancelled", "unauthorized")
FORWARD_MODES = ("graph", "eager")
TASKS = ("embed", "rerank", "classify", "score")

# snapshot key -> (metric name, help). Missing keys read as 0 (e.g. while loading).
ENGINE_GAUGES: dict[str, tuple[str, str]] = {
    "capture_bytes": ("prefill_graph_capture_memory_bytes",
                      "Device memory taken by CUDA-graph capture."),
    "capture_seconds": ("prefill_graph_capture_seconds", "Time spent capturing CUDA graphs."),
    "retained_input_bytes": ("prefill_graph_retained_input_bytes",
                             "Capture-only inputs kept alive after capture (DP gather path)."),
    "graph_buckets": ("prefill_graph_buckets", "Number of captured CUDA-graph token buckets."),
    "kv_tokens": ("prefill_kv_capacity_tokens", "Tokens the KV pool can hold."),
    "kv_bytes": ("prefill_kv_memory_bytes", "Device memory of the KV pool."),
    "kv_bytes_per_token": ("prefill_kv_bytes_per_token",
                           "KV pool bytes one token takes: K and V of every layer."),
    "kv_windowed_bytes_per_token": ("prefill_kv_windowed_bytes_per_token",
                                    "The sliding-window layers' share of "
                                    "prefill_kv_bytes_per_token (0 without such layers)."),
    "kv_used_tokens": ("prefill_kv_used_tokens",
                       "KV tokens (whole pages) held by in-flight requests."),
    "kv_usage_ratio": ("prefill_kv_usage_ratio", "prefill_kv_used_tokens / capacity."),
    "weights_bytes": ("prefill_weights_memory_bytes", "Device memory of the model weights."),
    "mem_fraction_static": ("prefill_mem_fraction_static",
                            "MEM_FRACTION_STATIC: share of free memory for weights+graphs+KV."),
    "queue_requests": ("prefill_queue_requests", "Prompts waiting for admission."),
    "queue_limit_requests": ("prefill_queue_limit_requests",
                             "MAX_QUEUE_REQUESTS: queued prompts beyond which requests get 429."),
    "running_requests": ("prefill_running_requests",
                         "Prompts admitted to the engine and not finished (in a forward or "
                         "between chunks)."),
    "ready": ("prefill_ready", "1 when the service accepts prefill requests."),
    "kv_transfer_leased_pages": ("prefill_kv_transfer_leased_pages",
                                 "Export pages holding KV offered to a decode and not yet pulled "
                                 "(KV_TRANSFER)."),
    "kv_transfer_leased_tokens": ("prefill_kv_transfer_leased_tokens",
                                  "Prompt tokens of the KV offered and not yet pulled."),
}
# snapshot key -> (counter name, help): the KV producer's (KV_TRANSFER), read from the engine
ENGINE_COUNTERS: dict[str, tuple[str, str]] = {
    "kv_transfer_offered": ("prefill_kv_transfer_offered_requests",
                            "Prompts whose KV was offered to a decode (kv_transfer_params)."),
    "kv_transfer_offered_bytes": ("prefill_kv_transfer_offered_bytes",
                                  "Bytes of KV offered to decodes."),
    "kv_transfer_notified": ("prefill_kv_transfer_notified_requests",
                             "Offers a decode reported pulled (NIXL done notification)."),
    "kv_transfer_expired": ("prefill_kv_transfer_expired_requests",
                            "Offers whose lease expired unpulled (KV_LEASE_S)."),
    "kv_transfer_refused": ("prefill_kv_transfer_refused_requests",
                            "Prompts answered without an offer: the export region was full."),
    "kv_transfer_handshakes": ("prefill_kv_transfer_handshakes",
                               "Side-channel handshakes answered to decodes."),
}
# SGLang's labels: the inference gateway's endpoint picker sizes its prefix-cache index from it
CACHE_CONFIG_INFO = "prefill_cache_config_info"
_CACHE_CONFIG_DOC = "KV pool: tokens per page (page_size) and pages prompts can hold (num_pages)."
_CACHE_CONFIG_LABELS = ["page_size", "num_pages", "model_name"]

MODEL_INFO = "prefill_model_info"
_MODEL_INFO_DOC = ("The served model's precision: dtype (activations, KV pool) and quantization "
                   "of its projections.")
_MODEL_INFO_LABELS = ["dtype", "quantization", "model_name"]

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            60.0)
_POW2 = tuple(float(1 << i) for i in range(0, 18))  # 1 .. 131072


def use_slot(slot: int) -> None:
    """Name this process's metric files after worker slot `slot` (a replacement counts on from
    them, so files do not grow with deaths); call before the first metric is made."""
    # NOTE: one writer per file: a slot's replacement starts only after its holder exited
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        values.ValueClass = values.MultiProcessValue(lambda: f"worker{slot}")


class _Gauges(Collector):
    def __init__(self, snapshot: dict[str, float | str], model_name: str):
        self._snapshot, self._model = snapshot, model_name

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self._snapshot
        for key, (name, doc) in ENGINE_GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self._model], float(snap.get(key, 0.0)))
            yield g
        for key, (name, doc) in ENGINE_COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([self._model], float(snap.get(key, 0.0)))
            yield c
        info = GaugeMetricFamily(CACHE_CONFIG_INFO, _CACHE_CONFIG_DOC, labels=_CACHE_CONFIG_LABELS)
        if "page_size" in snap:  # no series until the engine has sized its KV pool
            shape = [str(int(snap["page_size"])), str(int(snap["kv_pages"]))]
            info.add_metric([*shape, self._model], 1.0)
        yield info
        model = GaugeMetricFamily(MODEL_INFO, _MODEL_INFO_DOC, labels=_MODEL_INFO_LABELS)
        if "quantization" in snap:
            model.add_metric([str(snap["dtype"]), str(snap["quantization"]), self._model], 1.0)
        yield model

    def describe(self) -> Iterator[GaugeMetricFamily]:
        for _, (name, doc) in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(name, doc, labels=["model_name"])
        for _, (name, doc) in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(name, doc, labels=["model_name"])
        yield GaugeMetricFamily(CACHE_CONFIG_INFO, _CACHE_CONFIG_DOC, labels=_CACHE_CONFIG_LABELS)
        yield GaugeMetricFamily(MODEL_INFO, _MODEL_INFO_DOC, labels=_MODEL_INFO_LABELS)


class Metrics:
    """The service's metrics; also the scheduler's Observer."""

    def __init__(self, model_name: str):
        # NOTE: process-wide switch; `*_created` series only add noise to every dashboard query.
        disable_created_metrics()
        self.registry = r = CollectorRegistry()
        m = {"model_name": model_name}
        self._requests = Counter("prefill_requests", "HTTP API requests by outcome.",
                                 ["status", "model_name"], registry=r)
        self.prompt_tokens = Counter("prefill_prompt_tokens", "Prompt tokens prefilled.",
                                     ["model_name"], registry=r).labels(**m)
        self.cached_tokens = Counter("prefill_cached_tokens",
                                     "Prompt tokens served from the prefix cache.",
                                     ["model_name"], registry=r).labels(**m)
        forwards = Counter("prefill_forwards", "Model forwards by execution mode.",
                           ["mode", "model_name"], registry=r)
        self.ttft = Histogram("prefill_time_to_first_token_seconds",
                              "Arrival to first token, per prompt.", ["model_name"],
                              buckets=_SECONDS, registry=r).labels(**m)
        forward_seconds = Histogram("prefill_forward_seconds", "Duration of one forward.",
                                    ["mode", "model_name"], buckets=_SECONDS, registry=r)
        self.batch_tokens = Histogram("prefill_batch_tokens", "Tokens in one forward.",
                                      ["model_name"], buckets=_POW2, registry=r).labels(**m)
        self.batch_requests = Histogram("prefill_batch_requests", "Prompts in one forward.",
                                        ["model_name"], buckets=_POW2[:10],
                                        registry=r).labels(**m)
        self.queue_wait = Histogram("prefill_queue_wait_seconds",
                                    "Arrival to admission, per prompt.", ["model_name"],
                                    buckets=_SECONDS, registry=r).labels(**m)
        self.score_queries = Counter("prefill_score_queries", "/v1/score requests answered.",
                                     ["model_name"], registry=r).labels(**m)
        self.score_items = Counter("prefill_score_items", "Items scored by /v1/score.",
                                   ["model_name"], registry=r).labels(**m)
        self.score_shared_tokens = Counter(
            "prefill_score_shared_tokens",
            "Query tokens not prefilled again: prefilled once for all of a request's items.",
            ["model_name"], registry=r).labels(**m)
        tasks = {name: Counter(f"prefill_task_{name}", text, ["task", "model_name"], registry=r)
                 for name, text in (("requests", "Retrieval requests answered, by task."),
                                    ("items", "Inputs answered, by task."),
                                    ("tokens", "Prompt tokens of those inputs, by task."))}
        self.task = {name: {t: c.labels(task=t, **m) for t in TASKS} for name, c in tasks.items()}
        self.requests = {s: self._requests.labels(status=s, **m) for s in REQUEST_STATUSES}
        self.forwards = {f: forwards.labels(mode=f, **m) for f in FORWARD_MODES}
        self.forward_seconds = {f: forward_seconds.labels(mode=f, **m) for f in FORWARD_MODES}
        self.model_name = model_name

    def count(self, status: str) -> None:
        assert status in REQUEST_STATUSES, f"unknown request status {status!r}"
        self.requests[status].inc()

    def on_forward(self, mode: str, seconds: float, tokens: int, requests: int) -> None:
        self.forwards[mode].inc()
        self.forward_seconds[mode].observe(seconds)
        self.batch_tokens.observe(tokens)
        self.batch_requests.observe(requests)

    def on_results(self, results: Sequence[PromptTimes]) -> None:
        """A request's prompts, recorded by the API worker that answers it."""
        for r in results:
            self.queue_wait.observe(r.queue_s)
            self.ttft.observe(r.queue_s + r.prefill_s)  # arrival in the engine to first token
        self.prompt_tokens.inc(sum(r.prompt_tokens for r in results))
        self.cached_tokens.inc(sum(r.cached_tokens for r in results))

    def on_task(self, task: str, items: int, tokens: int) -> None:
        """One retrieval answer: `items` inputs of `tokens` prompt tokens in all."""
        for name, n in (("requests", 1), ("items", items), ("tokens", tokens)):
            self.task[name][task].inc(n)

    def on_score(self, items: int, shared: int) -> None:
        """One /v1/score answer: `items` scored over a query of `shared` tokens prefilled once."""
        self.score_queries.inc()
        self.score_items.inc(items)
        self.score_shared_tokens.inc(shared * (items - 1))

    content_type = CONTENT_TYPE_LATEST

    def render(self, snapshot: dict[str, float | str]) -> bytes:
        """The exposition text: every process's counters and histograms, and `snapshot`'s gauges."""
        registry = CollectorRegistry(auto_describe=True)
        path = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        registry.register(MultiProcessCollector(None, path) if path else self.registry)
        registry.register(_Gauges(snapshot, self.model_name))
        return generate_latest(registry)
