"""cuBLAS as the engine process sets it up: its environment defaults give way to the user's,
and on a GPU its GEMMs captured in a graph run without the memset nodes a workspace brings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from service.engine.blas import CUBLAS_ENV, configure_cublas

ROOT = Path(__file__).resolve().parents[2]


def test_configure_sets_the_defaults_and_keeps_what_the_user_set(monkeypatch):
    for key in CUBLAS_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # e.g. for deterministic GEMMs
    configure_cublas()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    for key in set(CUBLAS_ENV) - {"CUBLAS_WORKSPACE_CONFIG"}:
        assert os.environ[key] == CUBLAS_ENV[key]


def test_the_engine_process_configures_cublas_before_it_loads_the_model():
    from service.engine import server

    src = Path(server.__file__).read_text()
    run = src[src.index("def run("):]
    assert run.index("configure_cublas()") < run.index("EngineCore(")


# One process per run: PyTorch reads the workspace settings at the process's first GEMM.
GRAPH_GEMMS = """
import json, sys
import torch
from service.engine.blas import configure_cublas
configure_cublas()
from torch.profiler import ProfilerActivity, profile

out = {"names": [], "relerr": 0.0}
# SmolLM2-135M's projections (QKV, O, gate/up, down) at prefill row counts
for rows in (1024, 8192):
    for k, n in ((576, 960), (576, 576), (576, 3072), (1536, 576)):
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            torch.mm(x, w.t(), out=y)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            torch.mm(x, w.t(), out=y)
        y.zero_()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            g.replay()
            torch.cuda.synchronize()
        out["names"] += [e.name for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA]
        ref = x.float() @ w.float().t()
        out["relerr"] = max(out["relerr"], ((y.float() - ref).norm() / ref.norm()).item())
print(json.dumps(out))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_captured_gemms_run_without_memsets():
    env = {k: v for k, v in os.environ.items() if k not in CUBLAS_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    res = subprocess.run([sys.executable, "-c", GRAPH_GEMMS], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["names"], "the profiler saw no GPU work"
    assert not [n for n in out["names"] if "memset" in n.lower()], out["names"]
    assert out["relerr"] < 1e-2
