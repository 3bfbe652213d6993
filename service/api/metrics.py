"""Every Prometheus metric of the service, in base units, in one registry per app.

Gauges read a plain-number snapshot at scrape time; every series has the `model_name` label."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

REQUEST_STATUSES = ("ok", "bad_request", "rejected", "error", "cancelled", "unauthorized")
FORWARD_MODES = ("graph", "eager")

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
}

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            60.0)
_POW2 = tuple(float(1 << i) for i in range(0, 18))  # 1 .. 131072


class _EngineCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict[str, float]], model_name: str):
        self._snapshot, self._model = snapshot, model_name

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self._snapshot()
        for key, (name, doc) in ENGINE_GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([self._model], float(snap.get(key, 0.0)))
            yield g

    def describe(self) -> Iterator[GaugeMetricFamily]:
        for _, (name, doc) in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(name, doc, labels=["model_name"])


class Metrics:
    """The app's metrics; also the scheduler's Observer."""

    def __init__(self, snapshot: Callable[[], dict[str, float]], model_name: str):
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
        self.requests = {s: self._requests.labels(status=s, **m) for s in REQUEST_STATUSES}
        self.forwards = {f: forwards.labels(mode=f, **m) for f in FORWARD_MODES}
        self.forward_seconds = {f: forward_seconds.labels(mode=f, **m) for f in FORWARD_MODES}
        r.register(_EngineCollector(snapshot, model_name))

    def count(self, status: str) -> None:
        assert status in REQUEST_STATUSES, f"unknown request status {status!r}"
        self.requests[status].inc()

    # NOTE: the Observer hooks below run on the engine thread
    def on_forward(self, mode: str, seconds: float, tokens: int, requests: int) -> None:
        self.forwards[mode].inc()
        self.forward_seconds[mode].observe(seconds)
        self.batch_tokens.observe(tokens)
        self.batch_requests.observe(requests)

    def on_admit(self, queue_wait_s: float) -> None:
        self.queue_wait.observe(queue_wait_s)

    def on_finish(self, ttft_s: float, prompt_tokens: int, cached_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)

    content_type = CONTENT_TYPE_LATEST

    def render(self) -> bytes:
        return generate_latest(self.registry)
