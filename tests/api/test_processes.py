"""The service as it runs: a supervisor, the engine process, two API worker processes and the
admin server.

Each test drives `python -m service` over HTTP, and kills processes where the test is about
faults. One shared service (module scope) serves the tests that do not stop anything."""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import re
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import metric, wait_for
from tests.api.services import Service, running

KEY = "sk-processes"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG = "The quick brown fox jumps over the lazy dog. " * 30  # ~300 tokens


@pytest.fixture(scope="module")
def svc(tmp_path_factory) -> Service:
    s = Service(tmp_path_factory.mktemp("svc"), API_WORKERS="2", API_KEY=KEY,
                MAX_QUEUE_REQUESTS="64", MAX_BODY_BYTES="65536", MAX_PREFILL_TOKENS="256")
    yield s
    s.close()


def post(svc: Service, body: dict, path: str = "/v1/prefill",
         timeout: float = 120) -> httpx.Response:
    return httpx.post(svc.url + path, json=body, headers=AUTH, timeout=timeout)


def settle(svc: Service) -> str:
    """/metrics once nothing runs and no KV page is held."""
    wait_for(lambda: (metric(m := svc.metrics(), "prefill_running_requests") == 0
                      and metric(m, "prefill_queue_requests") == 0
                      and metric(m, "prefill_kv_used_tokens") == 0), 30, "the engine to settle")
    return svc.metrics()


def worker_of_each_request(svc: Service) -> set[str]:
    return {ln.split()[3] for ln in svc.tail(10**7).splitlines() if '"POST /v1/' in ln}


def test_workers_load_no_torch(svc) -> None:
    workers, engine = svc.pids("API worker"), svc.pids("the engine")
    assert len(workers) == 2 and len(engine) == 1
    maps = {p: Path(f"/proc/{p}/maps").read_text() for p in workers + engine}
    assert all("libtorch" not in maps[p] for p in workers)
    assert "libtorch" in maps[engine[0]]


def test_routes_work_across_processes(svc) -> None:
    assert httpx.post(svc.url + "/v1/prefill", json={"prompt": "Hi"}).status_code == 401
    r = post(svc, {"prompt": "The capital of France is", "top_logprobs": 3,
                   "prompt_logprobs": True})
    assert r.status_code == 200, r.text
    res = r.json()["results"][0]
    assert res["next_token"]["text"] == " Paris" and len(res["top_logprobs"]) == 3
    assert len(res["prompt_logprobs"]) == res["prompt_tokens"]
    # the prefix cache: the same long prompt again reuses its full pages
    first = post(svc, {"prompt": LONG}).json()["results"][0]
    again = post(svc, {"prompt": LONG}).json()["results"][0]
    assert first["cached_tokens"] == 0 and again["cached_tokens"] >= 256
    assert again["next_token"]["id"] == first["next_token"]["id"]
    big = post(svc, {"prompt": "x" * 70_000})
    assert big.status_code == 413 and big.json()["error"]["message"]
    bad = post(svc, {"input_ids": [1, 2, 10**9]})
    assert bad.status_code == 400 and "input_ids[2]" in bad.json()["error"]["message"]
    models = httpx.get(svc.url + "/v1/models", headers=AUTH).json()
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct.Q4_1"
    cmpl = post(svc, {"prompt": "The capital of France is", "max_tokens": 1, "logprobs": 2},
                "/v1/completions")
    assert cmpl.status_code == 200 and cmpl.json()["choices"][0]["text"] == " Paris"


def test_openai_client(svc) -> None:
    import openai

    client = openai.OpenAI(base_url=svc.url + "/v1", api_key=KEY, max_retries=0)
    out = client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", max_tokens=1,
                                    prompt="The capital of France is", logprobs=1)
    assert out.choices[0].text == " Paris" and out.usage.prompt_tokens == 5
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=svc.url + "/v1", api_key="wrong", max_retries=0
                      ).completions.create(model="x", prompt="Hi", max_tokens=1)


def test_disconnect_cancels_in_the_engine_and_frees_pages(svc) -> None:
    before = metric(settle(svc), "prefill_requests_total", status="cancelled")
    # ~4,000 tokens in chunks of 256 on the CPU: still running when the client goes
    done = threading.Event()

    def go() -> None:
        try:
            post(svc, {"prompt": LONG * 13}, timeout=1.5)
        except httpx.TimeoutException:
            pass
        done.set()

    threading.Thread(target=go, daemon=True).start()
    wait_for(done.is_set, 30, "the client to give up")
    m = settle(svc)
    assert metric(m, "prefill_requests_total", status="cancelled") == before + 1


def test_concurrent_load_through_two_workers(svc) -> None:
    """Ten seconds of concurrent clients: every request answered, every counter summed over
    both workers and the engine, nothing left in the KV pool."""
    m0 = settle(svc)
    ok0 = metric(m0, "prefill_requests_total", status="ok")
    tokens0 = metric(m0, "prefill_prompt_tokens_total")
    ttft0 = metric(m0, "prefill_time_to_first_token_seconds_count")
    end = time.monotonic() + 10.0

    def client(seed: int) -> tuple[int, int, int, list[int]]:
        rng = random.Random(seed)
        sent = prompts = tokens = 0
        codes: list[int] = []
        with httpx.Client(base_url=svc.url, headers=AUTH, timeout=120) as c:
            while time.monotonic() < end:
                n = rng.choice([1, 1, 1, 4])
                ids = [[rng.randrange(100, 40000) for _ in range(rng.randrange(4, 48))]
                       for _ in range(n)]
                body = {"input_ids": ids if n > 1 else ids[0],
                        "prompt_logprobs": rng.random() < 0.2}
                r = c.post("/v1/prefill", json=body)
                codes.append(r.status_code)
                sent += 1
                if r.status_code == 200:
                    prompts += n
                    tokens += r.json()["usage"]["prompt_tokens"]
        return sent, prompts, tokens, codes

    with cf.ThreadPoolExecutor(12) as pool:
        results = list(pool.map(client, range(12)))
    codes = [c for r in results for c in r[3]]
    assert codes and set(codes) == {200}, {c: codes.count(c) for c in set(codes)}
    m = settle(svc)
    assert metric(m, "prefill_requests_total", status="ok") - ok0 == len(codes)
    assert metric(m, "prefill_prompt_tokens_total") - tokens0 == sum(r[2] for r in results)
    assert metric(m, "prefill_time_to_first_token_seconds_count") - ttft0 == sum(
        r[1] for r in results)
    assert worker_of_each_request(svc) == {"worker-0", "worker-1"}  # both workers served


def keep_alive_burst(svc: Service) -> tuple[Counter, Counter]:
    """16 keep-alive clients connecting in the same moment, 4 requests each: the connections
    and requests each worker served (from its access log lines)."""
    start = svc.log_path.stat().st_size
    barrier = threading.Barrier(16)

    def client(i: int) -> list[int]:
        with httpx.Client(base_url=svc.url, timeout=120) as c:
            barrier.wait(30)
            return [c.post("/v1/prefill", json={"input_ids": [100 + i, 200 + j, 300]}
                           ).status_code for j in range(4)]

    with cf.ThreadPoolExecutor(16) as pool:
        codes = [c for r in pool.map(client, range(16)) for c in r]
    assert codes == [200] * 64
    with svc.log_path.open() as f:
        f.seek(start)
        # "<date> <time> INFO worker-1 uvicorn.access: 127.0.0.1:<port> - "POST /v1/prefill..."
        lines = [ln.split() for ln in f if '"POST /v1/prefill' in ln]
    requests = Counter(ln[3] for ln in lines)
    connections = Counter(w for w, _ in {(ln[3], ln[5]) for ln in lines})
    assert sum(requests.values()) == 64 and sum(connections.values()) == 16, lines
    return connections, requests


def test_keep_alive_clients_spread_over_the_workers(service) -> None:
    """Each worker slot listens on a PORT socket of its own (SO_REUSEPORT): the kernel spreads
    new connections over the slots, also while a dead worker's replacement starts (its slot's
    connections wait for it), so the clients that reconnect then do not all pin the survivor."""
    svc = service(API_WORKERS="2")
    connections, requests = keep_alive_burst(svc)
    assert set(connections) == {"worker-0", "worker-1"}, (connections, requests)
    os.kill(svc.pids("API worker")[1], signal.SIGKILL)
    connections, requests = keep_alive_burst(svc)  # at once: while its replacement starts
    new = re.findall(r"started API worker (\d+)", svc.tail(10**7))[-1]
    assert set(connections) == {"worker-0", f"worker-{new}"}, (connections, requests)


def test_429_at_the_queue_limit(service) -> None:
    svc = service(API_WORKERS="2", MAX_QUEUE_REQUESTS="1", MAX_BATCH_PROMPTS="1",
                  MAX_PREFILL_TOKENS="16")
    slow = svc.post_in_background({"prompt": LONG})
    queued = svc.post_in_background({"prompt": LONG + "!"}, wait=False)
    wait_for(lambda: metric(svc.metrics(), "prefill_queue_requests") == 1, 30, "a queued prompt")
    refused = [httpx.post(svc.url + "/v1/prefill", json={"prompt": "Hi"}, timeout=30)
               for _ in range(4)]  # through both workers, most likely
    assert {r.status_code for r in refused} == {429}
    assert all(r.headers["retry-after"].isdigit() and r.json()["error"]["message"]
               for r in refused)
    for r in (slow, queued):
        r["thread"].join(120)
        assert r["r"].status_code == 200


def test_no_worker_is_ready_before_the_engine(service) -> None:
    svc = service(wait=False, API_WORKERS="2")
    seen = set()
    while True:
        r = svc.status("/ready")
        seen.add(r)
        if r == 200:
            # the engine logs this before it tells any worker
            assert "service.engine.server: ready:" in svc.tail(10**7)
            break
        assert svc.proc.poll() is None, svc.tail()
        time.sleep(0.05)
    assert 503 in seen  # the workers answered while the engine loaded


def test_a_killed_engine_fails_every_request_and_stops_the_service(service) -> None:
    svc = service(API_WORKERS="2", MAX_PREFILL_TOKENS="16")
    slow = svc.post_in_background({"prompt": LONG})
    (engine,) = svc.pids("the engine")
    os.kill(engine, signal.SIGKILL)
    slow["thread"].join(30)
    r = slow["r"]
    assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
    assert "engine process is gone" in r.json()["error"]["message"]
    statuses = []
    while svc.proc.poll() is None:
        statuses.append(svc.status("/health"))
        time.sleep(0.05)
    assert 200 not in statuses, statuses  # never a green check behind a dead engine
    assert svc.proc.returncode == 1
    assert "the engine process was killed by signal 9" in svc.tail(10**7)
    assert not svc.run_dirs()  # the supervisor removed its directory on the way out


def test_a_killed_worker_is_replaced_and_its_requests_cancelled(service) -> None:
    svc = service(API_WORKERS="2", MAX_PREFILL_TOKENS="16")
    workers = svc.pids("API worker")
    ok = metric(svc.metrics(), "prefill_requests_total", status="ok")
    for _ in range(3):  # answered, and counted, by the workers about to die
        r = httpx.post(svc.url + "/v1/prefill", json={"prompt": "Hi"}, timeout=60)
        assert r.status_code == 200, r.text
    slow = svc.post_in_background({"prompt": LONG * 4})
    for w in workers:  # the worker holding the request goes with the other one
        os.kill(w, signal.SIGKILL)
    slow["thread"].join(30)
    assert "r" not in slow or slow["r"].status_code != 200  # its connection dropped
    # a SIGKILLed process stays in the process table, not yet a zombie, for a moment
    wait_for(lambda: len(now := set(svc.pids("API worker"))) == 2 and not now & set(workers),
             30, "two new workers in place of the killed ones")
    # a new worker takes connections only once it knows the engine's state, so the first
    # request after the restart is served, whichever worker accepts it
    r = httpx.post(svc.url + "/v1/prefill", json={"prompt": "The capital of France is"},
                   timeout=60)
    assert r.status_code == 200 and r.json()["results"][0]["next_token"]["text"] == " Paris"
    m = settle(svc)  # the dead worker's prompt was cancelled in the engine
    assert svc.tail(10**7).count("restarting it") == 2
    # the replacements count on in the dead workers' metric files: none lost, none added
    assert metric(m, "prefill_requests_total", status="ok") == ok + 4
    (run_dir,) = svc.run_dirs()
    # a counter file and a histogram file for each of the two worker slots, the admin
    # server's and the engine
    assert len(list((run_dir / "metrics").iterdir())) == 2 * 4


def test_the_children_exit_with_the_supervisor(service) -> None:
    """kill -9 of the supervisor (no shutdown of its own) leaves no engine, worker or admin
    server behind."""
    svc = service(API_WORKERS="2")
    children = svc.pids("the engine") + svc.pids("API worker") + svc.pids("the admin server")
    assert len(children) == 4
    svc.proc.kill()
    svc.proc.wait()
    wait_for(lambda: not any(running(p) for p in children), 10, "the children to exit")
    assert svc.tail(10**7).count("the supervisor is gone: exiting") == 4
