"""Servers in their own process groups on loopback, and the HTTP and Prometheus calls to them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")


class Server:
    """One server command; `up()` waits for its /health, `down()` ends its whole group."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, log: Path,
                 health: str = "/health", cwd: str | None = None):
        self.name, self.cmd, self.env, self.port, self.log = name, cmd, env, port, log
        self.health, self.cwd, self.proc = health, cwd, None
        self.url = self.admin = f"http://127.0.0.1:{port}"

    def start(self) -> Server:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.cmd, env={**os.environ, **self.env}, cwd=self.cwd,
                                         stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        return self

    def up(self, timeout: float = 300.0) -> Server:
        if self.proc is None:
            self.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log}")
            try:
                with urllib.request.urlopen(self.url + self.health, timeout=5) as r:
                    if r.status == 200:
                        return self
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not healthy within {timeout:.0f} s; see {self.log}")

    def down(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            return
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # children the leader left behind (vLLM's engine core)
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc = None

    def post(self, path: str, body: dict, headers: dict[str, str] | None = None,
             timeout: float = 300.0) -> tuple[int, dict]:
        headers = {"Content-Type": "application/json", **(headers or {})}
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            try:
                return e.code, json.loads(text)
            except json.JSONDecodeError:
                return e.code, {"error": text}

    def metrics(self, url: str | None = None) -> dict[str, float]:
        """`name{labels}` -> value of every sample of /metrics (labels as written)."""
        with urllib.request.urlopen((url or self.url) + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            m = _SAMPLE.match(line)
            if m:
                out[m[1] + (m[2] or "")] = float(m[3])
        return out

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of `name`'s samples whose labels include `labels`."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in samples.items()
               if k.split("{")[0] == name and all(w in k for w in want))
