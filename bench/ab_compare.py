"""An interleaved A/B of two trees on one GPU: a before tree (a worktree in .before) against the
working tree.

bench/h200_session.sh's step `ab` runs e2e, attention and capture in the order before, after,
before, after (the old tree from its worktree in .before) into AB_DIR/{before1,after1,before2,
after2}, then this script's report. Two modes:

  python3 bench/ab_compare.py report AB_DIR [--out-dir bench/results] [--change NAME]
          [--before "tag X (abc1234)"] [--known "what differs on purpose"] [--name NAME]
      reads each run's e2e.json, attention.json and capture.json (a missing run or file is
      reported as such) and writes NAME.md and NAME.json (default name:
      ab-<change>-<gpu>-<date of the runs>)
  python3 <this tree>/bench/ab_compare.py run-attention [--seqs 512,...] [--dims 64,128]
          [--heads 32/8] [--dry]
      run from a tree's root (`cd .before && python3 ../bench/ab_compare.py run-attention`):
      that tree's bench/attention.py causal cases for the chosen shapes only (its CLI cannot pick
      sequence lengths), each timed as its causal_cases times it (SDPA flash and cuDNN, ours with
      the service's table pick, at head_dim 128 also the Hopper kernel and, from 4,096 tokens, the
      plain Triton kernel; CUDA-graph replays up to 2,048 tokens), no config sweep; writes
      attention.json/.md to $OUT as that script does. --dry: tiny shapes on the CPU through
      Triton's interpreter (a check of the plumbing).

Verdicts: a metric's pair spread is |run1 - run2| / their mean; "slower" (or "worse" for memory)
when the after mean is worse than the before mean by more than the larger of the two spreads
plus 2 %, "faster" ("better") when it is better by as much, else "within noise". A side with one
run left has no spread (0 is used) and its verdict says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import traceback
from pathlib import Path

RUNS = ("before1", "before2", "after1", "after2")
BENCHES = ("e2e", "attention", "capture")
MARGIN = 0.02
MB = float(1 << 20)


# --- run-attention: executed inside the tree under test ---------------------------------------


def run_attention(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="ab_compare.py run-attention")
    p.add_argument("--seqs", default="512,1024,2048,8192,16384")
    p.add_argument("--dims", default="64,128")
    p.add_argument("--heads", default="32/8", help="q/kv heads, comma-separated pairs")
    p.add_argument("--short", default="64x128,16x512,8x1024",
                   help="batches of equal prompts, NxS comma-separated ('': none)")
    p.add_argument("--dry", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    args = p.parse_args(argv)
    if args.dry:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first triton import
    here = os.getcwd()  # the tree under test: its bench/, service/ and kernels/ come first
    sys.path[:] = [here] + [x for x in sys.path if Path(x or ".").resolve() != Path(__file__)
                            .resolve().parent]
    argv, sys.argv = sys.argv, [sys.argv[0]]  # bench/attention.py reads sys.argv on import
    import torch

    import bench.attention as a

    sys.argv = argv  # run_meta records the command

    assert Path(a.__file__).resolve().is_relative_to(Path(here).resolve()), a.__file__
    cuda = torch.cuda.is_available() and not args.dry
    if not cuda and not args.dry:
        sys.exit("needs a CUDA GPU (or --dry)")
    device, dtype = ("cuda" if cuda else "cpu"), torch.bfloat16
    seqs = [int(x) for x in args.seqs.split(",")]
    dims = [int(x) for x in args.dims.split(",")]
    heads = [tuple(int(y) for y in x.split("/")) for x in args.heads.split(",")]
    short = [tuple(int(y) for y in x.split("x")) for x in args.short.split(",") if x]
    meta = a.run_meta()
    meta["ab_subset"] = dict(seqs=seqs, dims=dims, heads=[f"{h}/{k}" for h, k in heads],
                             short=args.short, tree=here, script=a.__file__)
    if cuda:
        meta["table_config_d128"] = str(a.pick_config(128, dtype, torch.device("cuda")))
        meta["table_config_d64"] = str(a.pick_config(64, dtype, torch.device("cuda")))
    rows = a.Rows()
    for H, KVH in heads:
        for D in dims:
            shapes = [(1, S) for S in seqs] + short
            for n, S in shapes:
                try:
                    _causal_shape(a, rows, H, KVH, D, n, S, cuda, device, dtype)
                except Exception:  # keep what was measured, as bench/attention.py does
                    rows.append(dict(case="causal", H=H, KVH=KVH, D=D, S=S, kernel="-",
                                     how=traceback.format_exc()[-400:]))
                    traceback.print_exc()
    if cuda:
        torch.cuda.empty_cache()
    meta["launch_overhead_us"] = a.launch_overhead(cuda, device, dtype)
    header = ["H/KVH", "D", "S", "kernel", "ms", "TFLOP/s", "TFLOP/s graph", "relerr vs SDPA",
              "how"]
    table = [[f"{r.get('H')}/{r.get('KVH')}", r.get("D"), r.get("S"), r["kernel"], r.get("ms"),
              r.get("tflops"), r.get("tflops_graph"), r.get("relerr_vs_sdpa"), r.get("how")]
             for r in rows]
    md = (f"bench/attention.py causal cases, subset {meta['ab_subset']}\n\n"
          + a.markdown_table(header, table)
          + f"\n\nlauncher overhead (host µs/call): {meta['launch_overhead_us']}\n")
    json_path, _ = a.write_results(a.out_dir(), "attention", meta, {"rows": rows}, md)
    print(f"wrote {json_path}")


def _causal_shape(a, rows, H, KVH, D, n, S, cuda, device, dtype) -> None:
    """n prompts of S rows, as bench/attention.py's causal (n = 1) and short cases build them
    (the same in both trees), outside their variants."""
    if n == 1:
        batch = a.Paged([S], [0], H, KVH, D, 16, device, dtype, seed=S + D)
        info = dict(case="causal", H=H, KVH=KVH, D=D, S=S)
    else:
        batch = a.Paged([S] * n, [0] * n, H, KVH, D, 16, device, dtype, seed=n + D)
        info = dict(case="short", H=H, KVH=KVH, D=D, S=f"{n} x {S}")
    flops = n * 4 * S * S * D * H / 2
    graph = n > 1 or S <= a.GRAPH_MAX_S
    q4, k4, v4 = (x.view(n, S, -1, D).transpose(1, 2) for x in (batch.q, batch.k, batch.v))
    make = lambda b: a.sdpa_runner(b, q4, k4, v4, is_causal=True)
    ref = None
    for name in a.BACKENDS:
        ms, how, out, ms_graph = a.timed_sdpa(name, make, cuda, graph=graph)
        if out is not None and ref is None:
            ref = out.transpose(1, 2).reshape(n * S, H, D)
        rows.append(dict(info, kernel=f"sdpa-{name}", ms=ms, tflops=a.tflops(flops, ms),
                         ms_graph=ms_graph, tflops_graph=a.tflops(flops, ms_graph), how=how))
    if not cuda:
        names = {"table": a.INTERPRETER_CONFIG}
    else:  # the service's pick, and at D=128 the Hopper kernel at every S
        names = {"table": None, **({"sm90": a.SM90_CONFIG} if D == 128 and n == 1 else {}),
                 **({"triton": a.TRITON} if D == 128 and S >= 4096 else {})}
    for vname, cfg in names.items():
        rows.append(a.ours_row(batch, cfg, vname, flops, ref, cuda, info, graph=graph))


# --- report --------------------------------------------------------------------------------


def load_runs(ab_dir: Path) -> tuple[dict, dict]:
    """({run: {bench: parsed json or None}}, {run: status line})."""
    data: dict = {}
    status: dict = {}
    for run in RUNS:
        d = ab_dir / run
        data[run] = {b: None for b in BENCHES}
        if not d.is_dir():
            status[run] = "missing (no directory: the run did not start or the call was cut)"
            continue
        missing = []
        for b in BENCHES:
            f = d / f"{b}.json"
            try:
                data[run][b] = json.loads(f.read_text())
            except FileNotFoundError:
                missing.append(b)
            except (json.JSONDecodeError, OSError) as e:
                missing.append(f"{b} (unreadable: {e})")
        status[run] = "complete" if not missing else "no " + ", ".join(missing)
    return data, status


def read_times(ab_dir: Path) -> list[list[str]]:
    f = ab_dir / "times.tsv"
    if not f.exists():
        return []
    lines = [ln.split("\t") for ln in f.read_text().splitlines() if ln.strip()]
    return [ln for ln in lines if ln and ln[0] != "bench"]


def metrics_e2e(d: dict) -> dict:
    """{(group, metric): (value, unit, direction, extra)}; direction +1 higher is better, -1
    lower is better, 0 informational."""
    out = {}
    for r in d.get("rows", []):
        for variant, v in r.items():
            if variant.startswith("ours-") and v:
                out[(f"prefill tok/s ({variant})", f"{r['model']} {r['case']}")] = (
                    v["tok_s"], "tok/s", +1, v.get("mode"))
    for model, m in (d.get("memory") or {}).items():
        if not m:
            continue
        g = "engine memory (ours-graph engines)"
        out[(g, f"{model} capture MB")] = (m["capture_bytes"] / MB, "MB", -1, None)
        out[(g, f"{model} KV tokens")] = (m["kv_tokens"], "tokens", +1, None)
        out[(g, f"{model} graphs")] = (m.get("graphs"), "graphs", 0, None)
    return out


def metrics_capture(d: dict) -> dict:
    out = {}
    for r in d.get("results", []):
        if "error" in r:
            continue
        tag = f"{r['model']} {r['variant']}"
        g = "capture memory"
        out[(g, f"{tag} capture MB")] = (r["capture_bytes"] / MB, "MB", -1, None)
        out[(g, f"{tag} KV tokens @0.85")] = (r["kv_tokens"], "tokens", +1, None)
        out[(g, f"{tag} graphs")] = (r.get("graphs"), "graphs", 0, None)
        for lat in r.get("latency") or []:
            for k in ("eager_ms", "breakable_ms", "full_graph_ms"):
                out[("one-sequence latency (capture.py)",
                     f"{tag} {lat['tokens']} tok {k[:-3].replace('_', ' ')}")] = (
                    lat[k], "ms", -1, None)
    return out


def metrics_attention(d: dict) -> dict:
    out = {}
    for r in d.get("rows", []):
        kernel = r.get("kernel", "-")
        if kernel == "-":
            continue
        page = f" page {r['page_size']}" if r.get("page_size") else ""
        shape = f"{r['case']} {r.get('H')}/{r.get('KVH')} D{r.get('D')} S={r.get('S')}{page}"
        g = ("attention, ours" if kernel.startswith("ours") else
             "attention, SDPA (the control: the same library in both trees)")
        for key, suffix in (("tflops", ""), ("tflops_graph", " graph"),
                            ("tflops_with_gather", " +gather")):
            if key in r and (key == "tflops" or r[key] is not None):
                out[(g, f"{shape} {kernel}{suffix}")] = (r[key], "TFLOP/s", +1, r.get("how"))
    for name, us in ((d.get("meta") or {}).get("launch_overhead_us") or {}).items():
        out[("attention launcher, host time per call", name)] = (us, "µs", -1, None)
    return out


EXTRACT = {"e2e": metrics_e2e, "attention": metrics_attention, "capture": metrics_capture}


def spread(xs: list[float]) -> float | None:
    if len(xs) < 2:
        return None
    m = statistics.fmean(xs)
    return (max(xs) - min(xs)) / abs(m) if m else 0.0


def verdict(direction: int, unit: str, bm, am, sb, sa) -> str:
    if bm is None or am is None:
        return "n/a"
    if direction == 0:
        return "same" if bm == am else "differs"
    speed = unit not in ("MB", "tokens")
    if bm == 0:
        return "n/a (zero before)"
    rel = (am - bm) / abs(bm) * direction  # > 0: after is better
    noise = max(sb or 0.0, sa or 0.0) + MARGIN
    word = ("within noise" if abs(rel) <= noise else
            ("faster" if speed else "better") if rel > 0 else ("slower" if speed else "worse"))
    if sb is None or sa is None:
        word += " (one run a side)" if sb is None and sa is None else " (one run on a side)"
    return word


def compare(data: dict) -> list[dict]:
    per_run = {run: {} for run in RUNS}
    for run in RUNS:
        for b in BENCHES:
            if data[run][b] is not None:
                for (g, m), v in EXTRACT[b](data[run][b]).items():
                    per_run[run][(b, g, m)] = v
    keys: list = []
    for run in ("before1", "after1", "before2", "after2"):  # first-seen order
        keys += [k for k in per_run[run] if k not in keys]
    rows = []
    for b_, g, m in keys:
        vals = {run: (per_run[run][(b_, g, m)][0] if (b_, g, m) in per_run[run] else None)
                for run in RUNS}
        some = next(per_run[run][(b_, g, m)] for run in RUNS if (b_, g, m) in per_run[run])
        _, unit, direction, _ = some
        extras = {run: per_run[run][(b_, g, m)][3] for run in RUNS
                  if (b_, g, m) in per_run[run] and per_run[run][(b_, g, m)][3] is not None}
        bv = [vals[r] for r in ("before1", "before2") if vals[r] is not None]
        av = [vals[r] for r in ("after1", "after2") if vals[r] is not None]
        bm = statistics.fmean(bv) if bv else None
        am = statistics.fmean(av) if av else None
        sb, sa = spread(bv), spread(av)
        row = dict(bench=b_, group=g, metric=m, unit=unit, direction=direction, values=vals,
                   before_mean=bm, after_mean=am, before_spread=sb, after_spread=sa,
                   ratio=(am / bm if bm and am is not None else None),
                   verdict=verdict(direction, unit, bm, am, sb, sa))
        if b_ == "e2e" and len(set(extras.values())) > 1:
            row["note"] = "path differs: " + ", ".join(f"{r} {x}" for r, x in extras.items())
        if b_ == "attention" and any(str(x).startswith("failed") for x in extras.values()):
            row["note"] = "; ".join(f"{r}: {x}" for r, x in extras.items()
                                    if str(x).startswith("failed"))[:200]
        rows.append(row)
    return rows


def _num(x) -> str:
    if x is None:
        return "—"
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) >= 1000):
        return f"{int(x):,}"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 100:
        return f"{x:.1f}"
    if abs(x) >= 10:
        return f"{x:.2f}"
    return f"{x:.3f}"


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


def _meta_of(data: dict) -> dict:
    for run in ("after1", "before1", "after2", "before2"):
        for b in BENCHES:
            d = data[run][b]
            if d and d.get("meta"):
                return d["meta"]
    return {}


def report(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="ab_compare.py report")
    p.add_argument("ab_dir", type=Path, help="holds before1, after1, before2, after2")
    p.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--change", default="change", help="what the A/B is of, e.g. restructure")
    p.add_argument("--before", default="the tree in `.before`",
                   help="what the before tree is, e.g. tag before-restructure (42b08ae)")
    p.add_argument("--known", default="", help="differences expected beforehand")
    p.add_argument("--name", default=None)
    args = p.parse_args(argv)
    data, status = load_runs(args.ab_dir)
    meta = _meta_of(data)
    date = (meta.get("date") or datetime.datetime.now(datetime.timezone.utc).isoformat())[:10]
    gpu = meta.get("gpu") or "cpu"
    tag = "h200" if "H200" in gpu else "".join(c if c.isalnum() else "-" for c in gpu.lower())
    name = args.name or f"ab-{args.change}-{tag}-{date}"
    rows = compare(data)
    times = read_times(args.ab_dir)
    commands = {f"{run} {b}": data[run][b]["meta"].get("command")
                for run in RUNS for b in BENCHES
                if data[run][b] and data[run][b].get("meta")}

    lines = [f"# {args.change}, before/after ({gpu}, {date})", ""]
    lines.append(
        f"{args.before} (a worktree in `.before`) against the working tree, "
        "each benchmark run before, after, before, after in separate processes on one GPU "
        "(`STEPS=ab bash bench/h200_session.sh`). "
        f"torch {meta.get('torch')}, triton {meta.get('triton')}, CUDA {meta.get('cuda')}.")
    lines.append("")
    lines.append(
        "Spread = |run 1 − run 2| / their mean. Verdict: after mean worse than before mean by "
        f"more than max(before spread, after spread) + {100 * MARGIN:.0f} % → slower (memory: "
        "worse), better by as much → faster (better), else within noise. Graph counts are "
        "informational (same / differs)." + (f" Known beforehand: {args.known}" if args.known
                                             else ""))
    lines += ["", "## Runs", "", "| run | status |", "|---|---|"]
    lines += [f"| {run} | {status[run]} |" for run in ("before1", "after1", "before2", "after2")]
    if times:
        lines += ["", "| benchmark | run | rc | seconds | note |", "|---|---|---|---|---|"]
        lines += ["| " + " | ".join((t + ["", "", "", "", ""])[:5]) + " |" for t in times]
    summary = {}
    for b in BENCHES:
        counts: dict = {}
        for r in rows:
            if r["bench"] == b and r["direction"] != 0:
                w = r["verdict"].split(" (")[0]
                counts[w] = counts.get(w, 0) + 1
        summary[b] = counts
    lines += ["", "## Summary", ""]
    for b in BENCHES:
        c = summary[b]
        lines.append(f"- {b}: " + (", ".join(f"{n} {w}" for w, n in sorted(c.items()))
                                   if c else "no data"))
    bad = [r for r in rows if r["verdict"].startswith(("slower", "worse"))]
    if bad:
        lines += ["", "Slower / worse after:", ""]
        lines += [f"- {r['bench']}: {r['metric']} ({r['unit']}): after/before "
                  f"{r['ratio']:.3f}, {r['verdict']}" for r in bad]
    notes = [r for r in rows if r.get("note")]
    if notes:
        lines += ["", "Notes:", ""] + [f"- {r['bench']}: {r['metric']}: {r['note']}"
                                       for r in notes]
    header = ("| metric | before1 | before2 | after1 | after2 | before spread | after spread | "
              "after/before | verdict |")
    for b in BENCHES:
        groups = list(dict.fromkeys(r["group"] for r in rows if r["bench"] == b))
        lines += ["", f"## {b}", ""]
        if not groups:
            lines.append("No results in any run.")
            continue
        for g in groups:
            units = {r["unit"] for r in rows if r["bench"] == b and r["group"] == g}
            lines += [f"### {g}" + (f" ({units.pop()})" if len(units) == 1 else ""), "", header,
                      "|---" * 9 + "|"]
            for r in rows:
                if r["bench"] != b or r["group"] != g:
                    continue
                v = r["values"]
                cells = [r["metric"]] + [_num(v[x]) if v[x] is not None else
                                         ("missing" if status[x].startswith("missing") else "—")
                                         for x in RUNS]
                cells += [_pct(r["before_spread"]), _pct(r["after_spread"]),
                          "—" if r["ratio"] is None else f"{r['ratio']:.3f}", r["verdict"]]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
    lines += ["", "## Commands", ""] + [f"- {k}: `{c}`" for k, c in commands.items()]
    md = "\n".join(lines).rstrip() + "\n"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.md").write_text(md)
    (args.out_dir / f"{name}.json").write_text(json.dumps(dict(
        benchmark=f"{args.change} A/B ({args.before} vs the working tree)", date=date, gpu=gpu,
        torch=meta.get("torch"), triton=meta.get("triton"), margin=MARGIN, runs=status,
        times=times, commands=commands, summary=summary, rows=rows), indent=1))
    print(md)
    print(f"wrote {args.out_dir / name}.md and .json")


def main() -> None:
    argv = sys.argv[1:]
    if argv and argv[0] == "run-attention":
        run_attention(argv[1:])
    elif argv and argv[0] == "report":
        report(argv[1:])
    else:  # the report is the default
        report(argv)


if __name__ == "__main__":
    main()
