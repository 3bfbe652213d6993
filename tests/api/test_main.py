"""`python -m service`: start-up fails fast with one line; SIGTERM drains, answers what is left
with JSON 503s and exits 0 within DRAIN_TIMEOUT_S + SHUTDOWN_MARGIN_S."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from service.api.worker import SHUTDOWN_MARGIN_S
from service.model.files import default_model_path
from tests.api.conftest import free_port, wait_for
from tests.api.services import service_env

REPO = Path(__file__).resolve().parents[2]
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 400  # 4,001 tokens


def run_service(timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service"], env=service_env(**env), cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("var,value,needle", [
    ("MEM_FRACTION_STATIC", "1.5", "less than 1"),
    ("MEM_FRACTION_STATIC", "nan", "must be a number"),
    ("PAGE_SIZE", "zero", "valid integer"),
    ("MODEL_PRESET", "gpt5", "unknown preset"),
    ("API_KEY", "", "would disable authentication"),
    ("DP_SIZE", "2", "scales out with replicas"),
])
def test_bad_config_exits_2(var, value, needle) -> None:
    res = run_service(**{var: value})
    assert res.returncode == 2, res.stderr
    assert f"{var}={value!r}" in res.stderr and needle in res.stderr
    assert res.stderr.count("\n") == 1, res.stderr


def model_paths(tmp: Path) -> dict[str, tuple[Path, str]]:
    """Broken MODEL_PATHs: name -> (path, what the one error line says)."""
    real = default_model_path().read_bytes()
    (tmp / "empty").mkdir()
    (tmp / "notes.txt").write_text("not a model\n")
    (tmp / "truncated.gguf").write_bytes(real[:100_000])
    (tmp / "corrupt.gguf").write_bytes(b"GGUF" + os.urandom(50_000))
    bad_cfg = tmp / "bad-config"
    bad_cfg.mkdir()
    (bad_cfg / "config.json").write_text("{ not json")
    no_weights = tmp / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,'
        ' "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}')
    return {
        "missing": (tmp / "nope.gguf", "no such file or directory"),
        "empty-dir": (tmp / "empty", "not a model directory"),
        "text-file": (tmp / "notes.txt", "not a GGUF file"),
        "truncated-gguf": (tmp / "truncated.gguf", "truncated.gguf"),
        "corrupt-gguf": (tmp / "corrupt.gguf", "corrupt.gguf"),
        "bad-config": (bad_cfg, "config.json"),
        "no-weights": (no_weights, "no-weights"),
    }


@pytest.mark.parametrize("case", ["missing", "empty-dir", "text-file", "truncated-gguf",
                                  "corrupt-gguf", "bad-config", "no-weights"])
def test_bad_model_path_exits_1_with_one_line(case, tmp_path) -> None:
    path, needle = model_paths(tmp_path)[case]
    res = run_service(MODEL_PATH=str(path), HOST="127.0.0.1", PORT=str(free_port()),
                      LOG_LEVEL="info")
    assert res.returncode == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    errors = [ln for ln in res.stderr.splitlines()
              if " ERROR " in ln or ln.startswith("triton-prefill:")]
    assert len(errors) == 1 and needle in errors[0] and str(path) in errors[0], res.stderr[-3000:]


@pytest.mark.parametrize("host", ["127.0.0.1", "256.0.0.1"])
def test_unusable_address_fails_before_loading(host) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        res = run_service(HOST=host, PORT=str(taken.getsockname()[1]), timeout=60)
    assert res.returncode == 1, res.stderr
    assert res.stderr.startswith(f"triton-prefill: cannot listen on HOST={host!r}"), res.stderr
    assert res.stderr.count("\n") == 1, res.stderr  # nothing was loaded: no log lines at all


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT balancing")
def test_port_sockets_are_one_group_and_a_taken_port_fails() -> None:
    """PORT gets a socket per worker slot, one SO_REUSEPORT group on one address; the plain
    bind before it fails while anyone listens on the port, with SO_REUSEPORT as this user
    (another copy of the service) too, where the group's own binds would join it."""
    from service.config import ConfigError
    from service.supervisor import bind

    group = bind("127.0.0.1", free_port(), group=3)
    try:
        assert len(group) == 3 and len({s.getsockname() for s in group}) == 1
        for s in group:
            s.listen()
        with pytest.raises(ConfigError, match="Address already in use"):
            bind("127.0.0.1", group[0].getsockname()[1], group=3)
    finally:
        for s in group:
            s.close()


def test_sigterm_drains_and_exits_zero(service) -> None:
    svc = service(DRAIN_TIMEOUT_S="60", MAX_PREFILL_TOKENS="16", ACCESS_LOG="false",
                  API_WORKERS="2")
    # ~300 tokens at 16 per forward: ~19 chunked forwards (longer on a busy machine; the drain
    # waits as long as it takes, up to DRAIN_TIMEOUT_S)
    slow = svc.post_in_background(
        {"prompt": "The quick brown fox jumps over the lazy dog. " * 30})
    svc.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: svc.status("/ready") == 503, 5, "/ready to turn 503")
    # the listener stays open while draining, so load balancers see 503s, not resets
    ready = httpx.get(svc.url + "/ready", timeout=5)
    assert ready.json()["status"] == "unavailable" and "ready" not in ready.text
    # each worker's PORT socket, the drained one's too, sends fresh connections to a 503
    assert [svc.status("/ready") for _ in range(8)] == [503] * 8
    with httpx.Client(base_url=svc.url, timeout=5) as keep_alive:
        refused = keep_alive.post("/v1/prefill", json={"prompt": "Hi"})
    assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
    assert refused.headers["connection"] == "close"
    slow["thread"].join(70)
    assert slow["r"].status_code == 200, slow["r"].text + svc.tail()
    assert slow["r"].json()["results"][0]["prompt_tokens"] > 250
    assert svc.proc.wait(timeout=30) == 0, svc.tail()
    assert not svc.run_dirs()  # the supervisor removed its directory on the way out
    log = svc.tail()
    assert "signal 15: draining for up to 60s" in log and "draining (1 requests in flight)" in log
    assert '"POST /v1/prefill' not in log, "ACCESS_LOG=false still logged requests"
    assert "loaded SmolLM2-135M-Instruct.Q4_1 " in log and "Smollm2" not in log
    assert f"from {default_model_path()} " in log  # the path is in the log, not in /info


@pytest.mark.parametrize("second_signal", [False, True], ids=["drain-timeout", "second-signal"])
def test_what_the_drain_leaves_gets_a_json_503_and_the_process_exits_in_time(
        service, second_signal) -> None:
    """A forward that outlasts the drain (one 4,001-token prompt on the CPU) is not waited for:
    its client gets a retryable JSON 503 and the process exits 0 within the margin."""
    drain = 60.0 if second_signal else 1.0
    svc = service(DRAIN_TIMEOUT_S=str(drain))
    slow = svc.post_in_background({"prompt": LONG_PROMPT})
    svc.proc.send_signal(signal.SIGTERM)
    if second_signal:
        wait_for(lambda: svc.status("/ready") == 503, 5, "the drain to start")
        svc.proc.send_signal(signal.SIGTERM)
        drain = 0.0
    # a deadline, not a measurement: the contract is exit by DRAIN_TIMEOUT_S + SHUTDOWN_MARGIN_S
    assert svc.proc.wait(timeout=drain + SHUTDOWN_MARGIN_S + 2) == 0, svc.tail()
    slow["thread"].join(10)
    r = slow["r"]
    assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
    assert "shutting down" in r.json()["error"]["message"]
    log = svc.tail()
    assert "Traceback" not in log and "Internal Server Error" not in log, log
    assert ("second signal" if second_signal else "drain timeout") in log
