"""The FastAPI app factory and its lifespan (connect to the engine process; close)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

from fastapi import APIRouter, FastAPI

from service.api import errors, native, openai, probes, retrieval
from service.api.engine_client import EngineClient
from service.api.middleware import BodyLimit, Guard
from service.api.state import AppState
from service.config import EngineConfig, ServerConfig
from service.metrics import Metrics
from service.model.tokenizer import TextTokenizer

ROUTERS = (probes.router, *native.ROUTERS, *openai.ROUTERS, *retrieval.ROUTERS)


def create_app(engine_cfg: EngineConfig, server_cfg: ServerConfig, engine: EngineClient,
               tokenizer: TextTokenizer, *, metrics: Metrics | None = None,
               routers: Sequence[APIRouter] = ROUTERS) -> FastAPI:
    """An app in front of `engine` serving `routers`; its lifespan connects to it."""
    metrics = metrics or Metrics(server_cfg.served_model_name)
    state = AppState(engine_cfg, server_cfg, engine, tokenizer, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            state.begin_drain()
            await engine.close()

    app = FastAPI(title="triton-prefill", version="0.1.0", lifespan=lifespan,
                  summary="Prefill: first token + logprobs; OpenAI completions subset.")
    app.state.prefill = state
    errors.install(app, metrics.count)
    # added innermost first: Guard wraps BodyLimit wraps the routes
    app.add_middleware(BodyLimit, max_bytes=server_cfg.max_body_bytes,
                       on_reject=lambda: metrics.count("bad_request"))
    app.add_middleware(Guard, draining=lambda: state.draining, count=metrics.count)
    for router in routers:
        app.include_router(router)
    return app
