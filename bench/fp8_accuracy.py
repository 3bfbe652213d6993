"""FP8 (W8A8, per-channel weights, per-token activations) accuracy on a real model, on the CPU.

The embedded SmolLM2-135M-Instruct, three ways over the same tokens: fp32; bf16 as the GPU serves
it (norms folded); FP8 as QUANTIZATION=fp8 serves it (the bf16 weights, the pre-norms' weights
multiplied into QKV and gate/up, every projection quantized, the norms run with unit weights and
their output is quantized; the reference path emulates e4m3 exactly: both operands rounded with
their scales, fp32 accumulation). Embedding and LM head stay bf16.

- rolling loglikelihood over a fixed English corpus: the module docstrings of a fixed list of
  Python standard-library modules (this Python's, named in the output), in windows of 1,024
  tokens: perplexity per variant and the ratios;
- next-token top-1 over 512 prompts (spans of 16-128 tokens cut from the corpus at fixed
  offsets): agreement of each variant with fp32 and of FP8 with bf16.

Usage: python bench/fp8_accuracy.py [--tokens 20480] [--prompts 512]
Writes fp8_accuracy.{json,md,png} to $OUT (default bench/results).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import inspect
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.common import markdown_table, out_dir, pyplot, run_meta, write_results  # noqa: E402
from service.engine.batch import SeqChunk, build_batch  # noqa: E402
from service.engine.kv_pool import KVPool  # noqa: E402
from service.engine.pages import pages_for  # noqa: E402
from service.model.loader import load_model  # noqa: E402
from service.model.quant.fp8 import quantize_model  # noqa: E402

WINDOW = 1024
PAGE = 16
MODULES = (  # prose-heavy docstrings; the order fixes the corpus
    "argparse", "asyncio", "collections", "concurrent.futures", "contextlib", "csv",
    "dataclasses", "decimal", "difflib", "doctest", "email", "enum", "fractions", "functools",
    "heapq", "http.client", "http.server", "inspect", "ipaddress", "json", "logging",
    "multiprocessing", "pathlib", "pdb", "pickle", "pydoc", "queue", "random", "re", "sched",
    "selectors", "shelve", "shlex", "shutil", "smtplib", "socket", "sqlite3", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tkinter",
    "tokenize", "trace", "turtle", "typing", "unittest", "urllib.parse", "uuid", "warnings",
    "weakref", "xml.dom.minidom", "zipfile", "zoneinfo",
)


def corpus() -> tuple[str, list[str]]:
    """Module, class and function docstrings of MODULES, in a fixed order."""
    parts, used = [], []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        used.append(name)
        docs = [inspect.getdoc(mod) or ""]
        for attr in sorted(vars(mod)):
            obj = getattr(mod, attr)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(
                    obj, "__module__", None) == mod.__name__:
                docs.append(inspect.getdoc(obj) or "")
        parts += [d for d in docs if len(d) > 200]
    return "\n\n".join(parts), used


class Runner:
    """All-position logits of one token sequence at a time, through the model's forward."""

    def __init__(self, model):
        self.model = model
        dtype = model.dtype
        self.pool = KVPool(model.cfg, WINDOW + PAGE, PAGE, dtype, "cpu")

    @torch.inference_mode()
    def logits(self, ids: list[int], all_rows: bool) -> torch.Tensor:
        pages = self.pool.allocator.alloc(pages_for(len(ids), PAGE))
        try:
            chunk = SeqChunk(tuple(ids), 0, tuple(pages), all_rows)
            b = build_batch([chunk], self.pool.cache, "cpu")
            return self.model(b.input_ids, b.positions, b.meta).float()
        finally:
            self.pool.allocator.free(pages)


def variants() -> tuple[dict, object]:
    loaded = load_model(None, "cpu", torch.float32)
    fp32 = loaded.model
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    bf16.build_rope_tables(torch.device("cpu"))
    fp8 = copy.deepcopy(bf16)
    bf16.fold_norms()  # as the engine serves bf16
    quantize_model(fp8)  # as QUANTIZATION=fp8 serves it
    return {"fp32": fp32, "bf16": bf16, "fp8": fp8}, loaded.tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=20 * WINDOW)
    ap.add_argument("--prompts", type=int, default=512)
    args = ap.parse_args()
    models, tok = variants()
    text, used = corpus()
    ids = tok.encode(text)[: args.tokens]
    assert len(ids) >= args.tokens, f"corpus has {len(ids)} tokens, {args.tokens} asked"
    runners = {k: Runner(m) for k, m in models.items()}

    nll = {k: 0.0 for k in models}
    scored = 0
    for lo in range(0, len(ids) - 1, WINDOW):
        window = ids[lo: lo + WINDOW + 1]
        x, y = window[:-1], torch.tensor(window[1:])
        for k, r in runners.items():
            lp = torch.log_softmax(r.logits(x, True), -1)
            nll[k] -= lp[torch.arange(len(y)), y].sum().item()
        scored += len(y)
    ppl = {k: math.exp(v / scored) for k, v in nll.items()}

    rng = random.Random(0)
    tops = {k: [] for k in models}
    for _ in range(args.prompts):
        n = rng.randint(16, 128)
        lo = rng.randrange(0, len(ids) - n)
        for k, r in runners.items():
            tops[k].append(int(r.logits(ids[lo: lo + n], False)[-1].argmax()))

    def agree(a: str, b: str) -> float:
        return sum(x == y for x, y in zip(tops[a], tops[b])) / len(tops[a])

    res = dict(tokens_scored=scored, perplexity=ppl,
               ratio={"bf16/fp32": ppl["bf16"] / ppl["fp32"], "fp8/fp32": ppl["fp8"] / ppl["fp32"],
                      "fp8/bf16": ppl["fp8"] / ppl["bf16"]},
               top1={"bf16 vs fp32": agree("bf16", "fp32"), "fp8 vs fp32": agree("fp8", "fp32"),
                     "fp8 vs bf16": agree("fp8", "bf16")},
               prompts=args.prompts, corpus_modules=used, corpus_chars=len(text))
    md = ("SmolLM2-135M-Instruct (embedded GGUF), CPU. Corpus: docstrings of "
          f"{len(used)} standard-library modules of Python {sys.version.split()[0]}, "
          f"{scored:,} tokens scored in windows of {WINDOW}. Top-1: {args.prompts} prompts of "
          "16-128 tokens from the corpus (seed 0).\n\n"
          + markdown_table(["variant", "perplexity", "/ fp32", "/ bf16", "top-1 = fp32",
                            "top-1 = bf16"],
                           [["fp32", ppl["fp32"], 1.0, ppl["fp32"] / ppl["bf16"], 1.0,
                             agree("fp32", "bf16")],
                            ["bf16", ppl["bf16"], res["ratio"]["bf16/fp32"], 1.0,
                             agree("bf16", "fp32"), 1.0],
                            ["fp8 (W8A8)", ppl["fp8"], res["ratio"]["fp8/fp32"],
                             res["ratio"]["fp8/bf16"], agree("fp8", "fp32"),
                             agree("fp8", "bf16")]]))
    out = out_dir()
    write_results(out, "fp8_accuracy", run_meta(), res, md)
    plt = pyplot()
    if plt is not None:
        fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3.2))
        a.bar(list(ppl), list(ppl.values()), color=["#555", "#1f77b4", "#d62728"])
        a.set_ylabel("perplexity")
        a.set_ylim(min(ppl.values()) * 0.98, max(ppl.values()) * 1.01)
        b.bar(list(res["top1"]), list(res["top1"].values()), color="#2ca02c")
        b.set_ylabel("top-1 agreement")
        b.set_ylim(0.8, 1.0)
        b.tick_params(axis="x", labelsize=7)
        fig.suptitle("SmolLM2-135M, FP8 W8A8 vs bf16 vs fp32 (CPU reference)")
        fig.tight_layout()
        fig.savefig(out / "fp8_accuracy.png", dpi=120)
    print(md)


if __name__ == "__main__":
    main()
