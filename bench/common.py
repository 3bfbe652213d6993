"""Shared benchmark helpers: timing, run metadata, and writing JSON + markdown + PNG results."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def out_dir(default: str = "bench/results") -> Path:
    """$OUT if set, else `default` (relative to the repo root)."""
    path = Path(os.environ.get("OUT") or Path(__file__).resolve().parents[1] / default)
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_meta() -> dict:
    """What a reader needs to reproduce a number: command, device, versions, date."""
    meta = {
        "command": " ".join(shlex.quote(a) for a in [Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        meta.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            sms=props.multi_processor_count,
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
        )
    else:
        meta["gpu"] = None
    return meta


def bench_ms(fn: Callable[[], object], cuda: bool, rep_ms: int = 100, graph: bool = False) -> float:
    """Median milliseconds of fn(). On CUDA: triton.testing.do_bench, which flushes L2 before
    every run (so repeated runs over one input set are not served from cache); with graph=True,
    do_bench_cudagraph (replays of a captured graph: device time without host launch cost)."""
    if cuda:
        import triton.testing

        if graph:
            return float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
        return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def graph_us(fn: Callable[[], object], reps: int = 20, replays: int = 10) -> float:
    """GPU microseconds per fn() call: fn warmed up on a side stream, captured `reps` times in
    one CUDA graph, the graph replayed `replays` times between two events (the mean), so host
    launch cost is not in the figure."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for _ in range(reps):
            fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * reps)


def relerr(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def pyplot():
    """matplotlib.pyplot drawing to files only (the Agg backend), or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(x) for x in row) + " |")
    return "\n".join(lines)


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 10 else f"{x:.0f}"
    return "" if x is None else str(x)


def write_results(
    directory: Path, name: str, meta: dict, results: dict, markdown: str
) -> tuple[Path, Path]:
    """<name>.json (meta + results) and <name>.md (meta header + tables)."""
    json_path = directory / f"{name}.json"
    json_path.write_text(json.dumps({"meta": meta, **results}, indent=1))
    header = "\n".join(f"- {k}: `{v}`" for k, v in meta.items())
    md_path = directory / f"{name}.md"
    md_path.write_text(f"# {name}\n\n{header}\n\n{markdown}\n")
    return json_path, md_path
