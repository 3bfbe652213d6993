"""Liveness, readiness and the operator's view of the engine (/info)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from service.api.deps import State

router = APIRouter(tags=["health"])


@router.head("/health", include_in_schema=False)  # probes may send HEAD
@router.get("/health")
async def health(state: State) -> JSONResponse:
    """Liveness: 200 while the engine process is alive (also while loading), 503 once it died."""
    engine = state.engine
    if engine.alive:
        return JSONResponse({"status": "ok", "state": engine.state})
    return JSONResponse({"status": "dead", "state": engine.state, "error": engine.error}, 503)


@router.head("/ready", include_in_schema=False)
@router.get("/ready")
async def ready(state: State) -> JSONResponse:
    """Readiness: 503 until load + capture + KV sizing are done, and while draining."""
    if state.ready:
        return JSONResponse({"status": "ready"})
    # NOTE: no word containing "ready" in this body: scripts grep for it
    reason = "draining" if state.draining else state.engine.state
    return JSONResponse({"status": "unavailable", "reason": reason,
                         "error": state.engine.error}, 503, headers={"Retry-After": "5"})


@router.get("/info")
async def info(state: State) -> dict:
    """Model, device, dtype, graph buckets and every term of the memory budget."""
    return state.info(await state.engine.stats())
