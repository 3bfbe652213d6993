"""Tables, targets and plots for bench/capture.py results."""

from __future__ import annotations

from pathlib import Path

from bench.common import markdown_table, pyplot, write_results

MB = float(1 << 20)
TARGET_RATIO = {"llama-3.2-1b": 1.15, "smollm2-135m": 2.0}


def _get(results: list[dict], model: str, variant: str) -> dict | None:
    return next((r for r in results if r["model"] == model and r["variant"] == variant
                 and "error" not in r), None)


def memory_table(results: list[dict]) -> str:
    header = ["model", "variant", "graphs", "capture MB", "reserved +MB", "static MB",
              "pool MB", "non-alloc MB", "KB/graph", "eager peak MB", "capture/peak",
              "capture s", "retained B", "KV tokens @0.85", "KV/ideal", "kernel load MB"]
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["model"], r["variant"], r["error"]] + [""] * (len(header) - 3))
            continue
        peak = max(r["eager_peak_bytes"], 1)
        rows.append([
            r["model"], r["variant"], r["graphs"], r["capture_bytes"] / MB,
            r["reserved_growth_bytes"] / MB, r["static_bytes"] / MB, r["pool_bytes"] / MB,
            r["non_allocator_bytes"] / MB, r["non_allocator_bytes"] / 1024 / max(r["graphs"], 1),
            r["eager_peak_bytes"] / MB, r["capture_bytes"] / peak, r["capture_s"],
            r["retained_bytes"], r["kv_tokens"], r["kv_tokens"] / max(r["kv_ideal_tokens"], 1),
            r["kernel_load_bytes"] / MB if "kernel_load_bytes" in r else None])
    return markdown_table(header, rows)


def latency_table(results: list[dict]) -> str:
    header = ["model", "variant", "tokens", "eager ms", "breakable ms", "full graph ms",
              "breakable/full", "eager/breakable", "relerr vs eager"]
    rows = []
    for r in results:
        for lat in r.get("latency") or []:
            rows.append([r["model"], r["variant"], lat["tokens"], lat["eager_ms"],
                         lat["breakable_ms"],
                         lat["full_graph_ms"], lat["breakable_ms"] / lat["full_graph_ms"],
                         lat["eager_ms"] / lat["breakable_ms"], lat["relerr_vs_eager"]])
    return markdown_table(header, rows)


def targets(results: list[dict]) -> list[list]:
    rows: list[list] = []

    def add(name: str, value: str, ok: bool | None) -> None:
        rows.append([name, value, "n/a" if ok is None else ("PASS" if ok else "FAIL")])

    for r in results:
        if r["variant"] == "main" and "error" not in r:
            add(f"{r['model']}: non-DP retained = 0 B", f"{r['retained_bytes']} B",
                r["retained_bytes"] == 0)
            ratio = r["kv_tokens"] / max(r["kv_ideal_tokens"], 1)
            add(f"{r['model']}: KV capacity ≥ 99 % of ideal", f"{100 * ratio:.2f} %",
                ratio >= 0.99)
    dp = _get(results, "smollm2-135m", "dp1")
    if dp is not None:
        worst = max(dp["retained_per_bucket"].values())
        add("DP world 1: retained ≤ 4 KiB per bucket", f"max {worst} B over "
            f"{len(dp['retained_per_bucket'])} buckets", worst <= 4096)
    for model, limit in TARGET_RATIO.items():
        r = _get(results, model, "main")
        if r is not None:
            ratio = r["capture_bytes"] / max(r["eager_peak_bytes"], 1)
            add(f"{model}: capture ≤ {limit} × eager peak", f"{ratio:.2f} ×", ratio <= limit)
    smol = _get(results, "smollm2-135m", "main")
    for lat in (smol or {}).get("latency") or []:
        n, b, f, e = (lat["tokens"], lat["breakable_ms"], lat["full_graph_ms"],
                      lat["eager_ms"])
        if n <= 1024:
            add(f"smollm2-135m @ {n}: breakable ≤ 1.15 × full graph", f"{b / f:.2f} ×",
                b / f <= 1.15)
        if n <= 256:
            add(f"smollm2-135m @ {n}: breakable ≥ 4 × faster than eager", f"{e / b:.2f} ×",
                e / b >= 4.0)
    return rows


def plots(directory: Path, results: list[dict]) -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    ok = [r for r in results if "error" not in r]
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['model']}\n{r['variant']}" for r in ok]
    ax.bar(range(len(ok)), [r["capture_bytes"] / MB for r in ok], label="capture (free drop)")
    ax.plot(range(len(ok)), [r["eager_peak_bytes"] / MB for r in ok], "k_", markersize=20,
            label="eager peak, largest bucket")
    ax.set_xticks(range(len(ok)), labels, fontsize=6, rotation=60)
    ax.set_ylabel("MB")
    ax.legend()
    ax.set_title("capture memory, 58 buckets to 8,192 tokens")
    fig.tight_layout()
    fig.savefig(directory / "capture_memory.png", dpi=120)
    lat = [r for r in ok if r.get("latency")]
    fig, axes = plt.subplots(1, max(len(lat), 1), figsize=(4 * max(len(lat), 1), 3.5))
    for ax, r in zip(axes if len(lat) > 1 else [axes], lat):
        xs = [x["tokens"] for x in r["latency"]]
        for key in ("eager_ms", "breakable_ms", "full_graph_ms"):
            ax.loglog(xs, [x[key] for x in r["latency"]], marker="o", label=key[:-3])
        ax.set_title(r["model"], fontsize=9)
        ax.set_xlabel("tokens")
        ax.set_ylabel("ms")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(directory / "capture_latency.png", dpi=120)
    plt.close("all")
    return ["capture_memory.png", "capture_latency.png"]


def write_report(directory: Path, meta: dict, results: list[dict]) -> str:
    pngs = plots(directory, results)
    dp = _get(results, "smollm2-135m", "dp1")
    dp_line = ""
    if dp is not None:
        per = dp["retained_per_bucket"]
        dp_line = (f"DP world 1 retained capture-only tensors: {len(per)} buckets, "
                   f"{min(per.values())}–{max(per.values())} B each, {sum(per.values())} B "
                   "in all (one int32 [gather_len, n_0..] tensor per bucket).\n\n")
    md = "\n\n".join([
        "## Capture memory (free-memory drop across capture; MB = 2^20 B)", memory_table(results),
        "Columns: reserved + = allocator growth; static = the runner's max-size buffers; pool = "
        "reserved growth − static (graph private pools, workspaces); non-alloc = capture − "
        "reserved growth (graph executables, driver); kernel load = first-use module loading "
        "measured by an eager sweep (warm variant only, not part of its capture figure).",
        dp_line + "## Forward latency (one sequence; median of do_bench)", latency_table(results),
        "## Targets", markdown_table(["target", "value", "result"], targets(results)),
        "Plots: " + (", ".join(pngs) if pngs else "(matplotlib missing)")])
    write_results(directory, "capture", meta, {"results": results}, md)
    return md
