"""The service under test for bench/hardening.py: `python -m service` in a given checkout, in
its own process group and TMPDIR, and raw access to its engine's work socket."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import msgspec
import zmq

API_WORKERS = 2
LOOP = "127.0.0.1"


def post(port: int, input_ids: list[int], timeout: float) -> dict:
    t0 = time.perf_counter()
    try:
        r = httpx.post(f"http://{LOOP}:{port}/v1/prefill", json={"input_ids": input_ids},
                       timeout=timeout)
        status = r.status_code
    except httpx.HTTPError as e:
        status = type(e).__name__
    return {"status": status, "s": round(time.perf_counter() - t0, 3)}


def submit(rid: int, prompts: list[bytes]) -> bytes:
    """A raw Submit from worker 0: [tag, worker, rid, prompts, params, keys, shared]."""
    return msgspec.msgpack.encode(["Submit", 0, rid, prompts, {}, [], 0])


def push(sock_dir: Path, msgs: list[bytes]) -> int:
    """PUSH msgs to the engine's work socket; how many went out (a dead peer stops it)."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 2000)
    s.setsockopt(zmq.SNDTIMEO, 1000)
    s.connect(f"ipc://{sock_dir / 'engine-in'}")
    sent = 0
    for msg in msgs:
        try:
            s.send(msg)
        except zmq.Again:
            break
        sent += 1
    s.close()
    ctx.term()
    return sent


def proc_stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z"


class Service:
    """`python -m service` in `repo`, in its own process group and TMPDIR, ready."""

    def __init__(self, repo: Path, python: str, tmp: Path, extra: dict[str, str]):
        self.tmp = Path(tempfile.mkdtemp(prefix="svc-", dir=tmp))
        self.port = free_port()
        env = {**os.environ, "PYTHONPATH": str(repo), "TMPDIR": str(self.tmp), "HOST": LOOP,
               "PORT": str(self.port), "API_WORKERS": str(API_WORKERS),
               "LOG_LEVEL": "warning", **extra}
        self.admin_port = None
        if "admin_port" in (repo / "service/config.py").read_text():
            self.admin_port = free_port()
            env["ADMIN_PORT"] = str(self.admin_port)
        self.log_path = self.tmp / "service.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([python, "-m", "service"], cwd=repo, env=env,
                                         stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 180
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the service did not become ready: {self.log()[-2000:]}")
            time.sleep(0.3)
        (self.sock_dir,) = self.tmp.glob("triton-prefill-*")
        self.engine_pid = self._engine_pid()

    def _ready(self) -> bool:
        try:
            return httpx.get(f"http://{LOOP}:{self.port}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _engine_pid(self) -> int:
        """The supervisor's first child (the engine starts before the workers)."""
        kids = []
        for d in Path("/proc").iterdir():
            stat = proc_stat(int(d.name)) if d.name.isdigit() else None
            if stat and int(stat[1]) == self.proc.pid:
                cmd = (d / "cmdline").read_bytes()
                if b"resource_tracker" not in cmd:
                    kids.append((int(stat[19]), int(d.name)))
        assert len(kids) >= 1 + API_WORKERS, f"expected engine + workers (+ admin), got {kids}"
        return min(kids)[1]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """SIGTERM to the group, 10 s, then SIGKILL to whatever of it is left."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOP, 0))
        return s.getsockname()[1]


def checkout_service(repo: Path, python: str) -> str:
    """The `service` package `python` imports in `repo`, checked to be that checkout's own."""
    path = subprocess.run([python, "-c", "import service; print(service.__file__)"], cwd=repo,
                          env={**os.environ, "PYTHONPATH": str(repo)}, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert path.startswith(f"{repo}/"), f"{path} is not {repo}'s"
    return path
