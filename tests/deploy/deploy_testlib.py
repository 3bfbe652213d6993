"""Helpers shared by the deployment tests (imported by conftest.py and the test modules)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = ("h200", "small-gpu")
# CI installs these with: apt-get install -y --no-install-recommends prometheus
APT_HINT = "apt-get install -y --no-install-recommends prometheus"

READY_TIMEOUT_S = 180.0
SERVICE_DRAIN_TIMEOUT_S = 5


def find_tool(name: str) -> str | None:
    """`name` on PATH, or next to the running interpreter (pip-installed tools in the venv)."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else None


def require_tool(name: str, how: str) -> str:
    path = find_tool(name)
    if path is None:
        pytest.skip(
            f"`{name}` not found on PATH or in {Path(sys.executable).parent}; install: {how}"
        )
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """HTTP status of a GET, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return None


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, wait up to grace_s, then SIGKILL. Only touches the process we started."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def load_yaml_docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


# --- the rendered pod, as the kubelet sees it -----------------------------------------------


def one(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def named(docs: list[dict], kind: str, name: str) -> dict:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


CLIENT_SERVICE, METRICS_SERVICE = "triton-prefill", "triton-prefill-metrics"


def scrape_job(docs: list[dict]) -> str:
    """The `job` label Prometheus gives our targets: the scraped Service's jobLabel label, or
    its name without one (the Prometheus Operator's rule)."""
    mon = one(docs, "ServiceMonitor")["spec"]
    svc = named(docs, "Service", METRICS_SERVICE)
    meta = svc["metadata"]
    return meta["labels"][mon["jobLabel"]] if "jobLabel" in mon else meta["name"]


def container(docs: list[dict]) -> dict:
    containers = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, "one container per pod expected"
    return containers[0]


def effective_env(docs: list[dict]) -> dict[str, str | None]:
    """The container's environment as the kubelet builds it: envFrom in order, then env wins.

    valueFrom entries map to None (their value is not in the manifests).
    """
    c = container(docs)
    configmaps = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    env: dict[str, str | None] = {}
    for src in c.get("envFrom", []):
        ref = src.get("configMapRef")
        assert ref, f"only configMapRef envFrom is expected, got {src}"
        assert ref["name"] in configmaps, f"envFrom references missing ConfigMap {ref['name']}"
        prefix = src.get("prefix", "")
        env.update({prefix + k: v for k, v in configmaps[ref["name"]].get("data", {}).items()})
    for var in c.get("env", []):
        env[var["name"]] = var.get("value")
    return env
