"""Client processes of bench/retrieval.py: closed-loop embeddings, open-loop (Poisson) rerank."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import numpy as np

from bench.load import Connection, pct

TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Closed:
    """One client process's share of a closed-loop point."""

    url: str
    path: str
    conc: int
    prompts: int
    tokens: int
    vocab: int
    start_at: float
    duration: float
    seed: int


@dataclass(frozen=True)
class Open:
    """One client process's share of an open-loop point: Poisson arrivals at `qps`."""

    url: str
    qps: float
    docs: int
    query_tokens: int
    doc_tokens: int
    pieces: tuple[str, ...]
    item_tokens: int  # the prompt tokens of one item, 0: not checked
    start_at: float
    duration: float
    seed: int


def run(part: Closed | Open) -> dict:
    return asyncio.run(_closed(part) if isinstance(part, Closed) else _open(part))


async def post(conn: Connection, data: bytes, codes: dict) -> tuple[int, bytes]:
    try:
        status, reply = await conn.post(data)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
        conn.close()
        status, reply = 0, type(e).__name__.encode()
    if status != 200:
        key = str(status or reply.decode())
        codes[key] = codes.get(key, 0) + 1
    return status, reply


async def _closed(p: Closed) -> dict:
    rng = np.random.default_rng(p.seed)
    conns = [Connection(p.url, {}, TIMEOUT_S, p.path) for _ in range(p.conc)]
    lat, codes, tokens = [], {}, [0]
    await asyncio.sleep(max(0.0, p.start_at - time.time()))
    t0, cpu0 = time.perf_counter(), time.process_time()

    async def worker(conn: Connection) -> None:
        while time.perf_counter() - t0 < p.duration:
            ids = rng.integers(100, p.vocab, (p.prompts, p.tokens)).tolist()
            body = ({"input": ids, "encoding_format": "base64"} if p.path == "/v1/embeddings"
                    else {"input_ids": ids})
            data = json.dumps(body).encode()
            t = time.perf_counter()
            status, reply = await post(conn, data, codes)
            if status == 200:
                lat.append(time.perf_counter() - t)
                tokens[0] += json.loads(reply)["usage"]["prompt_tokens"]

    await asyncio.gather(*(worker(c) for c in conns))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    for c in conns:
        c.close()
    return dict(lat=lat, tokens=tokens[0], items=0, codes=codes, wall=wall, cpu=cpu, mismatch=0)


def words(rng: np.random.Generator, pieces: np.ndarray, n: int) -> str:
    return "".join(rng.choice(pieces, n))


def rerank_body(rng: np.random.Generator, pieces: np.ndarray, p: Open) -> bytes:
    docs = [words(rng, pieces, p.doc_tokens) for _ in range(p.docs)]
    return json.dumps({"query": words(rng, pieces, p.query_tokens), "documents": docs,
                       "return_documents": False}).encode()


async def _open(p: Open) -> dict:
    rng = np.random.default_rng(p.seed)
    pieces = np.array(p.pieces, dtype=object)
    gaps = rng.exponential(1 / p.qps, int(p.qps * p.duration * 1.5) + 10)
    arrivals = np.cumsum(gaps)
    arrivals = arrivals[arrivals < p.duration]
    bodies = [rerank_body(rng, pieces, p) for _ in arrivals]  # built before the clock starts
    free: list[Connection] = []
    lat, codes, count = [], {}, {"items": 0, "tokens": 0, "mismatch": 0}

    async def one(at: float, data: bytes) -> None:
        conn = free.pop() if free else Connection(p.url, {}, TIMEOUT_S, "/v1/rerank")
        status, reply = await post(conn, data, codes)
        done = time.perf_counter()
        free.append(conn)
        if status == 200:
            lat.append(done - at)
            out = json.loads(reply)
            count["items"] += len(out["results"])
            count["tokens"] += out["usage"]["prompt_tokens"]
            want = p.item_tokens * p.docs
            count["mismatch"] += bool(want) and out["usage"]["prompt_tokens"] != want

    await asyncio.sleep(max(0.0, p.start_at - time.time()))
    t0, cpu0 = time.perf_counter(), time.process_time()
    tasks = []
    for at, data in zip(arrivals, bodies):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(t0 + at, data)))
    await asyncio.gather(*tasks)
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    for c in free:
        c.close()
    return dict(lat=lat, codes=codes, wall=max(wall, p.duration), cpu=cpu, **count)


def merged(outs: list[dict]) -> dict:
    """One point's figures over its client processes."""
    lat = [x for o in outs for x in o["lat"]]
    wall = max(o["wall"] for o in outs)
    codes: dict[str, int] = {}
    for o in outs:
        for k, v in o["codes"].items():
            codes[k] = codes.get(k, 0) + v
    return {"requests": len(lat), "errors": sum(codes.values()), "error_codes": codes,
            "seconds": wall, "tok_s": sum(o["tokens"] for o in outs) / wall,
            "items_s": sum(o["items"] for o in outs) / wall,
            "usage_mismatch": sum(o["mismatch"] for o in outs),
            "p50_ms": (pct(lat, 50) or 0) * 1e3, "p99_ms": (pct(lat, 99) or 0) * 1e3,
            "client_cpu_max": max(o["cpu"] / o["wall"] for o in outs)}
