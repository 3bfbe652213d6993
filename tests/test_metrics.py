"""service.metrics across processes: a replacement API worker counts on in the files of the
worker it replaces, so counts survive worker deaths and the files do not grow with them."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from service.metrics import Metrics
from tests.api.conftest import metric

REPO = Path(__file__).resolve().parents[1]

# One API worker's life: its slot, some answered requests and prompts, then SIGKILL (no exit
# handler runs, as when a worker crashes).
WORKER = """
import os, signal, sys
from service.metrics import Metrics, use_slot
use_slot(int(sys.argv[1]))
m = Metrics("m")
for _ in range(int(sys.argv[2])):
    m.count("ok")
    m.ttft.observe(0.01)
os.kill(os.getpid(), signal.SIGKILL)
"""


def worker_life(metrics_dir: Path, slot: int, requests: int) -> None:
    res = subprocess.run([sys.executable, "-c", WORKER, str(slot), str(requests)], cwd=REPO,
                         env={"PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
                              "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert res.returncode == -signal.SIGKILL, res.stderr


def test_a_replacement_worker_adds_to_the_dead_workers_counts(tmp_path, monkeypatch) -> None:
    lives = [(0, 1), (1, 2), (0, 3), (0, 4), (1, 5), (0, 6)]  # two slots, four deaths
    for slot, requests in lives:
        worker_life(tmp_path, slot, requests)
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    text = Metrics("m").render({}).decode()
    assert metric(text, "prefill_requests_total", status="ok") == 21
    assert metric(text, "prefill_time_to_first_token_seconds_count") == 21
    # one counter and one histogram file per slot, however many workers died in it
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "counter_worker0.db", "counter_worker1.db", "histogram_worker0.db",
        "histogram_worker1.db"]


def test_metrics_imports_nothing_from_the_engine() -> None:
    """Per-prompt metrics take plain fields (metrics.PromptTimes), not an engine type."""
    import ast

    tree = ast.parse((REPO / "service" / "metrics.py").read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [n for n in names if n.startswith("service.engine")], names


def test_on_results_takes_any_object_with_the_prompt_fields() -> None:
    from types import SimpleNamespace

    m = Metrics("plain")
    m.on_results([SimpleNamespace(prompt_tokens=7, cached_tokens=3, queue_s=0.5, prefill_s=0.25)])
    assert m.prompt_tokens._value.get() == 7 and m.cached_tokens._value.get() == 3
