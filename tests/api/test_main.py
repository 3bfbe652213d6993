"""`python -m service`: config errors exit 2; SIGTERM drains in-flight work and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import free_port, metric, wait_for

REPO = Path(__file__).resolve().parents[2]


def service_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.isupper() and k not in (
        "MODEL_PATH", "MODEL_PRESET", "API_KEY", "PORT", "HOST")}
    env.update(PYTHONPATH=str(REPO), **extra)
    return env


@pytest.mark.parametrize("var,value,needle", [
    ("MEM_FRACTION_STATIC", "1.5", "less than 1"),
    ("PAGE_SIZE", "zero", "valid integer"),
    ("MODEL_PRESET", "gpt5", "unknown preset"),
])
def test_bad_config_exits_2(var, value, needle) -> None:
    res = subprocess.run([sys.executable, "-m", "service"], env=service_env(**{var: value}),
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2, res.stderr
    assert f"{var}={value!r}" in res.stderr and needle in res.stderr
    assert "Traceback" not in res.stderr


def test_load_failure_exits_1() -> None:
    res = subprocess.run([sys.executable, "-m", "service"], cwd=REPO, capture_output=True,
                         text=True, timeout=120,
                         env=service_env(MODEL_PATH="/nonexistent/model.gguf", HOST="127.0.0.1",
                                         PORT=str(free_port())))
    assert res.returncode == 1, res.stderr[-2000:]
    assert "engine failed to load" in res.stderr and "/nonexistent/model.gguf" in res.stderr


def test_sigterm_drains_and_exits_zero(tmp_path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "service.log").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "service"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
        env=service_env(HOST="127.0.0.1", PORT=str(port), DRAIN_TIMEOUT_S="60",
                        MAX_PREFILL_TOKENS="16", LOG_LEVEL="info", ACCESS_LOG="false"))

    def tail() -> str:
        log.flush()
        return (tmp_path / "service.log").read_text()[-3000:]

    def status(path: str) -> int:
        try:
            return httpx.get(url + path, timeout=5).status_code
        except httpx.TransportError:
            return -1

    try:
        wait_for(lambda: status("/ready") == 200 or proc.poll() is not None, 90, "/ready")
        assert proc.poll() is None, tail()
        slow: dict = {}
        # ~300 tokens at 16 per forward: ~19 chunked forwards (longer on a busy machine; the
        # drain waits as long as it takes, up to DRAIN_TIMEOUT_S)
        body = {"prompt": "The quick brown fox jumps over the lazy dog. " * 30}
        t = threading.Thread(target=lambda: slow.update(
            r=httpx.post(url + "/v1/prefill", json=body, timeout=60)))
        t.start()
        wait_for(lambda: metric(httpx.get(url + "/metrics").text, "prefill_kv_used_tokens") > 0,
                 20, "the slow request to be running")
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # the listener stays open while draining, so load balancers see 503s, not resets
        assert status("/ready") == 503
        refused = httpx.post(url + "/v1/prefill", json={"prompt": "Hi"}, timeout=5)
        assert refused.status_code == 503 and "draining" in refused.text
        t.join(70)
        assert slow["r"].status_code == 200, slow["r"].text + tail()
        assert slow["r"].json()["results"][0]["prompt_tokens"] > 250
        rc = proc.wait(timeout=30)
        assert rc == 0, tail()
        assert "draining for up to 60s (1 requests in flight)" in tail()
        assert '"POST /v1/prefill' not in tail(), "ACCESS_LOG=false still logged requests"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
