"""`python -m service` as a subprocess on a free loopback port, for tests through the real
processes (supervisor, engine, API workers)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx

from tests.api.conftest import free_port, metric, wait_for

REPO = Path(__file__).resolve().parents[2]


def service_env(**extra: str) -> dict[str, str]:
    """The inherited environment without the settings a test must choose, a free ADMIN_PORT (the
    default 8001 would collide between services), then `extra`."""
    env = {k: v for k, v in os.environ.items() if k.isupper() and k not in (
        "MODEL_PATH", "MODEL_PRESET", "API_KEY", "PORT", "ADMIN_PORT", "HOST")}
    env.update(PYTHONPATH=str(REPO), ADMIN_PORT=str(free_port()))
    env.update(extra)
    return env


def running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


class Service:
    """`python -m service` on a free loopback port and a free admin port, its log in a file."""

    def __init__(self, tmp: Path, wait: bool = True, **env: str):
        self.url = f"http://127.0.0.1:{(port := free_port())}"
        env.setdefault("ADMIN_PORT", str(free_port()))
        self.admin_url = f"http://127.0.0.1:{env['ADMIN_PORT']}"
        self.log_path = tmp / f"service-{port}.log"
        self.log = self.log_path.open("w+")
        # its own TMPDIR, which close() removes: a supervisor ended by SIGKILL (close(), the
        # fault tests) cannot remove its run directory. Short: IPC paths fit in ~100 bytes.
        self.tmpdir = Path(tempfile.mkdtemp(prefix="tps-"))
        env["TMPDIR"] = str(self.tmpdir)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "service"], cwd=REPO, stdout=self.log,
            stderr=subprocess.STDOUT,
            env=service_env(HOST="127.0.0.1", PORT=str(port), LOG_LEVEL="info", **env))
        if wait:
            try:
                wait_for(lambda: self.status("/ready") == 200 or self.proc.poll() is not None,
                         120, "/ready")
                assert self.proc.poll() is None, self.tail()
            except AssertionError:
                self.close()  # no fixture holds it yet: nothing else would stop it
                raise

    def tail(self, chars: int = 4000) -> str:
        self.log.flush()
        return self.log_path.read_text()[-chars:]

    def run_dirs(self) -> list[Path]:
        """The supervisor's run directory (sockets, metric files), while it exists."""
        return sorted(self.tmpdir.glob("triton-prefill-*"))

    def pids(self, what: str) -> list[int]:
        """Live pids the supervisor logged as started: "the engine", "API worker" or "the admin
        server"."""
        found = re.findall(rf"started {what}[^(\n]*\(pid (\d+)\)", self.tail(10**7))
        return [int(p) for p in found if running(int(p))]

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def status(self, path: str) -> int:
        try:
            return httpx.get(self.url + path, timeout=5).status_code
        except httpx.TransportError:
            return -1

    def post_in_background(self, body: dict, wait: bool = True) -> dict:
        """POST /v1/prefill on a thread; waits until a prompt runs unless `wait` is false."""
        out: dict = {}

        def go() -> None:
            try:
                out["r"] = httpx.post(self.url + "/v1/prefill", json=body, timeout=300)
            except httpx.TransportError as e:  # a test that kills the process it talks to
                out["error"] = e

        t = threading.Thread(target=go, daemon=True)
        t.start()
        out["thread"] = t
        if wait:
            wait_for(lambda: metric(httpx.get(self.url + "/metrics").text,
                                "prefill_running_requests") > 0, 60,
                     "the request to run")
        return out

    def close(self) -> None:
        children = self.pids("the engine") + self.pids("API worker") + self.pids("the admin server")
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        # the children of a killed supervisor see it gone and exit; then nothing writes here
        wait_for(lambda: not any(running(p) for p in children), 30, "the service's processes")
        self.log.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
