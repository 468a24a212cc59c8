"""GET /v1/models and /v1/models/{id} (OpenAI's): the one model this server serves."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from ..edge import answers
from ..ingress_state import IngressState, authorized
from ..openai_replies import ModelInfo, ModelList

router = APIRouter()


@router.get("/v1/models", responses=answers(ModelList, 401))
async def list_models(state: IngressState = Depends(authorized)):
    return {"object": "list", "data": [await state.model_card()]}


@router.get("/v1/models/{model_id:path}", responses=answers(ModelInfo, 401, 404))
async def get_model(model_id: str, state: IngressState = Depends(authorized)):
    card = await state.model_card()
    state.check_model(model_id, card, "model_id")
    return card
