"""bench/capture.py imports and its CPU-side logic runs (tiny model, no GPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_capture_bench_dry_run_writes_json_markdown_and_table(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "bench.capture", "--dry-run"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.rstrip().splitlines()[-1].startswith("Plots:")
    assert "## Targets" in proc.stdout and "non-DP retained = 0 B" in proc.stdout
    data = json.loads((tmp_path / "capture.json").read_text())
    assert {"command", "torch", "triton", "date", "gpu"} <= set(data["meta"])
    variants = {r["variant"]: r for r in data["results"]}
    assert set(variants) == {"main", "dp1", "ungated", "separate", "warm"}
    assert variants["main"]["retained_bytes"] == 0 < variants["ungated"]["retained_bytes"]
    assert max(variants["dp1"]["retained_per_bucket"].values()) <= 4096
    assert [x["tokens"] for x in variants["main"]["latency"]] == [16, 64]
    assert (tmp_path / "capture.md").read_text().startswith("# capture")


def test_dp_bench_dry_run_two_gloo_ranks(tmp_path):
    """bench/dp.py on CPU: DP 1 and 2 gloo ranks capture, size KV, time prefill, report."""
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "bench.dp", "--dry-run"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "dp.json").read_text())
    runs = {(r["world"], r["variant"]): r for r in data["results"]}
    assert set(runs) == {(1, "main"), (2, "dp"), (2, "ungated")}
    assert all("error" not in r for r in runs.values())
    dp = runs[2, "dp"]["ranks"]
    assert [x["rank"] for x in dp] == [0, 1]
    for x in dp:  # gated: only the per-bucket counts tensor is kept
        assert 0 < max(x["retained_per_bucket"].values()) <= 4096
        assert x["retained_bytes"] == sum(x["retained_per_bucket"].values())
        assert x["then"]["throughput"][0]["mode"] == "graph"
    assert runs[2, "ungated"]["ranks"][0]["retained_bytes"] > dp[0]["retained_bytes"]
    assert runs[1, "main"]["ranks"][0]["retained_bytes"] == 0
    assert "retained ≤ 4 KiB per bucket" in (tmp_path / "dp.md").read_text()
