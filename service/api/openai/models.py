"""OpenAI-style model list."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from service.api.deps import State, api_router
from service.api.prompts import require_ready

router = api_router("models", fast_json=False)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "triton-prefill"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


@router.get("/models", response_model=ModelList)
async def list_models(state: State) -> ModelList:
    info = state.engine.info
    if info is None:
        require_ready(state)
    card = ModelCard(id=state.model_name, created=state.created, root=info.model_path,
                     max_model_len=state.max_prompt_tokens)
    return ModelList(data=[card])
