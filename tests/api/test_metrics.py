"""/metrics: every name operators and the deployment rely on, parsed and promtool-checked."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from prometheus_client.parser import text_string_to_metric_families

GAUGES = [
    "prefill_graph_capture_memory_bytes", "prefill_graph_capture_seconds",
    "prefill_graph_retained_input_bytes", "prefill_kv_capacity_tokens", "prefill_kv_memory_bytes",
    "prefill_kv_used_tokens", "prefill_kv_usage_ratio", "prefill_weights_memory_bytes",
    "prefill_mem_fraction_static", "prefill_queue_requests", "prefill_ready",
    "prefill_graph_buckets", "prefill_queue_limit_requests", "prefill_running_requests",
    "prefill_kv_bytes_per_token", "prefill_kv_windowed_bytes_per_token",
]
COUNTERS = {  # family name (without _total) -> label values that must exist from the start
    "prefill_requests": {"status": {"ok", "bad_request", "rejected", "error", "cancelled",
                                    "unauthorized"}},
    "prefill_prompt_tokens": {},
    "prefill_cached_tokens": {},
    "prefill_forwards": {"mode": {"graph", "eager"}},
}
HISTOGRAMS = {
    "prefill_time_to_first_token_seconds": {},
    "prefill_forward_seconds": {"mode": {"graph", "eager"}},
    "prefill_batch_tokens": {},
    "prefill_batch_requests": {},
    "prefill_queue_wait_seconds": {},
}


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_every_metric_exists_before_traffic(api) -> None:
    fams = families(api.get("/metrics").text)
    for name in GAUGES:
        assert fams[name].type == "gauge", name
    for name, labels in {**COUNTERS, **HISTOGRAMS}.items():
        fam = fams[name]
        assert fam.type == ("counter" if name in COUNTERS else "histogram"), name
        for key, values in labels.items():
            assert {s.labels[key] for s in fam.samples if key in s.labels} == values, name
    every = [smp for fam in fams.values() if fam.name.startswith("prefill_") for smp in fam.samples]
    assert every and {smp.labels.get("model_name") for smp in every} == {api.state.model_name}
    value = {n: fams[n].samples[0].value for n in GAUGES}
    assert value["prefill_queue_limit_requests"] == 256 and value["prefill_running_requests"] == 0
    assert value["prefill_ready"] == 1.0 and value["prefill_kv_capacity_tokens"] > 0
    assert value["prefill_kv_memory_bytes"] > 0 and value["prefill_weights_memory_bytes"] > 0
    # SmolLM2-135M in fp32: 30 layers x K and V x 3 KV heads x 64 x 4 bytes, no windowed layers
    assert value["prefill_kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 4
    assert value["prefill_kv_windowed_bytes_per_token"] == 0
    assert value["prefill_mem_fraction_static"] == 0.85
    assert value["prefill_kv_used_tokens"] == 0 and value["prefill_queue_requests"] == 0


def test_metrics_count_traffic(api) -> None:
    api.post("/v1/prefill", json={"prompts": ["The capital of France is", "Hello"]})
    api.post("/v1/prefill", json={"prompt": ""})
    fams = families(api.get("/metrics").text)

    def sample(fam: str, name: str, **labels: str) -> float:
        return next(s.value for s in fams[fam].samples
                    if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    assert sample("prefill_requests", "prefill_requests_total", status="ok") == 1
    assert sample("prefill_requests", "prefill_requests_total", status="bad_request") == 1
    assert sample("prefill_prompt_tokens", "prefill_prompt_tokens_total") == 6
    assert sample("prefill_forwards", "prefill_forwards_total", mode="eager") >= 1
    ttft = "prefill_time_to_first_token_seconds"
    assert sample(ttft, ttft + "_count") == 2
    assert sample("prefill_forward_seconds", "prefill_forward_seconds_count", mode="eager") >= 1


def test_cache_config_info_is_the_kv_pool(api) -> None:
    """prefill_cache_config_info: value 1, the pool's page size and usable pages in labels (the
    inference gateway's endpoint picker reads them: deploy/components/inference-gateway)."""
    info = api.state.engine.info
    (sample,) = families(api.get("/metrics").text)["prefill_cache_config_info"].samples
    assert sample.value == 1.0
    assert sample.labels == {"model_name": api.state.model_name, "page_size": str(info.page_size),
                             "num_pages": str(info.kv_capacity_tokens // info.page_size)}


def test_model_info_says_the_precision(api) -> None:
    """prefill_model_info: value 1, the dtype and the projections' quantization in labels."""
    (sample,) = families(api.get("/metrics").text)["prefill_model_info"].samples
    assert sample.value == 1.0
    assert sample.labels == {"model_name": api.state.model_name,
                             "dtype": api.state.engine_cfg.dtype,
                             "quantization": api.state.engine.info.quantization}


def test_promtool_check_metrics(api) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    api.post("/v1/prefill", json={"prompt": "Hello"})
    text = api.get("/metrics").text
    res = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0 and not res.stdout.strip() and not res.stderr.strip(), (
        res.stdout + res.stderr)
