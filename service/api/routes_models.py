"""OpenAI-style model list."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from service.api.deps import State, require_api_key
from service.api.prompts import require_ready
from service.api.schemas import ModelCard, ModelList

router = APIRouter(prefix="/v1", tags=["models"], dependencies=[Depends(require_api_key)])


@router.get("/models", response_model=ModelList)
async def list_models(state: State) -> ModelList:
    info = state.engine.info
    if info is None:
        require_ready(state)
    card = ModelCard(id=state.model_name, created=state.created, root=info.model_path,
                     max_model_len=state.max_prompt_tokens)
    return ModelList(data=[card])
