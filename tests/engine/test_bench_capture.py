"""bench/capture.py and bench/dp.py run on the CPU (tiny model), the capture targets judge
results by their thresholds, and bench/e2e.py's profile splits idle GPU time by its borders."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench.capture_report import targets

REPO = Path(__file__).resolve().parents[2]


def run_dry(module: str, out: Path, timeout: int) -> dict:
    env = {**os.environ, "OUT": str(out)}
    proc = subprocess.run([sys.executable, "-m", module, "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / f"{module.split('.')[-1]}.json").read_text())


def verdicts(results: list[dict]) -> dict[str, str]:
    return {name: verdict for name, _, verdict in targets(results)}


def capture_result(variant: str = "main", **over) -> dict:
    r = dict(model="llama-3.2-1b", variant=variant, retained_bytes=0, kv_tokens=1000,
             kv_ideal_tokens=1000, capture_bytes=100, eager_peak_bytes=100)
    return {**r, **over}


def test_capture_dry_run_records_retention_kv_and_latency(tmp_path):
    data = run_dry("bench.capture", tmp_path, timeout=120)
    assert {"command", "torch", "triton", "date", "gpu"} <= set(data["meta"])
    results = data["results"]
    variants = {r["variant"]: r for r in results}
    assert set(variants) == {"main", "dp1", "warm"}
    assert variants["main"]["retained_bytes"] == 0 < variants["dp1"]["retained_bytes"]
    assert max(variants["dp1"]["retained_per_bucket"].values()) <= 4096
    assert [x["tokens"] for x in variants["main"]["latency"]] == [16, 64]
    v = verdicts(results)
    assert v["smollm2-135m: non-DP retained = 0 B"] == "PASS"
    assert v["smollm2-135m: KV capacity ≥ 99 % of ideal"] == "PASS"
    assert v["DP world 1: retained ≤ 4 KiB per bucket"] == "PASS"


def test_targets_fail_past_each_threshold():
    ok = verdicts([capture_result()])
    assert ok == {"llama-3.2-1b: non-DP retained = 0 B": "PASS",
                  "llama-3.2-1b: KV capacity ≥ 99 % of ideal": "PASS",
                  "llama-3.2-1b: capture ≤ 1.15 × eager peak": "PASS"}
    bad = verdicts([capture_result(retained_bytes=8, kv_tokens=989, capture_bytes=116)])
    assert set(bad.values()) == {"FAIL"} and bad.keys() == ok.keys()
    dp = capture_result("dp1", model="smollm2-135m", retained_per_bucket={16: 512, 64: 4097})
    assert verdicts([dp]) == {"DP world 1: retained ≤ 4 KiB per bucket": "FAIL"}


def test_targets_judge_smollm2_latency_only_where_they_apply():
    lat = [dict(tokens=n, eager_ms=e, breakable_ms=b, full_graph_ms=f)
           for n, e, b, f in ((64, 4.0, 1.1, 1.0), (256, 4.0, 1.2, 1.0), (4096, 5.0, 5.0, 1.0))]
    v = verdicts([capture_result(model="smollm2-135m", latency=lat)])
    assert v["smollm2-135m @ 64: breakable ≤ 1.15 × full graph"] == "PASS"
    assert v["smollm2-135m @ 64: breakable ≥ 4 × faster than eager"] == "FAIL"
    assert v["smollm2-135m @ 256: breakable ≤ 1.15 × full graph"] == "FAIL"
    assert not any("@ 4096" in name for name in v)  # no latency target beyond 1,024 tokens


def test_targets_skip_failed_runs():
    assert verdicts([dict(model="llama-3.2-1b", variant="main", error="worker exit 1")]) == {}


def test_dp_dry_run_two_gloo_ranks(tmp_path):
    """bench/dp.py on CPU: DP 1 and 2 gloo ranks capture, size KV, time prefill."""
    data = run_dry("bench.dp", tmp_path, timeout=180)
    runs = {(r["world"], r["variant"]): r for r in data["results"]}
    assert set(runs) == {(1, "main"), (2, "dp")}
    assert all("error" not in r for r in runs.values())
    dp = runs[2, "dp"]["ranks"]
    assert [x["rank"] for x in dp] == [0, 1]
    for x in dp:  # gated: only the per-bucket counts tensor is kept
        assert 0 < max(x["retained_per_bucket"].values()) <= 4096
        assert x["retained_bytes"] == sum(x["retained_per_bucket"].values())
        assert x["then"]["throughput"][0]["mode"] == "graph"
    assert runs[1, "main"]["ranks"][0]["retained_bytes"] == 0


def test_profile_gaps_are_split_by_what_borders_them():
    from bench.e2e import gap_split

    # (start us, end us, name), out of order as the profiler may list them
    events = [(10.0, 20.0, "Memset (Device)"), (0.0, 8.0, "_rms_norm_kernel"),
              (23.0, 40.0, "nvjet_sm90_tst_256x128_coopA"), (45.0, 60.0, "_attention_kernel"),
              (61.0, 70.0, "nvjet_sm90_tst_320x128_coopB"), (70.5, 71.0, "_act_and_mul_kernel"),
              (70.8, 72.0, "_apply_rope_kernel")]  # overlapping: no negative gap
    gaps = gap_split(events)
    assert gaps["memset"] == dict(ms=(2.0 + 3.0) / 1e3, count=2)
    assert gaps["attention"] == dict(ms=(5.0 + 1.0) / 1e3, count=2)
    assert gaps["rest"] == dict(ms=0.5 / 1e3, count=2)
