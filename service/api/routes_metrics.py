"""Prometheus scrape endpoint (text exposition format 0.0.4)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

from service.api.deps import State

router = APIRouter(tags=["metrics"])


@router.get("/metrics")
async def metrics(state: State) -> Response:
    return Response(state.metrics.render(), media_type=state.metrics.content_type)
