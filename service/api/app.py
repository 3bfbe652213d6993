"""The FastAPI app factory and its lifespan (load -> capture -> size KV -> ready, off the loop)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI

from service.api import (
    errors,
    routes_completions,
    routes_health,
    routes_metrics,
    routes_models,
    routes_prefill,
)
from service.api.metrics import Metrics
from service.api.middleware import BodyLimit, Guard
from service.api.state import AppState
from service.config import EngineConfig, ServerConfig, Settings, load_settings, resolve
from service.engine.scheduler import Scheduler

log = logging.getLogger(__name__)

EngineFactory = Callable[[EngineConfig], Any]
ENGINE_STOP_WAIT_S = 1.0


def default_engine_factory(cfg: EngineConfig) -> Any:
    from service.engine.core import EngineCore  # torch + model import: only when loading

    return EngineCore(cfg)


def _configs(settings: Settings | None, engine_cfg: EngineConfig | None,
             server_cfg: ServerConfig | None) -> tuple[EngineConfig, ServerConfig]:
    if engine_cfg is not None and server_cfg is not None:
        return engine_cfg, server_cfg
    import torch

    eng, srv = resolve(settings or load_settings(), torch.cuda.is_available())
    return engine_cfg or eng, server_cfg or srv


async def _watch_load(state: AppState, on_fatal: Callable[[str], None] | None) -> None:
    assert state.scheduler.loaded is not None
    try:
        await state.scheduler.loaded
        log.info("ready: %s, KV pool %d tokens", state.model_name,
                 state.scheduler.info.kv_capacity_tokens)
    except Exception as e:  # noqa: BLE001 - reported through /health, /ready and on_fatal
        if on_fatal is not None:
            on_fatal(str(e))
        else:
            log.error("not serving: %s", e)


def create_app(settings: Settings | None = None, *, engine_cfg: EngineConfig | None = None,
               server_cfg: ServerConfig | None = None,
               engine_factory: EngineFactory | None = None,
               on_fatal: Callable[[str], None] | None = None) -> FastAPI:
    """Build an app; nothing loads until its lifespan starts (`engine_factory` on its thread)."""
    eng_cfg, srv_cfg = _configs(settings, engine_cfg, server_cfg)
    factory = engine_factory or default_engine_factory
    # NOTE: `state` is bound below, before any scrape
    metrics = Metrics(lambda: state.snapshot(), srv_cfg.served_model_name)
    scheduler = Scheduler(lambda: factory(eng_cfg), max_queue=eng_cfg.max_queue_requests,
                          max_batch_prompts=eng_cfg.max_batch_prompts,
                          prefix_cache=eng_cfg.prefix_cache, observer=metrics)
    state = AppState(eng_cfg, srv_cfg, scheduler, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start(asyncio.get_running_loop())
        watcher = asyncio.create_task(_watch_load(state, on_fatal))
        try:
            yield
        finally:
            state.begin_drain()
            watcher.cancel()
            await asyncio.to_thread(scheduler.stop, ENGINE_STOP_WAIT_S)

    app = FastAPI(title="triton-prefill", version="0.1.0", lifespan=lifespan,
                  summary="Prefill: first token + logprobs; OpenAI completions subset.")
    app.state.prefill = state
    errors.install(app, metrics.count)
    # added innermost first: Guard wraps BodyLimit wraps the routes
    app.add_middleware(BodyLimit, max_bytes=srv_cfg.max_body_bytes,
                       on_reject=lambda: metrics.count("bad_request"))
    app.add_middleware(Guard, draining=lambda: state.draining, count=metrics.count)
    for module in (routes_health, routes_metrics, routes_models, routes_prefill,
                   routes_completions):
        app.include_router(module.router)
    return app
