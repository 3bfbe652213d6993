"""Prometheus scrape endpoint (text exposition format 0.0.4)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from service.api.deps import State

router = APIRouter(tags=["metrics"])


@router.head("/metrics", include_in_schema=False)
@router.get("/metrics")
async def metrics(state: State) -> Response:
    snapshot = state.snapshot(await state.engine.stats())
    return Response(state.metrics.render(snapshot), media_type=state.metrics.content_type)
