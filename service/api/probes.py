"""What probes, operators and scrapers read: /health, /ready, /info and /metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from service.api.deps import State

router = APIRouter()


@router.head("/health", include_in_schema=False)  # probes may send HEAD
@router.get("/health", tags=["health"])
async def health(state: State) -> JSONResponse:
    """Liveness: 200 while the engine process is alive (also while loading), 503 once it died."""
    engine = state.engine
    if engine.alive:
        return JSONResponse({"status": "ok", "state": engine.state})
    return JSONResponse({"status": "dead", "state": engine.state, "error": engine.error}, 503)


@router.head("/ready", include_in_schema=False)
@router.get("/ready", tags=["health"])
async def ready(state: State) -> JSONResponse:
    """Readiness: 503 until load + capture + KV sizing are done, and while draining."""
    if state.ready:
        return JSONResponse({"status": "ready"})
    # NOTE: no word containing "ready" in this body: scripts grep for it
    reason = "draining" if state.draining else state.engine.state
    return JSONResponse({"status": "unavailable", "reason": reason,
                         "error": state.engine.error}, 503, headers={"Retry-After": "5"})


@router.get("/info", tags=["health"])
async def info(state: State) -> dict:
    """Model, device, dtype, graph buckets and every term of the memory budget."""
    return state.info(await state.engine.stats())


@router.head("/metrics", include_in_schema=False)
@router.get("/metrics", tags=["metrics"])
async def metrics(state: State) -> Response:
    snapshot = state.snapshot(await state.engine.stats())
    return Response(state.metrics.render(snapshot), media_type=state.metrics.content_type)
