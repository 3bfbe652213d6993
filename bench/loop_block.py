"""/health latency on an API worker while it answers large prompt_logprobs requests.

Starts `python -m service` with API_WORKERS=1 (every request meets the one event loop), then
posts --requests /v1/prefill requests of --tokens prompt tokens with prompt_logprobs and
top_logprobs=--top, one after the other, while a probe process GETs /health every --every-ms
on a kept-alive connection. Prints /health p50/p99/max over the probes sent while the worker
turned each answer into JSON and sent it (from the end of the engine's work, as the answer's
queue_ms + prefill_ms place it, to the answer's last byte), and over every probe. Loopback
only; bounded by --requests and the service's REQUEST_TIMEOUT_S.

  python bench/loop_block.py --tokens 5000 --top 20 --requests 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.overload import serve  # noqa: E402


def probe(port: int, every_s: float, stop, q) -> None:
    """(monotonic send time, seconds to the answer) of each /health until `stop` is set."""
    out = []
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
        c.get("/health")
        while not stop.is_set():
            t0 = time.monotonic()
            c.get("/health")
            out.append((t0, time.monotonic() - t0))
            time.sleep(every_s)
    q.put(out)


def summary(ms: list[float]) -> dict:
    ms = sorted(ms)
    if not ms:
        return {"probes": 0}
    return {"probes": len(ms), "p50_ms": round(statistics.median(ms), 1),
            "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 1), "max_ms": round(ms[-1], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=5000)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--every-ms", type=float, default=5.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rng = random.Random(0)
    server, port = serve({"API_WORKERS": "1", "ADMIN_PORT": "0"})
    ctx = mp.get_context("spawn")
    stop, q = ctx.Event(), ctx.Queue()
    prober = ctx.Process(target=probe, args=(port, args.every_ms / 1e3, stop, q))
    windows, answers = [], []
    try:
        prober.start()
        time.sleep(1.0)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as c:
            for _ in range(args.requests):
                ids = [rng.randrange(100, 40000) for _ in range(args.tokens)]
                t0 = time.monotonic()
                r = c.post("/v1/prefill", json={"input_ids": ids, "prompt_logprobs": True,
                                                "top_logprobs": args.top})
                t1 = time.monotonic()
                assert r.status_code == 200, r.text[:500]
                res = r.json()["results"][0]
                engine_s = (res["queue_ms"] + res["prefill_ms"]) / 1e3
                windows.append((t0 + engine_s, t1))
                answers.append({"bytes": len(r.content), "seconds": round(t1 - t0, 3),
                                "engine_seconds": round(engine_s, 3)})
                time.sleep(0.5)
        stop.set()
        probes = q.get(timeout=60)
        prober.join()
    finally:
        server.terminate()
        server.wait(60)
    during = [lat * 1e3 for t, lat in probes if any(a <= t <= b for a, b in windows)]
    res = {"tokens": args.tokens, "top": args.top, "answers": answers,
           "health_during_answers": summary(during),
           "health_all": summary([lat * 1e3 for _, lat in probes])}
    d, a = res["health_during_answers"], res["health_all"]
    print(f"{args.requests} answers of {args.tokens} x {args.top} "
          f"({answers[0]['bytes'] / 1e6:.1f} MB, {[x['seconds'] for x in answers]} s, of which "
          f"engine {[x['engine_seconds'] for x in answers]} s)")
    print(f"/health while answering: p50 {d.get('p50_ms')} ms, p99 {d.get('p99_ms')} ms, "
          f"max {d.get('max_ms')} ms over {d['probes']} probes; all: p50 {a.get('p50_ms')}, "
          f"p99 {a.get('p99_ms')}, max {a.get('max_ms')} ms over {a['probes']}")
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv),
                                        "date": time.strftime("%Y-%m-%d"), **res}, indent=1))


if __name__ == "__main__":
    main()
