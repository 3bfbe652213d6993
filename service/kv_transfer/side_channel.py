"""The NIXL side channel a vLLM decode asks for our handshake: a ZMQ ROUTER on a daemon thread."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from service.kv_transfer.wire import WireError, parse_request

log = logging.getLogger(__name__)

_POLL_MS = 1000  # how long close() may wait for the thread to notice
_MAX_FRAME_BYTES = 4096  # zmq drops a peer sending more, before it is buffered
_WARN_EVERY_S = 10.0


class SideChannelError(Exception):
    """The side channel cannot bind its address."""


class SideChannel:
    """Answers [identity, "", GET_META_MSG(0, 0)] with [payload(), msgpack perf_counter]."""

    def __init__(self, host: str, port: int, payload: Callable[[], bytes]):
        self.address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        self._payload = payload
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._warned_at = -_WARN_EVERY_S
        self.served = 0  # handshakes answered
        self.refused = 0  # malformed requests left unanswered

    def start(self) -> None:
        """Bind now (a taken port raises SideChannelError here) and serve on a daemon thread."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        for opt, value in ((zmq.RCVHWM, 0), (zmq.SNDHWM, 0), (zmq.LINGER, 0)):
            sock.setsockopt(opt, value)
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME_BYTES)
        sock.setsockopt(zmq.IPV6, int(self.address.startswith("tcp://[")))
        try:
            sock.bind(self.address)
        except zmq.ZMQError as e:
            sock.close()
            ctx.term()
            msg = f"cannot bind the NIXL side channel to {self.address}: {e.strerror}"
            raise SideChannelError(msg) from None
        self._ctx, self._sock = ctx, sock
        self._thread = threading.Thread(target=self._serve, name="nixl-side-channel", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._ctx.term()
            self._sock = self._ctx = None

    def _serve(self) -> None:
        sock = self._sock
        while not self._stop.is_set():
            try:
                if not sock.poll(_POLL_MS):
                    continue
                frames = sock.recv_multipart(zmq.NOBLOCK)
                try:
                    reply = self._answer(frames)
                except WireError as e:
                    self._refuse(e)
                    continue
                self.served += 1
                sock.send_multipart(reply)
            except Exception:  # the thread must outlive any one peer or payload failure
                log.exception("NIXL side channel on %s: request not answered", self.address)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) != 3 or frames[1]:
            raise WireError(f"{len(frames) - 1} frames after the identity, expected ['', request]")
        ranks = parse_request(frames[2])
        if ranks != (0, 0):
            raise WireError(f"(pp_rank, tp_rank) = {ranks}: this producer serves only (0, 0)")
        return [frames[0], b"", self._payload(), msgspec.msgpack.encode(time.perf_counter())]

    def _refuse(self, error: WireError) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            log.warning("NIXL side channel on %s refused a request (%d so far): %s",
                        self.address, self.refused, error)
