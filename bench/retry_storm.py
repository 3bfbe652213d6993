"""Goodput under a retry storm: successful prefills per second when clients retry 429s at once.

Starts `python -m service` (CPU or GPU, whatever the machine has) with a small queue limit and
runs two phases against it on loopback, each client a loop of POST /v1/prefill that retries a 429
after --retry-ms (not honouring Retry-After, as a careless client does):

  saturation  --clients-sat clients, as many as the queue holds: every request is admitted;
  storm       --clients-storm clients: most requests get 429 and are retried at once.

It prints (and with --out writes as JSON) both goodputs, their ratio, the 429 rate and the
Retry-After values seen. The clients are raw asyncio sockets with a prebuilt request, in their own
process, so that the client costs far less CPU than the server it measures.

  python bench/retry_storm.py                       # 16 / 256 clients, queue 16, 20 s each
  python bench/retry_storm.py --seconds 10 --out /tmp/storm.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def request_bytes(prompt: str) -> bytes:
    body = json.dumps({"prompt": prompt}).encode()
    return (b"POST /v1/prefill HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes]]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for ln in lines[1:]:
        k, _, v = ln.partition(b":")
        headers[k.strip().lower()] = v.strip()
    await reader.readexactly(int(headers.get(b"content-length", b"0")))
    return status, headers


async def client(port: int, req: bytes, retry_s: float, until: float, out: dict) -> None:
    reader = writer = None
    while time.monotonic() < until:
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(req)
            status, headers = await read_response(reader)
        except (OSError, asyncio.IncompleteReadError):
            writer = None
            out["errors"] += 1
            await asyncio.sleep(retry_s)
            continue
        if headers.get(b"connection") == b"close":
            writer.close()
            writer = None
        if status == 200:
            out["ok"] += 1
        elif status == 429:
            out["rejected"] += 1
            ra = headers.get(b"retry-after", b"?").decode()
            out["retry_after"][ra] = out["retry_after"].get(ra, 0) + 1
            await asyncio.sleep(retry_s)
        else:
            out["other"][str(status)] = out["other"].get(str(status), 0) + 1
    if writer is not None:
        writer.close()


def run_clients(port: int, n: int, prompt: str, retry_s: float, seconds: float, q) -> None:
    async def main() -> dict:
        out = {"ok": 0, "rejected": 0, "errors": 0, "retry_after": {}, "other": {}}
        until = time.monotonic() + seconds
        t0 = time.process_time()
        await asyncio.gather(*(client(port, request_bytes(prompt), retry_s, until, out)
                               for _ in range(n)))
        out["client_cpu_s"] = time.process_time() - t0
        return out

    q.put(asyncio.run(main()))


def phase(port: int, n: int, prompt: str, retry_s: float, seconds: float) -> dict:
    q: mp.Queue = mp.Queue()
    p = mp.Process(target=run_clients, args=(port, n, prompt, retry_s, seconds, q))
    p.start()
    out = q.get(timeout=seconds + 120)
    p.join()
    out.update(clients=n, seconds=seconds, goodput_rps=out["ok"] / seconds,
               rejected_rps=out["rejected"] / seconds,
               client_cpu_share=out["client_cpu_s"] / seconds)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--queue", type=int, default=16, help="MAX_QUEUE_REQUESTS of the server")
    ap.add_argument("--clients-sat", type=int, default=16)
    ap.add_argument("--clients-storm", type=int, default=256)
    ap.add_argument("--retry-ms", type=float, default=50.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--prompt", default="The capital of France is")
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.port == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            args.port = s.getsockname()[1]
    env = {**os.environ, "PORT": str(args.port), "HOST": "127.0.0.1", "ACCESS_LOG": "false",
           "LOG_LEVEL": "warning", "MAX_QUEUE_REQUESTS": str(args.queue)}
    server = subprocess.Popen([sys.executable, "-m", "service"], cwd=REPO, env=env)
    url = f"http://127.0.0.1:{args.port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit("the service did not become ready")
            time.sleep(0.5)
        retry_s = args.retry_ms / 1e3
        phase(args.port, args.clients_sat, args.prompt, retry_s, 3.0)  # warm-up
        sat = phase(args.port, args.clients_sat, args.prompt, retry_s, args.seconds)
        storm = phase(args.port, args.clients_storm, args.prompt, retry_s, args.seconds)
    finally:
        server.terminate()
        server.wait(60)
    result = {"command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d"),
              "queue": args.queue, "retry_ms": args.retry_ms, "saturation": sat,
              "storm": storm, "ratio": storm["goodput_rps"] / max(sat["goodput_rps"], 1e-9)}
    for name in ("saturation", "storm"):
        r = result[name]
        print(f"{name:10s} {r['clients']:4d} clients: {r['goodput_rps']:8.1f} ok/s "
              f"{r['rejected_rps']:8.1f} 429/s  client CPU {r['client_cpu_share']:.0%}  "
              f"Retry-After {r['retry_after']}  other {r['other']} errors {r['errors']}")
    print(f"goodput under the storm / at saturation: {result['ratio']:.2f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
