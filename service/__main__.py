"""`python -m service` / `triton-prefill`: read settings once, log, serve, drain on SIGTERM.

SIGTERM (or Ctrl+C) starts a drain: /ready and new POSTs answer 503 while the listener stays open
(so Kubernetes sees the pod leave its endpoints), in-flight requests finish for up to
DRAIN_TIMEOUT_S, then uvicorn shuts down and the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import logging
import sys
import time
from types import FrameType

import uvicorn

from service.config import ConfigError, load_settings, resolve

log = logging.getLogger("service")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain_timeout_s: float):
        super().__init__(config)
        self.drain_timeout_s = drain_timeout_s
        self.drain_deadline: float | None = None
        self.exit_code = 0

    @property
    def _state(self):  # noqa: ANN202 - the app's AppState
        return self.config.app.state.prefill

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: not recorded in _captured_signals: uvicorn would re-raise it after shutdown and
        # the process would die by SIGTERM instead of exiting 0.
        if self.drain_deadline is not None or self.should_exit:
            log.warning("second signal %d: exiting without waiting", sig)
            self.should_exit = self.force_exit = True
            return
        log.info("signal %d: draining for up to %.0fs (%d requests in flight)", sig,
                 self.drain_timeout_s, self._state.active_requests)
        self._state.begin_drain()
        self.drain_deadline = time.monotonic() + self.drain_timeout_s

    async def on_tick(self, counter: int) -> bool:
        if self.drain_deadline is not None and not self.should_exit:
            idle = self._state.active_requests == 0 and self._state.scheduler.in_flight == 0
            if idle or time.monotonic() >= self.drain_deadline:
                if not idle:
                    log.warning("drain timeout: %d requests still in flight",
                                self._state.active_requests)
                self.should_exit = True
        return await super().on_tick(counter)

    def fatal(self, message: str) -> None:
        log.error("exiting: %s", message)
        self.exit_code = 1
        self.should_exit = True


def main() -> None:
    try:
        settings = load_settings()
        import torch

        engine_cfg, server_cfg = resolve(settings, torch.cuda.is_available())
    except ConfigError as e:
        print(f"triton-prefill: {e}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(level=server_cfg.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from service.api.app import create_app

    server: DrainingServer | None = None

    def on_fatal(message: str) -> None:
        assert server is not None
        server.fatal(message)

    app = create_app(engine_cfg=engine_cfg, server_cfg=server_cfg, on_fatal=on_fatal)
    config = uvicorn.Config(app, host=server_cfg.host, port=server_cfg.port,
                            log_level=server_cfg.log_level, access_log=server_cfg.access_log,
                            lifespan="on",
                            timeout_graceful_shutdown=5, log_config=None)
    server = DrainingServer(config, server_cfg.drain_timeout_s)
    log.info("engine: device=%s dtype=%s model=%s", engine_cfg.device, engine_cfg.dtype,
             engine_cfg.model_preset or engine_cfg.model_path or "default (SmolLM2-135M)")
    server.run()
    if server.exit_code:
        sys.exit(server.exit_code)


if __name__ == "__main__":
    main()
