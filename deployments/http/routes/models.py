"""GET /v1/models and /v1/models/{id} (OpenAI's): the model this server serves, and its LoRA
adapters (`parent` the base model, as vLLM lists them); POST /v1/load_lora_adapter and
/v1/unload_lora_adapter (vLLM's): adapters known from then on, or no longer."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from ..edge import answers, body_of, read_json
from ..ingress_state import IngressState, authorized, guarded
from ..openai import LoadLoraRequest, UnloadLoraRequest
from ..openai_replies import ModelInfo, ModelList
from ..validation import parse

router = APIRouter()


@router.get("/v1/models", responses=answers(ModelList, 401))
async def list_models(state: IngressState = Depends(authorized)):
    card = await state.model_card()
    names = await state.adapter_paths(fresh=True)  # adapters come and go
    return {"object": "list", "data": [_listed(card)] + [_listed(state.adapter_card(card, name)) for name in names]}


@router.get("/v1/models/{model_id:path}", responses=answers(ModelInfo, 401, 404))
async def get_model(model_id: str, state: IngressState = Depends(authorized)):
    return _listed(await state.served_as(model_id, "model_id"))


@router.post("/v1/load_lora_adapter", openapi_extra=body_of(LoadLoraRequest),
             responses=answers(None, 400, 401, 503, text=True))
async def load_lora_adapter(request: Request, state: IngressState = Depends(guarded)):
    body = parse(LoadLoraRequest, await read_json(request, state.max_body))
    await state.load_adapter(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", openapi_extra=body_of(UnloadLoraRequest),
             responses=answers(None, 400, 401, 404, 503, text=True))
async def unload_lora_adapter(request: Request, state: IngressState = Depends(guarded)):
    body = parse(UnloadLoraRequest, await read_json(request, state.max_body))
    await state.unload_adapter(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _listed(card: dict) -> dict:
    return {k: v for k, v in card.items() if k not in ("adapters", "adapter", "adapter_path")}
