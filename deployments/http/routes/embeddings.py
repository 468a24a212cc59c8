"""POST /v1/embeddings (OpenAI's): an embedding model's vectors of texts or token ids."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from ...schema import EmbedRequest
from ..answers import embedding_response
from ..edge import ERRORS, answers, body_of
from ..ingress_state import IngressState, guarded
from ..openai import EmbeddingRequest
from ..openai_replies import EmbeddingList

router = APIRouter()


@router.post("/v1/embeddings", openapi_extra=body_of(EmbeddingRequest), responses=answers(EmbeddingList, *ERRORS))
async def embeddings(request: Request, state: IngressState = Depends(guarded)):
    async def run(body: EmbeddingRequest, card: dict, rid: str):
        out = await state.calls.embed(EmbedRequest(inputs=body.inputs(), dimensions=body.dimensions, request_id=rid))
        return embedding_response(card["id"], out.embeddings, out.prompt_tokens, body.encoding_format)
    return await state.route(request, EmbeddingRequest, run, prefix="embd-")
