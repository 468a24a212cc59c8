"""POST /tokenize and /detokenize (vLLM's): text or chat messages (with tools) to token ids, and back."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from ..edge import ERRORS, answers, body_of
from ..ingress_state import IngressState, guarded
from ..openai import DetokenizeRequest, TokenizeRequest
from ..openai_replies import DetokenizeResponse, TokenizeResponse

router = APIRouter()


@router.post("/tokenize", openapi_extra=body_of(TokenizeRequest), responses=answers(TokenizeResponse, *ERRORS))
async def tokenize(request: Request, state: IngressState = Depends(guarded)):
    async def run(body: TokenizeRequest, card: dict, rid: str):
        messages = None if body.messages is None else [m.model_dump(exclude_none=True) for m in body.messages]
        out = await state.calls.tokenize(body.prompt, messages, body.add_special_tokens, body.add_generation_prompt,
                                         body.template_variables(), body.return_token_strs, rid)
        return {"count": len(out.tokens), "max_model_len": card["context_length"], "tokens": out.tokens,
                "token_strs": out.token_strs}
    return await state.route(request, TokenizeRequest, run)


@router.post("/detokenize", openapi_extra=body_of(DetokenizeRequest), responses=answers(DetokenizeResponse, *ERRORS))
async def detokenize(request: Request, state: IngressState = Depends(guarded)):
    async def run(body: DetokenizeRequest, card: dict, rid: str):
        return {"prompt": await state.calls.detokenize(body.tokens, rid)}
    return await state.route(request, DetokenizeRequest, run)
